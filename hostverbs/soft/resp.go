package soft

import (
	"fmt"
	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// The RC responder (rxe_resp.c's job): a gate of checks on each request
// (PSN, opcode sequence, QP access, resources, length, R_Key), then
// execution: SEND data into the receive WQE, RDMA WRITE into the MR the
// R_Key names, RDMA READ responses, atomics with a replay cache for
// duplicates. ACKs are coalesced: a request asking for one leaves it
// pending and the transmit batch sends one per QP at its end. rqMu is held.

// msgKind is the multi-packet message the responder is in the middle of.
type msgKind uint8

const (
	msgNone msgKind = iota
	msgSend
	msgWrite
)

// respRes is one entry of the responder's READ/atomic resources
// (max_dest_rd_atomic of them), kept to answer duplicates (IBA 9.7.5.1.2).
type respRes struct {
	valid    bool
	atomic   bool
	firstPSN roce.PSN
	lastPSN  roce.PSN
	va       uint64
	rkey     uint32
	length   uint32
	orig     uint64
}

// respState is the responder's position.
type respState struct {
	psn     roce.PSN // expected PSN
	msn     uint32
	inMsg   msgKind
	sentNAK bool // a sequence NAK is out; no second until back in order
	commEst bool

	haveWQE bool // a receive WQE is being filled
	wqe     recvWQE
	segs    []seg
	wqeLen  uint64
	recvd   uint64

	wmr    *mr // the MR of the RDMA WRITE in progress (nil for 0 bytes)
	wrkey  uint32
	wva    uint64
	wresid uint64
	wlen   uint32

	res     []respRes
	resNext int
	readSeg [1]seg
	reads   readFIFO // READ responses still to send (wire only)

	ackPending bool
	ackPSN     roce.PSN
	gotoError  bool
	errEvent   hostverbs.EventType
}

// respondRC runs one request through the gate and executes it.
func (q *qp) respondRC(tx *txBatch, p *packet) {
	r := &q.resp
	d := p.psn.Diff(r.psn)
	if d > 0 {
		// Class B (IBA 9.9.3.1.2): one NAK, then silence until in order.
		q.dev.ctrs.inc(cntRxOutOfSeq)
		if !r.reads.empty() {
			// The NAK would overtake the queued READ responses: it
			// goes after them.
			r.reads.held = true
			return
		}
		if !r.sentNAK {
			r.sentNAK = true
			q.dev.ctrs.inc(cntTxNAKSeq)
			q.respAck(tx, roce.NAKPSNSequenceError, r.psn)
		}
		return
	}
	if d < 0 {
		q.respDuplicate(tx, p)
		return
	}
	if !r.reads.empty() && !p.info.Has(roce.MaskRead) {
		q.holdBehindReads()
		return
	}
	r.sentNAK = false
	if q.state == hostverbs.QPStateRTR && !r.commEst {
		r.commEst = true
		q.dev.event(hostverbs.EventCommEst, q.ctx, q.qpn)
	}
	info := p.info
	// Opcode sequence (IBA 9.7.5.2.2).
	switch r.inMsg {
	case msgSend:
		if !info.Has(roce.MaskSend) || info.Has(roce.MaskStart) {
			q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
			return
		}
	case msgWrite:
		if !info.Has(roce.MaskWrite) || info.Has(roce.MaskStart) {
			q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
			return
		}
	default:
		if !info.Has(roce.MaskStart) {
			q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
			return
		}
	}
	// The QP must allow the operation (IBA 10.2.4 access flags).
	acc := q.attr.AccessFlags
	if (info.Has(roce.MaskWrite) && acc&hostverbs.AccessRemoteWrite == 0) ||
		(info.Has(roce.MaskRead) && acc&hostverbs.AccessRemoteRead == 0) ||
		(info.Has(roce.MaskAtomic) && acc&hostverbs.AccessRemoteAtomic == 0) ||
		(info.Any(roce.MaskRead|roce.MaskAtomic) && q.attr.MaxDestRdAtomic == 0) {
		q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
		return
	}
	// Packet lengths against the path MTU (IBA 9.7.5.2.3); an in-process
	// message travels as one packet.
	if !p.local && info.Has(roce.MaskPayload) {
		mtu := uint32(q.mtu)
		switch {
		case info.Has(roce.MaskStart | roce.MaskEnd):
			if p.n > mtu {
				q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
				return
			}
		case info.Any(roce.MaskStart | roce.MaskMiddle):
			if p.n != mtu {
				q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
				return
			}
		default:
			if p.n == 0 || p.n > mtu {
				q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
				return
			}
		}
	}
	switch {
	case info.Has(roce.MaskSend):
		q.respSend(tx, p)
	case info.Has(roce.MaskWrite):
		q.respWrite(tx, p)
	case info.Has(roce.MaskRead):
		q.respRead(tx, p)
	case info.Has(roce.MaskAtomic):
		q.respAtomic(tx, p)
	}
}

// takeRecvWQE makes the next receive WQE current; ok false means none
// (RNR). done means the packet is dealt with and the caller stops: a WQE
// whose SGL fails the local checks is a class A error, and a request that
// needs a receive of a frozen SRQ (SaveRecvs) is dropped as if lost,
// nothing changed, so that the peer resends it to the next process.
func (q *qp) takeRecvWQE(tx *txBatch, p *packet) (ok, done bool) {
	r := &q.resp
	if r.haveWQE {
		return true, false
	}
	var got bool
	if q.srq != nil {
		var frozen bool
		if got, frozen = q.srq.take(&r.wqe); frozen {
			q.dev.ctrs.inc(cntDropSRQHandedOver)
			return false, true
		}
	} else {
		got = q.rq.take(&r.wqe)
	}
	if !got {
		return false, false
	}
	r.haveWQE = true
	segs, total, err := resolveSGL(q.dev, q.pd, r.wqe.sgl, hostverbs.AccessLocalWrite, r.segs[:0])
	r.segs = segs
	if err != nil {
		q.dev.lim.Debug("recv-local-access", "recv wqe: local access", "qpn", q.qpn, "err", err)
		q.respError(tx, p, roce.NAKRemoteOperation, hostverbs.WCLocProtErr, hostverbs.EventQPFatal)
		return false, true
	}
	r.wqeLen = total
	r.recvd = 0
	return true, false
}

// sendRNRNAK answers a request that needs a receive WQE when there is none.
func (q *qp) sendRNRNAK(tx *txBatch, p *packet) {
	q.dev.ctrs.inc(cntTxRNRNAK)
	q.respAck(tx, roce.RNRNAK(q.attr.MinRNRTimer), p.psn)
}

func (q *qp) respSend(tx *txBatch, p *packet) {
	r := &q.resp
	ok, done := q.takeRecvWQE(tx, p)
	if done {
		return
	}
	if !ok {
		q.sendRNRNAK(tx, p)
		return
	}
	if r.recvd+uint64(p.n) > r.wqeLen {
		q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCLocLenErr, hostverbs.EventQPReqErr)
		return
	}
	if err := p.copyPayloadTo(tx, r.segs, r.recvd); err != nil {
		if q.sourceFault(p, err) {
			return
		}
		q.respError(tx, p, roce.NAKRemoteOperation, hostverbs.WCLocProtErr, hostverbs.EventQPFatal)
		return
	}
	r.recvd += uint64(p.n)
	r.psn = p.psn.Add(1)
	if !p.info.Has(roce.MaskEnd) {
		r.inMsg = msgSend
		q.ackIfAsked(tx, p)
		return
	}
	r.inMsg = msgNone
	r.msn++
	if p.info.Has(roce.MaskIETH) {
		// SEND with invalidate (IBA 10.6.7.2.4): the key must be a
		// fast-reg MR's of this QP's PD; it is free before the receive
		// completes (with the key in the completion).
		if err := q.dev.remoteInvalidate(q.pd, p.iethKey); err != nil {
			q.dev.ctrs.inc(cntRemoteInvalidateRefused)
			q.dev.lim.Warn("remote-invalidate", "SEND with invalidate refused", "qpn", q.qpn, "key", fmt.Sprintf("%#x", p.iethKey), "err", err)
			q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
			return
		}
		q.dev.ctrs.inc(cntRemoteInvalidations)
	}
	r.haveWQE = false
	q.completeRecv(&r.wqe, hostverbs.WCSuccess, p, uint32(r.recvd))
	q.ackIfAsked(tx, p)
}

