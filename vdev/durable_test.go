package vdev

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// The guest's send and receive rings are the durable record of the work
// outstanding (workQueue): cons_head moves past a WQE only when it
// completes, and before its CQE is visible.

// sqTail and rqTail are the guest's prod_tail of each ring.
func (q *gqp) sqTail() uint32 { return q.g.u32(q.sqState()) }
func (q *gqp) rqTail() uint32 { return q.g.u32(q.rqState()) }

// sqWRID and rqWRID read the wr_id of the WQE at ring index idx from guest
// memory.
func (q *gqp) sqWRID(idx uint32) uint64 { return q.g.u64(q.sqWQE(idx)) }
func (q *gqp) rqWRID(idx uint32) uint64 { return q.g.u64(q.rqWQE(idx)) }

func TestRingReleasedAtCompletion(t *testing.T) {
	u := newUserRC(t)
	q, fq := u.qp, u.fq
	q.postSend(wqe(hostverbs.WRSend, 100, hostverbs.SendSignaled), u.sge(0, 8))
	q.postSend(wqe(hostverbs.WRSend, 101, 0), u.sge(0, 8))
	q.postSend(wqe(hostverbs.WRSend, 102, 0), u.sge(0, 8))
	q.postSend(wqe(hostverbs.WRRDMAWrite, 103, hostverbs.SendSignaled), u.sge(0, 8))
	require.Equal(t, 4, fq.outstanding(false))
	assert.Zero(t, q.sqConsumed(), "posting does not move cons_head")
	assert.EqualValues(t, 4, q.sqTail())

	// WQE 0 completes: cons_head 1, then its CQE.
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 1, q.sqConsumed())
	e := u.scq.mustPoll()
	assert.EqualValues(t, 100, e.WRID)
	// The provider completes WQE 3: the unsignaled 1 and 2 before it are
	// complete too and released with it, with no CQE of their own.
	fq.finish(t, false, 2, hostverbs.WorkCompletion{Opcode: hostverbs.WCRDMAWrite, ByteLen: 8})
	assert.EqualValues(t, 4, q.sqConsumed())
	e = u.scq.mustPoll()
	assert.EqualValues(t, 103, e.WRID)
	assert.EqualValues(t, hostverbs.WCRDMAWrite, e.Opcode)
	_, ok := u.scq.poll()
	assert.False(t, ok)

	// Receives: one slot each, released in order as they complete.
	q.postRecv(200, u.sge(0, 64))
	q.postRecv(201, u.sge(64, 64))
	assert.Zero(t, q.rqConsumed())
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv, ByteLen: 3})
	assert.EqualValues(t, 1, q.rqConsumed())
	assert.EqualValues(t, 200, u.rcq.mustPoll().WRID)
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv, ByteLen: 4})
	assert.EqualValues(t, 2, q.rqConsumed())
	assert.EqualValues(t, 201, u.rcq.mustPoll().WRID)

	// A full ring of outstanding WQEs, across the wrap bit: the guest can
	// post a whole ring, and the provider never holds more.
	for round := 0; round < 3; round++ {
		base := q.sqTail()
		for i := 0; i < 16; i++ {
			q.postSend(wqe(hostverbs.WRSend, uint64(1000+i), hostverbs.SendSignaled), u.sge(0, 8))
		}
		require.Equal(t, 16, fq.outstanding(false))
		require.Equal(t, base, q.sqConsumed())
		for i := 0; i < 16; i++ {
			fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
			require.EqualValues(t, 1000+i, u.scq.mustPoll().WRID)
		}
		require.Equal(t, q.sqTail(), q.sqConsumed())
	}
	assert.Zero(t, u.g.dev.Stats().StaleCompletions)
}

