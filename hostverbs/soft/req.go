package soft

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// The requester (rxe_req.c's job): it starts send WQEs in order, gives
// each its PSN range, segments it into packets of the path MTU and
// transmits as far as the window allows. It runs on whichever goroutine
// makes progress possible: the poster (PostSend), the receive loop (an
// ACK opened the window) or a timer (retransmission). sqMu is held.

// reqState is the requester's position.
type reqState struct {
	psn        roce.PSN // PSN of the next new packet
	sentHigh   roce.PSN // one past the highest PSN ever sent
	noAck      int      // packets since the last AckReq
	rdInFlight int      // READ/atomic WQEs started and not completed
	waitRNR    bool     // an RNR NAK timer is pending
	rnrPSN     roce.PSN // where to resume after it
	// sqdNotified: EventSQDrained was reported for the current SQD.
	sqdNotified bool
}

// ackEvery asks for an ACK at least every this many packets (rxe's
// RXE_MAX_PKT_PER_ACK), besides the last packet of each message.
const ackEvery = 64

// localMTU is the segment size of in-process messages: they travel whole.
const localMTU = 1 << 40

// readChunk is how many response packets the next READ request of w asks
// for: a large READ is requested a window at a time, so the responses to
// one request never exceed what the window lets through and the next
// request goes out as the responses arrive (IBA allows a requester to
// issue several RDMA READ requests for one work request's data; each is a
// complete READ of its own).
//
// Parts start at fixed multiples of the window from the WQE's first PSN, so
// a retry of the rest of a part asks for a subset of what the responder
// saw (a duplicate it can replay); and a part goes out only once the
// previous one is answered, so one READ never holds more than one of the
// responder's max_dest_rd_atomic resources.
func (q *qp) readChunk(w *sendWQE) uint32 {
	win := q.dev.f.window
	end := min(w.npkts, (w.nextPkt/win+1)*win)
	return end - w.nextPkt
}

// reqRun transmits what the send queue and the window allow.
func (q *qp) reqRun(tx *txBatch) {
	if q.state != hostverbs.QPStateRTS && q.state != hostverbs.QPStateSQD {
		return
	}
	if q.req.waitRNR || q.frozen.Load() {
		return
	}
	for q.sq.next != q.sq.tail {
		w := q.sq.at(q.sq.next)
		if w.state == wqePosted {
			if q.state == hostverbs.QPStateSQD || !q.reqStart(w) {
				break
			}
			if q.state == hostverbs.QPStateErr {
				return
			}
		}
		if !q.reqSend(tx, w) {
			break
		}
		q.sq.next++
		if q.isUD() {
			// UD has no acknowledgement: sent is done (IBA 9.8.3).
			q.completeSendHead(hostverbs.WCSuccess)
		}
	}
	if !q.isUD() {
		q.armRTO()
	}
}

// reqStart gives w its segmentation and PSNs. It returns false if w must
// wait (fence, read/atomic limit) or failed (the QP is then in ERR).
func (q *qp) reqStart(w *sendWQE) bool {
	rdAtomic := w.isReadOrAtomic()
	limit := max(int(q.attr.MaxRdAtomic), 1)
	if w.wr.Flags&hostverbs.SendFence != 0 && q.req.rdInFlight > 0 {
		return false
	}
	if rdAtomic && q.req.rdInFlight >= limit {
		return false
	}
	want := hostverbs.Access(0)
	if rdAtomic {
		want = hostverbs.AccessLocalWrite
	}
	segs, total, err := resolveSGL(q.dev, q.pd, w.wr.SGL, want, w.segs[:0])
	w.segs = segs
	if err != nil {
		q.dev.lim.Debug("send-local-access", "send wqe: local access", "qpn", q.qpn, "err", err)
		w.state, w.status = wqeError, hostverbs.WCLocProtErr
		q.enterErrorLocked()
		return false
	}
	w.length = total
	if w.isAtomic() {
		w.length = 8
	}
	var dgid hostverbs.GID
	if q.isUD() {
		dgid = w.wr.AV.DGID
		g, err := q.dev.sgid(w.wr.AV.SGIDIndex)
		if err != nil || (!q.dev.v1 && g.IsV4() != dgid.IsV4()) || dgid.IsZero() {
			w.state, w.status = wqeError, hostverbs.WCLocQPOpErr
			q.enterErrorLocked()
			return false
		}
		w.sgid = g
	} else {
		dgid = q.attr.AV.DGID
		w.sgid = q.sgid
	}
	w.local = q.dev.f.isLocal(dgid)
	w.mtu = q.mtu
	if w.local {
		w.mtu = localMTU
	}
	w.npkts = 1
	if !q.isUD() && !w.isAtomic() && w.length > w.mtu {
		w.npkts = uint32((w.length + w.mtu - 1) / w.mtu)
	}
	if !q.isUD() && !q.outstanding() {
		// Nothing was in flight: the local ACK timeout counts from now,
		// not from the last progress.
		q.comp.deadline = q.dev.f.clock.Now().Add(roce.LocalACKTimeout(q.attr.Timeout))
	}
	w.firstPSN = q.req.psn
	w.lastPSN = q.req.psn.Add(w.npkts - 1)
	q.req.psn = q.req.psn.Add(w.npkts)
	w.nextPkt, w.readNext = 0, 0
	w.state = wqeSending
	if rdAtomic {
		w.rdAtomic = true
		q.req.rdInFlight++
	}
	return true
}

