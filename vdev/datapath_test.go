package vdev

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

var (
	gidA = hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 14: 0, 15: 1}
	gidB = hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 14: 0, 15: 2}
)

// userRC is one process's RC setup on a probed guest: context 1 (UAR page
// 1), a PD, send and receive CQs, a 1 MiB MR and a QP in RTS.
type userRC struct {
	g        *guest
	fv       *fakeVerbs
	pd       uint32
	scq, rcq *gcq
	mr       *gmr
	qp       *gqp
	fq       *fakeQP
}

func newUserRC(t testing.TB) *userRC {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	g.bindGID(0, gidA)
	u := &userRC{g: g, fv: fv}
	uc := g.createUC(1)
	u.pd = g.createPD(uc)
	u.scq, u.rcq = g.createCQ(uc, 64), g.createCQ(uc, 64)
	u.mr = g.regMR(u.pd, 0x7f1234560010, 1<<20, 0xf)
	u.qp = u.newQP(t)
	return u
}

func (u *userRC) newQP(t testing.TB) *gqp {
	q := u.g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 4, recvSGE: 2, uar: 1})
	q.toRTS(0x99, gidB, 0)
	u.fq = u.fv.qps[len(u.fv.qps)-1]
	return q
}

func (u *userRC) sge(off uint64, n uint32) abi.SGE {
	return abi.SGE{Addr: u.mr.iova + off, Length: n, LKey: u.mr.lkey}
}

func wqe(op hostverbs.WROpcode, wrid uint64, flags hostverbs.SendFlags) abi.SQWQEHdr {
	return abi.SQWQEHdr{WRID: wrid, Opcode: uint32(op), SendFlags: uint32(flags)}
}

func TestSendTranslationRC(t *testing.T) {
	u := newUserRC(t)
	q := u.qp
	h := wqe(hostverbs.WRSendWithImm, 1, hostverbs.SendSignaled|hostverbs.SendSolicited|hostverbs.SendInline)
	h.Ex = 0x04030201
	q.postSend(h, u.sge(0, 100), u.sge(4096, 200))
	h = wqe(hostverbs.WRRDMAWriteWithImm, 2, 0)
	h.Ex = 7
	abi.WRRDMA{RemoteAddr: 0xabc0001000, RKey: 0x5522}.Encode(h.WR[:])
	q.postSend(h, u.sge(8, 1<<16))
	h = wqe(hostverbs.WRRDMARead, 3, hostverbs.SendSignaled)
	abi.WRRDMA{RemoteAddr: 0xabc0002000, RKey: 0x5523}.Encode(h.WR[:])
	q.postSend(h, u.sge(0, 4096))
	h = wqe(hostverbs.WRAtomicCmpAndSwp, 4, hostverbs.SendSignaled|hostverbs.SendFence)
	abi.WRAtomic{RemoteAddr: 0xabc0003000, CompareAdd: 11, Swap: 22, RKey: 0x5524}.Encode(h.WR[:])
	q.postSend(h, u.sge(64, 8))
	h = wqe(hostverbs.WRAtomicFetchAndAdd, 5, hostverbs.SendSignaled)
	abi.WRAtomic{RemoteAddr: 0xabc0003008, CompareAdd: 3, RKey: 0x5524}.Encode(h.WR[:])
	q.postSend(h, u.sge(72, 8))
	h = wqe(hostverbs.WRSend, 6, 0)
	q.postSend(h) // zero SGEs: a zero-length send

	sends, _ := u.fq.take()
	require.Len(t, sends, 6)
	s := sends[0]
	assert.Equal(t, hostverbs.WRSendWithImm, s.Opcode)
	assert.Equal(t, q.providerWRID(false, 0), s.WRID, "the provider gets the ring index, not the guest's wr_id")
	assert.Equal(t, hostverbs.SendSignaled|hostverbs.SendSolicited, s.Flags, "INLINE is dropped: no inline data in this ABI")
	assert.EqualValues(t, 0x04030201, s.ImmData, "immediate data verbatim")
	assert.Equal(t, []hostverbs.SGE{{Addr: u.mr.iova, Length: 100, LKey: u.mr.lkey}, {Addr: u.mr.iova + 4096, Length: 200, LKey: u.mr.lkey}}, s.SGL)
	assert.Equal(t, hostverbs.WRRDMAWriteWithImm, sends[1].Opcode)
	assert.EqualValues(t, 0xabc0001000, sends[1].RemoteAddr)
	assert.EqualValues(t, 0x5522, sends[1].RKey)
	assert.EqualValues(t, 7, sends[1].ImmData)
	assert.EqualValues(t, 0xabc0002000, sends[2].RemoteAddr)
	assert.Equal(t, hostverbs.WRAtomicCmpAndSwp, sends[3].Opcode)
	assert.Equal(t, []uint64{11, 22}, []uint64{sends[3].CompareAdd, sends[3].Swap})
	assert.EqualValues(t, 0x5524, sends[3].RKey)
	assert.Equal(t, hostverbs.SendSignaled|hostverbs.SendFence, sends[3].Flags)
	assert.EqualValues(t, 3, sends[4].CompareAdd)
	assert.Empty(t, sends[5].SGL)
	assert.EqualValues(t, 0, q.sqConsumed(), "posted, not completed: no slot released")
	assert.EqualValues(t, 6, u.g.dev.Stats().SendWQEs)

	// Receives.
	q.postRecv(77, u.sge(0, 512), u.sge(1024, 512))
	_, recvs := u.fq.take()
	require.Len(t, recvs, 1)
	assert.Equal(t, q.providerWRID(true, 0), recvs[0].WRID)
	assert.Len(t, recvs[0].SGL, 2)
	assert.EqualValues(t, 0, q.rqConsumed())
	u.fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv, ByteLen: 9})
	r := u.rcq.mustPoll()
	assert.EqualValues(t, 77, r.WRID, "the guest's wr_id again")
	assert.EqualValues(t, 1, q.rqConsumed())
}