// TestReleaseBeforeCQE checks the order of the two stores: cons_head of
// the WQE's ring first, then the CQ's prod_tail that publishes the CQE.
func TestReleaseBeforeCQE(t *testing.T) {
	u := newUserRC(t)
	q, fq := u.qp, u.fq
	u.g.dev.mu.Lock()
	scq, _ := u.g.dev.cqs.get(u.scq.handle)
	rcq, _ := u.g.dev.cqs.get(u.rcq.handle)
	u.g.dev.mu.Unlock()
	type seen struct{ consHead, cqTail uint32 }
	var at []seen
	scq.beforeCommit = func() { at = append(at, seen{q.sqConsumed(), u.scq.tail()}) }
	rcq.beforeCommit = func() { at = append(at, seen{q.rqConsumed(), u.rcq.tail()}) }

	q.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 8))
	q.postSend(wqe(hostverbs.WRSend, 2, hostverbs.SendSignaled), u.sge(0, 8))
	fq.finish(t, false, 1, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.Equal(t, []seen{{2, 0}}, at, "cons_head past WQE 1 while its CQE is not yet visible")
	assert.EqualValues(t, 1, u.scq.tail())
	q.postRecv(3, u.sge(0, 8))
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	assert.Equal(t, seen{1, 0}, at[1])

	// The same for a CQE the device writes itself, deferred behind a
	// provider completion: each CQE's own release comes first. The
	// refused WQE moves the RC QP to ERR, whose flush completes the send
	// before it.
	u.scq.mustPoll()
	at = nil
	q.postSend(wqe(hostverbs.WRSend, 4, hostverbs.SendSignaled), u.sge(0, 8))
	q.postSend(wqe(hostverbs.WRLSO, 5, hostverbs.SendSignaled)) // refused by the device, after 4
	assert.Equal(t, []seen{{3, 1}, {4, 2}}, at)
	e := u.scq.mustPoll()
	assert.Equal(t, []uint64{4, uint64(hostverbs.WCWRFlushErr)}, []uint64{e.WRID, uint64(e.Status)})
	e = u.scq.mustPoll()
	assert.Equal(t, []uint64{5, uint64(hostverbs.WCLocQPOpErr)}, []uint64{e.WRID, uint64(e.Status)})
}