func (q *qp) respWrite(tx *txBatch, p *packet) {
	r := &q.resp
	info := p.info
	if info.Has(roce.MaskStart) {
		if p.dmaLen > maxMsgSize {
			q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
			return
		}
		r.wmr = nil
		if p.dmaLen > 0 {
			m := q.checkRKey(p.rkey, p.va, uint64(p.dmaLen), hostverbs.AccessRemoteWrite)
			if m == nil {
				q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
				return
			}
			r.wmr, r.wrkey = m, p.rkey
		}
		r.wva, r.wresid, r.wlen = p.va, uint64(p.dmaLen), p.dmaLen
	} else if r.wmr != nil && q.dev.keys.lookup(r.wrkey) != r.wmr {
		// Deregistered since the first packet: the rest may not land.
		q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
		return
	}
	n := uint64(p.n)
	if n > r.wresid || (info.Has(roce.MaskEnd) && n != r.wresid) {
		q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
		return
	}
	if info.Has(roce.MaskRecvWQE) {
		ok, done := q.takeRecvWQE(tx, p)
		if done {
			return
		}
		if !ok {
			q.sendRNRNAK(tx, p)
			return
		}
	}
	if n > 0 {
		// The copy holds the registration: an invalidation waits for it,
		// and one that came first fails it (mraccess.go).
		if !r.wmr.enter() {
			q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
			return
		}
		r.readSeg[0] = seg{mr: r.wmr, iova: r.wva, n: n, guard: true}
		err := p.copyPayloadTo(tx, r.readSeg[:], 0)
		r.wmr.leave()
		if err != nil {
			if q.sourceFault(p, err) {
				return
			}
			q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
			return
		}
	}
	r.wva += n
	r.wresid -= n
	r.psn = p.psn.Add(1)
	if !info.Has(roce.MaskEnd) {
		r.inMsg = msgWrite
		q.ackIfAsked(tx, p)
		return
	}
	r.inMsg = msgNone
	r.msn++
	if info.Has(roce.MaskRecvWQE) {
		r.haveWQE = false
		q.completeRecv(&r.wqe, hostverbs.WCSuccess, p, r.wlen)
	}
	q.ackIfAsked(tx, p)
}

