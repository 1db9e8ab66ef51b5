package soft

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// qp is a queue pair: a requester and completer sharing the send queue
// (sqMu) and a responder owning the receive side (rqMu), as in rxe. QP
// attributes and state are written with both locks held (sqMu first) and
// read with either. Completions are pushed to the CQ handlers with the
// owning lock held, so they come out in order per queue.
type qp struct {
	dev    *device
	pd     *pd
	typ    hostverbs.QPType
	qpn    uint32
	scq    *cq
	rcq    *cq
	srq    *srq
	sigAll bool
	ctx    uint64
	caps   hostverbs.QPCap

	state   hostverbs.QPState
	attr    hostverbs.QPAttr
	mtu     uint64 // path MTU (RC) or port MTU (UD), bytes
	sgid    hostverbs.GID
	srcPort uint16
	dead    bool

	sqMu sync.Mutex
	sq   sendQueue
	req  reqState
	comp compState
	sqWC hostverbs.WorkCompletion
	rto  Timer
	rnr  Timer
	// cc is the requester's DCQCN state and pace its pacing timer.
	cc        rateState
	pace      Timer
	paceArmed bool
	// cnpSentAt is when this QP last sent a CNP (UnixNano; either lock).
	cnpSentAt atomic.Int64
	// ectSentAt is when this QP last sent an ECN-capable packet to its
	// peer (UnixNano, 0 never; stored with either lock held): a CNP is
	// taken only while requests are unacknowledged or within
	// CongestionConfig.CNPWindow of it (cnpSolicited).
	ectSentAt atomic.Int64

	rqMu sync.Mutex
	rq   recvQueue
	resp respState
	rqWC hostverbs.WorkCompletion
	// inPump: the QP waits for its turn in the fabric's read pump.
	inPump atomic.Bool
	// frozen: SaveTransport handed the QP's transport state over; it
	// drops what it receives and sends nothing until it is resumed
	// (ResumeTransport, or any post or modify). Stored with both locks
	// held but for a post's resume; read with either.
	frozen atomic.Bool
}