// TestUnpublishedCQEStillReleases: a completion whose CQE cannot be
// published (here the CQ's ring-state page turned read-only) is counted
// and still releases its WQE, and is never written twice.
func TestUnpublishedCQEStillReleases(t *testing.T) {
	fv := newFakeVerbs()
	const cqState = 40 << 20 // the CQ's ring-state page, a region of its own
	mem := guestmem.New()
	raw := make([]byte, guestRAMSize)
	for _, r := range [][2]uint64{{0, cqState}, {cqState, cqState + guestmem.PageSize}, {cqState + guestmem.PageSize, guestRAMSize}} {
		require.NoError(t, mem.Add(guestmem.Bytes(guestmem.GPA(r[0]), raw[r[0]:r[1]], guestmem.ProtRead|guestmem.ProtWrite)))
	}
	g := &guest{t: t, mem: mem, raw: raw, verbs: fv, irq: &fakeIRQ{}, next: 1 << 20}
	dev, err := New(Config{Memory: mem, Verbs: fv, IRQ: g.irq, MAC: testMAC})
	require.NoError(t, err)
	g.dev = dev
	t.Cleanup(func() { _ = dev.Close() })
	g.probe()
	g.bindGID(0, gidA)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	mr := g.regMR(pd, 0x7f1234560010, 1<<20, 0xf)
	rcq := g.createCQ(uc, 64)
	g.next = cqState
	scq := g.createCQ(uc, 64)
	require.EqualValues(t, cqState, scq.pages[0])
	q := g.createQP(qpSpec{pd: pd, scq: scq, rcq: rcq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	q.toRTS(0x99, gidB, 0)
	fq := fv.qps[0]
	sge := abi.SGE{Addr: mr.iova, Length: 8, LKey: mr.lkey}

	q.postSend(wqe(hostverbs.WRSend, 7, hostverbs.SendSignaled), sge)
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	require.EqualValues(t, 1, q.sqConsumed())
	require.EqualValues(t, 7, scq.mustPoll().WRID)

	q.postSend(wqe(hostverbs.WRSend, 8, hostverbs.SendSignaled), sge)
	_, err = mem.Remove(cqState, guestmem.PageSize)
	require.NoError(t, err)
	require.NoError(t, mem.Add(guestmem.Bytes(cqState, raw[cqState:cqState+guestmem.PageSize], guestmem.ProtRead)))
	overflows := dev.Stats().CQOverflows
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 2, q.sqConsumed(), "released all the same")
	assert.EqualValues(t, 1, scq.tail(), "the CQE never became visible")
	assert.Equal(t, overflows+1, dev.Stats().CQOverflows, "the completion is lost, counted")

	_, err = mem.Remove(cqState, guestmem.PageSize)
	require.NoError(t, err)
	require.NoError(t, mem.Add(guestmem.Bytes(cqState, raw[cqState:cqState+guestmem.PageSize], guestmem.ProtRead|guestmem.ProtWrite)))
	q.postSend(wqe(hostverbs.WRSend, 9, hostverbs.SendSignaled), sge)
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	// CQE 8 was written into its slot; the next publication carries it
	// (ringbuf keeps the device's prod_tail when the store fails), once.
	assert.EqualValues(t, 8, scq.mustPoll().WRID)
	assert.EqualValues(t, 9, scq.mustPoll().WRID)
	_, ok := scq.poll()
	assert.False(t, ok)
	assert.EqualValues(t, 3, q.sqConsumed())
}

// TestCrashLeavesOutstandingWork abandons a device whose provider holds
// work: guest memory alone shows every WQE not completed. A device rebuilt
// over it (the journal replayed with SetAdoptRings, then KickQueues) posts
// exactly those again, and the CQEs written before the crash stay, once.
func TestCrashLeavesOutstandingWork(t *testing.T) {
	u := newUserRC(t)
	g, q, fq := u.g, u.qp, u.fq
	g.events()
	for i := uint64(1); i <= 5; i++ {
		flags := hostverbs.SendFlags(0)
		if i%2 == 1 {
			flags = hostverbs.SendSignaled
		}
		q.postSend(wqe(hostverbs.WRSend, i, flags), u.sge(0, 8))
	}
	for i := uint64(11); i <= 13; i++ {
		q.postRecv(i, u.sge(i*64, 64))
	}
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	q.writeSend(wqe(hostverbs.WRSend, 6, hostverbs.SendSignaled), u.sge(0, 8)) // written, never rung
	g.dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventPortErr})
	// The guest has not polled yet: CQEs 1 (send) and 11 (receive), one
	// event, in the rings.

	// The daemon dies: the device is dropped, not closed.
	assert.EqualValues(t, 1, q.sqConsumed())
	assert.EqualValues(t, 6, q.sqTail())
	for i := uint32(1); i < 6; i++ {
		assert.EqualValues(t, i+1, q.sqWRID(i), "send WQE %d still in the ring", i)
	}
	assert.EqualValues(t, 1, q.rqConsumed())
	assert.EqualValues(t, 3, q.rqTail())
	assert.EqualValues(t, 12, q.rqWRID(1))
	assert.EqualValues(t, 13, q.rqWRID(2))

	fv2 := newFakeVerbs()
	g.rebuild(fv2)
	fq2 := fv2.qps[0]
	sends, recvs := fq2.take()
	require.Len(t, sends, 5, "every send not completed, and the one never rung")
	require.Len(t, recvs, 2)
	for i, s := range sends {
		assert.Equal(t, q.providerWRID(false, uint32(i+1)), s.WRID)
	}
	assert.Equal(t, q.providerWRID(true, 1), recvs[0].WRID)
	assert.EqualValues(t, 1, q.sqConsumed())

	// What the old device wrote is there, once; what the new one writes
	// follows it.
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventPortErr), Info: 1}, {Type: uint32(eventPortActive), Info: 1}}, g.events(),
		"the old device's event, then the new one's activation")
	assert.EqualValues(t, 1, u.scq.mustPoll().WRID)
	assert.EqualValues(t, 11, u.rcq.mustPoll().WRID)
	fq2.finish(t, false, 1, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend}) // 2 (unsignaled), then 3
	assert.EqualValues(t, 3, q.sqConsumed())
	assert.EqualValues(t, 3, u.scq.mustPoll().WRID)
	fq2.finish(t, false, 1, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend}) // 4 (unsignaled), then 5
	assert.EqualValues(t, 5, u.scq.mustPoll().WRID)
	fq2.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 6, q.sqConsumed())
	assert.EqualValues(t, 6, u.scq.mustPoll().WRID)
	fq2.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	fq2.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	assert.EqualValues(t, 12, u.rcq.mustPoll().WRID)
	assert.EqualValues(t, 13, u.rcq.mustPoll().WRID)
	_, ok := u.scq.poll()
	assert.False(t, ok)
	g.dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventGIDChange})
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventGIDChange), Info: 1}}, g.events())

	// The guest goes on as before.
	q.postSend(wqe(hostverbs.WRSend, 7, hostverbs.SendSignaled), u.sge(0, 8))
	fq2.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 7, u.scq.mustPoll().WRID)
	assert.EqualValues(t, 7, q.sqConsumed())
}