func TestCompletionsBecomeCQEs(t *testing.T) {
	u := newUserRC(t)
	h := wqe(hostverbs.WRRDMARead, 0xfeed, hostverbs.SendSignaled)
	abi.WRRDMA{RemoteAddr: 0x1000, RKey: 1}.Encode(h.WR[:])
	u.qp.postSend(h, u.sge(0, 4096))
	u.qp.postRecv(9, u.sge(0, 64))
	u.qp.postRecv(10, u.sge(0, 512))
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Status: hostverbs.WCSuccess, Opcode: hostverbs.WCRDMARead, ByteLen: 4096})
	u.fq.finish(t, true, 0, hostverbs.WorkCompletion{Status: hostverbs.WCSuccess, Opcode: hostverbs.WCRecvRDMAWithImm,
		ByteLen: 12, ImmData: 0x01020304, SrcQP: 0x42, Flags: hostverbs.WCFlagWithImm, Port: 1})
	e := u.scq.mustPoll()
	assert.EqualValues(t, 0xfeed, e.WRID)
	assert.EqualValues(t, u.qp.handle, e.QP, "CQE.qp is the QP handle, not the QPN (pitfall 1)")
	assert.NotEqual(t, u.qp.qpn, u.qp.handle)
	assert.EqualValues(t, hostverbs.WCRDMARead, e.Opcode)
	assert.EqualValues(t, 4096, e.ByteLen)
	assert.EqualValues(t, 1, e.PortNum)
	r := u.rcq.mustPoll()
	assert.EqualValues(t, 0x81, r.Opcode)
	assert.EqualValues(t, 0x01020304, r.ImmData)
	assert.EqualValues(t, 0x42, r.SrcQP)
	assert.EqualValues(t, hostverbs.WCFlagWithImm, r.WCFlags)
	_, ok := u.scq.poll()
	assert.False(t, ok)

	// GSI/UD receive fields carry through (wc_flags GRH|NETWORK_HDR_TYPE,
	// network_hdr_type), and errors move the RC QP to ERR.
	u.fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv, ByteLen: 296,
		Flags: hostverbs.WCFlagGRH | hostverbs.WCFlagWithNetworkHdrTyp, NetworkHdrType: hostverbs.NetworkIPv4})
	r = u.rcq.mustPoll()
	assert.EqualValues(t, 10, r.WRID)
	assert.EqualValues(t, 0x41, r.WCFlags)
	assert.EqualValues(t, 1, r.NetworkHdrType)
	u.qp.postSend(wqe(hostverbs.WRRDMAWrite, 11, 0), u.sge(0, 1))
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Status: hostverbs.WCRetryExcErr, Opcode: 0x55}) // opcode undefined on errors
	e = u.scq.mustPoll()
	assert.EqualValues(t, hostverbs.WCRetryExcErr, e.Status, "an error completes an unsignaled WQE too")
	assert.EqualValues(t, 11, e.WRID)
	assert.EqualValues(t, hostverbs.WCRDMAWrite, e.Opcode, "the opcode the device kept")
	u.qp.postSend(wqe(hostverbs.WRSend, 12, hostverbs.SendSignaled), u.sge(0, 1))
	e = u.scq.mustPoll()
	assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status, "posted after an error completion: flushed")
	assert.EqualValues(t, 12, e.WRID)
}

func TestCQArmAndNotify(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	ok := func(recv, solicited bool, st hostverbs.WCStatus) {
		u.qp.postRecv(1, u.sge(0, 8))
		u.fq.finish(t, recv, 0, hostverbs.WorkCompletion{Status: st, Opcode: hostverbs.WCRecv, Solicited: solicited})
	}
	ok(true, false, hostverbs.WCSuccess)
	assert.Empty(t, g.notifications(), "not armed")
	u.rcq.arm(abi.UARCQArm)
	ok(true, false, hostverbs.WCSuccess)
	assert.Equal(t, []uint32{u.rcq.handle}, g.notifications())
	assert.EqualValues(t, 1, g.irq.count(abi.VectorCQ))
	ok(true, false, hostverbs.WCSuccess)
	assert.Empty(t, g.notifications(), "ARM is one-shot")

	u.rcq.arm(abi.UARCQArmSol)
	ok(true, false, hostverbs.WCSuccess)
	assert.Empty(t, g.notifications(), "ARM_SOL ignores unsolicited successes")
	ok(true, true, hostverbs.WCSuccess)
	assert.Equal(t, []uint32{u.rcq.handle}, g.notifications())
	u.rcq.arm(abi.UARCQArmSol)
	ok(true, false, hostverbs.WCLocLenErr)
	assert.Equal(t, []uint32{u.rcq.handle}, g.notifications(), "ARM_SOL fires on errors")
	u.qp = u.newQP(t) // the error left the QP in ERR
	u.rcq.arm(abi.UARCQArmSol)
	u.rcq.arm(abi.UARCQArm)
	ok(true, false, hostverbs.WCSuccess)
	assert.Len(t, g.notifications(), 1, "ARM after ARM_SOL upgrades to any completion")
	assert.EqualValues(t, 4, g.irq.count(abi.VectorCQ))

	// More notifications than the notify ring's 1024 usable slots: the
	// driver's arithmetic (indices masked with 2*slots-1) keeps consuming them.
	got := 0
	for i := 0; i < 2500; i++ {
		u.rcq.arm(abi.UARCQArm)
		ok(true, false, hostverbs.WCSuccess)
		u.rcq.mustPoll()
		got += len(g.notifications())
	}
	assert.Equal(t, 2500, got)
}