func (d *device) createQP(p *pd, a hostverbs.QPInitAttr) (hostverbs.QP, error) {
	switch a.Type {
	case hostverbs.QPTypeRC, hostverbs.QPTypeUD, hostverbs.QPTypeGSI:
	default:
		return nil, fmt.Errorf("create qp: type %v: %w", a.Type, hostverbs.ErrNotSupported)
	}
	scq, ok1 := a.SendCQ.(*cq)
	rcq, ok2 := a.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq.dev != d || rcq.dev != d {
		return nil, fmt.Errorf("create qp: send and receive CQs must be CQs of this device: %w", hostverbs.ErrInvalid)
	}
	var s *srq
	if a.SRQ != nil {
		var ok bool
		if s, ok = a.SRQ.(*srq); !ok || s.dev != d {
			return nil, fmt.Errorf("create qp: SRQ of another device: %w", hostverbs.ErrInvalid)
		}
		if a.Type != hostverbs.QPTypeRC && a.Type != hostverbs.QPTypeUD {
			return nil, fmt.Errorf("create qp: %v QP with an SRQ: %w", a.Type, hostverbs.ErrInvalid)
		}
	}
	c := a.Cap
	switch {
	case c.MaxSendWR < 1 || c.MaxSendWR > maxQPWR,
		s == nil && (c.MaxRecvWR < 1 || c.MaxRecvWR > maxQPWR),
		c.MaxSendSGE > maxSGE, c.MaxRecvSGE > maxSGE:
		return nil, fmt.Errorf("create qp: caps %+v beyond the device's (wr 1..%d, sge <= %d): %w", c, maxQPWR, maxSGE, hostverbs.ErrInvalid)
	case c.MaxInlineData > 0:
		return nil, fmt.Errorf("create qp: inline data: %w", hostverbs.ErrNotSupported)
	}
	if s != nil {
		c.MaxRecvWR, c.MaxRecvSGE = 0, 0
	}
	c.MaxSendSGE = max(c.MaxSendSGE, 1)
	c.MaxRecvSGE = max(c.MaxRecvSGE, 1)

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("create qp: %w", hostverbs.ErrClosed)
	}
	if _, ok := d.pds[p]; !ok {
		return nil, fmt.Errorf("create qp: pd was deallocated: %w", hostverbs.ErrNotFound)
	}
	if len(d.all) >= d.attr.MaxQP {
		return nil, fmt.Errorf("create qp: %d QPs: %w", len(d.all), hostverbs.ErrNoResources)
	}
	q := &qp{
		dev: d, pd: p, typ: a.Type, scq: scq, rcq: rcq, srq: s,
		sigAll: a.SigAll, ctx: a.Context, caps: c,
	}
	switch {
	case a.QPN != 0:
		if err := d.takeQPNLocked(a.QPN, a.Type); err != nil {
			return nil, fmt.Errorf("create qp: %w", err)
		}
		q.qpn = a.QPN
		if a.Type == hostverbs.QPTypeGSI && d.lookupQP(gsiQPN) != nil {
			return nil, fmt.Errorf("create qp: the device already has its GSI QP: %w", hostverbs.ErrBusy)
		}
	case a.Type == hostverbs.QPTypeGSI:
		if d.lookupQP(gsiQPN) != nil {
			return nil, fmt.Errorf("create qp: the device already has its GSI QP: %w", hostverbs.ErrBusy)
		}
		q.qpn = gsiQPN
	default:
		q.qpn = d.allocQPNLocked()
	}
	q.sq.init(int(c.MaxSendWR), int(c.MaxSendSGE))
	if s == nil {
		q.rq.init(int(c.MaxRecvWR), int(c.MaxRecvSGE))
		q.resp.wqe.sgl = make([]hostverbs.SGE, 0, c.MaxRecvSGE)
		q.resp.segs = make([]seg, 0, c.MaxRecvSGE)
	} else {
		q.resp.wqe.sgl = make([]hostverbs.SGE, 0, s.rq.maxSGE)
		q.resp.segs = make([]seg, 0, s.rq.maxSGE)
		s.refs.Add(1)
	}
	q.srcPort = roce.QPSourcePort(q.qpn)
	q.mtu = uint64(d.f.activeMTU.Bytes())
	q.attr.Cap = c
	q.attr.PathMTU = d.f.activeMTU
	q.rto = d.f.clock.AfterFunc(1<<62, q.onRTO)
	q.rto.Stop()
	q.rnr = d.f.clock.AfterFunc(1<<62, q.onRNRTimer)
	q.rnr.Stop()
	q.pace = d.f.clock.AfterFunc(1<<62, q.onPace)
	q.pace.Stop()
	p.refs.Add(1)
	scq.refs.Add(1)
	rcq.refs.Add(1)
	d.publishQPLocked(q)
	return q, nil
}

func (q *qp) QPN() uint32 { return q.qpn }

func (q *qp) isUD() bool { return q.typ != hostverbs.QPTypeRC }

// Query returns the QP's attributes.
func (q *qp) Query() (hostverbs.QPAttr, error) {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	q.rqMu.Lock()
	defer q.rqMu.Unlock()
	if q.dead {
		return hostverbs.QPAttr{}, fmt.Errorf("query qp %d: %w", q.qpn, hostverbs.ErrClosed)
	}
	a := q.attr
	a.State, a.CurState = q.state, q.state
	a.SQDraining = q.state == hostverbs.QPStateSQD && q.outstanding()
	return a, nil
}

// Modify validates and applies a state transition and attributes.
func (q *qp) Modify(attr *hostverbs.QPAttr, mask hostverbs.AttrMask) error {
	tx := q.dev.f.getTx()
	defer q.dev.f.putTx(tx)
	err := q.modify(tx, attr, mask)
	tx.flush()
	return err
}

