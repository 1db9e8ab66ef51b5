package vdev

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// One test per CVE class published against QEMU's former pvrdma device,
// driven through the BARs as a malicious guest driver would.

// loadDSR writes a DSR built by mutate and returns ERR after ACTIVATE.
func loadHostileDSR(g *guest, mutate func(d *abi.DSR)) uint32 {
	g.t.Helper()
	g.setupDSR()
	var d abi.DSR
	d.Decode(g.raw[g.dsr:])
	mutate(&d)
	d.Encode(g.raw[g.dsr:])
	require.NoError(g.t, g.writeReg(abi.RegDSRLow, uint32(g.dsr)))
	require.NoError(g.t, g.writeReg(abi.RegDSRHigh, uint32(g.dsr>>32)))
	require.NoError(g.t, g.writeReg(abi.RegCtl, abi.CtlActivate))
	return g.readReg(abi.RegErr)
}

func TestCVE_2018_20123_LeakAfterInitError(t *testing.T) {
	fv := newFakeVerbs()
	g := newGuest(t, fv, Limits{})
	errReg := loadHostileDSR(g, func(d *abi.DSR) { d.CQRing.PDirDMA = 0x7ff0000000 })
	assert.NotZero(t, errReg)
	var caps abi.Caps
	caps.Decode(g.raw[g.dsr+abi.DSRCapsOffset:])
	assert.Zero(t, caps.Mode|caps.GIDTypes, "no caps written for a refused DSR: the driver stops cleanly")
	assert.Nil(t, g.dev.async, "no ring kept from the half-loaded DSR")
	g.probe()
	assert.Equal(t, 0, fv.count("pd"))
}

func TestCVE_2018_20124_NumSGE(t *testing.T) {
	u := newUserRC(t)
	for _, n := range []uint32{5, 64, 1 << 16, 0xffffffff} {
		u.qp.writeSend(wqe(hostverbs.WRSend, 1, 0))
		u.g.put32(u.qp.sqWQE(u.g.u32(u.qp.sqState())-1)+8, n)
		u.g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|u.qp.handle)
		e := u.scq.mustPoll()
		assert.NotZero(t, e.Status, "num_sge %d", n)
	}
	for _, n := range []uint32{3, 0xffffffff} {
		u.qp.writeRecv(1)
		u.g.put32(u.qp.rqWQE(u.g.u32(u.qp.rqState())-1)+8, n)
		u.g.doorbell(1, abi.UARQPOffset, abi.UARQPRecv|u.qp.handle)
		assert.NotZero(t, u.rcq.mustPoll().Status)
	}
	s := u.g.createSRQ(u.pd, 4, 1, 0, 1)
	s.postRecv(1, u.sge(0, 1), u.sge(0, 1))
	evs := u.g.events()
	assert.Equal(t, abi.EQE{Type: uint32(hostverbs.EventSRQErr), Info: s.handle}, evs[len(evs)-1])
	sends, recvs := u.fq.take()
	assert.Empty(t, sends)
	assert.Empty(t, recvs)
}

func TestCVE_2018_20125_PageCounts(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	pd := g.createPD(0)
	dir := g.pdir(g.pages(2))
	start := time.Now()
	for _, r := range []abi.CreateCQ{
		{PDirDMA: dir, CQE: 16, NChunks: 0},
		{PDirDMA: dir, CQE: 16, NChunks: 1},
		{PDirDMA: dir, CQE: 16, NChunks: 0xffffffff},
		{PDirDMA: dir, CQE: 16, NChunks: 1 << 18},
		{PDirDMA: dir, CQE: 0xffffffff, NChunks: 2},
		{PDirDMA: dir, CQE: 1 << 30, NChunks: 1<<24 + 1},
		{PDirDMA: dir, CQE: 0, NChunks: 2},
	} {
		errReg, _ := g.cmd(abi.CmdCreateCQ, r)
		assert.NotZero(t, errReg, "%+v", r)
	}
	cq := g.createCQ(0, 16)
	for _, r := range []abi.CreateQP{
		{TotalChunks: 0, SendChunks: 0},
		{TotalChunks: 0xffff, SendChunks: 0xfffe},
		{TotalChunks: 2, SendChunks: 5},
		{TotalChunks: 3, SendChunks: 1, MaxSendWR: 1 << 20},
		{TotalChunks: 3, SendChunks: 1, MaxSendWR: 0xffffffff, MaxSendSGE: 0xffffffff},
		{TotalChunks: 3, SendChunks: 1, MaxRecvSGE: 1 << 30},
	} {
		r.PDHandle, r.SendCQHandle, r.RecvCQHandle, r.QPType, r.PDirDMA = pd, cq.handle, cq.handle, 2, dir
		if r.MaxSendWR == 0 {
			r.MaxSendWR, r.MaxSendSGE = 4, 1
		}
		if r.MaxRecvSGE == 0 {
			r.MaxRecvWR, r.MaxRecvSGE = 4, 1
		}
		errReg, _ := g.cmd(abi.CmdCreateQP, r)
		assert.NotZero(t, errReg, "%+v", r)
	}
	errReg, _ := g.cmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDirDMA: dir, PDHandle: pd, NChunks: 0xffffffff, Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: 1}})
	assert.NotZero(t, errReg)
	// Refused up front: the time is logged, not judged (it measures the
	// machine); tests/hostile's TestCVE_2018_20125_PageCounts bounds the
	// heap these refusals may grow.
	t.Logf("7 CQs, 6 QPs and an SRQ refused in %v", time.Since(start))
	assert.Equal(t, 0, fv.count("qp"))
}