// sourceFault reports (and counts) a packet delivered in process whose
// payload could not be read from the sender's memory: the sending VM is
// being torn down (its RAM unmapped mid-transfer). The packet is dropped as
// if lost on the wire: the sender's own QP times out and fails, and the
// receiving QP, which did nothing wrong, is left as it was.
func (q *qp) sourceFault(p *packet, err error) bool {
	if !p.local || !guestmem.IsSourceFault(err) {
		return false
	}
	q.dev.ctrs.inc(cntDropSourceFault)
	return true
}

// checkRKey resolves an R_Key in this device and checks PD, access and
// range; nil means a remote access error.
func (q *qp) checkRKey(rkey uint32, va, n uint64, want hostverbs.Access) *mr {
	m := q.dev.keys.lookup(rkey)
	if m == nil || m.pd != q.pd || m.check(va, n, want) != nil {
		q.rejectRKey(rkey, va, n, want, m)
		return nil
	}
	return m
}

// rejectRKey counts and logs (rate-limited) why an incoming rkey was
// refused: the operator's trace of a remote access error.
func (q *qp) rejectRKey(rkey uint32, va, n uint64, want hostverbs.Access, m *mr) {
	q.dev.ctrs.inc(cntRKeyRejected)
	var why string
	switch {
	case m == nil:
		why = "no MR has this key"
		if s := q.dev.keys.slot(rkey); s != nil && s.fr != nil {
			switch {
			case s.free:
				why = "fast-reg MR invalidated (free)"
			case s.key != rkey:
				why = fmt.Sprintf("fast-reg MR registered under key %#x (another consumer byte)", s.key)
			}
		}
	case m.pd != q.pd:
		why = "MR of another PD"
	default:
		why = m.check(va, n, want).Error()
	}
	q.dev.lim.Warn("rkey-rejected", "remote access refused", "qpn", q.qpn, "rkey", fmt.Sprintf("%#x", rkey),
		"va", fmt.Sprintf("%#x", va), "len", n, "access", fmt.Sprintf("%#x", uint32(want)), "why", why)
}

// newRes takes the next resource slot (the requester is responsible for
// not exceeding max_dest_rd_atomic; the oldest entry is recycled).
func (q *qp) newRes() *respRes {
	r := &q.resp
	if len(r.res) == 0 {
		return nil
	}
	res := &r.res[r.resNext]
	r.resNext = (r.resNext + 1) % len(r.res)
	*res = respRes{valid: true}
	return res
}

func (q *qp) readPackets(p *packet, length uint32) uint32 {
	if p.local || length == 0 {
		return 1
	}
	return uint32((uint64(length) + q.mtu - 1) / q.mtu)
}