func (q *qp) modify(tx *txBatch, attr *hostverbs.QPAttr, mask hostverbs.AttrMask) error {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	q.rqMu.Lock()
	defer q.rqMu.Unlock()
	if q.dead {
		return fmt.Errorf("modify qp %d: %w", q.qpn, hostverbs.ErrClosed)
	}
	q.frozen.Store(false) // a hand-over abandoned
	cur := q.state
	next := cur
	if mask&hostverbs.AttrState != 0 {
		next = attr.State
	}
	if mask&hostverbs.AttrCurState != 0 && attr.CurState != cur {
		return fmt.Errorf("modify qp %d: current state is %v, not %v: %w", q.qpn, cur, attr.CurState, hostverbs.ErrInvalid)
	}
	if err := hostverbs.CheckQPModify(q.typ, cur, mask, next); err != nil {
		return fmt.Errorf("modify qp %d: %w", q.qpn, err)
	}
	var sgid hostverbs.GID
	if err := q.checkValues(attr, mask, &sgid); err != nil {
		return fmt.Errorf("modify qp %d: %w", q.qpn, err)
	}
	q.apply(attr, mask, sgid)
	q.transition(tx, cur, next)
	return nil
}

// checkValues validates the attribute values mask selects.
func (q *qp) checkValues(a *hostverbs.QPAttr, mask hostverbs.AttrMask, sgid *hostverbs.GID) error {
	inv := hostverbs.ErrInvalid
	has := func(m hostverbs.AttrMask) bool { return mask&m != 0 }
	switch {
	case has(hostverbs.AttrPort) && a.Port != 1:
		return fmt.Errorf("port %d: %w", a.Port, inv)
	case has(hostverbs.AttrPKeyIndex) && a.PKeyIndex != 0:
		return fmt.Errorf("pkey index %d (one P_Key): %w", a.PKeyIndex, inv)
	case has(hostverbs.AttrPathMTU) && !a.PathMTU.Valid():
		return fmt.Errorf("path mtu %d: %w", a.PathMTU, inv)
	case has(hostverbs.AttrTimeout) && a.Timeout > 31,
		has(hostverbs.AttrRetryCnt) && a.RetryCnt > 7,
		has(hostverbs.AttrRNRRetry) && a.RNRRetry > 7,
		has(hostverbs.AttrMinRNRTimer) && a.MinRNRTimer > 31:
		return fmt.Errorf("timer or retry attribute out of range: %w", inv)
	case has(hostverbs.AttrRQPSN) && !roce.PSN(a.RQPSN).Valid(),
		has(hostverbs.AttrSQPSN) && !roce.PSN(a.SQPSN).Valid():
		return fmt.Errorf("psn beyond 24 bits: %w", inv)
	case has(hostverbs.AttrDestQPN) && a.DestQPN >= qpnSpace:
		return fmt.Errorf("dest qpn %#x: %w", a.DestQPN, inv)
	case has(hostverbs.AttrMaxQPRdAtomic) && int(a.MaxRdAtomic) > maxRdAtomic,
		has(hostverbs.AttrMaxDestRdAtomic) && int(a.MaxDestRdAtomic) > maxRdAtomic:
		return fmt.Errorf("rd_atomic above %d: %w", maxRdAtomic, inv)
	case has(hostverbs.AttrAccessFlags) && a.AccessFlags&^(hostverbs.AccessLocalWrite|
		hostverbs.AccessRemoteWrite|hostverbs.AccessRemoteRead|hostverbs.AccessRemoteAtomic|
		hostverbs.AccessMWBind) != 0:
		return fmt.Errorf("access flags %#x: %w", uint32(a.AccessFlags), inv)
	case has(hostverbs.AttrAltPath):
		return fmt.Errorf("alternate paths: %w", hostverbs.ErrNotSupported)
	case has(hostverbs.AttrCap) && a.Cap != q.caps:
		return fmt.Errorf("resizing a QP: %w", hostverbs.ErrNotSupported)
	}
	if has(hostverbs.AttrAV) {
		if a.AV.Port != 0 && a.AV.Port != 1 {
			return fmt.Errorf("av port %d: %w", a.AV.Port, inv)
		}
		g, err := q.dev.sgid(a.AV.SGIDIndex)
		if err != nil {
			return fmt.Errorf("av sgid index %d: %w", a.AV.SGIDIndex, err)
		}
		if a.AV.DGID.IsZero() || (!q.dev.v1 && g.IsV4() != a.AV.DGID.IsV4()) { // v1 GIDs need no common IP family
			return fmt.Errorf("av dgid %v with sgid %v: %w", a.AV.DGID, g, inv)
		}
		*sgid = g
	}
	return nil
}