// rebuild is a daemon restarted after a crash: a new device over the same
// guest memory (the old one is abandoned, not closed) loads the guest's
// DSR and replays the journal of commands that succeeded with
// SetAdoptRings on, then kicks the queues.
func (g *guest) rebuild(verbs hostverbs.Device) {
	g.t.Helper()
	dev, err := New(Config{Memory: g.mem, Verbs: verbs, IRQ: g.irq, MAC: testMAC})
	require.NoError(g.t, err)
	g.t.Cleanup(func() { _ = dev.Close() })
	g.dev, g.verbs = dev, verbs
	assert.False(g.t, dev.SetAdoptRings(true))
	require.NoError(g.t, g.writeReg(abi.RegDSRLow, uint32(g.dsr)))
	require.NoError(g.t, g.writeReg(abi.RegDSRHigh, uint32(g.dsr>>32)))
	require.NoError(g.t, g.writeReg(abi.RegIMR, 0))
	require.NoError(g.t, g.writeReg(abi.RegCtl, abi.CtlActivate))
	require.Zero(g.t, g.readReg(abi.RegErr))
	for _, req := range g.journal {
		copy(g.raw[g.cmdGPA:], req)
		require.NoError(g.t, g.writeReg(abi.RegRequest, 0))
		var h abi.CmdHdr
		h.Decode(req)
		require.Zero(g.t, g.readReg(abi.RegErr), "replay %s", CommandName(h.Cmd))
	}
	assert.True(g.t, dev.SetAdoptRings(false))
	dev.KickQueues()
}

func TestAdoptRejectsGarbage(t *testing.T) {
	for _, c := range []struct {
		name   string
		spoil  func(u *userRC)
		failed map[string]uint32
	}{
		{"SQ cons_head", func(u *userRC) { u.g.store32(u.qp.sqState()+4, 0x7777) },
			map[string]uint32{"CREATE_QP": 22, "MODIFY_QP": 22}},
		{"RQ cons_head", func(u *userRC) { u.g.store32(u.qp.rqState()+4, 32) },
			map[string]uint32{"CREATE_QP": 22, "MODIFY_QP": 22}},
		{"CQ prod_tail", func(u *userRC) { u.g.store32(u.rcq.pages[0]+8, 1<<31) },
			map[string]uint32{"CREATE_CQ": 22, "CREATE_QP": 22, "MODIFY_QP": 22}},
	} {
		t.Run(c.name, func(t *testing.T) {
			u := newUserRC(t)
			g := u.g
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 8))
			c.spoil(u)
			dev, err := New(Config{Memory: g.mem, Verbs: newFakeVerbs(), IRQ: g.irq, MAC: testMAC})
			require.NoError(t, err)
			t.Cleanup(func() { _ = dev.Close() })
			g.dev = dev
			dev.SetAdoptRings(true)
			require.NoError(t, g.writeReg(abi.RegDSRLow, uint32(g.dsr)))
			require.NoError(t, g.writeReg(abi.RegDSRHigh, uint32(g.dsr>>32)))
			require.NoError(t, g.writeReg(abi.RegCtl, abi.CtlActivate))
			require.Zero(t, g.readReg(abi.RegErr))
			failed := map[string]uint32{}
			for _, req := range g.journal {
				copy(g.raw[g.cmdGPA:], req)
				require.NoError(t, g.writeReg(abi.RegRequest, 0))
				var h abi.CmdHdr
				h.Decode(req)
				if e := g.readReg(abi.RegErr); e != 0 {
					failed[CommandName(h.Cmd)] = e
				}
			}
			assert.Equal(t, c.failed, failed, "EINVAL, no panic")
			dev.KickQueues()
		})
	}

	// A DSR ring whose prod_tail is no index refuses the DSR.
	u := newUserRC(t)
	g := u.g
	g.store32(g.async[0]+8, 0xffff)
	dev, err := New(Config{Memory: g.mem, Verbs: newFakeVerbs(), IRQ: g.irq, MAC: testMAC})
	require.NoError(t, err)
	t.Cleanup(func() { _ = dev.Close() })
	g.dev = dev
	dev.SetAdoptRings(true)
	require.NoError(t, g.writeReg(abi.RegDSRLow, uint32(g.dsr)))
	require.NoError(t, g.writeReg(abi.RegDSRHigh, uint32(g.dsr>>32)))
	assert.EqualValues(t, 22, g.readReg(abi.RegErr))
	assert.Error(t, dev.Fault())
	dev.KickQueues() // no DSR: nothing
}

