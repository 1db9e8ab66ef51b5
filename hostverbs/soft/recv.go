package soft

import (
	"encoding/binary"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// deliver is the per-device receive gate (rxe_recv.c's job): destination
// QP, transport service, P_Key; then the fork to the responder (requests)
// or the completer (responses). Every drop has its counter.
func (d *device) deliver(tx *txBatch, p *packet) {
	if p.v1 != d.v1 {
		// A device speaks one RoCE version; the other is not addressed
		// to it even when the GID matches.
		d.ctrs.inc(cntDropRoCEVersion)
		return
	}
	q := d.lookupQP(p.dqpn)
	if q == nil {
		d.ctrs.inc(cntDropUnknownQPN)
		return
	}
	if p.op == roce.CNP {
		d.ctrs.inc(cntRxCNP)
		if !q.isUD() {
			q.onCNP(p)
		}
		return
	}
	if p.op.IsRC() != (q.typ == hostverbs.QPTypeRC) {
		d.ctrs.inc(cntDropTransport)
		return
	}
	if !roce.PKeyMatch(p.pkey, roce.DefaultPKey) {
		d.ctrs.inc(cntDropPKey)
		d.pkeyViolations.Add(1)
		return
	}
	if p.info.Has(roce.MaskReq) {
		q.receiveRequest(tx, p)
	} else {
		q.receiveResponse(tx, p)
	}
}

// receiveRequest hands a request to the responder.
func (q *qp) receiveRequest(tx *txBatch, p *packet) {
	q.rqMu.Lock()
	switch {
	case q.dead:
		q.dev.ctrs.inc(cntDropQPState)
	case q.frozen.Load():
		q.dev.ctrs.inc(cntDropHandedOver)
	case q.state < hostverbs.QPStateRTR || q.state == hostverbs.QPStateErr:
		// Requests are accepted from RTR on (IBA 10.3.1.2).
		q.dev.ctrs.inc(cntDropQPState)
	case q.isUD():
		q.receiveUD(tx, p)
	case p.src != q.attr.AV.DGID || p.dst != q.sgid:
		// A connected QP talks to one peer only.
		q.dev.ctrs.inc(cntDropAddress)
	default:
		if p.ce {
			q.notifyCongestion(tx)
		}
		q.respondRC(tx, p)
	}
	gotoError, ev := q.resp.gotoError, q.resp.errEvent
	q.resp.gotoError = false
	q.rqMu.Unlock()
	if gotoError {
		q.toError(ev)
	}
}

// grhSize is the Global Route Header scattered ahead of every UD/GSI
// payload (IBA 11.4.1.1): for RoCE v2, the IP header the packet came with.
const grhSize = 40

// receiveUD delivers a UD or GSI SEND: Q_Key check, receive WQE, then the
// 40-byte GRH and the payload (rxe: 20 zero bytes and the IPv4 header for
// IPv4, else the IPv6 header). UD errors drop the packet or complete the
// WQE in error; they never affect the QP state. rqMu is held.
func (q *qp) receiveUD(tx *txBatch, p *packet) {
	if !p.op.IsUD() {
		q.dev.ctrs.inc(cntDropTransport)
		return
	}
	want := q.attr.QKey
	if q.typ == hostverbs.QPTypeGSI {
		want = roce.GSIQKey
	}
	if p.qkey != want {
		q.dev.ctrs.inc(cntDropQKey)
		q.dev.qkeyViolations.Add(1)
		return
	}
	// In process the sender's payload is read here, before a receive WQE is
	// taken: if the sending VM's memory is gone the datagram is lost, as if
	// the sender had failed to gather it, and the WQE stays queued.
	payload := p.data[:min(p.n, uint32(len(p.data)))]
	var local [wire.MaxDatagram]byte
	if p.local && p.n > 0 {
		if p.n > uint32(len(local)) {
			q.dev.ctrs.inc(cntDropUDLength)
			return
		}
		if err := gather(local[:p.n], tx.arena[p.arenaOff:p.arenaOff+p.arenaN], p.dataOff); err != nil {
			q.dev.ctrs.inc(cntDropSourceFault)
			return
		}
		payload = local[:p.n]
	}
	r := &q.resp
	var got bool
	if q.srq != nil {
		var frozen bool
		if got, frozen = q.srq.take(&r.wqe); frozen {
			q.dev.ctrs.inc(cntDropSRQHandedOver)
			return
		}
	} else {
		got = q.rq.take(&r.wqe)
	}
	if !got {
		q.dev.ctrs.inc(cntDropUDNoRecv)
		return
	}
	segs, total, err := resolveSGL(q.dev, q.pd, r.wqe.sgl, hostverbs.AccessLocalWrite, r.segs[:0])
	r.segs = segs
	if err != nil {
		q.completeRecv(&r.wqe, hostverbs.WCLocProtErr, nil, 0)
		return
	}
	if grhSize+uint64(p.n) > total {
		q.dev.ctrs.inc(cntDropUDLength)
		q.completeRecv(&r.wqe, hostverbs.WCLocLenErr, nil, 0)
		return
	}
	var grh [grhSize]byte
	buildGRH(&grh, p)
	if err := scatter(segs, 0, grh[:]); err != nil {
		q.completeRecv(&r.wqe, hostverbs.WCLocProtErr, nil, 0)
		return
	}
	if err := scatter(segs, grhSize, payload); err != nil {
		q.completeRecv(&r.wqe, hostverbs.WCLocProtErr, nil, 0)
		return
	}
	q.completeRecv(&r.wqe, hostverbs.WCSuccess, p, grhSize+p.n)
}

// buildGRH fills the GRH of a received UD packet: the IP header it
// arrived with, or for in-process delivery the header it would have had;
// for RoCE v1, the GRH itself.
func buildGRH(g *[grhSize]byte, p *packet) {
	if p.v1 {
		if len(p.ipHdr) == roce.GRHSize {
			copy(g[:], p.ipHdr)
			return
		}
		net := roce.NetFields{Src: p.src, Dst: p.dst, TClass: p.tclass, HopLimit: p.hopLimit, FlowLabel: p.flowLabel}
		roce.EncodeGRH(g[:], &net, roce.PacketSizeV1(p.op, int(p.n))-roce.GRHSize)
		return
	}
	if p.v4 {
		h := g[20:]
		if len(p.ipHdr) == roce.IPv4HeaderSize {
			copy(h, p.ipHdr)
			return
		}
		h[0] = 0x45
		h[1] = p.tclass
		total := roce.DatagramSize(true, p.op, int(p.n))
		binary.BigEndian.PutUint16(h[2:], uint16(total))
		binary.BigEndian.PutUint16(h[6:], 0x4000)
		h[8] = p.hopLimit
		h[9] = 17
		copy(h[12:16], p.src[12:])
		copy(h[16:20], p.dst[12:])
		binary.BigEndian.PutUint16(h[10:], roce.IPv4Checksum(h))
		return
	}
	if len(p.ipHdr) == roce.IPv6HeaderSize {
		copy(g[:], p.ipHdr)
		return
	}
	binary.BigEndian.PutUint32(g[0:], 6<<28|uint32(p.tclass)<<20|p.flowLabel&0xfffff)
	plen := roce.DatagramSize(false, p.op, int(p.n)) - roce.IPv6HeaderSize
	binary.BigEndian.PutUint16(g[4:], uint16(plen))
	g[6] = 17
	g[7] = p.hopLimit
	copy(g[8:24], p.src[:])
	copy(g[24:40], p.dst[:])
}
