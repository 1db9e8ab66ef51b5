package soft

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// wqeState is where a send WQE is in its life.
type wqeState uint8

const (
	wqePosted  wqeState = iota // queued, not started
	wqeSending                 // started; packets from nextPkt on still to send
	wqeSent                    // every packet sent, waiting for the response
	wqeError                   // failed; completes with status when flushed
)

// sendWQE is a send work request with its transmission state. Its SGL and
// resolved segments live in storage owned by the queue slot.
type sendWQE struct {
	wr       hostverbs.SendWR
	sge      []hostverbs.SGE
	segs     []seg
	length   uint64
	state    wqeState
	status   hostverbs.WCStatus
	firstPSN roce.PSN
	lastPSN  roce.PSN
	npkts    uint32
	nextPkt  uint32
	readNext uint32 // READ: response packets received in order
	mtu      uint64 // segment size, fixed when the WQE starts
	rdAtomic bool   // counts against max_rd_atomic
	local    bool   // segmented for in-process delivery
	sgid     hostverbs.GID
}

func (w *sendWQE) isReadOrAtomic() bool {
	switch w.wr.Opcode {
	case hostverbs.WRRDMARead, hostverbs.WRAtomicCmpAndSwp, hostverbs.WRAtomicFetchAndAdd:
		return true
	}
	return false
}

func (w *sendWQE) isAtomic() bool {
	return w.wr.Opcode == hostverbs.WRAtomicCmpAndSwp || w.wr.Opcode == hostverbs.WRAtomicFetchAndAdd
}

// sendQueue is a ring of send WQEs. head is the oldest not completed, next
// the first not fully transmitted, tail the next free slot; the counters
// only grow and index the ring modulo its size.
type sendQueue struct {
	w                []sendWQE
	head, next, tail uint32
}

func (s *sendQueue) init(depth, maxSGE int) {
	s.w = make([]sendWQE, depth)
	sges := make([]hostverbs.SGE, depth*maxSGE)
	segs := make([]seg, depth*maxSGE)
	for i := range s.w {
		s.w[i].sge = sges[i*maxSGE : i*maxSGE : (i+1)*maxSGE]
		s.w[i].segs = segs[i*maxSGE : i*maxSGE : (i+1)*maxSGE]
	}
}

func (s *sendQueue) at(i uint32) *sendWQE { return &s.w[i%uint32(len(s.w))] }

// push copies wr into the queue; false if it is full.
func (s *sendQueue) push(wr *hostverbs.SendWR) bool {
	if int(s.tail-s.head) >= len(s.w) {
		return false
	}
	w := s.at(s.tail)
	sge := append(w.sge[:0], wr.SGL...)
	w.wr = *wr
	w.wr.SGL = sge
	w.sge = sge
	w.segs = w.segs[:0]
	w.state = wqePosted
	w.status = hostverbs.WCSuccess
	w.rdAtomic = false
	s.tail++
	return true
}

// completeSendHead completes the oldest WQE with status (unsignaled
// successes complete silently, IBA 10.7.3.1). sqMu is held.
func (q *qp) completeSendHead(st hostverbs.WCStatus) {
	w := q.sq.at(q.sq.head)
	if w.rdAtomic {
		w.rdAtomic = false
		q.req.rdInFlight--
	}
	q.sq.head++
	if int32(q.sq.next-q.sq.head) < 0 {
		q.sq.next = q.sq.head
	}
	if st == hostverbs.WCSuccess && !q.sigAll && w.wr.Flags&hostverbs.SendSignaled == 0 {
		return
	}
	wc := &q.sqWC
	*wc = hostverbs.WorkCompletion{
		WRID: w.wr.WRID, Status: st, Opcode: wcOpcode(w.wr.Opcode), QPN: q.qpn,
		QPContext: q.ctx, Port: 1,
	}
	if st == hostverbs.WCSuccess {
		wc.ByteLen = uint32(w.length)
		if w.wr.Opcode == hostverbs.WRSendWithImm || w.wr.Opcode == hostverbs.WRRDMAWriteWithImm {
			wc.Flags = hostverbs.WCFlagWithImm
		}
	}
	q.scq.complete(wc)
}

func wcOpcode(op hostverbs.WROpcode) hostverbs.WCOpcode {
	switch op {
	case hostverbs.WRRDMAWrite, hostverbs.WRRDMAWriteWithImm:
		return hostverbs.WCRDMAWrite
	case hostverbs.WRRDMARead:
		return hostverbs.WCRDMARead
	case hostverbs.WRAtomicCmpAndSwp:
		return hostverbs.WCCompSwap
	case hostverbs.WRAtomicFetchAndAdd:
		return hostverbs.WCFetchAdd
	}
	return hostverbs.WCSend
}

// outstanding reports whether a started WQE awaits completion.
func (q *qp) outstanding() bool {
	return q.sq.head != q.sq.tail && q.sq.at(q.sq.head).state != wqePosted
}
