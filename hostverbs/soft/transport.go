package soft

import (
	"encoding/binary"
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// Transport state hand-over (hostverbs.TransportSaver): what an RC QP
// needs to go on with its peer in another process.
//
// Carried: the requester's next PSN, the highest PSN sent and the
// completer's oldest unacknowledged PSN (one value when the send side is
// drained, as SaveTransport requires), the responder's expected PSN, its
// MSN and whether communication was established, and the responder's
// READ/atomic resources (max_dest_rd_atomic of them): a peer whose READ
// responses or atomic acknowledgement were lost in the hand-over asks
// again with a duplicate request, and the restored responder answers it
// from them (a READ from memory again, an atomic with its saved result,
// never a second execution). Only resources within the half of the PSN
// space behind the expected PSN are carried: no duplicate can name the
// others.
//
// Not carried, and why that is sound: retry and RNR counters (reset, as
// after any progress; the send side is drained), timers (nothing
// outstanding), the pending coalesced ACK (sent by the old process, or
// lost: the peer's retransmission is a duplicate the new QP ACKs), the
// duplicate-READ replay bucket (full again), and the DCQCN rate state: the
// QP restarts at line rate and the notification point's history is
// forgotten, as for a new QP; congestion that persists cuts it again.
//
// A frozen QP drops what it receives, as a lost packet: the peer's
// retransmission reaches the restored QP. The restored QP sends its peer a
// PSN sequence NAK for its expected PSN at once, so that a peer whose
// requests were dropped resends them now instead of after its local ACK
// timeout (a peer with nothing outstanding ignores it).
//
// The blob (little-endian):
//
//	offset size
//	 0     4    magic "PVTS"
//	 4     1    version (transportVersion)
//	 5     1    QP type (hostverbs.QPTypeRC)
//	 6     1    QP state (RTR, RTS or SQD)
//	 7     1    flags: bit 0 communication established
//	 8     4    QPN
//	12     4    destination QPN
//	16     4    requester next PSN
//	20     4    requester highest PSN sent, plus one
//	24     4    completer oldest unacknowledged PSN
//	28     4    responder expected PSN
//	32     4    responder MSN
//	36     2    resources (max_dest_rd_atomic)
//	38     2    m, the resources carried
//	40     36m  the resources, oldest first: kind (1 READ, 2 atomic),
//	            3 bytes 0, first PSN, last PSN, R_Key, length (u32 each),
//	            VA, atomic result (u64 each); an atomic has R_Key, length
//	            and VA 0, a READ its result 0

const (
	transportMagic   = 0x53545650 // "PVTS"
	transportVersion = 1
	transportHdrSize = 40
	transportResSize = 36

	resKindRead   = 1
	resKindAtomic = 2

	transportCommEst = 1
)

var _ hostverbs.TransportSaver = (*qp)(nil)

// transportState is a decoded blob.
type transportState struct {
	state                  hostverbs.QPState
	commEst                bool
	qpn, destQPN           uint32
	reqPSN, sentHigh, comp roce.PSN
	respPSN                roce.PSN
	msn                    uint32
	nres                   int
	res                    []respRes
}

// SendsDrained reports whether every send WQE has completed (its
// completion delivered) and no READ response is still to be sent.
func (q *qp) SendsDrained() bool {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	q.rqMu.Lock()
	defer q.rqMu.Unlock()
	return q.sendsDrainedLocked()
}

// sendsDrainedLocked: both locks held.
func (q *qp) sendsDrainedLocked() bool {
	return q.dead || (q.sq.head == q.sq.tail && !q.req.waitRNR && q.resp.reads.empty())
}

// SaveTransport returns the state of a quiescent RC QP and freezes it.
func (q *qp) SaveTransport() ([]byte, error) {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	q.rqMu.Lock()
	defer q.rqMu.Unlock()
	r := &q.resp
	switch {
	case q.dead:
		return nil, fmt.Errorf("save transport of qp %d: %w", q.qpn, hostverbs.ErrClosed)
	case q.typ != hostverbs.QPTypeRC:
		return nil, fmt.Errorf("save transport of qp %d: a %v QP has no transport state: %w", q.qpn, q.typ, hostverbs.ErrNotSupported)
	case q.state != hostverbs.QPStateRTR && q.state != hostverbs.QPStateRTS && q.state != hostverbs.QPStateSQD:
		return nil, fmt.Errorf("save transport of qp %d in %v: %w", q.qpn, q.state, hostverbs.ErrInvalid)
	case !q.sendsDrainedLocked():
		return nil, fmt.Errorf("save transport of qp %d: sends in flight or READ responses pending: %w", q.qpn, hostverbs.ErrBusy)
	case r.inMsg != msgNone || r.haveWQE:
		return nil, fmt.Errorf("save transport of qp %d: a message is partly received: %w", q.qpn, hostverbs.ErrBusy)
	case q.req.psn != q.comp.psn || q.req.sentHigh != q.req.psn:
		// Drained, these are one PSN; anything else is not drained.
		return nil, fmt.Errorf("save transport of qp %d: requester at %#x, sent %#x, acknowledged %#x: %w",
			q.qpn, q.req.psn, q.req.sentHigh, q.comp.psn, hostverbs.ErrBusy)
	}
	b := q.encodeTransport()
	q.frozen.Store(true)
	return b, nil
}

// encodeTransport builds the blob. Both locks held.
func (q *qp) encodeTransport() []byte {
	r := &q.resp
	var carried []*respRes
	n := len(r.res)
	for k := range n {
		res := &r.res[(r.resNext+k)%n] // oldest first
		if res.valid && r.psn.Diff(res.firstPSN) > 0 && r.psn.Diff(res.lastPSN) > 0 {
			carried = append(carried, res)
		}
	}
	b := make([]byte, transportHdrSize+transportResSize*len(carried))
	le := binary.LittleEndian
	le.PutUint32(b[0:], transportMagic)
	b[4], b[5], b[6] = transportVersion, byte(q.typ), byte(q.state)
	if r.commEst {
		b[7] |= transportCommEst
	}
	le.PutUint32(b[8:], q.qpn)
	le.PutUint32(b[12:], q.attr.DestQPN)
	le.PutUint32(b[16:], uint32(q.req.psn))
	le.PutUint32(b[20:], uint32(q.req.sentHigh))
	le.PutUint32(b[24:], uint32(q.comp.psn))
	le.PutUint32(b[28:], uint32(r.psn))
	le.PutUint32(b[32:], r.msn)
	le.PutUint16(b[36:], uint16(n))
	le.PutUint16(b[38:], uint16(len(carried)))
	for i, res := range carried {
		e := b[transportHdrSize+i*transportResSize:]
		e[0] = resKindRead
		if res.atomic {
			e[0] = resKindAtomic
		}
		le.PutUint32(e[4:], uint32(res.firstPSN))
		le.PutUint32(e[8:], uint32(res.lastPSN))
		le.PutUint32(e[12:], res.rkey)
		le.PutUint32(e[16:], res.length)
		le.PutUint64(e[20:], res.va)
		le.PutUint64(e[28:], res.orig)
	}
	return b
}

// decodeTransport parses and checks a blob on its own: structure, ranges
// and the consistency of its values.
func decodeTransport(b []byte) (transportState, error) {
	var s transportState
	le := binary.LittleEndian
	inv := hostverbs.ErrInvalid
	if len(b) < transportHdrSize {
		return s, fmt.Errorf("transport state of %d bytes: %w", len(b), inv)
	}
	switch {
	case le.Uint32(b) != transportMagic:
		return s, fmt.Errorf("not a soft transport state: %w", inv)
	case b[4] != transportVersion:
		return s, fmt.Errorf("transport state version %d (this is %d): %w", b[4], transportVersion, inv)
	case hostverbs.QPType(b[5]) != hostverbs.QPTypeRC:
		return s, fmt.Errorf("transport state of a %v QP: %w", hostverbs.QPType(b[5]), inv)
	case b[7]&^transportCommEst != 0:
		return s, fmt.Errorf("transport state flags %#x: %w", b[7], inv)
	}
	s.state = hostverbs.QPState(b[6])
	switch s.state {
	case hostverbs.QPStateRTR, hostverbs.QPStateRTS, hostverbs.QPStateSQD:
	default:
		return s, fmt.Errorf("transport state of a QP in %v: %w", s.state, inv)
	}
	s.commEst = b[7]&transportCommEst != 0
	s.qpn, s.destQPN = le.Uint32(b[8:]), le.Uint32(b[12:])
	s.reqPSN, s.sentHigh, s.comp = roce.PSN(le.Uint32(b[16:])), roce.PSN(le.Uint32(b[20:])), roce.PSN(le.Uint32(b[24:]))
	s.respPSN, s.msn = roce.PSN(le.Uint32(b[28:])), le.Uint32(b[32:])
	s.nres = int(le.Uint16(b[36:]))
	m := int(le.Uint16(b[38:]))
	switch {
	case s.qpn < firstUserQPN || s.qpn >= qpnSpace || s.destQPN >= qpnSpace:
		return s, fmt.Errorf("transport state QPNs %#x -> %#x: %w", s.qpn, s.destQPN, inv)
	case !s.reqPSN.Valid() || !s.sentHigh.Valid() || !s.comp.Valid() || !s.respPSN.Valid():
		return s, fmt.Errorf("transport state PSN beyond 24 bits: %w", inv)
	case s.sentHigh != s.reqPSN || s.comp != s.reqPSN:
		return s, fmt.Errorf("transport state of a requester not drained (next %#x, sent %#x, acknowledged %#x): %w",
			s.reqPSN, s.sentHigh, s.comp, inv)
	case s.nres > maxRdAtomic || m > s.nres:
		return s, fmt.Errorf("transport state with %d of %d resources: %w", m, s.nres, inv)
	case len(b) != transportHdrSize+transportResSize*m:
		return s, fmt.Errorf("transport state of %d bytes for %d resources: %w", len(b), m, inv)
	}
	s.res = make([]respRes, m)
	for i := range s.res {
		e := b[transportHdrSize+i*transportResSize:]
		res := &s.res[i]
		*res = respRes{valid: true, atomic: e[0] == resKindAtomic,
			firstPSN: roce.PSN(le.Uint32(e[4:])), lastPSN: roce.PSN(le.Uint32(e[8:])),
			rkey: le.Uint32(e[12:]), length: le.Uint32(e[16:]), va: le.Uint64(e[20:]), orig: le.Uint64(e[28:])}
		bad := ""
		switch {
		case e[0] != resKindRead && e[0] != resKindAtomic, e[1] != 0 || e[2] != 0 || e[3] != 0:
			bad = "kind"
		case !res.firstPSN.Valid() || !res.lastPSN.Valid():
			bad = "PSN beyond 24 bits"
		case s.respPSN.Diff(res.firstPSN) <= 0 || s.respPSN.Diff(res.lastPSN) <= 0 || res.lastPSN.Before(res.firstPSN):
			bad = "PSNs not behind the expected PSN"
		case i > 0 && !res.firstPSN.After(s.res[i-1].lastPSN):
			bad = "PSNs out of order"
		case res.atomic && (res.lastPSN != res.firstPSN || res.rkey != 0 || res.length != 0 || res.va != 0):
			bad = "atomic with a READ's fields"
		case !res.atomic && (res.orig != 0 || uint64(res.length) > maxMsgSize || res.va+uint64(res.length) < res.va):
			bad = "READ with an atomic's fields or out of range"
		}
		if bad != "" {
			return s, fmt.Errorf("transport state resource %d: %s: %w", i, bad, inv)
		}
	}
	return s, nil
}

// ResumeTransport undoes SaveTransport.
func (q *qp) ResumeTransport() {
	q.sqMu.Lock()
	q.rqMu.Lock()
	q.frozen.Store(false)
	q.rqMu.Unlock()
	q.sqMu.Unlock()
}

// RestoreTransport applies a state SaveTransport returned to this QP.
func (q *qp) RestoreTransport(state []byte) error {
	s, err := decodeTransport(state)
	if err != nil {
		return fmt.Errorf("restore transport of qp %d: %w", q.qpn, err)
	}
	tx := q.dev.f.getTx()
	defer q.dev.f.putTx(tx)
	err = q.restoreTransport(tx, &s)
	tx.flush()
	if err != nil {
		return fmt.Errorf("restore transport of qp %d: %w", q.qpn, err)
	}
	return nil
}

func (q *qp) restoreTransport(tx *txBatch, s *transportState) error {
	q.sqMu.Lock()
	defer q.sqMu.Unlock()
	q.rqMu.Lock()
	defer q.rqMu.Unlock()
	r := &q.resp
	inv := hostverbs.ErrInvalid
	switch {
	case q.dead:
		return hostverbs.ErrClosed
	case q.typ != hostverbs.QPTypeRC:
		return fmt.Errorf("a %v QP has no transport state: %w", q.typ, hostverbs.ErrNotSupported)
	case s.qpn != q.qpn:
		return fmt.Errorf("the state of QP %#x: %w", s.qpn, inv)
	case s.state != q.state:
		return fmt.Errorf("the state of a QP in %v, this one is in %v: %w", s.state, q.state, inv)
	case s.destQPN != q.attr.DestQPN:
		return fmt.Errorf("the state of a QP connected to QP %#x, this one to %#x: %w", s.destQPN, q.attr.DestQPN, inv)
	case s.nres != len(r.res):
		return fmt.Errorf("the state of a QP with %d READ/atomic resources, this one has %d: %w", s.nres, len(r.res), inv)
	case q.frozen.Load() || q.sq.head != q.sq.tail || r.inMsg != msgNone || r.haveWQE || !r.reads.empty():
		return fmt.Errorf("work was posted or received already: %w", hostverbs.ErrBusy)
	}
	q.req.psn, q.req.sentHigh, q.comp.psn = s.reqPSN, s.sentHigh, s.comp
	q.req.noAck, q.req.waitRNR = 0, false
	q.resetRetries()
	r.psn, r.msn, r.commEst, r.sentNAK = s.respPSN, s.msn, s.commEst, false
	clear(r.res)
	copy(r.res, s.res)
	r.resNext = 0
	if len(r.res) > 0 {
		r.resNext = len(s.res) % len(r.res)
	}
	// Requests the frozen QP dropped: the peer resends them now.
	q.dev.ctrs.inc(cntTxNAKSeq)
	q.respAck(tx, roce.NAKPSNSequenceError, r.psn)
	return nil
}
