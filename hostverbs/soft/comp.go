package soft

import (
	"encoding/binary"
	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// The completer (rxe_comp.c's job): it matches ACKs, NAKs, RDMA READ
// responses and atomic ACKs to send WQEs in order, places READ data and
// atomic results in local memory, completes WQEs, and drives
// retransmission: go-back-N on a PSN sequence NAK, an implied NAK (a
// response that skips an outstanding READ or atomic) or a local ACK
// timeout, and RNR NAK waits. sqMu is held unless stated.

// compState is the completer's position.
type compState struct {
	psn          roce.PSN // oldest PSN not yet acknowledged
	retryCnt     uint8
	rnrRetry     uint8
	startedRetry bool // a go-back-N is under way; wait for progress
	rtoArmed     bool
	deadline     time.Time
}

// infiniteRNRRetry: an rnr_retry of 7 retries forever (IBA 9.7.5.2.8).
const infiniteRNRRetry = 7

func (q *qp) resetRetries() {
	q.comp.retryCnt = q.attr.RetryCnt
	q.comp.rnrRetry = q.attr.RNRRetry
	q.comp.startedRetry = false
}

// progress records that responses advanced the oldest unacked PSN to psn.
func (q *qp) progress(psn roce.PSN) {
	if psn.After(q.comp.psn) {
		q.comp.psn = psn
	}
	q.resetRetries()
	q.comp.deadline = q.dev.f.clock.Now().Add(roce.LocalACKTimeout(q.attr.Timeout))
}

// receiveResponse handles one response packet for this QP.
func (q *qp) receiveResponse(tx *txBatch, p *packet) {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	if q.dead || (q.state != hostverbs.QPStateRTS && q.state != hostverbs.QPStateSQD) {
		q.dev.ctrs.inc(cntDropQPState)
		return
	}
	if q.frozen.Load() {
		q.dev.ctrs.inc(cntDropHandedOver)
		return
	}
	if p.src != q.attr.AV.DGID || p.dst != q.sgid {
		q.dev.ctrs.inc(cntDropAddress)
		return
	}
	if p.ce {
		q.notifyCongestion(tx)
	}
	q.complete(tx, p)
	if q.state != hostverbs.QPStateErr {
		q.reqRun(tx)
	}
	q.checkSQDrained()
}

// checkSQDrained reports EventSQDrained once the work started before an
// RTS -> SQD transition has completed (IBA 11.6.3, affiliated event).
func (q *qp) checkSQDrained() {
	if q.state == hostverbs.QPStateSQD && q.attr.EnSQDAsyncNotify && !q.req.sqdNotified && !q.outstanding() {
		q.req.sqdNotified = true
		q.dev.event(hostverbs.EventSQDrained, q.ctx, q.qpn)
	}
}

func (q *qp) complete(tx *txBatch, p *packet) {
	info := p.info
	// A PSN sequence NAK names the responder's expected PSN: at most one
	// past what we sent, which says that it has everything (a responder
	// whose transport state was restored after a hand-over sends one at
	// once, RestoreTransport). Any other response names a PSN we sent.
	nakAll := p.psn == q.req.sentHigh && p.op == roce.RCAcknowledge && p.syn == roce.NAKPSNSequenceError
	if !p.psn.Before(q.req.sentHigh) && !nakAll {
		q.dev.ctrs.inc(cntDropResponse) // responds to nothing we sent
		return
	}
	var w *sendWQE
	// Responses beyond a SEND/WRITE acknowledge it implicitly (ACKs are
	// cumulative, IBA 9.7.5.1.1); beyond a READ or atomic they mean its
	// response was lost.
	for {
		if q.sq.head == q.sq.tail {
			q.dev.ctrs.inc(cntDropResponse)
			return
		}
		w = q.sq.at(q.sq.head)
		if w.state == wqePosted {
			q.dev.ctrs.inc(cntDropResponse)
			return
		}
		if !p.psn.After(w.lastPSN) {
			break
		}
		if w.isReadOrAtomic() {
			q.retry(tx, q.comp.psn, false)
			return
		}
		q.progress(w.lastPSN.Add(1))
		q.completeSendHead(hostverbs.WCSuccess)
	}
	if p.psn.Before(q.comp.psn) {
		q.dev.ctrs.inc(cntDropResponse) // a duplicate
		return
	}
	if p.psn.After(q.comp.psn) && w.isReadOrAtomic() && info.Any(roce.MaskRead|roce.MaskAtomic) {
		// Read responses arrive in order: one is missing.
		q.retry(tx, q.comp.psn, false)
		return
	}
	switch {
	case info.Has(roce.MaskRead):
		q.compReadResponse(tx, p, w)
	case info.Has(roce.MaskAtomic):
		q.compAtomicAck(p, w)
	default:
		q.compAck(tx, p, w)
	}
}

func (q *qp) compReadResponse(tx *txBatch, p *packet, w *sendWQE) {
	info := p.info
	if w.wr.Opcode != hostverbs.WRRDMARead ||
		(info.Has(roce.MaskAETH) && p.syn.Type() != roce.SyndromeACK) {
		q.failHead(w, hostverbs.WCBadRespErr)
		return
	}
	idx := p.psn.Distance(w.firstPSN)
	off := uint64(idx) * w.mtu
	if off > w.length {
		q.failHead(w, hostverbs.WCBadRespErr)
		return
	}
	want := min(w.mtu, w.length-off)
	last := off+want == w.length
	// A READ may have been requested in parts (window-sized requests, or
	// a retry of the rest): a part ends with a full-MTU LAST packet, the
	// data's true end must be a LAST or ONLY packet.
	if uint64(p.n) != want || (last && !info.Has(roce.MaskEnd)) || idx != w.readNext {
		q.failHead(w, hostverbs.WCBadRespErr)
		return
	}
	if err := p.copyPayloadTo(tx, w.segs, off); err != nil {
		// In process, an unreadable source is the responder's memory:
		// a remote failure, not ours.
		st := hostverbs.WCLocProtErr
		if p.local && guestmem.IsSourceFault(err) {
			st = hostverbs.WCRemAccessErr
		}
		q.failHead(w, st)
		return
	}
	w.readNext = idx + 1
	q.progress(p.psn.Add(1))
	if last {
		q.completeSendHead(hostverbs.WCSuccess)
	}
}

func (q *qp) compAtomicAck(p *packet, w *sendWQE) {
	if !w.isAtomic() || p.syn.Type() != roce.SyndromeACK || p.psn != w.firstPSN {
		q.failHead(w, hostverbs.WCBadRespErr)
		return
	}
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], p.orig)
	if err := scatter(w.segs, 0, b[:]); err != nil {
		q.failHead(w, hostverbs.WCLocProtErr)
		return
	}
	q.progress(p.psn.Add(1))
	q.completeSendHead(hostverbs.WCSuccess)
}