// apply stores the attributes. Both locks are held.
func (q *qp) apply(a *hostverbs.QPAttr, mask hostverbs.AttrMask, sgid hostverbs.GID) {
	has := func(m hostverbs.AttrMask) bool { return mask&m != 0 }
	t := &q.attr
	if has(hostverbs.AttrAccessFlags) {
		t.AccessFlags = a.AccessFlags
	}
	if has(hostverbs.AttrPKeyIndex) {
		t.PKeyIndex = a.PKeyIndex
	}
	if has(hostverbs.AttrPort) {
		t.Port = a.Port
	}
	if has(hostverbs.AttrQKey) {
		t.QKey = a.QKey
	}
	if has(hostverbs.AttrPathMTU) {
		t.PathMTU = a.PathMTU
		if q.typ == hostverbs.QPTypeRC {
			q.mtu = uint64(a.PathMTU.Bytes())
		}
	}
	if has(hostverbs.AttrTimeout) {
		t.Timeout = a.Timeout
	}
	if has(hostverbs.AttrRetryCnt) {
		t.RetryCnt = a.RetryCnt
		q.comp.retryCnt = a.RetryCnt
	}
	if has(hostverbs.AttrRNRRetry) {
		t.RNRRetry = a.RNRRetry
		q.comp.rnrRetry = a.RNRRetry
	}
	if has(hostverbs.AttrRQPSN) {
		t.RQPSN = a.RQPSN
		q.resp.psn = roce.PSN(a.RQPSN)
	}
	if has(hostverbs.AttrSQPSN) {
		t.SQPSN = a.SQPSN
		q.req.psn = roce.PSN(a.SQPSN)
		q.req.sentHigh = roce.PSN(a.SQPSN)
		q.comp.psn = roce.PSN(a.SQPSN)
	}
	if has(hostverbs.AttrMaxQPRdAtomic) {
		t.MaxRdAtomic = a.MaxRdAtomic
	}
	if has(hostverbs.AttrMaxDestRdAtomic) {
		t.MaxDestRdAtomic = a.MaxDestRdAtomic
		q.resp.res = make([]respRes, a.MaxDestRdAtomic)
		q.resp.resNext = 0
		// Every resource plus one replay (readpump.go).
		q.resp.reads = readFIFO{jobs: make([]readJob, a.MaxDestRdAtomic+1)}
	}
	if has(hostverbs.AttrMinRNRTimer) {
		t.MinRNRTimer = a.MinRNRTimer
	}
	if has(hostverbs.AttrPathMigState) {
		t.PathMigState = a.PathMigState
	}
	if has(hostverbs.AttrEnSQDAsyncNotify) {
		t.EnSQDAsyncNotify = a.EnSQDAsyncNotify
	}
	if has(hostverbs.AttrDestQPN) {
		t.DestQPN = a.DestQPN
	}
	if has(hostverbs.AttrAV) {
		t.AV = a.AV
		q.sgid = sgid
		q.ectSentAt.Store(0) // what it sent went to the old peer
	}
	if q.typ == hostverbs.QPTypeRC && has(hostverbs.AttrAV|hostverbs.AttrDestQPN) {
		// rxe: the UDP source port of a connected QP comes from the AV's
		// flow label, or from the two QPNs (ECMP entropy per QP pair).
		q.srcPort = roce.SourcePort(t.AV.FlowLabel, q.qpn, t.DestQPN)
	}
}

