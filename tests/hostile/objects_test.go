package hostile

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Hostile use of the objects the CVE classes do not name: shared receive
// queues, the GSI QP, fast-register work requests, CQ resize and
// overflow, the all-of-RAM DMA MR, and remote keys used beyond what their
// MR grants.

// gsrq is a guest SRQ: ring state page (rx half), WQEs from page 1.
type gsrq struct {
	v              *vm
	handle         uint32
	n, stride, uar uint32
	pages          []uint64
	sge            uint32
}

func (v *vm) createSRQ(pd, n, sge, uar uint32) *gsrq {
	v.t.Helper()
	s := &gsrq{v: v, n: n, sge: sge, stride: pow2(16 + 16*sge), uar: uar}
	s.pages = v.pages(1 + int((uint64(n)*uint64(s.stride)+4095)/4096))
	var r abi.CreateSRQResp
	r.Decode(v.mustCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDirDMA: v.pdir(s.pages), PDHandle: pd,
		NChunks: uint32(len(s.pages)), Attrs: abi.SRQAttr{MaxWR: n, MaxSGE: sge}}))
	s.handle = r.SRQN
	return s
}

func (s *gsrq) state() uint64 { return s.pages[0] + 8 }

// post writes a receive WQE at prod_tail and rings the SRQ doorbell; it
// returns the WQE's address (written before the doorbell).
func (s *gsrq) post(wrid uint64, mutate func(gpa uint64), sges ...abi.SGE) {
	ram := s.v.ram
	tail := load32(ram, s.state())
	off := uint64(tail&(s.n-1)) * uint64(s.stride)
	gpa := s.pages[1+off/4096] + off%4096
	abi.RQWQEHdr{WRID: wrid, NumSGE: uint32(len(sges))}.Encode(ram[gpa:])
	for i, sg := range sges {
		sg.Encode(ram[gpa+abi.RQWQEHdrSize+uint64(i)*abi.SGESize:])
	}
	if mutate != nil {
		mutate(gpa)
	}
	store32(ram, s.state(), ringInc(tail, s.n))
	s.v.doorbell(s.uar, abi.UARSRQOffset, abi.UARSRQRecv|s.handle)
}

// A bad SRQ WQE belongs to no QP yet: it is dropped and consumed, with an
// SRQ_ERR event; a corrupted SRQ index stops nothing else; an SRQ in use
// cannot be destroyed.
func TestHostileSRQ(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	require.NotZero(t, v.caps.MaxSRQ)
	s := v.createSRQ(p.pd, 16, 2, p.uc)
	srqErr := func() {
		t.Helper()
		_, err := v.waitIRQ(abi.VectorAsync, irqTimeout)
		require.NoError(t, err)
		require.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventSRQErr), Info: s.handle}}, v.events())
	}
	s.post(1, func(gpa uint64) { v.put32(gpa+8, 3) }, p.mr.sge(0, 64)) // num_sge above max
	srqErr()
	s.post(2, nil, abi.SGE{Addr: p.mr.iova, Length: 64, LKey: 0xbad})
	srqErr()
	require.EqualValues(t, 2, load32(v.ram, s.state()+4), "both bad WQEs consumed")
	require.EqualValues(t, 2, e.counter(vmEvil, "bad_wqes"))

	// A QP on the SRQ receives from its good WQEs.
	attach := qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: p.uc}
	q, req := v.layoutQP(attach)
	req.IsSRQ, req.SRQHandle, req.MaxRecvWR, req.MaxRecvSGE = 1, s.handle, 0, 0
	var r abi.CreateQPResp
	r.Decode(v.mustCmd(abi.CmdCreateQP, req))
	q.handle, q.qpn = r.QPHandle, r.QPN
	a := v.createQP(attach)
	a.toRTS(q.qpn, p.gid)
	q.toRTS(a.qpn, p.gid)
	s.post(3, nil, p.mr.sge(0x1000, 64))
	a.postSend(sendWQE(4), p.mr.sge(0, 32))
	requireCQE(t, p.scq.wait(), a, 4, hostverbs.WCSend, hostverbs.WCSuccess)
	rc := p.rcq.wait()
	requireCQE(t, rc, q, 3, hostverbs.WCRecv, hostverbs.WCSuccess)
	require.EqualValues(t, 32, rc.ByteLen)

	v.failCmd(abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: s.handle}, syscall.EBUSY)
	v.failCmd(abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: s.handle, AttrMask: 1, Attrs: abi.SRQAttr{MaxWR: 1 << 20}}, eInval)
	v.failCmd(abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: s.handle, AttrMask: 2, Attrs: abi.SRQAttr{SRQLimit: 17}}, eInval)
	v.failCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDHandle: p.pd, NChunks: 2, PDirDMA: v.pdir(v.pages(2)),
		Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: v.caps.MaxSRQSGE + 1}}, eInval)
	v.failCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDHandle: p.pd, NChunks: 2, PDirDMA: v.pdir(v.pages(2)),
		Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: 1}, SRQType: 1}, eInval)

	// A producer index that is no index: the SRQ reports an error, the
	// doorbell returns, and nothing is consumed.
	store32(v.ram, s.state(), 0xdeadbeef)
	v.doorbell(s.uar, abi.UARSRQOffset, abi.UARSRQRecv|s.handle)
	srqErr()
	v.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: q.handle})
	v.mustCmd(abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: s.handle})
	e.healthy()
}