func (q *qp) compAck(tx *txBatch, p *packet, w *sendWQE) {
	switch p.syn.Type() {
	case roce.SyndromeACK:
		if w.isReadOrAtomic() {
			// An ACK never completes a READ or atomic; this one is a
			// duplicate's re-acknowledgement.
			q.dev.ctrs.inc(cntDropResponse)
			return
		}
		q.progress(p.psn.Add(1))
		if p.psn == w.lastPSN {
			q.completeSendHead(hostverbs.WCSuccess)
		}
	case roce.SyndromeRNRNAK:
		q.dev.ctrs.inc(cntRxRNRNAK)
		if p.psn.After(q.comp.psn) {
			// Everything before the NAKed request arrived: progress.
			q.progress(p.psn)
		}
		if q.comp.rnrRetry == 0 {
			q.dev.ctrs.inc(cntRNRRetryExceeded)
			q.failHead(w, hostverbs.WCRNRRetryExcErr)
			return
		}
		if q.comp.rnrRetry != infiniteRNRRetry {
			q.comp.rnrRetry--
		}
		q.req.waitRNR = true
		q.req.rnrPSN = p.psn
		q.comp.rtoArmed = false
		q.rto.Stop()
		q.rnr.Reset(roce.RNRTimer(p.syn.Value()))
	case roce.SyndromeNAK:
		switch p.syn {
		case roce.NAKPSNSequenceError:
			q.dev.ctrs.inc(cntRxNAKSeq)
			if w.isReadOrAtomic() {
				// The responder has the requests before p.psn, but the
				// head's READ responses or atomic result are not here:
				// a NAK acknowledges no response data. Ask again from
				// the oldest missing one (a duplicate the responder
				// answers from its resources).
				q.retry(tx, q.comp.psn, false)
				return
			}
			if p.psn.After(q.comp.psn) {
				// The NAK acknowledges everything before its PSN: that
				// is progress, and a new gap deserves its own retry.
				q.progress(p.psn)
			}
			q.retry(tx, p.psn, false)
		case roce.NAKInvalidRequest:
			q.dev.ctrs.inc(cntRxNAKError)
			q.failHead(w, hostverbs.WCRemInvReqErr)
		case roce.NAKRemoteAccess:
			q.dev.ctrs.inc(cntRxNAKError)
			q.failHead(w, hostverbs.WCRemAccessErr)
		default:
			q.dev.ctrs.inc(cntRxNAKError)
			q.failHead(w, hostverbs.WCRemOpErr)
		}
	default:
		q.dev.ctrs.inc(cntDropResponse)
	}
}