func TestAdoptedReset(t *testing.T) {
	u := newUserRC(t)
	g, q := u.g, u.qp
	q.postSend(wqe(hostverbs.WRSend, 1, hostverbs.SendSignaled), u.sge(0, 8))
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	require.EqualValues(t, 1, q.sqConsumed())
	g.dev.SetAdoptRings(true)
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	assert.EqualValues(t, 1, q.sqConsumed(), "a replayed RESET keeps the ring as the guest has it")
	g.store32(q.rqState()+4, 0xdead)
	errReg, _ := q.modify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	assert.EqualValues(t, 22, errReg, "garbage cons_head: EINVAL")
	g.dev.SetAdoptRings(false)
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	assert.Zero(t, q.sqConsumed())
	assert.Zero(t, q.rqConsumed())
}

func TestFlushAndLocalOpsRelease(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	g.bindGID(0, gidA)
	pd := g.createPD(0)
	var dma abi.CreateMRResp
	dma.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, AccessFlags: 1, Flags: abi.MRFlagDMA}))
	cq := g.createCQ(0, 64)
	q := g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 2, recvSGE: 1})
	q.toRTS(5, gidB, 0)
	fq := fv.qps[0]
	sge := abi.SGE{Addr: 0x200000, Length: 64, LKey: dma.LKey}
	var fr abi.CreateMRResp
	fr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, Flags: abi.MRFlagFRMR, NChunks: 16}))
	inv := func(wrid uint64, flags hostverbs.SendFlags) abi.SQWQEHdr {
		h := wqe(hostverbs.WRLocalInv, wrid, flags)
		h.Ex = fr.LKey
		return h
	}

	// Local operations alone: released at once, a CQE when signaled.
	q.postSend(inv(1, hostverbs.SendSignaled))
	assert.EqualValues(t, 1, q.sqConsumed())
	e := cq.mustPoll()
	assert.EqualValues(t, 1, e.WRID)
	assert.EqualValues(t, hostverbs.WCLocalInv, e.Opcode)
	q.postSend(inv(2, 0))
	assert.EqualValues(t, 2, q.sqConsumed(), "unsignaled: released, no CQE")
	_, ok := cq.poll()
	assert.False(t, ok)

	// Behind a send the provider holds, a local operation's CQE waits for
	// the send: CQEs come in ring order and cons_head never passes it.
	q.postSend(wqe(hostverbs.WRSend, 3, 0), sge)
	q.postSend(inv(4, hostverbs.SendSignaled))
	sends, _ := fq.take()
	require.Len(t, sends, 1)
	assert.NotZero(t, sends[0].Flags&hostverbs.SendSignaled, "a send a local operation follows is signaled to the provider")
	assert.EqualValues(t, 2, q.sqConsumed())
	_, ok = cq.poll()
	assert.False(t, ok, "the LOCAL_INV waits for the send before it")
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 4, q.sqConsumed())
	e = cq.mustPoll()
	assert.EqualValues(t, 4, e.WRID, "the unsignaled send reports nothing; the LOCAL_INV then does")
	_, ok = cq.poll()
	assert.False(t, ok)

	// Two doorbells' sends, the first batch's last one signaled to the
	// provider; a LOCAL_INV of the second batch follows an unsignaled
	// send the provider holds.
	for i := uint64(5); i <= 7; i++ {
		q.writeSend(wqe(hostverbs.WRSend, i, 0), sge)
	}
	q.writeSend(inv(8, hostverbs.SendSignaled))
	g.doorbell(0, abi.UARQPOffset, abi.UARQPSend|q.handle)
	sends, _ = fq.take()
	require.Len(t, sends, 3)
	assert.Zero(t, sends[0].Flags&hostverbs.SendSignaled, "followed by a send: left unsignaled")
	assert.Zero(t, sends[1].Flags&hostverbs.SendSignaled)
	assert.NotZero(t, sends[2].Flags&hostverbs.SendSignaled, "followed by a local operation")

	// ERR: the provider flushes what it holds, the device what is left
	// in the ring; CQEs in ring order, every slot released.
	q.writeSend(wqe(hostverbs.WRSend, 9, 0), sge)
	q.writeSend(inv(10, 0))
	q.writeRecv(20, sge)
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
	var got []uint64
	var st []hostverbs.WCStatus
	for e, ok := cq.poll(); ok; e, ok = cq.poll() {
		got = append(got, e.WRID)
		st = append(st, hostverbs.WCStatus(e.Status))
	}
	assert.Equal(t, []uint64{5, 6, 7, 8, 9, 10, 20}, got, "flushed in order, unsignaled ones too")
	for i, s := range st {
		if got[i] == 8 {
			assert.Equal(t, hostverbs.WCSuccess, s, "the LOCAL_INV had completed")
			continue
		}
		assert.Equal(t, hostverbs.WCWRFlushErr, s, "wr_id %d", got[i])
	}
	assert.Equal(t, q.sqTail(), q.sqConsumed())
	assert.Equal(t, q.rqTail(), q.rqConsumed())
	assert.EqualValues(t, 3, g.dev.Stats().FlushedWQEs, "the device's own flushes")
}

