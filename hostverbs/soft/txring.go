package soft

import (
	"context"
	"errors"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"runtime"
	"sync"
	"sync/atomic"
)

// txRing is the fabric's ordered queue of datagrams for the wire. Producers
// (requesters and responders, holding their QP's lock) reserve a slot,
// encode the packet into it and commit it; slots leave in reservation
// order, so each QP's packets reach the wire in the order it made them.
// Whoever drains the ring does the sendmmsg calls: the posting goroutine
// itself when no one else is (the latency path: PostSend transmits before
// returning), or the fabric's transmit goroutine, which the receive loop
// wakes so that receiving and sending run on two cores.
type txRing struct {
	f     *Fabric
	mu    sync.Mutex // guards tail (reservations)
	slots []txSlot
	head  atomic.Uint64   // next slot to send
	tail  atomic.Uint64   // next slot to reserve
	drain sync.Mutex      // held by the goroutine sending
	dgs   []wire.Datagram // the drainer's batch
	wake  chan struct{}
}

type txSlot struct {
	buf       []byte
	dg        wire.Datagram
	committed atomic.Bool
}

// txRingSlots bounds the datagrams queued for the wire: a full window of a
// few QPs. A producer finding it full drains it itself.
const txRingSlots = 1024

// txDrainMax is the most datagrams a drainer hands the wire at once: a
// quarter of the ring, so that runs of one flow reach the wire whole (the
// UDP wire sends up to 15 full-MTU packets as one super-packet, and a cut
// batch cuts a run).
const txDrainMax = txRingSlots / 4

func newTxRing(f *Fabric) *txRing {
	r := &txRing{f: f, slots: make([]txSlot, txRingSlots), dgs: make([]wire.Datagram, txDrainMax),
		wake: make(chan struct{}, 1)}
	backing := make([]byte, txRingSlots*wire.MaxDatagram)
	for i := range r.slots {
		r.slots[i].buf = backing[i*wire.MaxDatagram : (i+1)*wire.MaxDatagram : (i+1)*wire.MaxDatagram]
	}
	return r
}

// reserve returns the next slot; the caller must commit it.
func (r *txRing) reserve() *txSlot {
	for {
		r.mu.Lock()
		t := r.tail.Load()
		if t-r.head.Load() < uint64(len(r.slots)) {
			r.tail.Store(t + 1)
			r.mu.Unlock()
			return &r.slots[t%uint64(len(r.slots))]
		}
		r.mu.Unlock()
		// Full: send what is ready ourselves; if the oldest slot is
		// still being filled by another producer, let it finish.
		r.drain.Lock()
		sent := r.drainLocked()
		r.drain.Unlock()
		if !sent {
			runtime.Gosched()
		}
	}
}

// commit publishes a reserved slot holding d (d.Packet nil: nothing to send).
func (s *txSlot) commit(d wire.Datagram) {
	s.dg = d
	s.committed.Store(true)
}

// pending reports whether the slot at head is ready to send.
func (r *txRing) pending() bool {
	h := r.head.Load()
	return h < r.tail.Load() && r.slots[h%uint64(len(r.slots))].committed.Load()
}

// backlog is the number of reserved slots not yet sent.
func (r *txRing) backlog() uint64 { return r.tail.Load() - r.head.Load() }

// flushInline sends what is queued on the calling goroutine, unless another
// goroutine is sending already (it will send ours too: a drainer re-checks
// the ring after letting go).
func (r *txRing) flushInline() {
	for r.pending() && r.drain.TryLock() {
		r.drainLocked()
		r.drain.Unlock()
	}
}

// kick hands what is queued to the transmit goroutine.
func (r *txRing) kick() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// run is the transmit goroutine.
func (r *txRing) run(ctx context.Context, done func()) {
	defer done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		}
		r.drain.Lock()
		r.drainLocked()
		r.drain.Unlock()
		r.flushInline()
	}
}

// drainLocked sends committed slots from head, in batches, until it meets
// an empty or uncommitted one, and reports whether it sent any. r.drain is
// held.
func (r *txRing) drainLocked() (sent bool) {
	n := uint64(len(r.slots))
	for {
		h, t := r.head.Load(), r.tail.Load()
		k := 0
		for h+uint64(k) < t && k < len(r.dgs) {
			s := &r.slots[(h+uint64(k))%n]
			if !s.committed.Load() {
				break
			}
			r.dgs[k] = s.dg
			k++
		}
		if k == 0 {
			return sent
		}
		sent = true
		r.transmit(r.dgs[:k])
		for i := range k {
			s := &r.slots[(h+uint64(i))%n]
			s.dg = wire.Datagram{}
			s.committed.Store(false)
		}
		r.head.Store(h + uint64(k))
	}
}

// transmit hands a batch to the wire, skipping (and counting) datagrams it
// refuses and slots that hold nothing.
func (r *txRing) transmit(dgs []wire.Datagram) {
	f := r.f
	// Drop placeholders of packets that failed to encode.
	k := 0
	for _, d := range dgs {
		if d.Packet != nil {
			dgs[k] = d
			k++
		}
	}
	dgs = dgs[:k]
	for len(dgs) > 0 {
		sent, err := f.wire.Transmit(dgs)
		var bytes uint64
		for _, d := range dgs[:sent] {
			bytes += uint64(len(d.Packet))
		}
		f.ctrs.add(cntTxBytes, bytes)
		f.ctrs.add(cntTxPackets, uint64(sent))
		dgs = dgs[sent:]
		switch {
		case err != nil:
			if errors.Is(err, wire.ErrOversize) {
				f.ctrs.inc(cntTxDropOversize)
			} else {
				f.ctrs.inc(cntTxErrors)
			}
			if len(dgs) > 0 {
				dgs = dgs[1:]
			}
		case sent == 0:
			f.ctrs.inc(cntTxErrors)
			return
		}
	}
}
