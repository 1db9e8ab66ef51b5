package hostile

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// The latent bugs found in QEMU's final pvrdma code (beside its CVEs), one
// test each: an error WQE that never left its slot (a spin), a negative
// ERR, an unvalidated UC pfn, nchunks caps, handles at or above the caps,
// and a second DSRHIGH.

// udPair creates two UD QPs in p's VM in RTS with qkey.
func (p *endpoint) udPair(qkey uint32) (*gqp, *gqp) {
	p.v.t.Helper()
	s := qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeUD,
		sendWR: qpDepth, recvWR: qpDepth, sendSGE: 2, recvSGE: 2, uar: p.uc}
	a, b := p.v.createQP(s), p.v.createQP(s)
	for _, q := range []*gqp{a, b} {
		q.mustModify(0x71, abi.QPAttr{State: 1, PortNum: 1, QKey: qkey})
		q.mustModify(0x1, abi.QPAttr{State: 2})
		q.mustModify(0x10001, abi.QPAttr{State: 3})
	}
	return a, b
}

// udSend is a signaled UD SEND to QP qpn of the VM's own GID.
func (p *endpoint) udSend(wrid uint64, qpn, qkey uint32) abi.SQWQEHdr {
	h := sendWQE(wrid)
	abi.WRUD{RemoteQPN: qpn, RemoteQKey: qkey, AV: abi.AV{PortPD: 1<<24 | p.pd, DGID: p.gid,
		GIDIndex: 0, HopLimit: 64, SrcPathBits: 0x80}}.Encode(h.WR[:])
	return h
}

// An error WQE must consume its slot (QEMU's pvrdma_qp_send/recv did
// `continue` without advancing and spun on it). Every kind of bad send
// WQE completes with its status and advances cons_head by one; on RC the
// QP then flushes the rest, on UD the next good WQE goes out.
func TestErrorWQEConsumesSlot(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	badOp := func(op uint32) abi.SQWQEHdr { h := sendWQE(1); h.Opcode = op; return h }
	atomicWQE := writeWQE(1, p.mr.iova, p.mr.rkey)
	atomicWQE.Opcode = uint32(hostverbs.WRAtomicFetchAndAdd)
	for _, c := range []struct {
		name string
		h    abi.SQWQEHdr
		sges []abi.SGE
		want hostverbs.WCStatus
		op   hostverbs.WCOpcode
	}{
		{"unknown opcode", badOp(0xff), nil, hostverbs.WCLocQPOpErr, hostverbs.WCSend},
		{"LSO", badOp(uint32(hostverbs.WRLSO)), nil, hostverbs.WCLocQPOpErr, hostverbs.WCLSO},
		{"REG_MR from a user QP", badOp(uint32(hostverbs.WRRegMR)), nil, hostverbs.WCLocQPOpErr, hostverbs.WCRegMR},
		{"unknown lkey", sendWQE(1), []abi.SGE{{Addr: p.mr.iova, Length: 8, LKey: 0xdead}}, hostverbs.WCLocProtErr, hostverbs.WCSend},
		{"SGE past the MR", sendWQE(1), []abi.SGE{p.mr.sge(mrBytes-4, 8)}, hostverbs.WCLocProtErr, hostverbs.WCSend},
		{"SGE wrapping", sendWQE(1), []abi.SGE{{Addr: ^uint64(0) - 2, Length: 8, LKey: p.mr.lkey}}, hostverbs.WCLocProtErr, hostverbs.WCSend},
		{"atomic of 4 bytes", atomicWQE, []abi.SGE{p.mr.sge(0, 4)}, hostverbs.WCLocLenErr, hostverbs.WCFetchAdd},
	} {
		q, _ := p.loopPair()
		q.writeSend(c.h, c.sges...)
		for i := uint64(2); i <= 4; i++ {
			q.writeSend(sendWQE(i), p.mr.sge(0, 8))
		}
		q.ringSend()
		require.EqualValues(t, 4, q.sqConsumed(), c.name)
		requireCQE(t, p.scq.wait(), q, 1, c.op, c.want)
		for i := uint64(2); i <= 4; i++ {
			requireCQE(t, p.scq.wait(), q, i, hostverbs.WCSend, hostverbs.WCWRFlushErr)
		}
		p.scq.empty()
	}

	// Before RTS (the drivers refuse this themselves; a hostile one
	// does not): LOC_QP_OP_ERR, slot consumed.
	s := qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: p.uc}
	q := v.createQP(s)
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1, AccessFlags: accRW})
	q.postSend(sendWQE(9), p.mr.sge(0, 8))
	requireCQE(t, p.scq.wait(), q, 9, hostverbs.WCSend, hostverbs.WCLocQPOpErr)
	require.EqualValues(t, 1, q.sqConsumed())

	// UD: the bad WQE completes in error, the QP stays usable and the
	// good WQE after it is sent.
	const qkey = 0x11111111
	a, b := p.udPair(qkey)
	b.postRecv(20, p.mr.sge(0x1000, 40+64))
	a.writeSend(writeWQE(21, p.mr.iova, p.mr.rkey), p.mr.sge(0, 8)) // RDMA WRITE on UD
	a.writeSend(p.udSend(22, b.qpn, qkey), p.mr.sge(0x100, 64))
	a.ringSend()
	requireCQE(t, p.scq.wait(), a, 21, hostverbs.WCRDMAWrite, hostverbs.WCLocQPOpErr)
	requireCQE(t, p.scq.wait(), a, 22, hostverbs.WCSend, hostverbs.WCSuccess)
	require.EqualValues(t, 2, a.sqConsumed(), "both released (22 at its completion, before its CQE)")
	rc := p.rcq.wait()
	requireCQE(t, rc, b, 20, hostverbs.WCRecv, hostverbs.WCSuccess)
	require.EqualValues(t, 40+64, rc.ByteLen, "GRH + payload")
	require.Equal(t, hostverbs.QPStateRTS, a.state())
	e.healthy()
}