// transition runs the side effects of a state change. Both locks are held.
func (q *qp) transition(tx *txBatch, cur, next hostverbs.QPState) {
	q.state = next
	switch next {
	case hostverbs.QPStateReset:
		q.resetLocked()
	case hostverbs.QPStateErr:
		if cur != hostverbs.QPStateErr {
			q.flushLocked()
		}
	case hostverbs.QPStateRTS:
		if cur == hostverbs.QPStateRTR {
			q.comp.retryCnt = q.attr.RetryCnt
			q.comp.rnrRetry = q.attr.RNRRetry
		}
		q.reqRun(tx)
	case hostverbs.QPStateSQD:
		if cur != hostverbs.QPStateSQD {
			q.req.sqdNotified = false
		}
		q.checkSQDrained()
	}
}

// resetLocked returns the QP to its freshly created condition, discarding
// outstanding work without completions.
func (q *qp) resetLocked() {
	q.rto.Stop()
	q.rnr.Stop()
	q.pace.Stop()
	q.paceArmed = false
	q.cc = rateState{}
	q.ectSentAt.Store(0)
	q.sq.head, q.sq.next, q.sq.tail = 0, 0, 0
	if q.srq == nil {
		q.rq.head, q.rq.tail = 0, 0
	}
	q.req = reqState{}
	q.comp = compState{}
	res := q.resp.res
	clear(res)
	reads := q.resp.reads
	reads.clear()
	q.resp = respState{wqe: recvWQE{sgl: q.resp.wqe.sgl[:0]}, segs: q.resp.segs[:0], res: res,
		reads: readFIFO{jobs: reads.jobs}}
	cap := q.attr.Cap
	q.attr = hostverbs.QPAttr{Cap: cap, PathMTU: q.dev.f.activeMTU}
	q.mtu = uint64(q.dev.f.activeMTU.Bytes())
	q.srcPort = roce.QPSourcePort(q.qpn)
}

// flushLocked completes everything outstanding with WR_FLUSH_ERR (a WQE
// that failed keeps its own status) and stops the timers: the QP is in
// ERR. Both locks are held.
func (q *qp) flushLocked() {
	q.rto.Stop()
	q.rnr.Stop()
	q.pace.Stop()
	q.paceArmed = false
	q.comp.rtoArmed = false
	q.req.waitRNR = false
	for q.sq.head != q.sq.tail {
		w := q.sq.at(q.sq.head)
		st := hostverbs.WCWRFlushErr
		if w.state == wqeError {
			st = w.status
		}
		q.completeSendHead(st)
	}
	q.sq.next = q.sq.tail
	r := &q.resp
	if r.haveWQE {
		q.completeRecv(&r.wqe, hostverbs.WCWRFlushErr, nil, 0)
		r.haveWQE = false
	}
	if q.srq == nil {
		q.rq.drain(func(w *recvWQE) { q.completeRecv(w, hostverbs.WCWRFlushErr, nil, 0) })
	} else {
		q.dev.event(hostverbs.EventQPLastWQEReach, q.ctx, q.qpn)
	}
	r.ackPending = false
	r.reads.clear()
}

// enterErrorLocked moves the QP to ERR from the requester or completer
// (sqMu held), taking rqMu.
func (q *qp) enterErrorLocked() {
	q.rqMu.Lock()
	if q.state != hostverbs.QPStateErr && !q.dead {
		q.state = hostverbs.QPStateErr
		q.flushLocked()
	}
	q.rqMu.Unlock()
}