// TestDirectErrorWaitsInOrder: on UD a bad WQE does not move the QP to ERR;
// its error CQE waits for the send the provider holds before it.
func TestDirectErrorWaitsInOrder(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	q := g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	fq := u.fv.qps[len(u.fv.qps)-1]
	q.udToRTS(0x11111111)
	send := func(wrid uint64, port uint32) {
		h := wqe(hostverbs.WRSend, wrid, hostverbs.SendSignaled)
		abi.WRUD{RemoteQPN: 0x1234, RemoteQKey: 0x11111111, AV: abi.AV{PortPD: port<<24 | u.pd, DGID: gidB, HopLimit: 1}}.Encode(h.WR[:])
		q.postSend(h, u.sge(0, 64))
	}
	send(1, 1)
	send(2, 2) // port 2: LOC_QP_OP_ERR
	_, ok := u.scq.poll()
	assert.False(t, ok, "waits for WQE 1")
	assert.Zero(t, q.sqConsumed())
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 1, u.scq.mustPoll().WRID)
	e := u.scq.mustPoll()
	assert.EqualValues(t, 2, e.WRID)
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, e.Status)
	assert.EqualValues(t, 2, q.sqConsumed())
	assert.Equal(t, hostverbs.QPStateRTS, fq.attr.State, "UD stays usable")
}