func TestBadWQEsCompleteWithErrors(t *testing.T) {
	cases := []struct {
		name string
		post func(u *userRC)
		want hostverbs.WCStatus
	}{
		{"num_sge above max_send_sge (CVE-2018-20124)", func(u *userRC) {
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 1), u.sge(0, 1), u.sge(0, 1), u.sge(0, 1), u.sge(0, 1))
		}, hostverbs.WCLocLenErr},
		{"num_sge huge", func(u *userRC) {
			u.qp.writeSend(wqe(hostverbs.WRSend, 1, 0))
			u.g.put32(u.qp.sqWQE(0)+8, 0xffffffff)
			u.g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|u.qp.handle)
		}, hostverbs.WCLocLenErr},
		{"unknown lkey", func(u *userRC) {
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), abi.SGE{Addr: u.mr.iova, Length: 8, LKey: 0xdeadbeef})
		}, hostverbs.WCLocProtErr},
		{"beyond the MR", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(1<<20-4, 8)) }, hostverbs.WCLocProtErr},
		{"before the MR", func(u *userRC) {
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), abi.SGE{Addr: u.mr.iova - 1, Length: 8, LKey: u.mr.lkey})
		}, hostverbs.WCLocProtErr},
		{"wrapping length", func(u *userRC) {
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), abi.SGE{Addr: ^uint64(0) - 2, Length: 8, LKey: u.mr.lkey})
		}, hostverbs.WCLocProtErr},
		{"MR of another PD", func(u *userRC) {
			other := u.g.regMR(u.g.createPD(1), 0x1000, 4096, 1)
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), abi.SGE{Addr: 0x1000, Length: 8, LKey: other.lkey})
		}, hostverbs.WCLocProtErr},
		{"READ into an MR without local write", func(u *userRC) {
			ro := u.g.regMR(u.pd, 0x2000, 4096, 0)
			h := wqe(hostverbs.WRRDMARead, 1, 0)
			u.qp.postSend(h, abi.SGE{Addr: 0x2000, Length: 8, LKey: ro.lkey})
		}, hostverbs.WCLocProtErr},
		{"unknown opcode", func(u *userRC) { u.qp.postSend(abi.SQWQEHdr{WRID: 1, Opcode: 99}, u.sge(0, 1)) }, hostverbs.WCLocQPOpErr},
		{"LSO", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRLSO, 1, 0)) }, hostverbs.WCLocQPOpErr},
		{"masked atomic", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRMaskedAtomicFAdd, 1, 0), u.sge(0, 8)) }, hostverbs.WCLocQPOpErr},
		{"REG_MR from user space", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRRegMR, 1, 0)) }, hostverbs.WCLocQPOpErr},
		{"LOCAL_INV from user space", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRLocalInv, 1, 0)) }, hostverbs.WCLocQPOpErr},
		{"SEND_WITH_INV from user space", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRSendWithInv, 1, 0)) }, hostverbs.WCLocQPOpErr},
		{"atomic of 4 bytes", func(u *userRC) { u.qp.postSend(wqe(hostverbs.WRAtomicFetchAndAdd, 1, 0), u.sge(0, 4)) }, hostverbs.WCLocLenErr},
		{"message above max_msg_sz", func(u *userRC) {
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 1<<20), abi.SGE{Addr: 0, Length: 0xffffffff, LKey: u.mr.lkey})
		}, hostverbs.WCLocProtErr},
		{"provider refuses", func(u *userRC) {
			u.fv.failNext("PostSend", hostverbs.ErrInvalid)
			u.qp.postSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 1))
		}, hostverbs.WCLocQPOpErr},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			u := newUserRC(t)
			tc.post(u)
			e := u.scq.mustPoll()
			assert.EqualValues(t, tc.want, e.Status)
			assert.EqualValues(t, 1, e.WRID)
			assert.EqualValues(t, u.qp.handle, e.QP)
			assert.EqualValues(t, 1, u.qp.sqConsumed(), "the bad WQE consumed its slot (no spinning on it)")
			sends, _ := u.fq.take()
			assert.Empty(t, sends, "nothing reached the provider")
			assert.Equal(t, hostverbs.QPStateErr, u.fq.attr.State, "an RC QP moves to ERR")
			// The next WQE is flushed.
			u.qp.postSend(wqe(hostverbs.WRSend, 2, hostverbs.SendSignaled), u.sge(0, 1))
			e = u.scq.mustPoll()
			assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
			assert.EqualValues(t, 2, e.WRID)
		})
	}
}

func TestBadRecvWQEs(t *testing.T) {
	u := newUserRC(t)
	ro := u.g.regMR(u.pd, 0x3000, 4096, 0)
	u.qp.postRecv(5, abi.SGE{Addr: 0x3000, Length: 64, LKey: ro.lkey})
	e := u.rcq.mustPoll()
	assert.EqualValues(t, hostverbs.WCLocProtErr, e.Status, "receive into an MR without local write")
	assert.EqualValues(t, hostverbs.WCRecv, e.Opcode)
	assert.EqualValues(t, 5, e.WRID)
	assert.EqualValues(t, 1, u.qp.rqConsumed())
	u.qp.postRecv(6, u.sge(0, 8))
	e = u.rcq.mustPoll()
	assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
	assert.EqualValues(t, 0x80, e.Opcode)
	assert.Zero(t, e.ByteLen)

	u2 := newUserRC(t)
	u2.qp.postRecv(7, u2.sge(0, 1), u2.sge(0, 1), u2.sge(0, 1))
	assert.EqualValues(t, hostverbs.WCLocLenErr, u2.rcq.mustPoll().Status, "3 SGEs on a 2-SGE RQ")
}