// ERR is never negative (QEMU stored the handler's -errno): whatever the
// failure, ERR is a small positive errno equal to the response's err,
// unknown command codes fail without touching the response slot, and so
// do unknown CTL values.
func TestERRNeverNegative(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	check := func(r result) {
		t.Helper()
		require.NotZero(t, r.err)
		require.Less(t, r.err, uint32(256), "ERR %#x", r.err)
		if r.code < abi.NumCmds {
			require.EqualValues(t, r.err, r.hdr.Err)
		}
	}
	for code := uint32(0); code < abi.NumCmds; code++ {
		// Every command with an all-ones body: handles, counts and
		// addresses out of range.
		slot := v.ram[v.cmdSlot : v.cmdSlot+abi.CmdReqSize]
		for i := range slot {
			slot[i] = 0xff
		}
		v.key++
		abi.CmdHdr{Response: v.key, Cmd: code}.Encode(slot)
		r := v.request(code)
		if code == abi.CmdQueryPKey || code == abi.CmdQueryPort {
			require.EqualValues(t, eInval, r.err, "%s", vdev.CommandName(code))
		}
		check(r)
	}
	for _, code := range []uint32{abi.NumCmds, 0x80, abi.RespFlag | abi.CmdCreatePD, 0xffffffff} {
		r := v.post(code, nil)
		require.EqualValues(t, eInval, r.err, "command %#x", code)
		for _, b := range r.resp {
			require.EqualValues(t, 0xEE, b, "no response written for unknown command %#x", code)
		}
	}
	require.NotZero(t, e.counter(vmEvil, "command_errors"))
	for _, ctl := range []uint32{3, 0x80000000, 0xffffffff} {
		v.setReg(abi.RegCtl, ctl)
		require.EqualValues(t, eInval, v.reg(abi.RegErr), "CTL %#x", ctl)
	}
	e.healthy()
}