// TestHostileRingIndices: a guest that rewrites its indices under work
// in flight gets QP_FATAL or has its writes ignored; never a panic, never
// a slot released twice.
func TestHostileRingIndices(t *testing.T) {
	u := newUserRC(t)
	g, q, fq := u.g, u.qp, u.fq
	g.events()
	for i := uint64(1); i <= 3; i++ {
		q.postSend(wqe(hostverbs.WRSend, i, hostverbs.SendSignaled), u.sge(0, 8))
	}
	// cons_head is the device's: scribbles are overwritten by the next
	// release, and never move the device's view.
	g.store32(q.sqState()+4, 3)
	q.postSend(wqe(hostverbs.WRSend, 4, hostverbs.SendSignaled), u.sge(0, 8))
	require.Equal(t, 4, fq.outstanding(false), "the device does not read its own index back")
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 1, q.sqConsumed())
	for _, bad := range []uint32{0xffffffff, 1 << 31, 33} {
		g.store32(q.sqState()+4, bad)
		fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	}
	assert.EqualValues(t, 4, q.sqConsumed())
	for i := uint64(1); i <= 4; i++ {
		assert.EqualValues(t, i, u.scq.mustPoll().WRID)
	}

	// prod_tail moved back behind WQEs already posted: QP_FATAL, and the
	// provider's flush still completes each of them once.
	q.postSend(wqe(hostverbs.WRSend, 5, hostverbs.SendSignaled), u.sge(0, 8))
	q.postSend(wqe(hostverbs.WRSend, 6, hostverbs.SendSignaled), u.sge(0, 8))
	g.store32(q.sqState(), 5)
	g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|q.handle)
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: q.handle}}, g.events())
	assert.EqualValues(t, 5, u.scq.mustPoll().WRID)
	assert.EqualValues(t, 6, u.scq.mustPoll().WRID)
	_, ok := u.scq.poll()
	assert.False(t, ok)
	assert.EqualValues(t, 6, q.sqConsumed())

	// Every other value of prod_tail, on a fresh QP with work in flight.
	for _, bad := range []uint32{0xffffffff, 32, 1 << 31, 17} { // 17: a ring and one ahead
		q = u.newQP(t)
		q.postRecv(1, u.sge(0, 8))
		g.store32(q.rqState(), bad)
		g.doorbell(1, abi.UARQPOffset, abi.UARQPRecv|q.handle)
		assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: q.handle}}, g.events(), "prod_tail %#x", bad)
		assert.EqualValues(t, 1, u.rcq.mustPoll().WRID, "flushed once")
		assert.EqualValues(t, 1, q.rqConsumed())
	}
	// Provider completions naming nothing: dropped.
	stale := g.dev.Stats().StaleCompletions
	for _, id := range []uint64{0, ^uint64(0), wridMagic | 1<<31 | 5, wridMagic | wridRecv | 0xffffffff, wridMagic | 7<<wridEpochShift} {
		u.fq.complete(false, hostverbs.WorkCompletion{WRID: id, Status: hostverbs.WCWRFlushErr})
		u.fq.complete(true, hostverbs.WorkCompletion{WRID: id})
	}
	assert.Equal(t, stale+10, g.dev.Stats().StaleCompletions)
	_, ok = u.scq.poll()
	assert.False(t, ok)
	_, ok = u.rcq.poll()
	assert.False(t, ok)
}

// TestSRQQPSharedCQ: on a QP whose SRQ receives and sends share a CQ,
// the receives keep the guest's wr_id and the sends are translated, for
// errors as for successes.
func TestSRQQPSharedCQ(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	s := g.createSRQ(u.pd, 8, 1, 0, 1)
	cq := g.createCQ(1, 64)
	q := g.createQP(qpSpec{pd: u.pd, scq: cq, rcq: cq, srq: s, typ: hostverbs.QPTypeRC, sendWR: 4, sendSGE: 1, uar: 1})
	q.toRTS(0x99, gidB, 0)
	fq := u.fv.qps[len(u.fv.qps)-1]
	fs := u.fv.srqs[0]
	s.postRecv(0x5000, u.sge(0, 8))
	require.Len(t, fs.recvs, 1)
	assert.EqualValues(t, 0x5000, fs.recvs[0].WRID, "the SRQ passes the guest's wr_id")
	assert.EqualValues(t, 1, g.u32(s.pages[0]+12), "the SRQ ring is released at post")
	q.postSend(wqe(hostverbs.WRSend, 0x6000, hostverbs.SendSignaled), u.sge(0, 8))
	fq.complete(true, hostverbs.WorkCompletion{WRID: 0x5000, Opcode: hostverbs.WCRecv})
	assert.EqualValues(t, 0x5000, cq.mustPoll().WRID)
	fq.complete(false, hostverbs.WorkCompletion{WRID: wridMagic | 77, Status: hostverbs.WCWRFlushErr})
	e := cq.mustPoll()
	assert.EqualValues(t, wridMagic|77, e.WRID, "an error whose WRID is no send's: a receive")
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Status: hostverbs.WCWRFlushErr})
	e = cq.mustPoll()
	assert.EqualValues(t, 0x6000, e.WRID, "a send's error, translated")
	assert.EqualValues(t, hostverbs.WCSend, e.Opcode)
	assert.EqualValues(t, 1, q.sqConsumed())
}

