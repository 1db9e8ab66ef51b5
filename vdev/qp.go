package vdev

import (
	"fmt"
	"sync/atomic"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// qp is a queue pair: guest SQ and RQ rings in one page directory (page 0
// holds both ring states, SQ at byte 0 and RQ at byte 8; SQ WQEs from page
// 1, RQ WQEs from page send_chunks+1) and a provider QP. The guest knows it
// by handle (doorbells, CQEs, commands); the wire and peers know it by the
// provider's QPN.
type qp struct {
	dev              *Device
	handle, gen      uint32
	typ              hostverbs.QPType
	pd               *pd
	scq, rcq         *cq
	srq              *srq
	uar              uint32
	hv               hostverbs.QP
	sigAll           bool
	sq               *workQueue
	rq               *workQueue // nil with an SRQ
	sendWR, recvWR   uint32
	sendSGE, recvSGE uint32
	cost             uint64 // bytes charged to the VM's budget
	// state is the QP state as far as the device knows: set by MODIFY_QP,
	// and to ERR by error completions and fatal events (any goroutine).
	state                atomic.Uint32
	stalledSQ, stalledRQ bool // guarded by Device.mu
	// rec is the journal payload of its CREATE_QP and mods the modifies
	// that lead to its state (Checkpoint; guarded by Device.mu).
	rec  []byte
	mods []qpMod
	// transport is the payload of the transport record SaveTransports
	// wrote for a hand-over still pending (Device.handover; guarded by
	// Device.mu).
	transport []byte
}

// context is the provider-side context of the QP: handle and a
// generation, so that a completion for a destroyed QP whose handle was
// reused is recognised as stale.
func (q *qp) context() uint64 { return uint64(q.gen)<<32 | uint64(q.handle) }

func (q *qp) State() hostverbs.QPState { return hostverbs.QPState(q.state.Load()) }

// liveQP returns the QP a provider context names, or nil if it is gone.
func (d *Device) liveQP(ctx uint64) *qp {
	h := uint32(ctx)
	if h >= uint32(len(d.live)) {
		return nil
	}
	q := d.live[h].Load()
	if q == nil || q.gen != uint32(ctx>>32) {
		return nil
	}
	return q
}

// WQE strides: the header plus max_sge SGEs, rounded up to a power of two,
// with the SGE count exactly as CREATE_QP carries it: rdma-core 44 and later
// do not round it, and the stride must match theirs.
func sqStride(sge uint32) uint32 { return pow2Ceil(abi.SQWQEHdrSize + abi.SGESize*sge) }
func rqStride(sge uint32) uint32 { return pow2Ceil(abi.RQWQEHdrSize + abi.SGESize*sge) }

func pow2Ceil(v uint32) uint32 {
	p := uint32(1)
	for p < v {
		p <<= 1
	}
	return p
}

func queuePages(wr, stride uint32) uint64 {
	return (uint64(wr)*uint64(stride) + guestmem.PageSize - 1) / guestmem.PageSize
}

func (d *Device) cmdCreateQP(req, resp []byte) error {
	var r abi.CreateQP
	r.Decode(req)
	typ := hostverbs.QPType(r.QPType)
	switch typ {
	case hostverbs.QPTypeRC, hostverbs.QPTypeUD, hostverbs.QPTypeGSI:
	default:
		return fmt.Errorf("QP type %d: %w", r.QPType, syscall.EINVAL)
	}
	p, err := d.pd(r.PDHandle)
	if err != nil {
		return err
	}
	if typ == hostverbs.QPTypeGSI && (p.uar != 0 || d.gsi != nil) {
		return fmt.Errorf("GSI QP (PD %d, one exists: %v): %w", p.handle, d.gsi != nil, syscall.EINVAL)
	}
	scq, err := d.cq(r.SendCQHandle)
	if err != nil {
		return err
	}
	rcq, err := d.cq(r.RecvCQHandle)
	if err != nil {
		return err
	}
	var s *srq
	if r.IsSRQ != 0 {
		if typ == hostverbs.QPTypeGSI {
			return fmt.Errorf("GSI QP on an SRQ: %w", syscall.EINVAL)
		}
		if s, err = d.srq(r.SRQHandle); err != nil {
			return err
		}
	}
	validWR := func(n uint32) bool { return n != 0 && n <= d.caps.MaxQPWR && n&(n-1) == 0 }
	validSGE := func(n uint32) bool { return n != 0 && n <= d.caps.MaxSGE }
	if !validWR(r.MaxSendWR) || !validSGE(r.MaxSendSGE) {
		return fmt.Errorf("send queue %d WRs x %d SGEs (max %d x %d): %w", r.MaxSendWR, r.MaxSendSGE, d.caps.MaxQPWR, d.caps.MaxSGE, syscall.EINVAL)
	}
	recvWR, recvSGE := r.MaxRecvWR, r.MaxRecvSGE
	if s != nil {
		recvWR, recvSGE = 0, 0
	} else if !validWR(recvWR) || !validSGE(recvSGE) {
		return fmt.Errorf("receive queue %d WRs x %d SGEs (max %d x %d): %w", recvWR, recvSGE, d.caps.MaxQPWR, d.caps.MaxSGE, syscall.EINVAL)
	}
	sStride, rStride := sqStride(r.MaxSendSGE), rqStride(recvSGE)
	sendPages := queuePages(r.MaxSendWR, sStride)
	recvPages := uint64(0)
	if s == nil {
		recvPages = queuePages(recvWR, rStride)
	}
	// Page counts (CVE-2018-20125): the send queue needs sendPages after
	// the ring-state page, the receive queue recvPages after those; the
	// guest may give more, up to what the largest queues allowed need.
	most := 1 + 2*queuePages(d.caps.MaxQPWR, sqStride(d.caps.MaxSGE))
	if uint64(r.SendChunks) < sendPages || uint64(r.TotalChunks) < 1+uint64(r.SendChunks)+recvPages ||
		uint64(r.TotalChunks) > most {
		return fmt.Errorf("QP pages: send %d (needs %d), total %d (needs %d, at most %d): %w",
			r.SendChunks, sendPages, r.TotalChunks, 1+uint64(r.SendChunks)+recvPages, most, ringbuf.ErrPageCount)
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(r.PDirDMA), int(r.TotalChunks), int(most))
	if err != nil {
		return fmt.Errorf("QP page directory: %w", err)
	}
	cost := costQP + uint64(len(pages))*costPageEntry + queueCost(r.MaxSendWR, r.MaxSendSGE, costSendWQE+costWQESlot, costSendSGE) +
		queueCost(recvWR, recvSGE, costRecvWQE+costWQESlot, costRecvSGE)
	if err := d.heap.Charge(cost); err != nil {
		return fmt.Errorf("QP of %d+%d WRs: %w", r.MaxSendWR, recvWR, err)
	}
	q := &qp{dev: d, typ: typ, pd: p, scq: scq, rcq: rcq, srq: s, uar: p.uar, sigAll: r.SQSigAll != 0,
		sendWR: r.MaxSendWR, recvWR: recvWR, sendSGE: r.MaxSendSGE, recvSGE: recvSGE, cost: cost}
	created := false
	defer func() {
		if !created {
			d.heap.Release(cost)
		}
	}()
	sring, err := d.consumer(pages[:1+int(r.SendChunks)], pages[0], guestmem.PageSize, sStride, r.MaxSendWR)
	if err != nil {
		return fmt.Errorf("send queue: %w", err)
	}
	q.sq = newWorkQueue(scq, sring, false)
	if s == nil {
		rring, err := d.consumer(pages[1+int(r.SendChunks):], pages[0]+8, 0, rStride, recvWR)
		if err != nil {
			return fmt.Errorf("receive queue: %w", err)
		}
		q.rq = newWorkQueue(rcq, rring, true)
	}
	h, ok := allocHandle(d, &d.qps, q)
	if !ok {
		return fmt.Errorf("%d QPs: %w", d.qps.len(), ErrLimit)
	}
	d.qpGen++
	q.handle, q.gen = h, d.qpGen
	init := hostverbs.QPInitAttr{
		Type: typ, SendCQ: scq.hv, RecvCQ: rcq.hv, SigAll: q.sigAll, Context: q.context(),
		Cap: hostverbs.QPCap{MaxSendWR: r.MaxSendWR, MaxRecvWR: recvWR, MaxSendSGE: r.MaxSendSGE, MaxRecvSGE: recvSGE},
	}
	if s != nil {
		init.SRQ = s.hv
	}
	if q.hv, err = d.createProviderQP(p, init); err != nil {
		d.qps.free(h)
		return fmt.Errorf("create QP: %w", err)
	}
	q.state.Store(uint32(hostverbs.QPStateReset))
	d.attachQP(q, p, scq, rcq, s)
	created = true
	abi.CreateQPResp{QPN: q.hv.QPN(), QPHandle: h, MaxSendWR: r.MaxSendWR, MaxRecvWR: recvWR,
		MaxSendSGE: r.MaxSendSGE, MaxRecvSGE: recvSGE}.Encode(resp)
	return nil
}

// attachQP makes a new QP live (completion handlers find it) and counts
// it on the objects it uses; the GSI QP is remembered. d.mu held.
func (d *Device) attachQP(q *qp, p *pd, scq, rcq *cq, s *srq) {
	d.live[q.handle].Store(q)
	p.refs++
	scq.refs++
	rcq.refs++
	if s != nil {
		s.refs++
	}
	if q.typ == hostverbs.QPTypeGSI {
		d.gsi = q
	}
}

// consumer builds the device side of a guest-produced queue of n WQEs of
// stride bytes starting base bytes into pages, with its ring at state:
// cons_head reset to 0, or taken from guest memory while rings are
// adopted (Device.SetAdoptRings, and throughout a Restore).
func (d *Device) consumer(pages []guestmem.GPA, state guestmem.GPA, base uint64, stride, n uint32) (*ringbuf.Consumer, error) {
	geo, err := ringbuf.NewGeometry(n)
	if err != nil {
		return nil, err
	}
	area, err := ringbuf.NewArea(pages, base, stride, n)
	if err != nil {
		return nil, err
	}
	if d.adopt || d.rp != nil {
		return ringbuf.AdoptConsumer(d.mem, state, geo, area)
	}
	return ringbuf.NewConsumer(d.mem, state, geo, area)
}

// qp validates a QP handle from a command.
func (d *Device) qp(h uint32) (*qp, error) {
	q, ok := d.qps.get(h)
	if !ok {
		return nil, fmt.Errorf("QP %d: %w", h, ErrBadHandle)
	}
	return q, nil
}

func (d *Device) cmdModifyQP(req, resp []byte) error {
	var r abi.ModifyQP
	r.Decode(req)
	q, err := d.qp(r.QPHandle)
	if err != nil {
		return err
	}
	mask := hostverbs.AttrMask(r.AttrMask)
	a := &r.Attrs
	if mask&^hostverbs.AttrAll != 0 || a.State > uint32(hostverbs.QPStateErr) || a.CurState > uint32(hostverbs.QPStateErr) {
		return fmt.Errorf("QP %d: mask %#x state %d: %w", q.handle, r.AttrMask, a.State, syscall.EINVAL)
	}
	cur := q.State()
	if mask&hostverbs.AttrCurState != 0 {
		cur = hostverbs.QPState(a.CurState)
	}
	next := cur
	if mask&hostverbs.AttrState != 0 {
		next = hostverbs.QPState(a.State)
	}
	if err := hostverbs.CheckQPModify(q.typ, cur, mask, next); err != nil {
		return fmt.Errorf("QP %d: %w", q.handle, err)
	}
	if err := d.checkQPAttr(a, mask); err != nil {
		return fmt.Errorf("QP %d: %w", q.handle, err)
	}
	if mask&hostverbs.AttrQKey != 0 && a.QKey&ControlledQKey != 0 && q.typ != hostverbs.QPTypeGSI {
		// As Linux refuses it to users without CAP_NET_RAW: with it a UD QP
		// could send as the GSI QP (CM MADs to QP1 of any host); the
		// daemon's own CAP_NET_RAW must not lend the guest that right.
		return fmt.Errorf("QP %d: Q_Key %#x has the controlled bit (only the GSI QP may): %w", q.handle, a.QKey, syscall.EPERM)
	}
	attr := hostQPAttr(a)
	if err := q.hv.Modify(&attr, mask); err != nil {
		return fmt.Errorf("QP %d %v->%v: %w", q.handle, cur, next, err)
	}
	q.state.Store(uint32(next))
	if d.rp != nil {
		return nil // a restore: rings stay as the guest has them until Restore kicks them
	}
	switch next {
	case hostverbs.QPStateReset:
		// The guest resets both ring indices after a successful transition
		// to RESET (pvrdma_reset_qp, rdma-core pvrdma_init_qp_queue); the
		// provider discards the WQEs it held, without completions. A
		// replayed RESET keeps the rings as the guest has them now.
		d.unstall(q)
		if err := q.sq.reset(d.adopt); err != nil {
			return fmt.Errorf("QP %d send queue: %w", q.handle, err)
		}
		if q.rq != nil {
			if err := q.rq.reset(d.adopt); err != nil {
				return fmt.Errorf("QP %d receive queue: %w", q.handle, err)
			}
		}
	case hostverbs.QPStateErr:
		// Whatever is still in the rings completes with WR_FLUSH_ERR (rping
		// and RDMA-CM wait for it before they exit).
		d.unstall(q)
		d.postSends(q, false)
		d.postRecvs(q)
	}
	return nil
}

// ControlledQKey is the Q_Key bit that marks a controlled Q_Key (IBA
// 10.2.4; the GSI QP's is 0x80010000): a send work request whose Q_Key has
// it uses the QP's own, and only privileged consumers may give a QP one.
const ControlledQKey = 0x80000000

// checkQPAttr validates what the device must understand itself: the port
// and the source GID index of the address vector, which must name a GID
// the guest bound (its type comes from that binding).
func (d *Device) checkQPAttr(a *abi.QPAttr, mask hostverbs.AttrMask) error {
	if mask&hostverbs.AttrPort != 0 && a.PortNum != portNum {
		return fmt.Errorf("port %d: %w", a.PortNum, syscall.EINVAL)
	}
	if mask&hostverbs.AttrPathMTU != 0 && !hostverbs.MTU(a.PathMTU).Valid() {
		return fmt.Errorf("path MTU %d: %w", a.PathMTU, syscall.EINVAL)
	}
	if mask&hostverbs.AttrAV != 0 {
		if err := d.checkSGID(a.AH.SGIDIndex); err != nil {
			return err
		}
		if a.AH.PortNum != 0 && a.AH.PortNum != portNum {
			return fmt.Errorf("AH port %d: %w", a.AH.PortNum, syscall.EINVAL)
		}
	}
	return nil
}

func (d *Device) checkSGID(i uint8) error {
	if int(i) >= len(d.gids) || !d.gids[i].bound {
		return fmt.Errorf("source GID index %d not bound: %w", i, syscall.EINVAL)
	}
	return nil
}

// hostQPAttr converts the ABI's QP attributes to the provider's (the enums
// are numerically equal).
func hostQPAttr(a *abi.QPAttr) hostverbs.QPAttr {
	return hostverbs.QPAttr{
		State: hostverbs.QPState(a.State), CurState: hostverbs.QPState(a.CurState),
		PathMTU: hostverbs.MTU(a.PathMTU), PathMigState: uint8(a.PathMigState),
		QKey: a.QKey, RQPSN: a.RQPSN, SQPSN: a.SQPSN, DestQPN: a.DestQPNum,
		AccessFlags: hostverbs.Access(a.AccessFlags), PKeyIndex: a.PKeyIndex, AltPKeyIndex: a.AltPKeyIndex,
		EnSQDAsyncNotify: a.EnSQDAsyncNotify != 0, SQDraining: a.SQDraining != 0,
		MaxRdAtomic: a.MaxRdAtomic, MaxDestRdAtomic: a.MaxDestRdAtomic, MinRNRTimer: a.MinRNRTimer,
		Port: a.PortNum, Timeout: a.Timeout, RetryCnt: a.RetryCnt, RNRRetry: a.RNRRetry,
		AltPort: a.AltPortNum, AltTimeout: a.AltTimeout,
		Cap: hostverbs.QPCap{MaxSendWR: a.Cap.MaxSendWR, MaxRecvWR: a.Cap.MaxRecvWR,
			MaxSendSGE: a.Cap.MaxSendSGE, MaxRecvSGE: a.Cap.MaxRecvSGE, MaxInlineData: a.Cap.MaxInlineData},
		AV: hostAV(&a.AH), AltAV: hostAV(&a.AltAH),
	}
}

func hostAV(ah *abi.AHAttr) hostverbs.AddressVector {
	return hostverbs.AddressVector{
		DGID: hostverbs.GID(ah.DGID), SGIDIndex: ah.SGIDIndex, HopLimit: ah.HopLimit,
		TrafficClass: ah.TrafficClass, FlowLabel: ah.FlowLabel & 0xFFFFF, SL: ah.SL,
		StaticRate: ah.StaticRate, Port: ah.PortNum, DMAC: ah.DMAC, VLANID: ah.VLANID,
	}
}

func (d *Device) cmdQueryQP(req, resp []byte) error {
	var r abi.QueryQP
	r.Decode(req)
	q, err := d.qp(r.QPHandle)
	if err != nil {
		return err
	}
	qa, err := q.hv.Query()
	if err != nil {
		return fmt.Errorf("query QP %d: %w", q.handle, err)
	}
	a := abi.QPAttr{
		State: uint32(qa.State), CurState: uint32(qa.State), PathMTU: uint32(qa.PathMTU),
		PathMigState: uint32(qa.PathMigState), QKey: qa.QKey, RQPSN: qa.RQPSN, SQPSN: qa.SQPSN,
		DestQPNum: qa.DestQPN, AccessFlags: uint32(qa.AccessFlags), PKeyIndex: qa.PKeyIndex,
		AltPKeyIndex: qa.AltPKeyIndex, MaxRdAtomic: qa.MaxRdAtomic, MaxDestRdAtomic: qa.MaxDestRdAtomic,
		MinRNRTimer: qa.MinRNRTimer, PortNum: max(qa.Port, portNum), Timeout: qa.Timeout, RetryCnt: qa.RetryCnt,
		RNRRetry: qa.RNRRetry, AltPortNum: qa.AltPort, AltTimeout: qa.AltTimeout,
		Cap: abi.QPCap{MaxSendWR: q.sendWR, MaxRecvWR: q.recvWR, MaxSendSGE: q.sendSGE, MaxRecvSGE: q.recvSGE},
		AH:  abiAH(&qa.AV), AltAH: abiAH(&qa.AltAV),
	}
	if qa.EnSQDAsyncNotify {
		a.EnSQDAsyncNotify = 1
	}
	if qa.SQDraining {
		a.SQDraining = 1
	}
	q.state.Store(uint32(qa.State))
	abi.QueryQPResp{Attrs: a}.Encode(resp)
	return nil
}

func abiAH(av *hostverbs.AddressVector) abi.AHAttr {
	ah := abi.AHAttr{
		DGID: av.DGID, FlowLabel: av.FlowLabel, SGIDIndex: av.SGIDIndex, HopLimit: av.HopLimit,
		TrafficClass: av.TrafficClass, VLANID: av.VLANID, SL: av.SL, StaticRate: av.StaticRate,
		PortNum: av.Port, DMAC: av.DMAC,
	}
	if !av.DGID.IsZero() {
		ah.Flags = abi.AHFlagGRH // RoCE always carries a GRH
	}
	return ah
}

func (d *Device) cmdDestroyQP(req, resp []byte) error {
	var r abi.DestroyQP
	r.Decode(req)
	q, err := d.qp(r.QPHandle)
	if err != nil {
		return err
	}
	if err := d.destroyQP(q); err != nil {
		return err
	}
	abi.DestroyQPResp{}.Encode(resp)
	return nil
}

// destroyQP destroys the provider QP and makes sure no completion of it is
// written afterwards: the QP leaves the live table first, and taking each
// CQ lock once waits out a handler that had already looked it up.
func (d *Device) destroyQP(q *qp) error {
	d.live[q.handle].Store(nil)
	err := q.hv.Destroy()
	q.scq.quiesce()
	q.rcq.quiesce()
	d.unstall(q)
	d.qps.free(q.handle)
	d.heap.Release(q.cost)
	q.pd.refs--
	q.scq.refs--
	q.rcq.refs--
	if q.srq != nil {
		q.srq.refs--
	}
	if d.gsi == q {
		d.gsi = nil
	}
	if err != nil {
		d.lim.Warn("destroy-qp", "pvrdma: provider failed to destroy a QP", "qp", q.handle, "err", err)
		return fmt.Errorf("destroy QP %d: %w", q.handle, err)
	}
	return nil
}

// errorQP moves a QP to ERR after a fatal condition the device found (a
// bad WQE, a corrupt ring): the provider flushes what it holds, the device
// flushes what is left in the rings.
func (d *Device) errorQP(q *qp) {
	q.state.Store(uint32(hostverbs.QPStateErr))
	attr := hostverbs.QPAttr{State: hostverbs.QPStateErr}
	if err := q.hv.Modify(&attr, hostverbs.AttrState); err != nil {
		d.lim.Debug("qp-to-err", "pvrdma: provider refused QP to ERR", "qp", q.handle, "err", err)
	}
}

// qpFatal handles a QP whose rings the device can no longer use (an
// invalid index, a ring page that vanished): ERR plus a QP_FATAL event, so
// the guest hears about it instead of the device spinning.
func (d *Device) qpFatal(q *qp, err error) {
	d.lim.Debug("qp-ring", "pvrdma: QP ring unusable", "qp", q.handle, "err", err)
	if q.State() != hostverbs.QPStateErr {
		d.errorQP(q)
		d.pushEvent(uint32(hostverbs.EventQPFatal), q.handle)
	}
}