func TestFlushOnErr(t *testing.T) {
	u := newUserRC(t)
	q := u.qp
	q.postRecv(1, u.sge(0, 64))
	_, recvs := u.fq.take()
	require.Len(t, recvs, 1, "posted to the provider; its flush is the provider's job")
	// WQEs written but not rung stay in the rings until the QP errors.
	q.writeSend(wqe(hostverbs.WRRDMAWrite, 10, 0), u.sge(0, 8))
	q.writeSend(wqe(hostverbs.WRRDMARead, 11, 0), u.sge(0, 8))
	q.writeRecv(12, u.sge(0, 8))
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
	assert.Equal(t, hostverbs.QPStateErr, u.fq.attr.State)
	var got []abi.CQE
	for e, ok := u.scq.poll(); ok; e, ok = u.scq.poll() {
		got = append(got, e)
	}
	require.Len(t, got, 2)
	assert.Equal(t, []uint64{10, 11}, []uint64{got[0].WRID, got[1].WRID})
	assert.EqualValues(t, hostverbs.WCRDMAWrite, got[0].Opcode)
	assert.EqualValues(t, hostverbs.WCRDMARead, got[1].Opcode)
	assert.EqualValues(t, hostverbs.WCWRFlushErr, got[1].Status)
	r := u.rcq.mustPoll()
	assert.EqualValues(t, 1, r.WRID, "the provider flushes what it holds first: CQEs in ring order")
	assert.EqualValues(t, hostverbs.WCWRFlushErr, r.Status)
	assert.EqualValues(t, hostverbs.WCRecv, r.Opcode)
	r = u.rcq.mustPoll()
	assert.EqualValues(t, 12, r.WRID)
	assert.EqualValues(t, hostverbs.WCWRFlushErr, r.Status)
	assert.EqualValues(t, 2, q.sqConsumed())
	assert.EqualValues(t, 2, q.rqConsumed())
	// Posted while in ERR: flushed at the doorbell.
	q.postRecv(13, u.sge(0, 8))
	assert.EqualValues(t, 13, u.rcq.mustPoll().WRID)
	sends, recvs := u.fq.take()
	assert.Empty(t, sends)
	assert.Empty(t, recvs)

	// ERR -> RESET resets the rings; the guest resets its side too.
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	assert.Zero(t, q.sqConsumed())
	assert.Zero(t, q.rqConsumed())
	u.g.put32(q.sqState(), 0)
	u.g.put32(q.rqState(), 0)
	q.toRTS(0x99, gidB, 0)
	q.postSend(wqe(hostverbs.WRSend, 14, hostverbs.SendSignaled), u.sge(0, 8))
	sends, _ = u.fq.take()
	require.Len(t, sends, 1)
	assert.NotEqual(t, q.providerWRID(false, 0), sends[0].WRID, "a new epoch after RESET")
	u.fq.complete(false, hostverbs.WorkCompletion{WRID: q.providerWRID(false, 0), Opcode: hostverbs.WCSend})
	_, ok := u.scq.poll()
	assert.False(t, ok, "a completion from before the RESET is stale")
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 14, u.scq.mustPoll().WRID)
	assert.EqualValues(t, 1, q.sqConsumed())
}

func TestPostBeforeRTS(t *testing.T) {
	u := newUserRC(t)
	q := u.g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	q.postRecv(1, u.sge(0, 8))
	assert.EqualValues(t, 0, q.rqConsumed(), "receives in RESET are not consumed")
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1})
	q.g.doorbell(1, abi.UARQPOffset, abi.UARQPRecv|q.handle)
	assert.Equal(t, 1, u.fv.qps[len(u.fv.qps)-1].outstanding(true), "receives in INIT are posted")
	q.postSend(wqe(hostverbs.WRSend, 2, 0), u.sge(0, 8))
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, u.scq.mustPoll().Status, "sends before RTS fail")
}

func TestStallAndResume(t *testing.T) {
	u := newUserRC(t)
	u.fv.queueCap = 2
	for i := 0; i < 5; i++ {
		u.qp.writeSend(wqe(hostverbs.WRSend, uint64(i), 0), u.sge(0, 8))
	}
	u.g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|u.qp.handle)
	assert.Equal(t, 2, u.fq.outstanding(false), "stopped at the provider's queue limit, WQEs stay in the ring")
	u.scq.arm(abi.UARCQPoll)
	assert.Equal(t, 2, u.fq.outstanding(false), "still full")
	sends, _ := u.fq.take()
	require.Len(t, sends, 2)
	u.g.doorbell(1, abi.UARCQOffset, abi.UARCQPoll|u.scq.handle) // the provider's empty-poll doorbell
	assert.Equal(t, 4, u.fq.outstanding(false))
	u.fq.take()
	u.scq.arm(abi.UARCQArm)
	assert.Equal(t, 5, u.fq.outstanding(false))
	sends, _ = u.fq.take()
	require.Len(t, sends, 1)
	assert.Equal(t, u.qp.providerWRID(false, 4), sends[0].WRID, "in order")
	assert.Positive(t, u.g.dev.Stats().StalledPosts)
	assert.Zero(t, u.qp.sqConsumed(), "nothing completed")
	u.fq.finish(t, false, 4, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 5, u.qp.sqConsumed(), "all five released by the last one's completion")
	_, ok := u.scq.poll()
	assert.False(t, ok, "unsignaled: no CQE")
}