// TestHotPathAllocs: posting, completing and releasing allocate nothing
// per WQE (the provider here completes at once, as in the benchmarks).
func TestHotPathAllocs(t *testing.T) {
	u := newUserRC(t)
	u.fv.autoComplete = true
	g, q := u.g, u.qp
	var w [abi.SQWQEHdrSize + abi.SGESize]byte
	h := wqe(hostverbs.WRSend, 0, hostverbs.SendSignaled)
	h.NumSGE = 1
	h.Encode(w[:])
	u.sge(0, 64).Encode(w[abi.SQWQEHdrSize:])
	var r [abi.RQWQEHdrSize + abi.SGESize]byte
	abi.RQWQEHdr{WRID: 1, NumSGE: 1}.Encode(r[:])
	u.sge(0, 64).Encode(r[abi.RQWQEHdrSize:])
	var sdb, rdb [4]byte
	putLE32(sdb[:], abi.UARQPSend|q.handle)
	putLE32(rdb[:], abi.UARQPRecv|q.handle)
	consume := func(c *gcq) {
		st := c.pages[0] + 8
		head := g.u32(st + 4)
		if g.u32(st) == head {
			t.Fatal("no CQE")
		}
		g.put32(st+4, drvInc(head, c.n))
	}
	allocs := testing.AllocsPerRun(200, func() {
		tail := g.u32(q.sqState())
		copy(g.raw[q.sqWQE(tail):], w[:])
		g.put32(q.sqState(), drvInc(tail, q.sendWR))
		if err := g.dev.WriteBAR(abi.UARBAR, abi.UARPageSize+abi.UARQPOffset, sdb[:]); err != nil {
			t.Fatal(err)
		}
		consume(u.scq)
		tail = g.u32(q.rqState())
		copy(g.raw[q.rqWQE(tail):], r[:])
		g.put32(q.rqState(), drvInc(tail, q.recvWR))
		if err := g.dev.WriteBAR(abi.UARBAR, abi.UARPageSize+abi.UARQPOffset, rdb[:]); err != nil {
			t.Fatal(err)
		}
		consume(u.rcq)
	})
	assert.Zero(t, allocs)
	assert.Equal(t, q.sqTail(), q.sqConsumed())
	assert.Equal(t, q.rqTail(), q.rqConsumed())
}

// TestDrainAfterUnsignaledSends is ib_drain_qp after a run of unsignaled
// sends the provider completed in silence: the QP goes to ERR (the
// provider has nothing to flush) and the signaled marker WQE posted then
// must complete, releasing the sends before it.
func TestDrainAfterUnsignaledSends(t *testing.T) {
	u := newUserRC(t)
	q, fq := u.qp, u.fq
	for i := uint64(1); i <= 3; i++ {
		q.postSend(wqe(hostverbs.WRSend, i, 0), u.sge(0, 8))
	}
	sends, _ := fq.take()
	require.Len(t, sends, 3)
	assert.Zero(t, sends[2].Flags&hostverbs.SendSignaled, "a user QP's unsignaled send stays unsignaled")
	fq.retire(3)
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
	_, ok := u.scq.poll()
	assert.False(t, ok)
	q.postSend(wqe(hostverbs.WRRDMAWrite, 0xd7a1, hostverbs.SendSignaled)) // the drain marker
	e := u.scq.mustPoll()
	assert.EqualValues(t, 0xd7a1, e.WRID)
	assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
	assert.EqualValues(t, 4, q.sqConsumed())
	_, ok = u.scq.poll()
	assert.False(t, ok)
}

// TestDirectErrorAfterUnsignaled: on UD a refused WQE after an unsignaled
// send completes at once (its completion covers the send, which may have
// completed in silence); a late completion of the send is dropped.
func TestDirectErrorAfterUnsignaled(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	q := g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	fq := u.fv.qps[len(u.fv.qps)-1]
	q.udToRTS(0x11111111)
	send := func(wrid uint64, port uint32, flags hostverbs.SendFlags) {
		h := wqe(hostverbs.WRSend, wrid, flags)
		abi.WRUD{RemoteQPN: 0x1234, RemoteQKey: 0x11111111, AV: abi.AV{PortPD: port<<24 | u.pd, DGID: gidB, HopLimit: 1}}.Encode(h.WR[:])
		q.postSend(h, u.sge(0, 64))
	}
	send(1, 1, 0)
	send(2, 2, hostverbs.SendSignaled) // port 2: refused
	e := u.scq.mustPoll()
	assert.EqualValues(t, 2, e.WRID)
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, e.Status)
	assert.EqualValues(t, 2, q.sqConsumed())
	stale := g.dev.Stats().StaleCompletions
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Status: hostverbs.WCGeneralErr})
	_, ok := u.scq.poll()
	assert.False(t, ok, "never a second completion for WQE 1's slot")
	assert.Equal(t, stale+1, g.dev.Stats().StaleCompletions)
}