// failHead completes the head WQE with st and moves the QP to ERR, which
// flushes the rest.
func (q *qp) failHead(w *sendWQE, st hostverbs.WCStatus) {
	w.state, w.status = wqeError, st
	q.enterErrorLocked()
}

// retry goes back to psn and retransmits from there, unless a retry is
// already under way (and this is not a timeout) or the retry count is
// exhausted, which fails the head WQE with RETRY_EXC_ERR.
func (q *qp) retry(tx *txBatch, psn roce.PSN, timeout bool) {
	if q.comp.startedRetry && !timeout {
		return
	}
	if q.sq.head == q.sq.tail {
		return
	}
	if q.comp.retryCnt == 0 {
		q.dev.ctrs.inc(cntRetryExceeded)
		q.failHead(q.sq.at(q.sq.head), hostverbs.WCRetryExcErr)
		return
	}
	q.comp.retryCnt--
	q.comp.startedRetry = true
	q.rewind(psn)
	q.reqRun(tx)
}

// rewind makes the requester resend from psn: the started WQE containing
// it resumes at that packet (a READ re-requests the remaining data), and
// every later started WQE is resent whole.
func (q *qp) rewind(psn roce.PSN) {
	found := false
	for i := q.sq.head; i != q.sq.tail; i++ {
		w := q.sq.at(i)
		if w.state == wqePosted {
			break
		}
		if !found {
			if !psn.InRange(w.firstPSN, w.lastPSN) {
				continue
			}
			found = true
			q.sq.next = i
			w.nextPkt = psn.Distance(w.firstPSN)
			if w.wr.Opcode == hostverbs.WRRDMARead {
				w.readNext = w.nextPkt
			}
		} else {
			w.nextPkt, w.readNext = 0, 0
		}
		if w.state == wqeSent {
			w.state = wqeSending
		}
	}
}

// armRTO starts the local ACK timer if work is outstanding.
func (q *qp) armRTO() {
	to := roce.LocalACKTimeout(q.attr.Timeout)
	if to == 0 || q.req.waitRNR || !q.outstanding() {
		return
	}
	if !q.comp.rtoArmed {
		q.comp.rtoArmed = true
		q.comp.deadline = q.dev.f.clock.Now().Add(to)
		q.rto.Reset(to)
	}
}

// onRTO runs when the local ACK timer fires (no lock held).
func (q *qp) onRTO() {
	f := q.dev.f
	tx := f.getTx()
	q.sqMu.Lock()
	q.rtoFired(tx)
	q.sqMu.Unlock()
	tx.flush()
	f.putTx(tx)
}

func (q *qp) rtoFired(tx *txBatch) {
	q.comp.rtoArmed = false
	if q.dead || (q.state != hostverbs.QPStateRTS && q.state != hostverbs.QPStateSQD) ||
		q.req.waitRNR || !q.outstanding() {
		return
	}
	if now := q.dev.f.clock.Now(); now.Before(q.comp.deadline) {
		// Progress moved the deadline: sleep until it.
		q.comp.rtoArmed = true
		q.rto.Reset(q.comp.deadline.Sub(now))
		return
	}
	q.dev.ctrs.inc(cntRetransmitTimeout)
	q.retry(tx, q.comp.psn, true)
	if q.state != hostverbs.QPStateErr {
		q.armRTO()
	}
}