// The UC pfn is validated (QEMU had a TODO): only UAR pages 1..max_uar-1
// of this device's BAR2, each to one context; and an object may only be
// rung from its own context's UAR page.
func TestUCPFNValidated(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	for _, pfn := range []uint64{0, uarPFN - 1, uarPFN, uarPFN + vdev.UARPages, uarPFN + 1<<32, ^uint64(0)} {
		v.failCmd(abi.CmdCreateUC, abi.CreateUC{PFN: pfn}, eInval)
	}
	uc := v.createUC(vdev.UARPages - 1)
	v.failCmd(abi.CmdCreateUC, abi.CreateUC{PFN: uarPFN + vdev.UARPages - 1}, syscall.EBUSY)
	v.failCmd(abi.CmdCreatePD, abi.CreatePD{CtxHandle: 7}, eInval)
	pd := v.createPD(uc)
	cq := v.createCQ(uc, 16)
	q := v.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: uc})
	bad := e.counter(vmEvil, "bad_doorbells")
	v.doorbell(0, abi.UARQPOffset, abi.UARQPSend|q.handle)    // the kernel's page
	v.doorbell(1, abi.UARQPOffset, abi.UARQPSend|q.handle)    // another context's page
	v.doorbell(uc-1, abi.UARCQOffset, abi.UARCQArm|cq.handle) // a page without a context
	require.Equal(t, bad+3, e.counter(vmEvil, "bad_doorbells"))
	require.ErrorIs(t, v.tryDoorbell(uc+1, abi.UARCQOffset, abi.UARCQArm|cq.handle), eInval, "past BAR2")
	v.doorbell(uc, abi.UARCQOffset, abi.UARCQArm|cq.handle)
	require.Equal(t, bad+3, e.counter(vmEvil, "bad_doorbells"), "its own page works")
	v.failCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: 0}, eInval) // the kernel's page has no context
	v.failCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: vdev.UARPages}, eInval)
	e.healthy()
}

// nchunks caps: ring page counts are bounded by what the largest queue
// the caps allow needs (QEMU's cap was PVRDMA_MAX_FAST_REG_PAGES, 128, for
// CQ and QP rings), fast-register MRs by 128 pages.
func TestNChunksCaps(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	mostCQ := uint32(cqPages(v.caps.MaxCQE))
	dir := v.pdir(v.pages(int(mostCQ + 1)))
	v.failCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: dir, CQE: 16, NChunks: mostCQ + 1}, eInval)
	var r abi.CreateCQResp
	r.Decode(v.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: dir, CQE: 16, NChunks: mostCQ}))
	cq := r.CQHandle
	_, req := v.layoutQP(qpSpec{pd: pd, scq: &gcq{handle: cq}, rcq: &gcq{handle: cq}, typ: hostverbs.QPTypeRC,
		sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	req.TotalChunks, req.SendChunks = 0xffff, 1
	v.failCmd(abi.CmdCreateQP, req, eInval)
	fr := abi.CreateMR{PDHandle: pd, AccessFlags: accLocalWrite, Flags: abi.MRFlagFRMR}
	for _, n := range []uint32{0, ringbuf.MaxFastRegPages + 1, 0xffffffff} {
		fr.NChunks = n
		v.failCmd(abi.CmdCreateMR, fr, eInval)
	}
	fr.NChunks = ringbuf.MaxFastRegPages
	v.mustCmd(abi.CmdCreateMR, fr)
	e.healthy()
}

// Handles handed out stay below the caps (the driver indexes its tables
// with handle % max and frees with table[handle]); handles at or above
// them name nothing, in commands and doorbells alike.
func TestHandlesAtOrAboveCapsRejected(t *testing.T) {
	e := newEnvLimits(t, vdev.Limits{MaxCQ: 8, MaxPD: 4, MaxQP: 4, MaxMR: 4})
	v := e.boot(vmEvil)
	require.EqualValues(t, 8, v.caps.MaxCQ)
	require.EqualValues(t, 4, v.caps.MaxQP)
	var cqs []*gcq
	for i := 0; i < 8; i++ {
		c := v.createCQ(0, 4)
		require.Less(t, c.handle, v.caps.MaxCQ)
		cqs = append(cqs, c)
	}
	v.failCmd(abi.CmdCreateCQ, abi.CreateCQ{CQE: 4, NChunks: 2, PDirDMA: v.pdir(v.pages(2))}, syscall.ENOMEM)
	var pds []uint32
	for i := 0; i < 4; i++ {
		pd := v.createPD(0)
		require.Less(t, pd, v.caps.MaxPD)
		pds = append(pds, pd)
	}
	v.failCmd(abi.CmdCreatePD, abi.CreatePD{}, syscall.ENOMEM)
	for i := 0; i < 4; i++ {
		q := v.createQP(qpSpec{pd: pds[0], scq: cqs[0], rcq: cqs[1], typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
		require.Less(t, q.handle, v.caps.MaxQP)
	}
	_, req := v.layoutQP(qpSpec{pd: pds[0], scq: cqs[0], rcq: cqs[1], typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	v.failCmd(abi.CmdCreateQP, req, syscall.ENOMEM)

	bad := e.counter(vmEvil, "bad_doorbells")
	for _, h := range []uint32{8, 9, 0xffff, abi.UARHandleMask} {
		v.failCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: h}, eInval)
		v.failCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: h}, eInval)
		v.failCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: h}, eInval)
		v.failCmd(abi.CmdModifyQP, abi.ModifyQP{QPHandle: h, AttrMask: 1, Attrs: abi.QPAttr{State: 6}}, eInval)
		v.doorbell(0, abi.UARCQOffset, abi.UARCQArm|h)
		v.doorbell(0, abi.UARQPOffset, abi.UARQPSend|abi.UARQPRecv|h)
	}
	v.failCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: 0xffffffff}, eInval)
	require.Equal(t, bad+8, e.counter(vmEvil, "bad_doorbells"))
	e.healthy()
}

