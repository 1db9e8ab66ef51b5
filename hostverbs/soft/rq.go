package soft

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// recvWQE is a receive work request as queued: its SGEs are copied into
// storage owned by the queue (or by the responder, once taken).
type recvWQE struct {
	wrID uint64
	sgl  []hostverbs.SGE
}

// recvQueue is a bounded FIFO of receive WQEs with preallocated SGE
// storage, so posting allocates nothing.
type recvQueue struct {
	slots  []recvWQE
	sges   []hostverbs.SGE
	maxSGE int
	head   uint32 // next to take
	tail   uint32 // next free
}

func (r *recvQueue) init(depth, maxSGE int) {
	r.slots = make([]recvWQE, depth)
	r.sges = make([]hostverbs.SGE, depth*maxSGE)
	r.maxSGE = maxSGE
	for i := range r.slots {
		r.slots[i].sgl = r.sges[i*maxSGE : i*maxSGE : (i+1)*maxSGE]
	}
}

func (r *recvQueue) cap() int { return len(r.slots) }
func (r *recvQueue) len() int { return int(r.tail - r.head) }

func (r *recvQueue) post(wr *hostverbs.RecvWR) error {
	if len(wr.SGL) > r.maxSGE {
		return fmt.Errorf("post recv: %d SGEs, max %d: %w", len(wr.SGL), r.maxSGE, hostverbs.ErrInvalid)
	}
	if r.len() >= len(r.slots) {
		return fmt.Errorf("post recv: %w", hostverbs.ErrQueueFull)
	}
	w := &r.slots[r.tail%uint32(len(r.slots))]
	w.wrID = wr.WRID
	w.sgl = append(w.sgl[:0], wr.SGL...)
	r.tail++
	return nil
}

// take moves the oldest WQE into dst (whose sgl has room for maxSGE).
func (r *recvQueue) take(dst *recvWQE) bool {
	if r.head == r.tail {
		return false
	}
	w := &r.slots[r.head%uint32(len(r.slots))]
	dst.wrID = w.wrID
	dst.sgl = append(dst.sgl[:0], w.sgl...)
	r.head++
	return true
}

// each calls fn for every queued WQE, oldest first, leaving the queue as
// it is.
func (r *recvQueue) each(fn func(w *recvWQE)) {
	for i := r.head; i != r.tail; i++ {
		fn(&r.slots[i%uint32(len(r.slots))])
	}
}

// drain calls fn for every queued WQE, oldest first, and empties the queue.
func (r *recvQueue) drain(fn func(w *recvWQE)) {
	for r.head != r.tail {
		w := &r.slots[r.head%uint32(len(r.slots))]
		r.head++
		if fn != nil {
			fn(w)
		}
	}
}