func TestCVE_2018_20126_ErrorPathLeaks(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	pd := g.createPD(0)
	errReg, _ := g.cmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: 0x7ff0000000, CQE: 16, NChunks: 2})
	assert.NotZero(t, errReg)
	cq := g.createCQ(0, 16)
	assert.EqualValues(t, 0, cq.handle, "the failed CQ kept no handle")
	bad := g.pdir(g.pages(3))
	g.put64(g.u64(bad)+16, 0x7ff0000000) // third page outside RAM
	errReg, _ = g.cmd(abi.CmdCreateQP, abi.CreateQP{PDirDMA: bad, PDHandle: pd, SendCQHandle: cq.handle, RecvCQHandle: cq.handle,
		MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1, QPType: 2, TotalChunks: 3, SendChunks: 1})
	assert.NotZero(t, errReg)
	assert.Equal(t, 0, fv.count("qp"))
	g.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: cq.handle}) // no reference leaked on the CQ
	g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd})
	assert.Equal(t, 0, fv.count("cq")+fv.count("pd"))
}

func (g *guest) u64(gpa uint64) uint64 { return uint64(g.u32(gpa)) | uint64(g.u32(gpa+4))<<32 }

func TestCVE_2018_20191_UARRead(t *testing.T) {
	g := probedGuest(t, newFakeVerbs())
	for off := uint64(0); off < BAR2Size; off += 4 {
		var b [4]byte
		require.NoError(t, g.dev.ReadBAR(abi.UARBAR, off, b[:]))
		if b != [4]byte{0xff, 0xff, 0xff, 0xff} {
			t.Fatalf("UAR read at %#x: %x", off, b)
		}
	}
}

func TestCVE_2018_20216_RingIndices(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	g.events()
	// A producer index the ring cannot have: no loop, no post, QP_FATAL.
	g.put32(u.qp.sqState(), 0xffffffff)
	done := make(chan struct{})
	go func() {
		g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|u.qp.handle)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("doorbell with an invalid index did not return")
	}
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: u.qp.handle}}, g.events())
	assert.Equal(t, hostverbs.QPStateErr, u.fq.attr.State)
	// A producer more than a ring ahead of the consumer.
	q2 := u.newQP(t)
	g.put32(q2.rqState(), drvInc(16, 16)) // 17 ahead of 0 in a 16-ring
	g.doorbell(1, abi.UARQPOffset, abi.UARQPRecv|q2.handle)
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: q2.handle}}, g.events())
	// A CQ consumer index the guest corrupted: completions are dropped
	// with a CQ error, never written out of bounds.
	g.put32(u.rcq.pages[0]+12, 0x12345678)
	q3 := u.newQP(t)
	q3.postRecv(1, u.sge(0, 8))
	u.fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventCQErr), Info: u.rcq.handle}}, g.events())
	// The device's own indices are not taken from guest memory.
	q4 := u.newQP(t)
	g.put32(q4.sqState()+4, 9) // guest scribbles over cons_head
	q4.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 1))
	sends, _ := u.fq.take()
	assert.Len(t, sends, 1)
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 1, q4.sqConsumed())
}

func TestCVE_2021_3582_MRLengthVsNChunks(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	pd := g.createPD(0)
	dir := g.pdir(g.pages(4))
	for _, r := range []abi.CreateMR{
		{Start: 0x1000, Length: 3 * 4096, NChunks: 2},
		{Start: 0x1000, Length: 3 * 4096, NChunks: 4},
		{Start: 0x1010, Length: 3 * 4096, NChunks: 3}, // unaligned start spans 4 pages
		{Start: 0x1000, Length: 0, NChunks: 0},
		{Start: 0xfffffffffffff000, Length: 0x2000, NChunks: 2},
		{Start: 0, Length: 1 << 62, NChunks: 4},
	} {
		r.PDHandle, r.AccessFlags, r.PDirDMA = pd, 1, dir
		errReg, _ := g.cmd(abi.CmdCreateMR, r)
		assert.NotZero(t, errReg, "%+v", r)
	}
	assert.Equal(t, 0, fv.count("mr"))
	g.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x1010, Length: 3 * 4096, NChunks: 4, PDHandle: pd, AccessFlags: 1, PDirDMA: dir})
}

