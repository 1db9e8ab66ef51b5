package vdev

import (
	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
)

// workQueue is the device side of a QP's send queue, or of its receive
// queue when the QP has no SRQ. Its guest ring is the durable record of
// the queue's outstanding work: reading and posting a WQE moves only the
// ring's posted cursor, and cons_head in guest memory moves past a WQE
// only when the WQE completes, just before its CQE becomes visible. A
// daemon that dies with work in the provider therefore leaves, between
// cons_head and prod_tail, every WQE the guest posted that did not
// complete, and a device rebuilt over the ring (ringbuf.AdoptConsumer)
// posts them again; a completion written before the crash is never
// written twice.
//
// The provider gets each WQE with a WRID the device makes (providerWRID:
// the ring index, the queue and a reset epoch); slots keeps, by ring slot,
// the guest's wr_id and what the CQE needs, and translates completions
// back. A slot is reused only after cons_head passes it, which now happens
// only after its completion, so the provider never holds more WQEs than
// the ring has slots and a slot's record is not overwritten while its WQE
// is in flight (but for the unsignaled WQE a later completion covers,
// below: its own completion, if any, then finds the index released and
// is dropped).
//
// A queue completes in order: the provider's completion of the WQE at
// index k completes every WQE before it (unsignaled WQEs report nothing of
// their own). WQEs the device completes itself (flushes in ERR, local
// operations, WQEs it refuses) are marked done and wait, CQE and all,
// until every WQE before them that the provider will report on has
// completed, so that CQEs come in ring order. A WQE posted to the provider
// unsignaled may have completed in silence, and nothing would ever tell:
// a done WQE after it therefore completes it too, as any completion does
// for the unsignaled WQEs before it (were it still in flight, its own late
// completion is dropped: a QP that fails flushes it anyway, and UD loses
// datagrams). This is what lets the flush of ib_drain_qp's marker WQE out
// after a run of unsignaled sends. On a kernel QP the send before a local
// operation is signaled to the provider (sendOne), so local operations
// complete after the sends before them.
//
// The QP's CQ for the queue (cq) guards the ring's indices, slots and
// epoch: completions are written under it, and the BAR goroutine takes it
// around each change of the posted cursor. The BAR goroutine alone moves
// the posted cursor, so it reads it (Next) without the lock.
type workQueue struct {
	cq    *cq
	ring  *ringbuf.Consumer
	slots []wqSlot
	done  int // slots in state slotDone
	epoch uint32
	recv  bool
	// at is the latency stamp of the doorbell pass in progress over a
	// send queue, which post and finish give the WQEs they take (0:
	// none); waiting the stamp of the pass that left WQEs in the ring
	// stalled (metrics.go). Both belong to the BAR goroutine.
	at, waiting int64
}

// wqSlot is what the device keeps of one WQE between posting and
// completion.
type wqSlot struct {
	wrid   uint64
	op     hostverbs.WCOpcode // the CQE's opcode (providers need not set one on errors)
	status hostverbs.WCStatus // slotDone: its completion status
	state  uint8
	// report: slotPosted: a successful completion is reported to the
	// guest (signaled, or sq_sig_all; always for receives); slotDone: a
	// CQE is owed.
	report bool
	// signaled: slotPosted: the provider reports the WQE's success too
	// (report, or signaled for the device's own sake).
	signaled bool
	// at is the latency stamp of the doorbell pass that took a send WQE
	// (the device's clock, metrics.go; 0: not timed).
	at int64
}

// Slot states.
const (
	slotFree   uint8 = iota
	slotPosted       // handed to the provider, awaiting its completion
	slotDone         // completed by the device, waiting for the WQEs before it
)

// Provider WRIDs: the ring index in the low 32 bits, the queue (send or
// receive) in bit 32, the queue's reset epoch in bits 33-47 (completions
// of WQEs posted before a RESET are recognised and dropped) and a magic
// value in the top 16 bits, which no user-space address or kernel pointer
// has, for QPs whose SRQ receives share the CQ (see qp.route).
const (
	wridMagic      = uint64(0x7076) << 48 // "pv"
	wridMagicMask  = uint64(0xffff) << 48
	wridRecv       = uint64(1) << 32
	wridEpochShift = 33
	wridEpochMask  = 1<<15 - 1
)

// costWQESlot is what a wqSlot costs the VM's budget, per WQE.
const costWQESlot = 24

func newWorkQueue(c *cq, ring *ringbuf.Consumer, recv bool) *workQueue {
	return &workQueue{cq: c, ring: ring, slots: make([]wqSlot, ring.Len()), recv: recv}
}

// providerWRID is the WRID the WQE at ring index idx is posted with.
func (w *workQueue) providerWRID(idx uint32) uint64 {
	v := wridMagic | uint64(w.epoch&wridEpochMask)<<wridEpochShift | uint64(idx)
	if w.recv {
		v |= wridRecv
	}
	return v
}

// owns returns the ring index a provider WRID names if it is one of w's,
// of the current epoch, for a WQE the provider holds. cq.mu held.
func (w *workQueue) owns(wrid uint64) (uint32, bool) {
	if wrid&wridMagicMask != wridMagic || (wrid&wridRecv != 0) != w.recv ||
		uint32(wrid>>wridEpochShift)&wridEpochMask != w.epoch&wridEpochMask {
		return 0, false
	}
	idx := uint32(wrid)
	geo := w.ring.Geometry()
	if !geo.Valid(idx) || geo.Used(w.ring.HeadIndex(), idx) >= w.ring.Outstanding() ||
		w.slots[geo.Slot(idx)].state != slotPosted {
		return 0, false
	}
	return idx, true
}