func (q *qp) respRead(tx *txBatch, p *packet) {
	r := &q.resp
	if p.dmaLen > maxMsgSize {
		q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
		return
	}
	var m *mr
	if p.dmaLen > 0 {
		if m = q.checkRKey(p.rkey, p.va, uint64(p.dmaLen), hostverbs.AccessRemoteRead); m == nil {
			q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
			return
		}
	}
	npkts := q.readPackets(p, p.dmaLen)
	j := readJob{m: m, rkey: p.rkey, psn: p.psn, va: p.va, length: p.dmaLen, npkts: npkts}
	if p.local {
		q.acceptRead(p, npkts)
		q.flushAckLocked(tx)
		q.sendReadRange(tx, &j, npkts, localMTU)
		return
	}
	if r.reads.full() {
		// More READs than max_dest_rd_atomic queued: take it again
		// once the queue has drained.
		q.holdBehindReads()
		return
	}
	q.acceptRead(p, npkts)
	q.queueRead(tx, j)
}

// acceptRead counts a READ as executed and keeps it for duplicates.
func (q *qp) acceptRead(p *packet, npkts uint32) {
	r := &q.resp
	r.msn++ // C9-148: a READ counts when it is accepted
	if res := q.newRes(); res != nil {
		res.firstPSN, res.lastPSN = p.psn, p.psn.Add(npkts-1)
		res.va, res.rkey, res.length = p.va, p.rkey, p.dmaLen
	}
	r.psn = p.psn.Add(npkts)
}

// holdBehindReads drops an in-order request that must wait for the queued
// READ responses; the requester is told to resend it once they are out.
func (q *qp) holdBehindReads() {
	q.dev.ctrs.inc(cntRxHeldBehindRead)
	q.resp.reads.held = true
}

func (q *qp) respAtomic(tx *txBatch, p *packet) {
	r := &q.resp
	if p.va&7 != 0 {
		q.respError(tx, p, roce.NAKInvalidRequest, hostverbs.WCRemInvReqErr, hostverbs.EventQPReqErr)
		return
	}
	m := q.checkRKey(p.rkey, p.va, 8, hostverbs.AccessRemoteAtomic)
	if m == nil || !m.enter() {
		q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
		return
	}
	gpa, err := m.pages.Translate(p.va)
	var orig uint64
	if err == nil {
		if p.op == roce.RCCompareSwap {
			orig, err = m.mem.CompareAndSwapUint64(guestmem.GPA(gpa), p.compare, p.swapAdd)
		} else {
			orig, err = m.mem.FetchAddUint64(guestmem.GPA(gpa), p.swapAdd)
		}
	}
	m.leave()
	if err != nil {
		q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
		return
	}
	if res := q.newRes(); res != nil {
		res.atomic = true
		res.firstPSN, res.lastPSN = p.psn, p.psn
		res.orig = orig
	}
	r.msn++
	r.psn = p.psn.Add(1)
	q.sendAtomicAck(tx, p.psn, orig)
}

func (q *qp) sendAtomicAck(tx *txBatch, psn roce.PSN, orig uint64) {
	q.flushAckLocked(tx)
	var a packet
	q.fillNet(&a)
	a.op = roce.RCAtomicAcknowledge
	a.info = a.op.Info()
	a.psn = psn
	a.syn, a.msn, a.orig = roce.SyndromeACKUnlimited, q.resp.msn, orig
	q.emitToPeer(tx, &a)
}