// onRNRTimer resumes transmission after an RNR NAK wait (no lock held).
// pacedOK reports whether the pacer lets the next packet go now; if not,
// it arms the pacing timer (sqMu held).
func (q *qp) pacedOK() bool {
	d := q.cc.wait(&q.dev.f.cc, q.dev.f.clock.Now())
	if d <= 0 {
		return true
	}
	if !q.paceArmed {
		q.paceArmed = true
		q.pace.Reset(d)
	}
	return false
}

// onPace runs when the pacing timer fires: the requester goes on.
func (q *qp) onPace() {
	f := q.dev.f
	tx := f.getTx()
	q.sqMu.Lock()
	q.paceArmed = false
	if !q.dead {
		q.reqRun(tx)
	}
	q.sqMu.Unlock()
	tx.flush()
	f.putTx(tx)
}

// onCNP is the reaction point: a CNP from this QP's peer cuts its rate,
// at most once per RateReductionPeriod (later CNPs within it are counted,
// rx_cnp_coalesced). A CNP from anyone else is dropped: it must not slow
// a QP down; so is one the QP's traffic cannot have drawn (cnpSolicited:
// no ECN-capable packet to its peer in flight or within CNPWindow), a
// forgery or an answer too late to matter (rx_cnp_unsolicited).
func (q *qp) onCNP(p *packet) {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	cc := &q.dev.f.cc
	switch {
	case q.dead || cc.Disabled, q.frozen.Load():
	case q.state != hostverbs.QPStateRTS && q.state != hostverbs.QPStateSQD:
		q.dev.ctrs.inc(cntDropQPState)
	case p.src != q.attr.AV.DGID || p.dst != q.sgid:
		q.dev.ctrs.inc(cntDropAddress)
	default:
		now := q.dev.f.clock.Now()
		switch {
		case !q.cnpSolicited(now):
			q.dev.ctrs.inc(cntRxCNPUnsolicited)
		case !q.cc.onCNP(cc, now):
			q.dev.ctrs.inc(cntRxCNPCoalesced)
		}
	}
}

// cnpSolicited reports whether a CNP arriving at now can answer this QP's
// traffic: the QP has sent its peer ECN-capable packets, and either some
// of its requests are unacknowledged (they may sit in a congested queue
// however long) or the last of those packets left within CNPWindow.
// sqMu is held.
func (q *qp) cnpSolicited(now time.Time) bool {
	ect := q.ectSentAt.Load()
	if ect == 0 {
		return false
	}
	return q.comp.psn.Before(q.req.sentHigh) || now.UnixNano()-ect <= int64(q.dev.f.cc.CNPWindow)
}

// cnpTClass is the traffic class of CNPs: DSCP 48 (CS6), Not-ECT, as RoCE
// NICs send them by default, so that they are not marked themselves.
const cnpTClass = 48 << 2

// notifyCongestion is the notification point: a packet for this QP came
// marked CE, so the peer QP that sent it gets a CNP, at most one per
// CNPInterval. Either of the QP's locks is held (it reads the AV).
func (q *qp) notifyCongestion(tx *txBatch) {
	f := q.dev.f
	if f.cc.Disabled || q.isUD() {
		return
	}
	now := f.clock.Now().UnixNano()
	last := q.cnpSentAt.Load()
	if last != 0 && now-last < int64(f.cc.CNPInterval) {
		return
	}
	if !q.cnpSentAt.CompareAndSwap(last, now) {
		return
	}
	var c packet
	q.fillNet(&c)
	c.op = roce.CNP
	c.info = c.op.Info()
	c.tclass = cnpTClass
	c.becn = true
	q.dev.ctrs.inc(cntTxCNP)
	tx.emit(&c)
}

func (q *qp) onRNRTimer() {
	f := q.dev.f
	tx := f.getTx()
	q.sqMu.Lock()
	if !q.dead && q.req.waitRNR {
		q.req.waitRNR = false
		q.rewind(q.req.rnrPSN)
		q.reqRun(tx)
	}
	q.sqMu.Unlock()
	tx.flush()
	f.putTx(tx)
}