func TestCVE_2021_3607_RingPageCount(t *testing.T) {
	for _, n := range []uint32{0, 1, 0xffffffff, 1 << 20} {
		g := newGuest(t, newFakeVerbs(), Limits{})
		assert.NotZero(t, loadHostileDSR(g, func(d *abi.DSR) { d.AsyncRing.NumPages = n }), "async ring of %d pages", n)
		g = newGuest(t, newFakeVerbs(), Limits{})
		assert.NotZero(t, loadHostileDSR(g, func(d *abi.DSR) { d.CQRing.NumPages = n }), "CQ ring of %d pages", n)
	}
}

func TestCVE_2021_3608_RingInitFailure(t *testing.T) {
	g := newGuest(t, newFakeVerbs(), Limits{})
	errReg := loadHostileDSR(g, func(d *abi.DSR) {
		pages := g.pages(4)
		pages[2] = 0x7ff0000000 // a page the ring init cannot map
		d.CQRing.PDirDMA = g.pdir(pages)
	})
	assert.NotZero(t, errReg)
	g.probe() // a good DSR afterwards starts from a clean state
	u := g.createPD(0)
	assert.EqualValues(t, 0, u)
}

func TestCVE_2022_1050_CommandBeforeDSR(t *testing.T) {
	g := newGuest(t, newFakeVerbs(), Limits{})
	require.NoError(t, g.writeReg(abi.RegIMR, 0))
	for i := 0; i < 3; i++ {
		require.NoError(t, g.writeReg(abi.RegRequest, 0))
		assert.EqualValues(t, syscall.EFAULT, g.readReg(abi.RegErr))
	}
	assert.EqualValues(t, 3, g.irq.count(abi.VectorResponse))
	// And after a reset, the slots are gone again.
	g.probe()
	require.NoError(t, g.writeReg(abi.RegCtl, abi.CtlReset))
	require.NoError(t, g.writeReg(abi.RegIMR, 0))
	require.NoError(t, g.writeReg(abi.RegRequest, 0))
	assert.EqualValues(t, syscall.EFAULT, g.readReg(abi.RegErr))
}

func TestCVE_2023_1544_RingBeyondOnePageTable(t *testing.T) {
	g := newGuest(t, newFakeVerbs(), Limits{})
	assert.NotZero(t, loadHostileDSR(g, func(d *abi.DSR) {
		d.AsyncRing = abi.RingPageInfo{NumPages: 513, PDirDMA: g.pdir(g.pages(513))}
	}))
	g = newGuest(t, newFakeVerbs(), Limits{})
	assert.Zero(t, loadHostileDSR(g, func(d *abi.DSR) {
		d.AsyncRing = abi.RingPageInfo{NumPages: 512, PDirDMA: g.pdir(g.pages(512))}
	}), "one full page table is allowed")
}

func TestDSRWriteWhileActiveRefused(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	g.bindGID(0, gidA)
	pd := g.createPD(0)
	cq := g.createCQ(0, 16)
	g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	// A second DSR without CTL RESET is refused, and nothing is torn down.
	require.NoError(t, g.writeReg(abi.RegDSRLow, uint32(g.dsr)))
	assert.EqualValues(t, syscall.EBUSY, g.readReg(abi.RegErr))
	require.NoError(t, g.writeReg(abi.RegDSRHigh, uint32(g.dsr>>32)))
	assert.EqualValues(t, syscall.EBUSY, g.readReg(abi.RegErr))
	assert.Equal(t, 3, fv.count("qp")+fv.count("cq")+fv.count("pd"), "the first DSR's objects live on")
	assert.NotEmpty(t, fv.gids)
	assert.EqualValues(t, 1, g.createPD(0))
	// After RESET the driver's probe loads a new DSR from scratch.
	require.NoError(t, g.writeReg(abi.RegCtl, abi.CtlReset))
	g.probe()
	assert.Equal(t, 0, fv.count("qp")+fv.count("cq")+fv.count("pd"), "the first DSR's objects are gone")
	assert.EqualValues(t, 0, g.createPD(0))
}

func TestHandlesStayBelowCaps(t *testing.T) {
	fv := newFakeVerbs()
	g := newGuest(t, fv, Limits{MaxCQ: 8})
	g.probe()
	for i := uint32(0); i < 8; i++ {
		assert.Less(t, g.createCQ(0, 4).handle, g.caps.MaxCQ)
	}
	errReg, _ := g.cmd(abi.CmdCreateCQ, abi.CreateCQ{CQE: 4, NChunks: 2, PDirDMA: g.pdir(g.pages(2))})
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	// Doorbells and commands with handles at or above the caps name nothing.
	g.doorbell(0, abi.UARCQOffset, abi.UARCQArm|8)
	g.doorbell(0, abi.UARCQOffset, abi.UARCQArm|abi.UARHandleMask)
	errReg, _ = g.cmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: 8})
	assert.NotZero(t, errReg)
}