func TestDoorbellOwnership(t *testing.T) {
	u := newUserRC(t)
	bad := u.g.dev.Stats().BadDoorbells
	u.qp.writeSend(wqe(hostverbs.WRSend, 1, 0), u.sge(0, 8))
	u.g.doorbell(0, abi.UARQPOffset, abi.UARQPSend|u.qp.handle) // the kernel's page
	u.g.doorbell(2, abi.UARQPOffset, abi.UARQPSend|u.qp.handle) // another context's page
	u.g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|0xfff)       // no such QP
	u.g.doorbell(0, abi.UARCQOffset, abi.UARCQArm|u.scq.handle)
	u.g.doorbell(1, abi.UARSRQOffset, abi.UARSRQRecv|3)
	assert.EqualValues(t, bad+5, u.g.dev.Stats().BadDoorbells)
	assert.Zero(t, u.fq.outstanding(false))
	u.g.doorbell(1+UARPages/2, abi.UARQPOffset, abi.UARQPSend|u.qp.handle)
	assert.Zero(t, u.fq.outstanding(false), "pages do not alias")
	u.g.doorbell(1, abi.UARQPOffset, abi.UARQPSend|u.qp.handle)
	assert.Equal(t, 1, u.fq.outstanding(false))
}

func TestUDSend(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	q := g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeUD, sendWR: 1, recvWR: 128, sendSGE: 1, recvSGE: 1, uar: 1})
	fq := u.fv.qps[len(u.fv.qps)-1]
	q.udToRTS(0x11111111)
	send := func(wrid uint64, gidIndex uint8, port uint32) {
		h := wqe(hostverbs.WRSendWithImm, wrid, hostverbs.SendSignaled)
		h.Ex = 0x12
		abi.WRUD{RemoteQPN: 0x1234, RemoteQKey: 0x11111111, AV: abi.AV{PortPD: port<<24 | u.pd,
			SLTClassFlowLabel: 3<<28 | 0x20<<20 | 0xabcde, DGID: gidB, GIDIndex: gidIndex, HopLimit: 1,
			DMAC: [6]byte{1, 2, 3, 4, 5, 6}}}.Encode(h.WR[:])
		q.postSend(h, u.sge(0, 512))
	}
	sent := func(wrid uint64) { // the provider completes it: the slot is free again
		t.Helper()
		fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
		assert.EqualValues(t, wrid, u.scq.mustPoll().WRID)
	}
	send(1, 0, 1) // a 1-entry SQ: every WQE is slot 0 (a prototype once consumed zero-filled WQEs here)
	sent(1)
	send(2, 0, 1)
	sends, _ := fq.take()
	require.Len(t, sends, 2)
	s := sends[1]
	assert.Equal(t, q.providerWRID(false, 1), s.WRID, "index 1, slot 0")
	assert.EqualValues(t, 0x1234, s.RemoteQPN)
	assert.EqualValues(t, 0x12, s.ImmData)
	assert.Equal(t, hostverbs.AddressVector{DGID: gidB, SGIDIndex: 0, HopLimit: 1, TrafficClass: 0x20,
		FlowLabel: 0xabcde, SL: 3, Port: 1, DMAC: [6]byte{1, 2, 3, 4, 5, 6}}, s.AV)
	sent(2)
	send(3, 5, 1) // unbound source GID
	e := u.scq.mustPoll()
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, e.Status)
	assert.EqualValues(t, 3, e.WRID)
	send(4, 0, 2) // port 2
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, u.scq.mustPoll().Status)
	send(5, 0, 1)
	sends, _ = fq.take()
	require.Len(t, sends, 1, "a UD QP stays usable after a bad WQE")
	sent(5)
	h := wqe(hostverbs.WRRDMAWrite, 6, 0)
	q.postSend(h, u.sge(0, 8))
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, u.scq.mustPoll().Status, "RDMA WRITE on UD")
}

func TestSRQ(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	s := g.createSRQ(u.pd, 32, 2, 4, 1)
	q := g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, srq: s, typ: hostverbs.QPTypeRC, sendWR: 4, sendSGE: 1, uar: 1})
	fs := u.fv.srqs[0]
	assert.EqualValues(t, 4, fs.attr.Limit)
	assert.Same(t, fs, u.fv.qps[len(u.fv.qps)-1].init.SRQ)
	for i := 0; i < 40; i++ {
		s.postRecv(uint64(i), u.sge(uint64(i)*64, 64))
	}
	assert.Len(t, fs.recvs, 40)
	s.postRecv(99, abi.SGE{Addr: 1, Length: 1, LKey: 0x1234567})
	evs := g.events()
	require.NotEmpty(t, evs)
	assert.Equal(t, abi.EQE{Type: uint32(hostverbs.EventSRQErr), Info: s.handle}, evs[len(evs)-1])

	g.mustCmd(abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: s.handle, AttrMask: srqAttrLimit, Attrs: abi.SRQAttr{SRQLimit: 8}})
	assert.EqualValues(t, 8, fs.attr.Limit)
	errReg, _ := g.cmd(abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: s.handle, AttrMask: srqAttrMaxWR, Attrs: abi.SRQAttr{MaxWR: 64}})
	assert.NotZero(t, errReg, "SRQ resize is not supported")
	var qr abi.QuerySRQResp
	qr.Decode(g.mustCmd(abi.CmdQuerySRQ, abi.QuerySRQ{SRQHandle: s.handle}))
	assert.Equal(t, abi.SRQAttr{MaxWR: 32, MaxSGE: 2, SRQLimit: 8}, qr.Attrs)
	errReg, _ = g.cmd(abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: s.handle})
	assert.NotZero(t, errReg, "SRQ in use by a QP")
	g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: q.handle})
	g.mustCmd(abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: s.handle})
	assert.Equal(t, 0, u.fv.count("srq"))

	for _, bad := range []abi.SRQAttr{{MaxWR: 0, MaxSGE: 1}, {MaxWR: 3, MaxSGE: 1}, {MaxWR: 1 << 20, MaxSGE: 1}, {MaxWR: 4, MaxSGE: 99}, {MaxWR: 4, MaxSGE: 1, SRQLimit: 5}} {
		errReg, _ := g.cmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDHandle: u.pd, NChunks: 2, PDirDMA: g.pdir(g.pages(2)), Attrs: bad})
		assert.NotZero(t, errReg, "%+v", bad)
	}
}