// The GSI QP (QP1) is the kernel's: one per device, in a kernel PD, on no
// SRQ. UD sends are checked against the bound GIDs and the port.
func TestHostileGSIAndUD(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	kpd := v.createPD(0)
	kcq := v.createCQ(0, 16)
	gsi := qpSpec{pd: kpd, scq: kcq, rcq: kcq, typ: hostverbs.QPTypeGSI, sendWR: 4, recvWR: 4, sendSGE: 2, recvSGE: 1}
	_, req := v.layoutQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeGSI, sendWR: 4, recvWR: 4, sendSGE: 2, recvSGE: 1})
	v.failCmd(abi.CmdCreateQP, req, eInval) // from a user context
	q1 := v.createQP(gsi)
	require.EqualValues(t, 1, q1.qpn, "the GSI QP is QP1")
	_, req = v.layoutQP(gsi)
	v.failCmd(abi.CmdCreateQP, req, eInval) // a second one
	for _, typ := range []uint8{0, 3, 5, 8, 0xff} {
		_, req = v.layoutQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPType(typ), sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
		v.failCmd(abi.CmdCreateQP, req, eInval)
	}

	const qkey = 0x22222222
	a, b := p.udPair(qkey)
	badAV := func(wrid uint64, mutate func(*abi.AV)) abi.SQWQEHdr {
		h := sendWQE(wrid)
		av := abi.AV{PortPD: 1<<24 | p.pd, DGID: p.gid, HopLimit: 64}
		mutate(&av)
		abi.WRUD{RemoteQPN: b.qpn, RemoteQKey: qkey, AV: av}.Encode(h.WR[:])
		return h
	}
	a.writeSend(badAV(1, func(av *abi.AV) { av.GIDIndex = 3 }), p.mr.sge(0, 8))            // unbound GID
	a.writeSend(badAV(2, func(av *abi.AV) { av.PortPD = 2<<24 | p.pd }), p.mr.sge(0, 8))   // port 2
	a.writeSend(p.udSend(3, b.qpn, qkey), p.mr.sge(0, 8), p.mr.sge(8, 8), p.mr.sge(16, 8)) // 3 SGEs, max 2
	a.ringSend()
	for wrid, st := range []hostverbs.WCStatus{1: hostverbs.WCLocQPOpErr, 2: hostverbs.WCLocQPOpErr, 3: hostverbs.WCLocLenErr} {
		if wrid > 0 {
			requireCQE(t, p.scq.wait(), a, uint64(wrid), hostverbs.WCSend, st)
		}
	}
	require.Equal(t, hostverbs.QPStateRTS, a.state(), "UD errors do not kill the QP")
	// A datagram too large for the receive buffer completes that receive
	// with LOC_LEN_ERR (IBA class D, as rxe does) and the QP carries on.
	b.postRecv(5, p.mr.sge(0x2000, 40+16))
	a.postSend(p.udSend(6, b.qpn, qkey), p.mr.sge(0, 64))
	requireCQE(t, p.scq.wait(), a, 6, hostverbs.WCSend, hostverbs.WCSuccess)
	requireCQE(t, p.rcq.wait(), b, 5, hostverbs.WCRecv, hostverbs.WCLocLenErr)
	require.Equal(t, hostverbs.QPStateRTS, b.state())
	b.postRecv(7, p.mr.sge(0x2000, 40+16))
	a.postSend(p.udSend(8, b.qpn, qkey), p.mr.sge(0, 16))
	requireCQE(t, p.scq.wait(), a, 8, hostverbs.WCSend, hostverbs.WCSuccess)
	rc := p.rcq.wait()
	requireCQE(t, rc, b, 7, hostverbs.WCRecv, hostverbs.WCSuccess)
	require.EqualValues(t, 40+16, rc.ByteLen)
	// A wrong qkey is dropped: the sender completes, the receiver sees
	// nothing.
	b.postRecv(9, p.mr.sge(0x2000, 40+64))
	a.postSend(p.udSend(10, b.qpn, qkey+1), p.mr.sge(0, 16))
	requireCQE(t, p.scq.wait(), a, 10, hostverbs.WCSend, hostverbs.WCSuccess)
	p.rcq.empty()
	e.healthy()
}