// A CREATE_BIND the provider refuses (another VM owns the GID) leaves the
// index bound to the GID it had.
func TestRefusedRebindKeepsGID(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	g.bindGID(0, gidA)
	fv.failNext("SetGID", hostverbs.ErrBusy)
	errReg, _ := g.cmd(abi.CmdCreateBind, abi.CreateBind{MTU: 1024, VLAN: 0xfff, Index: 0, NewGID: gidB, GIDType: 2})
	assert.EqualValues(t, syscall.EBUSY, errReg)
	assert.Equal(t, hostverbs.GIDEntry{GID: gidA, Type: hostverbs.GIDTypeRoCEv2}, g.dev.GIDs()[0])
	assert.Equal(t, hostverbs.GIDEntry{GID: gidA, Type: hostverbs.GIDTypeRoCEv2}, fv.gids[0])
	last := g.gotGID[len(g.gotGID)-1]
	assert.Equal(t, gidEvent{0, hostverbs.GIDEntry{GID: gidA, Type: hostverbs.GIDTypeRoCEv2}, true}, last)
}

// What all QPs, SRQs, CQs and MRs of a VM cost the daemon is capped in
// bytes (Limits.MaxBytes): page directories can name the same pages for
// every queue, so the guest's RAM does not bound what the provider
// allocates for them.
func TestObjectBudget(t *testing.T) {
	spec := func(pd uint32, cq *gcq) qpSpec {
		return qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1}
	}
	// What the CQ and one QP cost, with the default budget.
	g0 := newGuest(t, newFakeVerbs(), Limits{})
	g0.probe()
	pd0 := g0.createPD(0)
	cq0 := g0.createCQ(0, 16)
	base := g0.dev.Objects()["object_bytes"]
	g0.createQP(spec(pd0, cq0))
	perQP := g0.dev.Objects()["object_bytes"] - base
	require.Greater(t, perQP, 16*(costSendWQE+costRecvWQE))

	fv := newFakeVerbs()
	g := newGuest(t, fv, Limits{MaxBytes: uint64(base + 15*perQP)})
	g.probe()
	pd := g.createPD(0)
	cq := g.createCQ(0, 16)
	var qps []*gqp
	for i := 0; i < 15; i++ {
		qps = append(qps, g.createQP(spec(pd, cq)))
	}
	_, errReg := g.tryCreateQP(spec(pd, cq))
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	errReg, _ = g.cmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDirDMA: g.pdir(g.pages(2)), PDHandle: pd, NChunks: 2,
		Attrs: abi.SRQAttr{MaxWR: 32, MaxSGE: 1}})
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	errReg, _ = g.cmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: g.pdir(g.pages(2)), CQE: 16, NChunks: 2})
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: qps[0].handle})
	g.createQP(spec(pd, cq))
	assert.Equal(t, 15, fv.count("qp"))
	assert.Equal(t, base+15*perQP, g.dev.Objects()["object_bytes"])
	require.NoError(t, g.dev.Close())
	assert.Zero(t, g.dev.heap.Used(), "a closed device gives its bytes back")
}

// The daemon-wide budget is shared: what one VM holds, another cannot
// take, and it comes back when the first VM goes.
func TestDaemonBudget(t *testing.T) {
	daemon := NewBudget(64<<10, nil)
	a := newGuestBudget(t, newFakeVerbs(), Limits{}, guestRAMSize, daemon)
	b := newGuestBudget(t, newFakeVerbs(), Limits{}, guestRAMSize, daemon)
	a.probe()
	b.probe()
	pdA, pdB := a.createPD(0), b.createPD(0)
	cqA, cqB := a.createCQ(0, 16), b.createCQ(0, 16)
	spec := func(pd uint32, cq *gcq) qpSpec {
		return qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1}
	}
	n := 0
	for ; ; n++ {
		if _, errReg := a.tryCreateQP(spec(pdA, cqA)); errReg != 0 {
			assert.EqualValues(t, syscall.ENOMEM, errReg)
			break
		}
	}
	require.Greater(t, n, 0)
	_, errReg := b.tryCreateQP(spec(pdB, cqB))
	assert.EqualValues(t, syscall.ENOMEM, errReg, "the daemon's budget is spent by the other VM")
	assert.LessOrEqual(t, daemon.Used(), daemon.Limit())
	require.NoError(t, a.dev.Close())
	b.createQP(spec(pdB, cqB))
}