func TestCQOverflow(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	small := g.createCQ(1, 4)
	q := g.createQP(qpSpec{pd: u.pd, scq: small, rcq: small, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	fq := u.fv.qps[len(u.fv.qps)-1]
	q.toRTS(0x99, gidB, 0)
	g.events()
	for i := 0; i < 4; i++ {
		q.postSend(wqe(hostverbs.WRSend, uint64(i), hostverbs.SendSignaled), u.sge(0, 1))
	}
	q.postRecv(4, u.sge(0, 8))
	q.postRecv(5, u.sge(0, 8))
	for i := 0; i < 4; i++ {
		fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	}
	for i := 0; i < 2; i++ {
		fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	}
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventCQErr), Info: small.handle}}, g.events(), "one CQ error event, no blocking")
	for i := 0; i < 4; i++ {
		assert.EqualValues(t, i, small.mustPoll().WRID)
	}
	_, ok := small.poll()
	assert.False(t, ok)
	assert.EqualValues(t, 2, g.dev.Stats().CQOverflows)
	assert.EqualValues(t, 4, q.sqConsumed())
	assert.EqualValues(t, 2, q.rqConsumed(), "a completion the CQ dropped still releases its WQE")
}

func TestNoCompletionAfterDestroy(t *testing.T) {
	u := newUserRC(t)
	fq := u.fq
	u.g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: u.qp.handle})
	fq.complete(false, hostverbs.WorkCompletion{WRID: 1})
	_, ok := u.scq.poll()
	assert.False(t, ok, "a late completion of a destroyed QP is dropped")
	// The handle is reused by a new QP: the old QP's completions still do
	// not show up as the new one's.
	q2 := u.newQP(t)
	assert.Equal(t, u.qp.handle, q2.handle)
	fq.complete(false, hostverbs.WorkCompletion{WRID: 2})
	_, ok = u.scq.poll()
	assert.False(t, ok)
	assert.EqualValues(t, 2, u.g.dev.Stats().StaleCompletions)
	u.fq.complete(false, hostverbs.WorkCompletion{WRID: 3})
	_, ok = u.scq.poll()
	assert.False(t, ok, "a WRID the device never posted")
	assert.EqualValues(t, 3, u.g.dev.Stats().StaleCompletions)
	q2.postSend(wqe(hostverbs.WRSend, 4, hostverbs.SendSignaled), u.sge(0, 1))
	u.fq.complete(false, hostverbs.WorkCompletion{WRID: q2.providerWRID(false, 1)})
	u.fq.complete(false, hostverbs.WorkCompletion{WRID: q2.providerWRID(true, 0)})
	_, ok = u.scq.poll()
	assert.False(t, ok, "an index not posted, a receive not posted")
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{})
	u.fq.complete(false, hostverbs.WorkCompletion{WRID: q2.providerWRID(false, 0)})
	assert.EqualValues(t, 4, u.scq.mustPoll().WRID)
	_, ok = u.scq.poll()
	assert.False(t, ok, "never twice")
	assert.EqualValues(t, 6, u.g.dev.Stats().StaleCompletions)
}

func TestAsyncEvents(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	g.events()
	dev := g.dev
	dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventCommEst, Context: u.fq.init.Context})
	dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventQPLastWQEReach, Context: u.fq.init.Context})
	dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventSRQLimitReached, Context: 3})
	dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventPortErr, Port: 1})
	dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventQPFatal, Context: 1<<40 | 5}) // stale
	dev.HandleEvent(hostverbs.AsyncEvent{Type: 200})
	dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventQPAccessErr, Context: u.fq.init.Context})
	assert.Equal(t, []abi.EQE{
		{Type: uint32(hostverbs.EventCommEst), Info: u.qp.handle},
		{Type: uint32(hostverbs.EventQPLastWQEReach), Info: u.qp.handle},
		{Type: uint32(hostverbs.EventSRQLimitReached), Info: 3},
		{Type: uint32(hostverbs.EventPortErr), Info: 1},
		{Type: uint32(hostverbs.EventQPAccessErr), Info: u.qp.handle},
	}, g.events())
	assert.EqualValues(t, 6, g.irq.count(abi.VectorAsync))
	u.qp.postSend(wqe(hostverbs.WRSend, 7, 0), u.sge(0, 1))
	assert.EqualValues(t, hostverbs.WCWRFlushErr, u.scq.mustPoll().Status, "an access error event leaves the QP in ERR")

	// A full event ring drops events (counted) rather than blocking.
	for i := 0; i < 600; i++ {
		dev.HandleEvent(hostverbs.AsyncEvent{Type: hostverbs.EventPortActive})
	}
	assert.Len(t, g.events(), 512, "512 usable slots in a 4-page async ring")
	assert.Positive(t, dev.Stats().AsyncDropped)
}