// toError moves the QP to ERR after the responder asked for it (no lock
// held), with the async event the error calls for.
func (q *qp) toError(ev hostverbs.EventType) {
	q.sqMu.Lock()
	q.rqMu.Lock()
	moved := false
	if q.state != hostverbs.QPStateErr && q.state != hostverbs.QPStateReset && !q.dead {
		q.state = hostverbs.QPStateErr
		q.flushLocked()
		moved = true
	}
	q.rqMu.Unlock()
	q.sqMu.Unlock()
	if moved {
		q.dev.event(ev, q.ctx, q.qpn)
	}
}

// Destroy discards outstanding work without completions.
func (q *qp) Destroy() error {
	q.sqMu.Lock()
	dead := q.dead
	q.sqMu.Unlock()
	if dead {
		return fmt.Errorf("destroy qp %d: %w", q.qpn, hostverbs.ErrNotFound)
	}
	q.destroy()
	return nil
}

func (q *qp) destroy() {
	q.sqMu.Lock()
	q.rqMu.Lock()
	if q.dead {
		q.rqMu.Unlock()
		q.sqMu.Unlock()
		return
	}
	q.dead = true
	q.rto.Stop()
	q.rnr.Stop()
	q.pace.Stop()
	q.rqMu.Unlock()
	q.sqMu.Unlock()
	d := q.dev
	d.mu.Lock()
	d.unpublishQPLocked(q)
	d.mu.Unlock()
	q.pd.refs.Add(-1)
	q.scq.refs.Add(-1)
	q.rcq.refs.Add(-1)
	if q.srq != nil {
		q.srq.refs.Add(-1)
	}
}

// PostSend queues a send work request and starts transmitting it on the
// calling goroutine.
func (q *qp) PostSend(wr *hostverbs.SendWR) error {
	if err := q.checkSendWR(wr); err != nil {
		return fmt.Errorf("qp %d post send: %w", q.qpn, err)
	}
	tx := q.dev.f.getTx()
	q.sqMu.Lock()
	err := q.postSendLocked(tx, wr)
	q.sqMu.Unlock()
	tx.flush()
	q.dev.f.putTx(tx)
	return err
}

func (q *qp) checkSendWR(wr *hostverbs.SendWR) error {
	if len(wr.SGL) > int(q.caps.MaxSendSGE) {
		return fmt.Errorf("%d SGEs, max %d: %w", len(wr.SGL), q.caps.MaxSendSGE, hostverbs.ErrInvalid)
	}
	if wr.Flags&hostverbs.SendInline != 0 {
		return fmt.Errorf("inline data: %w", hostverbs.ErrNotSupported)
	}
	var total uint64
	for i := range wr.SGL {
		total += uint64(wr.SGL[i].Length)
	}
	if total > maxMsgSize {
		return fmt.Errorf("message of %d bytes: %w", total, hostverbs.ErrInvalid)
	}
	if q.isUD() {
		if wr.Opcode != hostverbs.WRSend && wr.Opcode != hostverbs.WRSendWithImm {
			return fmt.Errorf("opcode %v on a %v QP: %w", wr.Opcode, q.typ, hostverbs.ErrInvalid)
		}
		if total > uint64(q.dev.f.activeMTU.Bytes()) {
			return fmt.Errorf("UD message of %d bytes exceeds the MTU: %w", total, hostverbs.ErrInvalid)
		}
		return nil
	}
	switch wr.Opcode {
	case hostverbs.WRSend, hostverbs.WRSendWithImm, hostverbs.WRRDMAWrite,
		hostverbs.WRRDMAWriteWithImm, hostverbs.WRRDMARead, hostverbs.WRSendWithInv:
	case hostverbs.WRAtomicCmpAndSwp, hostverbs.WRAtomicFetchAndAdd:
		if total < 8 {
			return fmt.Errorf("atomic with a %d-byte local buffer: %w", total, hostverbs.ErrInvalid)
		}
		if wr.RemoteAddr&7 != 0 {
			return fmt.Errorf("atomic at unaligned %#x: %w", wr.RemoteAddr, hostverbs.ErrInvalid)
		}
	default:
		return fmt.Errorf("opcode %v: %w", wr.Opcode, hostverbs.ErrNotSupported)
	}
	return nil
}