// Fast-register work requests carry a page list the guest controls: every
// bound is checked and the MR stays unusable after a refused one; LOCAL_INV
// takes only fast-register keys. (User QPs may not post either:
// TestErrorWQEConsumesSlot.)
func TestHostileFastReg(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	gid := gidFor(1)
	v.bindGID(0, gid)
	pd := v.createPD(0)
	cq := v.createCQ(0, 64)
	spec := qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1}
	// newQP is a kernel QP in RTS aimed at a QP number nobody has: local
	// work never needs the peer, and an error kills only this QP.
	newQP := func() *gqp {
		q := v.createQP(spec)
		q.toRTS(0x999, gid)
		return q
	}
	var r abi.CreateMRResp
	r.Decode(v.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, AccessFlags: accRW, Flags: abi.MRFlagFRMR, NChunks: 4}))
	pages := v.pages(4)
	good := abi.WRFastReg{IOVAStart: 0x10000, PLPDirDMA: v.pdir(pages), PageShift: 12, PageListLen: 4, Length: 4 * 4096,
		AccessFlags: accRW, RKey: r.LKey | 0x01}
	regWQE := func(wrid uint64, fr abi.WRFastReg) abi.SQWQEHdr {
		h := abi.SQWQEHdr{WRID: wrid, Opcode: uint32(hostverbs.WRRegMR), SendFlags: uint32(hostverbs.SendSignaled)}
		fr.Encode(h.WR[:])
		return h
	}
	unusable := func() {
		t.Helper()
		q := newQP()
		q.postSend(sendWQE(100), abi.SGE{Addr: good.IOVAStart, Length: 8, LKey: good.RKey})
		requireCQE(t, cq.wait(), q, 100, hostverbs.WCSend, hostverbs.WCLocProtErr)
	}
	for i, c := range []struct {
		mutate func(*abi.WRFastReg)
		st     hostverbs.WCStatus
	}{
		{func(f *abi.WRFastReg) { f.PageListLen = 5 }, hostverbs.WCLocQPOpErr}, // more than the MR holds
		{func(f *abi.WRFastReg) { f.PageListLen = 0 }, hostverbs.WCLocQPOpErr},
		{func(f *abi.WRFastReg) { f.PageShift = 21 }, hostverbs.WCLocQPOpErr},                            // huge pages
		{func(f *abi.WRFastReg) { f.Length = 4*4096 + 1 }, hostverbs.WCLocLenErr},                        // longer than the list
		{func(f *abi.WRFastReg) { f.IOVAStart, f.Length = ^uint64(0)-100, 4096 }, hostverbs.WCLocLenErr}, // wraps
		{func(f *abi.WRFastReg) { f.PLPDirDMA = outsideRAM }, hostverbs.WCLocProtErr},
		{func(f *abi.WRFastReg) { f.RKey = 0x12345600 }, hostverbs.WCLocQPOpErr},            // no such MR (rxe answers the same)
		{func(f *abi.WRFastReg) { f.AccessFlags = accRemoteWrite }, hostverbs.WCLocQPOpErr}, // remote write without local
	} {
		fr := good
		c.mutate(&fr)
		q := newQP()
		q.postSend(regWQE(uint64(i), fr))
		requireCQE(t, cq.wait(), q, uint64(i), hostverbs.WCRegMR, c.st)
		unusable()
	}
	// The good one works; LOCAL_INV of a key that is not a fast-register
	// MR's is refused, of the right one takes the MR away again.
	q := newQP()
	q.postSend(regWQE(50, good))
	requireCQE(t, cq.wait(), q, 50, hostverbs.WCRegMR, hostverbs.WCSuccess)
	plain := v.regMR(pd, 0x9000_0000, 4096, accLocalWrite)
	for _, k := range []uint32{plain.lkey, 0xdeadbe00} {
		q := newQP()
		q.postSend(abi.SQWQEHdr{WRID: 51, Opcode: uint32(hostverbs.WRLocalInv), SendFlags: uint32(hostverbs.SendSignaled), Ex: k})
		requireCQE(t, cq.wait(), q, 51, hostverbs.WCLocalInv, hostverbs.WCLocQPOpErr)
	}
	q = newQP()
	q.postSend(abi.SQWQEHdr{WRID: 52, Opcode: uint32(hostverbs.WRLocalInv), SendFlags: uint32(hostverbs.SendSignaled), Ex: good.RKey})
	requireCQE(t, cq.wait(), q, 52, hostverbs.WCLocalInv, hostverbs.WCSuccess)
	unusable()
	e.healthy()
}