func TestModifyQPValidation(t *testing.T) {
	u := newUserRC(t)
	q := u.g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	for _, c := range []struct {
		mask hostverbs.AttrMask
		a    abi.QPAttr
	}{
		{0x1, abi.QPAttr{State: 3}},              // RESET -> RTS
		{0x39, abi.QPAttr{State: 1, PortNum: 2}}, // port 2
		{0x39, abi.QPAttr{State: 9, PortNum: 1}}, // no such state
		{1 << 25, abi.QPAttr{}},                  // unknown mask bit
		{0x1, abi.QPAttr{State: 1}},              // INIT without required attrs
	} {
		errReg, h := q.modify(c.mask, c.a)
		assert.NotZero(t, errReg, "%#x %+v", c.mask, c.a)
		assert.NotZero(t, h.Err)
	}
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1})
	errReg, _ := q.modify(0x129181, abi.QPAttr{State: 2, PathMTU: 3, DestQPNum: 5, AH: abi.AHAttr{DGID: gidB, SGIDIndex: 7, PortNum: 1}})
	assert.NotZero(t, errReg, "AV with an unbound source GID index")
	errReg, _ = q.modify(0x129181, abi.QPAttr{State: 2, PathMTU: 9, DestQPNum: 5, AH: abi.AHAttr{DGID: gidB, PortNum: 1}})
	assert.NotZero(t, errReg, "path MTU 9")
	q.toRTS(5, gidB, 0) // from INIT via its INIT->INIT... the helper starts with RESET->INIT
}

// TestControlledQKeyRefused: a guest's UD QP may not take a controlled
// Q_Key (issue 23: with the GSI QP's Q_Key a UD QP reaches QP1 of any
// host through the daemon's CAP_NET_RAW); an ordinary one is accepted.
func TestControlledQKeyRefused(t *testing.T) {
	u := newUserRC(t)
	q := u.g.createQP(qpSpec{pd: u.pd, scq: u.scq, rcq: u.rcq, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	const udInit = 0x71 // STATE | PKEY_INDEX | PORT | QKEY
	for _, k := range []uint32{0x80010000, 0x80000000, 0xffffffff} {
		errReg, h := q.modify(udInit, abi.QPAttr{State: 1, PortNum: 1, QKey: k})
		assert.NotZero(t, errReg, "%#x", k)
		assert.EqualValues(t, syscall.EPERM, h.Err, "%#x", k)
	}
	q.mustModify(udInit, abi.QPAttr{State: 1, PortNum: 1, QKey: 0x11111111})
	errReg, _ := q.modify(0x40, abi.QPAttr{QKey: 0x80010000}) // INIT->INIT, Q_Key alone
	assert.NotZero(t, errReg)
}

func TestQueryQP(t *testing.T) {
	u := newUserRC(t)
	var r abi.QueryQPResp
	r.Decode(u.g.mustCmd(abi.CmdQueryQP, abi.QueryQP{QPHandle: u.qp.handle, AttrMask: 0x40}))
	assert.EqualValues(t, hostverbs.QPStateRTS, r.Attrs.State)
	assert.EqualValues(t, 0x99, r.Attrs.DestQPNum)
	assert.Equal(t, [16]byte(gidB), r.Attrs.AH.DGID)
	assert.EqualValues(t, abi.AHFlagGRH, r.Attrs.AH.Flags)
	assert.Equal(t, abi.QPCap{MaxSendWR: 16, MaxRecvWR: 16, MaxSendSGE: 4, MaxRecvSGE: 2}, r.Attrs.Cap)
}

func TestResizeCQ(t *testing.T) {
	u := newUserRC(t)
	g := u.g
	c := g.createCQ(1, 16) // 2 pages: room for 64 CQEs
	var r abi.ResizeCQResp
	r.Decode(g.mustCmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: 64}))
	assert.EqualValues(t, 64, r.CQE)
	errReg, _ := g.cmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: 128})
	assert.NotZero(t, errReg, "more CQEs than the pages hold")
	errReg, _ = g.cmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: 48})
	assert.NotZero(t, errReg, "not a power of two")
	c.n = 64
	q := g.createQP(qpSpec{pd: u.pd, scq: c, rcq: c, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	fq := u.fv.qps[len(u.fv.qps)-1]
	q.toRTS(0x99, gidB, 0)
	for i := 0; i < 40; i++ {
		q.postSend(wqe(hostverbs.WRSend, uint64(i), hostverbs.SendSignaled), u.sge(0, 1))
		fq.finish(t, false, 0, hostverbs.WorkCompletion{})
	}
	for i := 0; i < 40; i++ {
		assert.EqualValues(t, i, c.mustPoll().WRID)
	}
	q.postSend(wqe(hostverbs.WRSend, 1, hostverbs.SendSignaled), u.sge(0, 1))
	fq.finish(t, false, 0, hostverbs.WorkCompletion{})
	errReg, _ = g.cmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: 16})
	assert.EqualValues(t, 16, errReg, "EBUSY: not empty")
}