// reqSend transmits w's remaining packets; false if the window is full.
func (q *qp) reqSend(tx *txBatch, w *sendWQE) bool {
	for w.nextPkt < w.npkts {
		if w.wr.Opcode == hostverbs.WRRDMARead && w.nextPkt > w.readNext {
			return false // the previous part is still being answered
		}
		psn := w.firstPSN.Add(w.nextPkt)
		if !q.isUD() && psn.Distance(q.comp.psn) >= q.dev.f.window {
			return false
		}
		if q.cc.limited && !q.pacedOK() {
			return false
		}
		q.reqPacket(tx, w, w.nextPkt)
		if q.cc.limited {
			off := uint64(w.nextPkt) * w.mtu
			q.cc.sent(&q.dev.f.cc, q.dev.f.clock.Now(), int(min(w.mtu, w.length-min(off, w.length)))+pktOverhead)
		}
		high := psn
		if w.wr.Opcode == hostverbs.WRRDMARead {
			// The request stands for all its response PSNs.
			high = psn.Add(q.readChunk(w) - 1)
		}
		if psn.Before(q.req.sentHigh) {
			q.dev.ctrs.inc(cntRetransmitPackets)
		}
		if !high.Before(q.req.sentHigh) {
			q.req.sentHigh = high.Add(1)
		}
		if w.wr.Opcode == hostverbs.WRRDMARead {
			w.nextPkt += q.readChunk(w)
		} else {
			w.nextPkt++
		}
	}
	w.state = wqeSent
	return true
}

// fillNet sets the addressing of a packet of this RC QP (either direction
// of the connection uses the QP's address vector).
func (q *qp) fillNet(p *packet) {
	av := &q.attr.AV
	p.src = q.sgid
	p.dst = av.DGID
	q.fillNetAV(p, av)
	p.dqpn = q.attr.DestQPN
}

// emitToPeer emits p, a packet of this RC QP to its peer, noting when one
// left ECN-capable: a CNP is taken only as an answer to such packets
// (onCNP). Either of the QP's locks is held.
func (q *qp) emitToPeer(tx *txBatch, p *packet) {
	if tx.emit(p) {
		q.ectSentAt.Store(q.dev.f.clock.Now().UnixNano())
	}
}

func (q *qp) fillNetAV(p *packet, av *hostverbs.AddressVector) {
	p.tclass = av.TrafficClass
	if p.tclass == 0 {
		p.tclass = q.dev.f.cfg.DefaultTOS
	}
	p.hopLimit = av.HopLimit
	if p.hopLimit == 0 {
		p.hopLimit = 64
	}
	p.flowLabel = av.FlowLabel
	p.srcPort = q.srcPort
	p.smac = q.dev.cfg.MAC
	p.v1 = q.dev.v1
	p.dmac = av.DMAC
	p.pkey = roce.DefaultPKey
}