// RESIZE_CQ stays within the pages the CQ was created with and refuses a
// ring that still holds CQEs; a guest that stops consuming overflows its
// CQ: a CQ_ERR event, later completions dropped and counted, the QP's
// send side still completes nowhere else, and nothing blocks.
func TestHostileCQResizeAndOverflow(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	c := v.createCQ(p.uc, 16)
	for _, n := range []uint32{0, 3, 128, 1 << 20, 0xffffffff} { // 128 CQEs need a second page
		v.failCmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: n}, eInval)
	}
	q, peer := p.loopPair2(c, p.rcq)
	peer.postRecv(1, p.mr.sge(0, 64))
	q.postSend(sendWQE(2), p.mr.sge(0, 8))
	requireCQE(t, p.rcq.wait(), peer, 1, hostverbs.WCRecv, hostverbs.WCSuccess)
	v.failCmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: 8}, syscall.EBUSY)
	requireCQE(t, c.wait(), q, 2, hostverbs.WCSend, hostverbs.WCSuccess)
	var rr abi.ResizeCQResp
	rr.Decode(v.mustCmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: c.handle, CQE: 8}))
	require.EqualValues(t, 8, rr.CQE)
	c.n = 8
	store32(v.ram, c.pages[0]+12, 0) // the guest restarts its cons_head

	// 8 slots: the 9th completion overflows, the rest are dropped.
	v.events()
	for i := 0; i < 12; i++ {
		peer.postRecv(uint64(10+i), p.mr.sge(0, 64))
		q.postSend(sendWQE(uint64(20+i)), p.mr.sge(0, 8))
		requireCQE(t, p.rcq.wait(), peer, uint64(10+i), hostverbs.WCRecv, hostverbs.WCSuccess)
	}
	_, err := v.waitIRQ(abi.VectorAsync, irqTimeout)
	require.NoError(t, err)
	require.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventCQErr), Info: c.handle}}, v.events())
	require.EqualValues(t, 4, e.counter(vmEvil, "cq_overflows"))
	for i := 0; i < 8; i++ {
		requireCQE(t, c.wait(), q, uint64(20+i), hostverbs.WCSend, hostverbs.WCSuccess)
	}
	c.empty()
	e.healthy()
}