// respDuplicate answers a request with an old PSN (IBA 9.7.5.2.1, C9-105):
// SEND and WRITE are re-acknowledged; READ is replayed from memory; an
// atomic gets its saved result, never a second execution.
func (q *qp) respDuplicate(tx *txBatch, p *packet) {
	r := &q.resp
	q.dev.ctrs.inc(cntRxDupRequest)
	info := p.info
	switch {
	case info.Any(roce.MaskSend | roce.MaskWrite):
		if !r.reads.empty() {
			q.dev.ctrs.inc(cntRxHeldBehindRead)
			r.reads.heldDup = true
			return
		}
		q.pendAck(tx, r.psn.Sub(1))
	case info.Has(roce.MaskRead):
		res := q.findRes(p.psn, false)
		if res == nil || p.rkey != res.rkey || p.va < res.va ||
			p.va+uint64(p.dmaLen) > res.va+uint64(res.length) || p.va+uint64(p.dmaLen) < p.va {
			q.dev.ctrs.inc(cntDropDupRead)
			return
		}
		var m *mr
		if p.dmaLen > 0 {
			if m = q.checkRKey(p.rkey, p.va, uint64(p.dmaLen), hostverbs.AccessRemoteRead); m == nil {
				// The READ was executed, but its key died since (an
				// invalidation or deregistration, possibly in the middle
				// of its responses): a remote access error, as for a new
				// READ (rxe answers a replay the same way), rather than
				// silence the requester would retry until it gives up.
				q.respError(tx, p, roce.NAKRemoteAccess, hostverbs.WCRemAccessErr, hostverbs.EventQPAccessErr)
				return
			}
		}
		npkts := q.readPackets(p, p.dmaLen)
		j := readJob{m: m, rkey: p.rkey, psn: p.psn, va: p.va, length: p.dmaLen, npkts: npkts, replay: true}
		if p.local {
			q.flushAckLocked(tx)
			q.sendReadRange(tx, &j, npkts, localMTU)
			return
		}
		q.replayRead(tx, j)
	case info.Has(roce.MaskAtomic):
		if !r.reads.empty() {
			// Its saved result would overtake the queued READ
			// responses; the requester asks again.
			q.dev.ctrs.inc(cntRxHeldBehindRead)
			return
		}
		res := q.findRes(p.psn, true)
		if res == nil || res.firstPSN != p.psn {
			q.dev.ctrs.inc(cntDropDupRead)
			return
		}
		q.sendAtomicAck(tx, p.psn, res.orig)
	}
}

func (q *qp) findRes(psn roce.PSN, atomic bool) *respRes {
	for i := range q.resp.res {
		res := &q.resp.res[i]
		if res.valid && res.atomic == atomic && psn.InRange(res.firstPSN, res.lastPSN) {
			return res
		}
	}
	return nil
}

// respError handles a class A or C responder error: NAK, the current
// receive WQE completes with st, and the QP goes to ERR once the responder
// lets go of it.
func (q *qp) respError(tx *txBatch, p *packet, syn roce.Syndrome, st hostverbs.WCStatus, ev hostverbs.EventType) {
	r := &q.resp
	switch syn {
	case roce.NAKInvalidRequest:
		q.dev.ctrs.inc(cntTxNAKInvalid)
	case roce.NAKRemoteAccess:
		q.dev.ctrs.inc(cntTxNAKAccess)
	default:
		q.dev.ctrs.inc(cntTxNAKOperation)
	}
	q.respAck(tx, syn, p.psn)
	if r.haveWQE {
		r.haveWQE = false
		q.completeRecv(&r.wqe, st, nil, 0)
	}
	r.gotoError = true
	r.errEvent = ev
}

// respAck emits an ACK or NAK now (after any pending ACK).
func (q *qp) respAck(tx *txBatch, syn roce.Syndrome, psn roce.PSN) {
	q.flushAckLocked(tx)
	var a packet
	q.fillNet(&a)
	a.op = roce.RCAcknowledge
	a.info = a.op.Info()
	a.psn = psn
	a.syn, a.msn = syn, q.resp.msn
	q.emitToPeer(tx, &a)
}

func (q *qp) ackIfAsked(tx *txBatch, p *packet) {
	if p.ackReq {
		q.pendAck(tx, p.psn)
	}
}

// pendAck leaves an ACK for psn pending; the batch sends one per QP.
func (q *qp) pendAck(tx *txBatch, psn roce.PSN) {
	r := &q.resp
	if !r.ackPending {
		r.ackPending = true
		tx.acks = append(tx.acks, q)
	} else if !psn.After(r.ackPSN) {
		return
	}
	r.ackPSN = psn
}

// flushAckLocked sends the pending ACK, if any (rqMu held).
func (q *qp) flushAckLocked(tx *txBatch) {
	r := &q.resp
	if !r.ackPending {
		return
	}
	r.ackPending = false
	var a packet
	q.fillNet(&a)
	a.op = roce.RCAcknowledge
	a.info = a.op.Info()
	a.psn = r.ackPSN
	a.syn, a.msn = roce.SyndromeACKUnlimited, r.msn
	q.emitToPeer(tx, &a)
}

// sendPendingAck is the batch's end-of-work call for a QP with an ACK
// pending.
func (q *qp) sendPendingAck(tx *txBatch) {
	q.rqMu.Lock()
	if !q.dead && q.state != hostverbs.QPStateErr && q.state != hostverbs.QPStateReset {
		q.flushAckLocked(tx)
	}
	q.resp.ackPending = false
	q.rqMu.Unlock()
}