// reqPacket builds and emits packet i of w.
func (q *qp) reqPacket(tx *txBatch, w *sendWQE, i uint32) {
	var p packet
	p.psn = w.firstPSN.Add(i)
	if q.isUD() {
		q.reqUDPacket(tx, w, &p)
		return
	}
	q.fillNet(&p)
	first, last := i == 0, i == w.npkts-1
	off := uint64(i) * w.mtu
	var n uint64
	if w.length > off {
		n = min(w.mtu, w.length-off)
	}
	wr := &w.wr
	switch wr.Opcode {
	case hostverbs.WRSend, hostverbs.WRSendWithImm:
		p.op = pick(first, last, roce.RCSendFirst, roce.RCSendMiddle, roce.RCSendLast, roce.RCSendOnly)
		if last && wr.Opcode == hostverbs.WRSendWithImm {
			p.op++ // SEND_LAST/ONLY_WITH_IMMEDIATE follow their plain opcode
			p.imm = wr.ImmData
		}
		p.se = last && wr.Flags&hostverbs.SendSolicited != 0
		p.segs, p.dataOff, p.n = w.segs, off, uint32(n)
	case hostverbs.WRSendWithInv:
		p.op = pick(first, last, roce.RCSendFirst, roce.RCSendMiddle, roce.RCSendLastInvalidate, roce.RCSendOnlyInvalidate)
		if last {
			p.iethKey = wr.ImmData // the rkey the responder invalidates
		}
		p.se = last && wr.Flags&hostverbs.SendSolicited != 0
		p.segs, p.dataOff, p.n = w.segs, off, uint32(n)
	case hostverbs.WRRDMAWrite, hostverbs.WRRDMAWriteWithImm:
		p.op = pick(first, last, roce.RCWriteFirst, roce.RCWriteMiddle, roce.RCWriteLast, roce.RCWriteOnly)
		if last && wr.Opcode == hostverbs.WRRDMAWriteWithImm {
			p.op++
			p.imm = wr.ImmData
			p.se = wr.Flags&hostverbs.SendSolicited != 0
		}
		if first {
			p.va, p.rkey, p.dmaLen = wr.RemoteAddr, wr.RKey, uint32(w.length)
		}
		p.segs, p.dataOff, p.n = w.segs, off, uint32(n)
	case hostverbs.WRRDMARead:
		p.op = roce.RCReadRequest
		n = min(uint64(q.readChunk(w))*w.mtu, w.length-min(off, w.length))
		p.va, p.rkey, p.dmaLen = wr.RemoteAddr+off, wr.RKey, uint32(n)
		n = 0
	case hostverbs.WRAtomicCmpAndSwp:
		p.op = roce.RCCompareSwap
		p.va, p.rkey, p.swapAdd, p.compare = wr.RemoteAddr, wr.RKey, wr.Swap, wr.CompareAdd
	case hostverbs.WRAtomicFetchAndAdd:
		p.op = roce.RCFetchAdd
		p.va, p.rkey, p.swapAdd = wr.RemoteAddr, wr.RKey, wr.CompareAdd
	}
	p.info = p.op.Info()
	q.req.noAck++
	if p.info.Has(roce.MaskEnd) || q.req.noAck >= ackEvery {
		p.ackReq = true
		q.req.noAck = 0
	}
	q.emitToPeer(tx, &p)
}

func pick(first, last bool, f, m, l, only roce.Opcode) roce.Opcode {
	switch {
	case first && last:
		return only
	case first:
		return f
	case last:
		return l
	}
	return m
}

// reqUDPacket builds and emits the single packet of a UD send.
func (q *qp) reqUDPacket(tx *txBatch, w *sendWQE, p *packet) {
	wr := &w.wr
	av := &wr.AV
	p.src = w.sgid
	p.dst = av.DGID
	q.fillNetAV(p, av)
	p.op = roce.UDSendOnly
	if wr.Opcode == hostverbs.WRSendWithImm {
		p.op = roce.UDSendOnlyImm
		p.imm = wr.ImmData
	}
	p.info = p.op.Info()
	p.se = wr.Flags&hostverbs.SendSolicited != 0
	p.dqpn = wr.RemoteQPN & 0xffffff
	// IBA 10.2.5: a Q_Key with the high bit set means the QP's own.
	p.qkey = wr.RemoteQKey
	if p.qkey&0x80000000 != 0 {
		p.qkey = q.attr.QKey
	}
	p.srcQP = q.qpn
	p.segs, p.dataOff, p.n = w.segs, 0, uint32(w.length)
	tx.emit(p)
}