func (q *qp) postSendLocked(tx *txBatch, wr *hostverbs.SendWR) error {
	if q.dead {
		return fmt.Errorf("qp %d post send: %w", q.qpn, hostverbs.ErrClosed)
	}
	switch q.state {
	case hostverbs.QPStateRTS, hostverbs.QPStateSQD, hostverbs.QPStateSQE, hostverbs.QPStateErr:
	default:
		return fmt.Errorf("qp %d post send in %v: %w", q.qpn, q.state, hostverbs.ErrInvalid)
	}
	q.frozen.Store(false) // a hand-over abandoned
	if !q.sq.push(wr) {
		return fmt.Errorf("qp %d post send: %w", q.qpn, hostverbs.ErrQueueFull)
	}
	if q.state == hostverbs.QPStateErr {
		q.completeSendHead(hostverbs.WCWRFlushErr)
		q.sq.next = q.sq.tail
		return nil
	}
	q.reqRun(tx)
	return nil
}

// PostRecv queues a receive work request.
func (q *qp) PostRecv(wr *hostverbs.RecvWR) error {
	if q.srq != nil {
		return fmt.Errorf("qp %d post recv: the QP uses an SRQ: %w", q.qpn, hostverbs.ErrInvalid)
	}
	q.rqMu.Lock()
	defer q.rqMu.Unlock()
	if q.dead {
		return fmt.Errorf("qp %d post recv: %w", q.qpn, hostverbs.ErrClosed)
	}
	if q.state == hostverbs.QPStateReset {
		return fmt.Errorf("qp %d post recv in RESET: %w", q.qpn, hostverbs.ErrInvalid)
	}
	q.frozen.Store(false) // a hand-over abandoned
	if err := q.rq.post(wr); err != nil {
		return fmt.Errorf("qp %d: %w", q.qpn, err)
	}
	if q.state == hostverbs.QPStateErr {
		q.rq.drain(func(w *recvWQE) { q.completeRecv(w, hostverbs.WCWRFlushErr, nil, 0) })
	}
	return nil
}

// completeRecv reports a receive completion: status and, on success, what
// p carried (n payload bytes placed). rqMu is held.
func (q *qp) completeRecv(w *recvWQE, st hostverbs.WCStatus, p *packet, n uint32) {
	wc := &q.rqWC
	*wc = hostverbs.WorkCompletion{
		WRID: w.wrID, Status: st, Opcode: hostverbs.WCRecv, QPN: q.qpn,
		QPContext: q.ctx, Port: 1,
	}
	if p != nil && st == hostverbs.WCSuccess {
		wc.ByteLen = n
		wc.Solicited = p.se
		if p.info.Has(roce.MaskImm) {
			wc.Flags |= hostverbs.WCFlagWithImm
			wc.ImmData = p.imm
		}
		if p.info.Has(roce.MaskWrite) {
			wc.Opcode = hostverbs.WCRecvRDMAWithImm
		}
		if p.info.Has(roce.MaskIETH) {
			wc.Flags |= hostverbs.WCFlagWithInvalidate
			wc.ImmData = p.iethKey
		}
		if q.isUD() {
			wc.SrcQP = p.srcQP
			wc.Flags |= hostverbs.WCFlagGRH | hostverbs.WCFlagWithNetworkHdrTyp
			switch {
			case p.v1:
				wc.NetworkHdrType = hostverbs.NetworkIB
			case p.v4:
				wc.NetworkHdrType = hostverbs.NetworkIPv4
			default:
				wc.NetworkHdrType = hostverbs.NetworkIPv6
			}
		} else {
			wc.SrcQP = q.attr.DestQPN
		}
	}
	q.rcq.complete(wc)
}