// The DMA MR names all of guest memory: only the kernel gets one, and
// never with remote access (its rkey would open the whole guest to the
// network).
func TestDMAMRNeverRemote(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	kpd := v.createPD(0)
	v.failCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: p.pd, AccessFlags: accLocalWrite, Flags: abi.MRFlagDMA}, eInval)
	for _, acc := range []uint32{accRemoteRead, accLocalWrite | accRemoteWrite, accLocalWrite | uint32(hostverbs.AccessRemoteAtomic)} {
		v.failCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: acc, Flags: abi.MRFlagDMA}, eInval)
	}
	v.failCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: accLocalWrite, Flags: abi.MRFlagDMA | abi.MRFlagFRMR}, eInval)
	v.failCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: accLocalWrite, Flags: 4}, eInval)
	v.failCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: 1 << 8, Start: 0x1000, Length: 4096, NChunks: 1,
		PDirDMA: v.pdir(v.pages(1))}, eInval) // unknown access bit
	var r abi.CreateMRResp
	r.Decode(v.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: kpd, AccessFlags: accLocalWrite, Flags: abi.MRFlagDMA}))
	e.healthy()
}

// Remote keys are checked at the target against the MR's access and
// bounds, on every packet: a peer cannot reach past an MR or write an MR
// that only allows reads.
func TestRemoteKeyLimits(t *testing.T) {
	e := newEnv(t)
	a, b := e.pair(vmEvil, vmPeer)
	ro := b.v.regMR(b.pd, 0x6000_0000, 8192, accLocalWrite|accRemoteRead)
	canary := pattern(64, 0x77)
	ro.write(b.v, 0, canary)
	for i, c := range []struct {
		h  abi.SQWQEHdr
		st hostverbs.WCStatus
	}{
		{writeWQE(1, ro.iova, ro.rkey), hostverbs.WCRemAccessErr},               // read-only MR
		{writeWQE(2, b.mr.iova+mrBytes-8, b.mr.rkey), hostverbs.WCRemAccessErr}, // past the end
		{writeWQE(3, b.mr.iova-8, b.mr.rkey), hostverbs.WCRemAccessErr},         // before the start
		{writeWQE(4, b.mr.iova, b.mr.rkey^0x100), hostverbs.WCRemAccessErr},     // a key nobody has
		{writeWQE(5, 0, b.mr.rkey), hostverbs.WCRemAccessErr},                   // GPA 0
	} {
		q, _ := a.v.createQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4,
			sendSGE: 1, recvSGE: 1, uar: a.uc}), 0
		bq := b.v.createQP(qpSpec{pd: b.pd, scq: b.scq, rcq: b.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4,
			sendSGE: 1, recvSGE: 1, uar: b.uc})
		q.toRTS(bq.qpn, b.gid)
		bq.toRTS(q.qpn, a.gid)
		q.postSend(c.h, a.mr.sge(0, 64))
		requireCQE(t, a.scq.wait(), q, uint64(i+1), hostverbs.WCRDMAWrite, c.st)
	}
	require.Equal(t, canary, ro.read(b.v, 0, 64), "the read-only MR is untouched")
	e.healthy()
}