// TestFastRegisterAndInvalidate: the device hands REG_MR and LOCAL_INV to
// the provider's fast-reg MR (its key, base and consumer byte, is the
// provider's, so peers' rkeys resolve there), checks what is the device's
// to check (the key's MR, its PD, the page list), and completes them in
// order after the sends before them. The provider's own semantics (the
// key refused once invalidated, remote invalidation) are tested with the
// soft provider (hostverbs/soft, soft_test.go).
func TestFastRegisterAndInvalidate(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	g.bindGID(0, gidA)
	pd := g.createPD(0)
	otherPD := g.createPD(0)
	cq := g.createCQ(0, 64)
	q := g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 2, recvSGE: 1})
	q.toRTS(5, gidB, 0)
	fq := fv.qps[0]
	var fr abi.CreateMRResp
	fr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, Flags: abi.MRFlagFRMR, NChunks: 16}))
	m := fv.mrs[len(fv.mrs)-1]
	assert.Equal(t, m.lkey, fr.LKey, "the provider's base key")
	assert.Equal(t, fr.LKey, fr.RKey)
	errReg, _ := g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, Flags: abi.MRFlagFRMR, NChunks: 129})
	assert.NotZero(t, errReg, "above PVRDMA_MAX_FAST_REG_PAGES")

	pages := g.scatteredPages(4)
	key := fr.LKey&^0xff | (fr.LKey+1)&0xff
	regWQE := func(wrid uint64, key uint32, shift uint32) abi.SQWQEHdr {
		h := wqe(hostverbs.WRRegMR, wrid, hostverbs.SendSignaled)
		abi.WRFastReg{IOVAStart: 0xffff000000001000, PLPDirDMA: g.pdir(pages), PageShift: shift, PageListLen: 4,
			Length: 4 * 4096, AccessFlags: uint32(hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite), RKey: key}.Encode(h.WR[:])
		return h
	}
	q.postSend(regWQE(2, key, 12))
	e := cq.mustPoll()
	assert.EqualValues(t, hostverbs.WCSuccess, e.Status)
	assert.EqualValues(t, hostverbs.WCRegMR, e.Opcode)
	st, reg := fv.frmrs(t)[0].Registration()
	require.Equal(t, hostverbs.MRValid, st)
	assert.Equal(t, key, reg.Key, "the guest's key, consumer byte and all")
	assert.Equal(t, uint64(0xffff000000001000), reg.Pages.IOVA)
	assert.EqualValues(t, pages[2], reg.Pages.Pages[2])
	assert.Equal(t, hostverbs.AccessLocalWrite|hostverbs.AccessRemoteWrite, reg.Access)

	q.postSend(wqe(hostverbs.WRSend, 3, 0), abi.SGE{Addr: 0xffff000000001000 + 4000, Length: 200, LKey: key})
	sends, _ := fq.take()
	require.Len(t, sends, 1)
	assert.Equal(t, key, sends[0].SGL[0].LKey, "the guest's key goes to the provider as it is")
	assert.NotZero(t, sends[0].Flags&hostverbs.SendSignaled, "a kernel QP's last send is signaled to the provider: a local operation may follow")
	h := wqe(hostverbs.WRLocalInv, 4, 0)
	h.Ex = key
	q.postSend(h)
	st, _ = fv.frmrs(t)[0].Registration()
	assert.Equal(t, hostverbs.MRFree, st, "LOCAL_INV reaches the provider")
	head := q.sqConsumed()
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	_, ok := cq.poll()
	assert.False(t, ok, "neither the unsignaled send nor the unsignaled LOCAL_INV reports")
	assert.Equal(t, head+2, q.sqConsumed(), "both released by the send's completion")
	s := g.dev.Stats()
	assert.EqualValues(t, 1, s.FastRegs)
	assert.EqualValues(t, 1, s.LocalInvs)

	// Refused, each a WQE completed in error (the QP goes to ERR: reset it).
	reset := func() {
		q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
		g.put32(q.sqState(), 0)
		g.put32(q.rqState(), 0)
		q.toRTS(5, gidB, 0)
	}
	for _, tc := range []struct {
		name string
		h    abi.SQWQEHdr
		want hostverbs.WCStatus
	}{
		{"another MR's key index", regWQE(5, key+0x100, 12), hostverbs.WCLocQPOpErr},
		{"page shift", regWQE(6, key, 16), hostverbs.WCLocQPOpErr},
		{"LOCAL_INV of a plain MR's key", func() abi.SQWQEHdr {
			h := wqe(hostverbs.WRLocalInv, 7, 0)
			h.Ex = g.regMR(pd, 0x10000, 4096, 1).lkey
			return h
		}(), hostverbs.WCLocQPOpErr},
	} {
		q.postSend(tc.h)
		assert.EqualValues(t, tc.want, cq.mustPoll().Status, tc.name)
		reset()
	}
	q.postSend(regWQE(8, key, 12))
	require.EqualValues(t, hostverbs.WCSuccess, cq.mustPoll().Status)
	q.postSend(regWQE(9, key, 12))
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, cq.mustPoll().Status, "REG_MR of a valid MR (the provider refuses)")
	reset()
	// A QP of another PD may not register it.
	q2 := g.createQP(qpSpec{pd: otherPD, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 2, recvSGE: 1})
	q2.toRTS(6, gidB, 0)
	q2.postSend(regWQE(10, key, 12))
	assert.EqualValues(t, hostverbs.WCLocProtErr, cq.mustPoll().Status)
	assert.EqualValues(t, 4, g.dev.Stats().FastRegRefused)
	assert.EqualValues(t, 1, g.dev.Stats().LocalInvRefused)
}

func TestDMAMRRestrictions(t *testing.T) {
	g := probedGuest(t, newFakeVerbs())
	kpd := g.createPD(0)
	upd := g.createPD(g.createUC(1))
	errReg, _ := g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: upd, AccessFlags: 1, Flags: abi.MRFlagDMA})
	assert.NotZero(t, errReg, "no DMA MR for a user context")
	errReg, _ = g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: 7, Flags: abi.MRFlagDMA})
	assert.NotZero(t, errReg, "no remotely accessible DMA MR: it would expose all guest RAM")
	errReg, _ = g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: 1, Flags: 3})
	assert.NotZero(t, errReg)
	errReg, _ = g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: upd, AccessFlags: 2, Start: 0x1000, Length: 4096, NChunks: 1, PDirDMA: g.pdir(g.pages(1))})
	assert.NotZero(t, errReg, "remote write without local write")
	errReg, _ = g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: upd, AccessFlags: 1 << 6, Start: 0x1000, Length: 4096, NChunks: 1, PDirDMA: g.pdir(g.pages(1))})
	assert.NotZero(t, errReg, "on-demand paging")
}