// pending returns how many WQEs wait to be posted (prod_tail - posted)
// and the queue's depth, the WQEs posted and not completed (prod_tail -
// cons_head).
func (w *workQueue) pending() (n, depth uint32, err error) {
	w.cq.mu.Lock()
	defer w.cq.mu.Unlock()
	n, err = w.ring.Pending()
	return n, n + w.ring.Outstanding(), err
}

// next returns the address of the WQE to post next.
func (w *workQueue) next() guestmem.GPA { return w.ring.Next() }

// post takes the WQE at the posted cursor as handed to the provider and
// returns the WRID to post it with; report and signaled are as in wqSlot.
// It is recorded before the provider sees it: the completion may arrive
// before PostSend returns.
func (w *workQueue) post(wrid uint64, op hostverbs.WCOpcode, report, signaled bool) (uint64, error) {
	w.cq.mu.Lock()
	defer w.cq.mu.Unlock()
	idx := w.ring.NextIndex()
	if err := w.ring.Take(); err != nil {
		return 0, err
	}
	w.slots[w.ring.Geometry().Slot(idx)] = wqSlot{wrid: wrid, op: op, state: slotPosted, report: report, signaled: signaled, at: w.at}
	return w.providerWRID(idx), nil
}

// unpost gives back the WQE the last post took, which the provider
// refused: it is the next to post again (or to complete in error).
func (w *workQueue) unpost() {
	w.cq.mu.Lock()
	defer w.cq.mu.Unlock()
	if w.ring.Untake() == nil {
		w.slots[w.ring.Geometry().Slot(w.ring.NextIndex())].state = slotFree
	}
}

// reset forgets every WQE (the provider discards what it holds on RESET)
// and restarts the ring: at 0, or where guest memory says when the device
// adopts ring state. The new epoch makes late completions of the old WQEs
// stale.
func (w *workQueue) reset(adopt bool) error {
	w.cq.mu.Lock()
	defer w.cq.mu.Unlock()
	w.epoch = (w.epoch + 1) & wridEpochMask
	clear(w.slots)
	w.done = 0
	w.waiting = 0
	if adopt {
		return w.ring.Adopt()
	}
	return w.ring.Reset()
}

// release moves cons_head to upTo. A failure (the ring's page is gone) is
// logged: the completions still go out, and the QP's next doorbell finds
// the ring unusable. cq.mu held.
func (w *workQueue) release(q *qp, upTo uint32) {
	if err := w.ring.Release(upTo); err != nil {
		q.dev.lim.Debug("wq-release", "pvrdma: cannot release ring slots", "qp", q.handle, "recv", w.recv, "err", err)
	}
}

// complete handles the provider's completion wc of the WQE at ring index
// idx (owns checked it): the WQEs before it are complete too, and those
// the device completed itself write their CQEs first; then this one's
// (unless it is an unsignaled success); then any device-completed WQEs
// that waited for it. cq.mu held.
func (w *workQueue) complete(q *qp, idx uint32, wc *hostverbs.WorkCompletion) {
	c := w.cq
	geo := w.ring.Geometry()
	i := w.ring.HeadIndex()
	for i != idx {
		s := &w.slots[geo.Slot(i)]
		done := s.state == slotDone
		s.state = slotFree
		i = geo.Inc(i)
		if done {
			w.done--
			if s.report {
				c.putSlot(q, w, s, i)
			}
		}
	}
	s := &w.slots[geo.Slot(idx)]
	s.state = slotFree
	i = geo.Inc(idx)
	if wc.Status != hostverbs.WCSuccess || s.report {
		c.wc = *wc
		c.wc.WRID = s.wrid
		if wc.Status != hostverbs.WCSuccess {
			c.wc.Opcode = s.op
		}
		c.put(q, &c.wc, w, i, s.at)
	}
	w.drain(q, i)
}

// drain releases, from ring index from on, the WQEs the device completed
// itself, writing the CQEs they owe, and the unsignaled provider WQEs
// before each of them, up to the first WQE the provider will report on.
// With no WQE done it is one look at a slot. cq.mu held.
func (w *workQueue) drain(q *qp, from uint32) {
	geo := w.ring.Geometry()
	i, end := from, w.ring.NextIndex()
	upTo := i // the end of what is released
	for i != end && w.done > 0 {
		s := &w.slots[geo.Slot(i)]
		switch {
		case s.state == slotPosted && !s.signaled:
			i = geo.Inc(i) // complete if a done WQE follows
			continue
		case s.state != slotDone:
			w.release(q, upTo)
			return
		}
		for ; upTo != i; upTo = geo.Inc(upTo) {
			w.slots[geo.Slot(upTo)].state = slotFree // completed in silence
		}
		s.state = slotFree
		w.done--
		i = geo.Inc(i)
		upTo = i
		if s.report {
			w.cq.putSlot(q, w, s, i)
		}
	}
	w.release(q, upTo) // done WQEs without a CQE (unsignaled local operations)
}

// finish completes the WQE at the posted cursor in the device, with
// status st and, if cqe, a CQE: a flush in ERR, a local operation, a WQE
// the device or the provider refused. It goes through the same release as
// a provider completion, after the WQEs before it. It returns false if the
// ring cannot take the WQE (the QP is then fatal).
func (d *Device) finish(q *qp, w *workQueue, wrid uint64, op hostverbs.WCOpcode, st hostverbs.WCStatus, cqe bool) bool {
	c := w.cq
	c.mu.Lock()
	idx := w.ring.NextIndex()
	if err := w.ring.Take(); err != nil {
		c.mu.Unlock()
		d.qpFatal(q, err)
		return false
	}
	w.slots[w.ring.Geometry().Slot(idx)] = wqSlot{wrid: wrid, op: op, status: st, state: slotDone, report: cqe, at: w.at}
	w.done++
	w.drain(q, w.ring.HeadIndex())
	c.unlock()
	return true
}