// DSRLOW or DSRHIGH written while the device is active (a driver
// reloaded over a live device, or a guest trying to make the device tear
// everything down on its whim; issue 12 saw it stall the device 3 s): the
// write is refused with EBUSY in ERR, the device and its objects serve on,
// and after CTL RESET the driver's probe starts from handle 0 as always.
func TestDSRHighRewrite(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	require.Len(t, e.vmStatus(vmEvil).GIDs, 1)
	for _, reg := range []uint64{abi.RegDSRLow, abi.RegDSRHigh} {
		start := time.Now()
		v.setReg(reg, uint32(v.dsr>>32))
		require.EqualValues(t, syscall.EBUSY, v.reg(abi.RegErr), "DSR register %#x written while active", reg)
		t.Logf("DSR register %#x written while active: refused in %v", reg, time.Since(start))
	}
	require.Len(t, e.vmStatus(vmEvil).GIDs, 1, "the GIDs stay bound")
	loopbackExchange(t, p)
	v.setReg(abi.RegCtl, abi.CtlReset)
	v.probe()
	require.Empty(t, e.vmStatus(vmEvil).GIDs, "GIDs of the first DSR unbound by the reset")
	v.failCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: p.qp.handle}, eInval)
	require.Zero(t, v.createPD(0))
	e.healthy()
}

// A QEMU restarted at once (or any client reconnecting) while the previous
// connection's teardown is still under way waits for it, bounded, instead
// of being refused (issue 12: a reconnect right after a close was refused).
func TestReconnectWaitsForTeardown(t *testing.T) {
	e := newEnv(t)
	old := e.boot(vmEvil)
	type dialed struct {
		v   *vm
		err error
	}
	res := make(chan dialed, 1)
	go func() {
		v, err := e.dial(vmEvil)
		res <- dialed{v, err}
	}()
	time.Sleep(300 * time.Millisecond) // the new client is waiting on the old session
	require.NoError(t, old.c.Close())  // the old QEMU exits
	d := <-res
	require.NoError(t, d.err, "the new QEMU is served once the old one is gone")
	d.v.mapRAM()
	d.v.pciSetup()
	d.v.probe()
	require.Zero(t, d.v.createPD(0))
	d.v.Close()
	old.Close() // its client is closed already; this releases its RAM and eventfds
	e.healthy()
}
