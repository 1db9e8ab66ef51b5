package vdev

import (
	"math/rand"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// newMemGuest is a probed guest whose device takes doorbells in memory
// (DoorbellsMemory); with manual the test makes the poller's passes
// itself (pollUAR), at times it chooses.
func newMemGuest(t testing.TB, fv *fakeVerbs, manual bool) *guest {
	t.Helper()
	mem, raw := guestmem.NewFlat(0, guestRAMSize)
	g := &guest{t: t, mem: mem, raw: raw, verbs: fv, irq: &fakeIRQ{}, next: 1 << 20}
	dev, err := New(Config{Memory: mem, Verbs: fv, IRQ: g.irq, MAC: testMAC,
		Doorbells: DoorbellsMemory, manualDoorbellPoll: manual})
	require.NoError(t, err)
	g.dev = dev
	t.Cleanup(func() { _ = dev.Close() })
	g.probe()
	g.bindGID(0, gidA)
	return g
}

// store is the guest's store to a UAR word of a user context's page: it
// lands in the shared memory, no region write.
func (g *guest) store(uar uint32, off uint64, v uint32) {
	atomic.StoreUint32(g.dev.uarm.word(uar, off), v)
}

func (g *guest) pass(now time.Time) bool {
	rung, _ := g.dev.pollUAR(now)
	return rung
}

func TestDoorbellModeParse(t *testing.T) {
	for s, want := range map[string]DoorbellMode{"": DoorbellsTrapped, "trapped": DoorbellsTrapped, "memory": DoorbellsMemory} {
		m, err := ParseDoorbellMode(s)
		require.NoError(t, err)
		assert.Equal(t, want, m)
	}
	_, err := ParseDoorbellMode("mmio")
	assert.Error(t, err)
	assert.Equal(t, "memory", DoorbellsMemory.String())
	assert.Equal(t, "trapped", DoorbellsTrapped.String())

	g := probedGuest(t, newFakeVerbs())
	_, _, _, ok := g.dev.UARMmap()
	assert.False(t, ok, "trapped by default: nothing to map")
	assert.Equal(t, DoorbellsTrapped, g.dev.DoorbellMode())

	m := newMemGuest(t, newFakeVerbs(), true)
	fd, off, size, ok := m.dev.UARMmap()
	require.True(t, ok)
	assert.GreaterOrEqual(t, fd, 0)
	assert.EqualValues(t, abi.UARPageSize, off, "page 0, the kernel's, stays trapped")
	assert.EqualValues(t, BAR2Size-abi.UARPageSize, size)
}

// memQP is a guest QP of a memory-doorbell test and what it posted.
type memQP struct {
	q          *gqp
	fq         *fakeQP
	sent, rcvd int
}

// TestMemoryDoorbellsTakeEveryWQE rings many QPs and an SRQ of two
// contexts at once through memory: stores overwrite each other between the
// poller's passes, and still every WQE is posted, in order, once, and
// never a WQE of a QP whose context did not ring.
func TestMemoryDoorbellsTakeEveryWQE(t *testing.T) {
	fv := newFakeVerbs()
	g := newMemGuest(t, fv, true)
	rng := rand.New(rand.NewSource(39))
	var qps []*memQP
	var srqs []*gsrq
	var allCQs []*gcq
	mrs := map[uint32]*gmr{}
	for _, uar := range []uint32{1, 2} {
		uc := g.createUC(uar)
		pd := g.createPD(uc)
		mrs[uar] = g.regMR(pd, 0x7f0000000000+uint64(uar)<<24, 1<<16, 0xf)
		var cqs []*gcq
		for i := 0; i < 4; i++ {
			cqs = append(cqs, g.createCQ(uc, 256))
		}
		allCQs = append(allCQs, cqs...)
		for i := 0; i < 12; i++ {
			q := g.createQP(qpSpec{pd: pd, scq: cqs[i%4], rcq: cqs[(i+1)%4], typ: hostverbs.QPTypeRC,
				sendWR: 64, recvWR: 64, sendSGE: 1, recvSGE: 1, uar: uar})
			q.toRTS(0x100+uint32(i), gidB, 0)
			qps = append(qps, &memQP{q: q, fq: fv.qps[len(fv.qps)-1]})
		}
		srqs = append(srqs, g.createSRQ(pd, 128, 1, 0, uar))
	}
	var srqPosted [2]int
	now := time.Unix(1000, 0)
	for round := 0; round < 40; round++ {
		for i := 0; i < 30; i++ {
			m := qps[rng.Intn(len(qps))]
			mr := mrs[m.q.uar]
			sge := abi.SGE{Addr: mr.iova, Length: 64, LKey: mr.lkey}
			if rng.Intn(2) == 0 {
				m.q.writeSend(wqe(hostverbs.WRSend, uint64(m.sent), 0), sge)
				m.sent++
				g.store(m.q.uar, abi.UARQPOffset, abi.UARQPSend|m.q.handle)
			} else {
				m.q.writeRecv(uint64(m.rcvd), sge)
				m.rcvd++
				g.store(m.q.uar, abi.UARQPOffset, abi.UARQPRecv|m.q.handle)
			}
			if rng.Intn(4) == 0 {
				k := rng.Intn(2)
				s := srqs[k]
				s.writeRecv(uint64(srqPosted[k]), abi.SGE{Addr: mrs[s.uar].iova, Length: 64, LKey: mrs[s.uar].lkey})
				srqPosted[k]++
				g.store(s.uar, abi.UARSRQOffset, abi.UARSRQRecv|s.handle)
			}
		}
		now = now.Add(time.Millisecond)
		g.pass(now)
		// Completions free the slots, so the rings never fill.
		for _, m := range qps {
			m.fq.f.mu.Lock()
			ns, nr := len(m.fq.outSends), len(m.fq.outRecvs)
			m.fq.f.mu.Unlock()
			for ; ns > 0; ns-- {
				m.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
			}
			for ; nr > 0; nr-- {
				m.fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
			}
		}
		for _, c := range allCQs {
			for {
				if _, ok := c.poll(); !ok {
					break
				}
			}
		}
	}
	g.pass(now.Add(time.Millisecond))
	totalS, totalR := 0, 0
	for i, m := range qps {
		sends, recvs := m.fq.take()
		require.Len(t, sends, m.sent, "QP %d: every send posted once", i)
		require.Len(t, recvs, m.rcvd, "QP %d: every receive posted once", i)
		for j, s := range sends {
			require.Equal(t, m.q.providerWRID(false, uint32(j)&(2*m.q.sendWR-1)), s.WRID, "QP %d send %d in order", i, j)
		}
		totalS, totalR = totalS+m.sent, totalR+m.rcvd
	}
	for k, s := range fv.srqs {
		require.Len(t, s.recvs, srqPosted[k], "SRQ %d: every receive posted once", k)
		for j, r := range s.recvs {
			require.EqualValues(t, j, r.WRID)
		}
	}
	st := g.dev.Stats()
	assert.EqualValues(t, totalS, st.SendWQEs)
	assert.Zero(t, st.TrappedDoorbells.QP, "no user doorbell trapped")
	assert.NotZero(t, st.MemoryDoorbells.QP)
	assert.Less(t, st.MemoryDoorbells.QP, uint64(totalS+totalR), "stores overwrote each other")
	assert.NotZero(t, st.MemoryDoorbells.SRQ)
	assert.Zero(t, st.MemoryBadDoorbells)

	// A WQE written without any doorbell of its context stays in its ring,
	// whatever the other context rings.
	m1 := qps[0]
	var other *memQP
	for _, m := range qps {
		if m.q.uar != m1.q.uar {
			other = m
			break
		}
	}
	mr := mrs[m1.q.uar]
	m1.q.writeSend(wqe(hostverbs.WRSend, 9999, 0), abi.SGE{Addr: mr.iova, Length: 8, LKey: mr.lkey})
	g.store(other.q.uar, abi.UARQPOffset, abi.UARQPSend|other.q.handle)
	g.pass(now.Add(2 * time.Millisecond))
	sends, _ := m1.fq.take()
	assert.Empty(t, sends, "another context's doorbell takes nothing of this one")
	g.store(m1.q.uar, abi.UARQPOffset, abi.UARQPSend|m1.q.handle)
	g.pass(now.Add(3 * time.Millisecond))
	sends, _ = m1.fq.take()
	assert.Len(t, sends, 1)
}

// memCQSetup is one context with n CQs and a UD QP per CQ (sending and
// receiving there).
type memCQSetup struct {
	g   *guest
	fv  *fakeVerbs
	mr  *gmr
	cqs []*gcq
	qps []*memQP
}

func newMemCQs(t *testing.T, n int) *memCQSetup {
	fv := newFakeVerbs()
	g := newMemGuest(t, fv, true)
	s := &memCQSetup{g: g, fv: fv}
	uc := g.createUC(1)
	pd := g.createPD(uc)
	s.mr = g.regMR(pd, 0x7f5500000000, 1<<16, 0xf)
	for i := 0; i < n; i++ {
		c := g.createCQ(uc, 64)
		s.cqs = append(s.cqs, c)
		q := g.createQP(qpSpec{pd: pd, scq: c, rcq: c, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
		q.udToRTS(0x11111111)
		s.qps = append(s.qps, &memQP{q: q, fq: fv.qps[len(fv.qps)-1]})
	}
	return s
}

// postRecvs posts k receives on every QP, ringing through memory.
func (s *memCQSetup) postRecvs(k int, now time.Time) {
	for _, m := range s.qps {
		for i := 0; i < k; i++ {
			m.q.writeRecv(uint64(m.rcvd), abi.SGE{Addr: s.mr.iova, Length: 64, LKey: s.mr.lkey})
			m.rcvd++
			s.g.store(1, abi.UARQPOffset, abi.UARQPRecv|m.q.handle)
		}
	}
	s.g.pass(now)
}

// TestMemoryDoorbellsArms: arms of many CQs stored back to back leave one
// word. The one seen is exact (notified at the next completion, at once);
// every other CQ that then gets CQEs its consumer leaves unconsumed is
// notified by the safety net after the grace, once; none is lost.
func TestMemoryDoorbellsArms(t *testing.T) {
	const n = 6
	s := newMemCQs(t, n)
	g := s.g
	now := time.Unix(2000, 0)
	s.postRecvs(1, now)
	for _, c := range s.cqs {
		g.store(1, abi.UARCQOffset, abi.UARCQArm|c.handle)
	}
	now = now.Add(10 * time.Microsecond)
	g.pass(now)
	last := s.cqs[n-1]
	require.Empty(t, g.notifications())

	// Completions on every CQ: the one whose arm was seen is notified now.
	for i := range s.qps {
		s.qps[i].fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	}
	assert.Equal(t, []uint32{last.handle}, g.notifications(), "the arm seen is honoured at once")

	// The others: lost arms, or never armed; the safety net cannot tell.
	now = now.Add(100 * time.Microsecond)
	g.pass(now)
	assert.Empty(t, g.notifications(), "not before the grace")
	now = now.Add(armGraceMin)
	g.pass(now)
	got := g.notifications()
	slices.Sort(got)
	var want []uint32
	for _, c := range s.cqs[:n-1] {
		want = append(want, c.handle)
	}
	assert.Equal(t, want, got, "every CQ whose arm may have been lost is notified once")
	now = now.Add(10 * armGraceMax)
	g.pass(now)
	assert.Empty(t, g.notifications(), "once")
	assert.EqualValues(t, n-1, g.dev.Stats().ArmSafetyNets)

	// A consumer that polls its CQEs in time is not disturbed.
	for _, c := range s.cqs {
		for {
			if _, ok := c.poll(); !ok {
				break
			}
		}
	}
	g.store(1, abi.UARCQOffset, abi.UARCQPoll|s.cqs[0].handle)
	now = now.Add(time.Microsecond)
	g.pass(now)
	now = now.Add(10 * armGraceMax)
	g.pass(now)
	assert.Empty(t, g.notifications(), "nothing pending: no notification")
	st := g.dev.Stats()
	assert.EqualValues(t, 1, st.MemoryDoorbells.CQArm, "six stores, one word seen")
	assert.EqualValues(t, 1, st.MemoryDoorbells.CQPoll)
	assert.Zero(t, st.TrappedDoorbells.CQArm+st.TrappedDoorbells.CQPoll)
}

// TestMemoryDoorbellsArmSolicited: an ARM_SOL seen is exact too: a
// solicited completion notifies at once, an unsolicited one does not.
func TestMemoryDoorbellsArmSolicited(t *testing.T) {
	s := newMemCQs(t, 1)
	g := s.g
	now := time.Unix(3000, 0)
	s.postRecvs(2, now)
	g.store(1, abi.UARCQOffset, abi.UARCQArmSol|s.cqs[0].handle)
	now = now.Add(time.Microsecond)
	g.pass(now)
	fq := s.qps[0].fq
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	assert.Empty(t, g.notifications(), "not solicited")
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv, Solicited: true})
	assert.Equal(t, []uint32{s.cqs[0].handle}, g.notifications())
	assert.Zero(t, g.dev.Stats().ArmSafetyNets, "the arm was seen: no safety net")
}

// TestMemoryDoorbellsHostile: garbage in the words (any value, any
// context's page, pages of no context, names of another context's
// objects) is counted and changes nothing; nothing panics.
func TestMemoryDoorbellsHostile(t *testing.T) {
	fv := newFakeVerbs()
	g := newMemGuest(t, fv, true)
	uc1, uc2 := g.createUC(1), g.createUC(2)
	pd2 := g.createPD(uc2)
	c1 := g.createCQ(uc1, 64)
	c2 := g.createCQ(uc2, 64)
	q2 := g.createQP(qpSpec{pd: pd2, scq: c2, rcq: c2, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 2})
	q2.udToRTS(0x11111111)
	mr2 := g.regMR(pd2, 0x7f6600000000, 4096, 0xf)
	q2.writeRecv(5, abi.SGE{Addr: mr2.iova, Length: 8, LKey: mr2.lkey})
	fq2 := fv.qps[len(fv.qps)-1]
	rng := rand.New(rand.NewSource(7))
	now := time.Unix(4000, 0)
	for i := 0; i < 2000; i++ {
		page := uint32(rng.Intn(UARPages))
		if page == 2 {
			page = 1 // context 2 rings nothing
		}
		if page == 0 {
			page = 3
		}
		v := rng.Uint32()
		switch rng.Intn(4) {
		case 0:
			v = abi.UARQPRecv | abi.UARQPSend | q2.handle // another context's QP
		case 1:
			v = abi.UARCQArm | c2.handle // another context's CQ
		}
		g.store(page, uint64(rng.Intn(3))*4, v)
		// Bytes beyond the words are the guest's own business.
		atomic.StoreUint32(g.dev.uarm.word(page, 12+uint64(rng.Intn(1000))*4), rng.Uint32())
		now = now.Add(100 * time.Microsecond)
		g.pass(now)
	}
	st := g.dev.Stats()
	assert.NotZero(t, st.MemoryBadDoorbells, "garbage is counted")
	_, recvs := fq2.take()
	assert.Empty(t, recvs, "another context's QP is never rung")
	assert.Zero(t, st.RecvWQEs+st.BadWQEs)
	c2dev, _ := g.dev.cqs.get(c2.handle)
	assert.False(t, c2dev.armedNow(), "another context's CQ is never armed")
	assert.Zero(t, st.TrappedDoorbells)
	_ = c1

	// A new context on a page starts clean: what was left there is no
	// doorbell.
	g.store(5, abi.UARQPOffset, abi.UARQPRecv|q2.handle)
	g.createUC(5)
	bad := g.dev.Stats().MemoryBadDoorbells
	g.pass(now.Add(time.Millisecond))
	assert.Equal(t, bad, g.dev.Stats().MemoryBadDoorbells)
}

// TestMemoryDoorbellsPoller runs the poller goroutine: a store is seen
// without a region write, and Close stops it.
func TestMemoryDoorbellsPoller(t *testing.T) {
	fv := newFakeVerbs()
	g := newMemGuest(t, fv, false)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	c := g.createCQ(uc, 64)
	mr := g.regMR(pd, 0x7f0000000000, 1<<16, 0xf)
	q := g.createQP(qpSpec{pd: pd, scq: c, rcq: c, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	q.toRTS(0x99, gidB, 0)
	fq := fv.qps[len(fv.qps)-1]
	// The WQE, then prod_tail with an atomic store: the race detector
	// sees no order through the doorbell word (memory outside Go's heap).
	tail := g.u32(q.sqState())
	h := wqe(hostverbs.WRSend, 1, 0)
	h.NumSGE = 1
	h.Encode(g.raw[q.sqWQE(tail):])
	abi.SGE{Addr: mr.iova, Length: 8, LKey: mr.lkey}.Encode(g.raw[q.sqWQE(tail)+abi.SQWQEHdrSize:])
	g.store32(q.sqState(), drvInc(tail, q.sendWR))
	g.store(1, abi.UARQPOffset, abi.UARQPSend|q.handle)
	require.Eventually(t, func() bool {
		fq.f.mu.Lock()
		defer fq.f.mu.Unlock()
		return len(fq.sends) == 1
	}, 20*time.Second, time.Millisecond)
	require.NoError(t, g.dev.Close())
	require.NoError(t, g.dev.Close())
	assert.NotZero(t, g.dev.Stats().DoorbellPasses)
}

// TestMemoryDoorbellsLostArmConsumedElsewhere: a CQ whose arm may have been
// lost and whose CQE another thread polls at once is still notified after
// the grace (its waiter must not hang); a CQ that is never armed again is
// notified ever more rarely (the grace doubles), and a seen arm makes the
// grace short again.
func TestMemoryDoorbellsLostArmConsumedElsewhere(t *testing.T) {
	s := newMemCQs(t, 2)
	g := s.g
	now := time.Unix(5000, 0)
	s.postRecvs(8, now)
	lost, seen := s.cqs[0], s.cqs[1]
	ring := func() {
		g.store(1, abi.UARCQOffset, abi.UARCQArm|lost.handle)
		g.store(1, abi.UARCQOffset, abi.UARCQPoll|seen.handle) // overwrites the arm
		now = now.Add(time.Microsecond)
		g.pass(now)
	}
	complete := func() {
		s.qps[0].fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
		lost.mustPoll() // consumed at once, by another thread
		now = now.Add(time.Microsecond)
		g.pass(now)
	}
	ring()
	complete()
	require.Empty(t, g.notifications())
	now = now.Add(armGraceMin)
	g.pass(now)
	require.Equal(t, []uint32{lost.handle}, g.notifications(), "the CQE produced since counts, consumed or not")

	// Not armed again (a consumer that polls): the next one waits twice as
	// long.
	ring()
	complete()
	now = now.Add(armGraceMin)
	g.pass(now)
	require.Empty(t, g.notifications(), "the grace doubled")
	now = now.Add(armGraceMin)
	g.pass(now)
	require.Equal(t, []uint32{lost.handle}, g.notifications())

	// An arm seen resets the grace.
	g.store(1, abi.UARCQOffset, abi.UARCQArm|lost.handle)
	now = now.Add(time.Microsecond)
	g.pass(now)
	complete()
	require.Equal(t, []uint32{lost.handle}, g.notifications(), "the arm seen is exact")
	ring()
	complete()
	now = now.Add(armGraceMin)
	g.pass(now)
	require.Equal(t, []uint32{lost.handle}, g.notifications(), "short grace again")
	assert.EqualValues(t, 3, g.dev.Stats().ArmSafetyNets)
}

// TestMemoryDoorbellsGraceShortForWaiters: a consumer that waits for the
// event leaves its CQEs unconsumed until it comes: once the safety net
// found it so, its grace is armGraceWaiter, however many of its arms are
// overwritten.
func TestMemoryDoorbellsGraceShortForWaiters(t *testing.T) {
	s := newMemCQs(t, 2)
	g := s.g
	now := time.Unix(6000, 0)
	s.postRecvs(8, now)
	waiter, poller := s.cqs[0], s.cqs[1]
	wait := armGraceMin // not classified yet
	for round := 0; round < 5; round++ {
		g.store(1, abi.UARCQOffset, abi.UARCQArm|waiter.handle)
		g.store(1, abi.UARCQOffset, abi.UARCQPoll|poller.handle) // overwrites the arm
		now = now.Add(time.Microsecond)
		g.pass(now)
		s.qps[0].fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
		now = now.Add(time.Microsecond)
		g.pass(now)
		now = now.Add(wait - time.Microsecond)
		g.pass(now)
		require.Empty(t, g.notifications(), "round %d: not before the grace", round)
		now = now.Add(time.Microsecond)
		g.pass(now)
		require.Equal(t, []uint32{waiter.handle}, g.notifications(), "round %d: notified after the grace", round)
		waiter.mustPoll()     // after the event
		wait = armGraceWaiter // the notification found its CQE waiting
	}
}

// TestMemoryDoorbellsKeptFile: a device made with a predecessor's UAR file
// (a daemon restarted under a running guest) watches the same memory, and
// doorbells stored before it existed are seen; a kept file that is not one
// is refused for a new one.
func TestMemoryDoorbellsKeptFile(t *testing.T) {
	fv := newFakeVerbs()
	g := newMemGuest(t, fv, true)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	c := g.createCQ(uc, 64)
	q := g.createQP(qpSpec{pd: pd, scq: c, rcq: c, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	q.toRTS(0x99, gidB, 0)
	fd, _, _, ok := g.dev.UARMmap()
	require.True(t, ok)

	// The successor's device maps the same file: a store through the
	// first mapping is in the second.
	fv2 := newFakeVerbs()
	d2, err := New(Config{Memory: g.mem, Verbs: fv2, IRQ: &fakeIRQ{}, MAC: testMAC, Doorbells: DoorbellsMemory, UARFile: fd, manualDoorbellPoll: true})
	require.NoError(t, err)
	defer d2.Close()
	fd2, _, _, ok := d2.UARMmap()
	require.True(t, ok)
	assert.NotEqual(t, fd, fd2, "a duplicate: the caller keeps its descriptor")
	g.store(1, abi.UARQPOffset, abi.UARQPSend|q.handle)
	assert.Equal(t, abi.UARQPSend|q.handle, atomic.LoadUint32(d2.uarm.word(1, abi.UARQPOffset)))

	// Not a file of the BAR's size: a new one.
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	d3, err := New(Config{Memory: g.mem, Verbs: newFakeVerbs(), IRQ: &fakeIRQ{}, MAC: testMAC, Doorbells: DoorbellsMemory,
		UARFile: int(r.Fd()), manualDoorbellPoll: true})
	require.NoError(t, err)
	defer d3.Close()
	assert.Zero(t, atomic.LoadUint32(d3.uarm.word(1, abi.UARQPOffset)))
}

// BenchmarkUARPass is one pass of the memory-doorbell poller over 4
// contexts of 8 QPs and 8 CQs each: idle (no word written: the cost of each
// of the idle poller's wake-ups) and with the QP and CQ words
// written on one context (a busy pass, nothing posted).
func BenchmarkUARPass(b *testing.B) {
	for _, busy := range []bool{false, true} {
		b.Run(map[bool]string{false: "idle", true: "rung"}[busy], func(b *testing.B) {
			fv := newFakeVerbs()
			g := newMemGuest(b, fv, true)
			var qs []*gqp
			for uar := uint32(1); uar <= 4; uar++ {
				uc := g.createUC(uar)
				pd := g.createPD(uc)
				for i := 0; i < 8; i++ {
					c := g.createCQ(uc, 64)
					q := g.createQP(qpSpec{pd: pd, scq: c, rcq: c, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: uar})
					q.udToRTS(0x11111111)
					qs = append(qs, q)
				}
			}
			now := time.Unix(7000, 0)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if busy {
					for _, q := range qs[:4] {
						g.store(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle)
						g.store(q.uar, abi.UARCQOffset, abi.UARCQPoll|q.handle)
					}
				}
				now = now.Add(time.Microsecond)
				g.pass(now)
			}
		})
	}
}

// TestMemoryDoorbellsKickAndDue: a CQE for a suspect CQ wakes the poller,
// and the pass that starts its grace says when the grace ends, so that the
// poller passes then rather than a sleep later.
func TestMemoryDoorbellsKickAndDue(t *testing.T) {
	s := newMemCQs(t, 2)
	g := s.g
	now := time.Unix(8000, 0)
	s.postRecvs(2, now)
	g.store(1, abi.UARCQOffset, abi.UARCQArm|s.cqs[0].handle)
	g.store(1, abi.UARCQOffset, abi.UARCQPoll|s.cqs[1].handle)
	now = now.Add(time.Microsecond)
	_, due := g.dev.pollUAR(now)
	assert.True(t, due.IsZero(), "no CQE yet: no grace runs")
	for len(g.dev.uarm.kick) > 0 {
		<-g.dev.uarm.kick
	}
	s.qps[0].fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	assert.Len(t, g.dev.uarm.kick, 1, "the CQE of a suspect CQ wakes the poller")
	now = now.Add(time.Microsecond)
	_, due = g.dev.pollUAR(now)
	assert.Equal(t, now.Add(armGraceMin), due)
	_, _ = g.dev.pollUAR(due)
	assert.Equal(t, []uint32{s.cqs[0].handle}, g.notifications())
}

// TestMemoryDoorbellsBeforeCommand: what the guest stored before a command
// is taken before the command runs: a POLL of a CQ it then destroys (or a
// post to a QP it then modifies) names a live object, as a trapped
// doorbell would have.
func TestMemoryDoorbellsBeforeCommand(t *testing.T) {
	fv := newFakeVerbs()
	g := newMemGuest(t, fv, true)
	uc := g.createUC(1)
	c := g.createCQ(uc, 64)
	g.store(1, abi.UARCQOffset, abi.UARCQPoll|c.handle)
	g.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: c.handle})
	g.pass(time.Unix(9000, 0))
	st := g.dev.Stats()
	assert.EqualValues(t, 1, st.MemoryDoorbells.CQPoll)
	assert.Zero(t, st.MemoryBadDoorbells)
}

// TestMemoryDoorbellsCQEWakesPoller: a CQE for a user CQ wakes a sleeping
// poller whether or not the CQ is a suspect: an event-driven consumer
// polls, re-arms and posts right after its CQE, and those doorbells must
// be seen at once, not a back-off sleep later.
func TestMemoryDoorbellsCQEWakesPoller(t *testing.T) {
	s := newMemCQs(t, 1)
	g := s.g
	now := time.Unix(9500, 0)
	s.postRecvs(2, now)
	g.store(1, abi.UARCQOffset, abi.UARCQArm|s.cqs[0].handle)
	_, _ = g.dev.pollUAR(now.Add(time.Microsecond))
	c, ok := g.dev.cqs.get(s.cqs[0].handle)
	require.True(t, ok)
	require.False(t, c.watched.Load(), "armed and seen: not a suspect")
	for len(g.dev.uarm.kick) > 0 {
		<-g.dev.uarm.kick
	}
	s.qps[0].fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	assert.Len(t, g.dev.uarm.kick, 1, "the CQE of a user CQ wakes the poller")
	assert.Equal(t, []uint32{s.cqs[0].handle}, g.notifications(), "and the armed CQ is notified")
}
