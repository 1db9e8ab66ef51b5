package soft

import (
	"container/heap"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// simNet is a network simulated in virtual time, for the tests that judge
// behaviour under emulated time (congestion control, pacing, timers): the
// test's goroutine runs all of it, one event at a time, so a run gives the
// same figures however fast the machine is and whatever else runs on it.
//
// Each fabric's wire is a simPort. What a fabric transmits becomes events
// at virtual times: the datagram crosses its host's link (serialised at the
// port's rate), reaches the switch after the propagation delay, waits in
// the switch's egress queue towards its destination if that port has one
// (a bottleneck: drained at its rate, marking CE above a threshold at
// dequeue, dropping above a cap), and reaches the destination's host after
// the delay again. At that time the simulator hands it to the destination
// fabric's receive path itself, on the test's goroutine (the fabric's own
// receive goroutine waits on the simPort and never gets a datagram). The
// fabrics' timers run on the simulator's ManualClock, which it advances
// from one event or timer to the next, never further.
//
// What the transport does in reply runs on the same goroutine and before
// the next event: transmission (the send ring is drained inline) and
// completions (a chanCQ fills at once). Only the fabric's READ pump runs
// on its own goroutine, so a simulation keeps READs below readBurst
// packets.
type simNet struct {
	clock  *ManualClock
	delay  time.Duration // one-way propagation, host to switch and switch to host
	events simEvents
	seq    uint64
	ports  []*simPort
	// unrouted counts datagrams to a GID no port's fabric owns.
	unrouted uint64
}

// simPort is one host's attachment: a wire.Wire for its fabric.
type simPort struct {
	n        *simNet
	f        *Fabric
	rate     float64   // the host link's rate, bytes per second (0: no serialisation)
	linkFree time.Time // when the host link has sent what it was given
	q        *simQueue // the switch's egress queue towards this host (nil: none)
	closed   chan struct{}
	done     bool
}

// simQueue is a switch's egress queue into a slower link.
type simQueue struct {
	rate     float64 // bytes per second
	markAt   int     // CE-mark on leaving while more than this many bytes are queued
	capBytes int     // drop arrivals that would exceed this
	bytes    int
	free     time.Time // when the link has sent what is queued
	drops    uint64
	marked   uint64
	// all holds the queue's depth (bytes) at each arrival, depths the
	// same from sampleFrom on.
	all, depths []int
	sampleFrom  time.Time
}

type simEventKind uint8

const (
	simArrive  simEventKind = iota // at the switch queue towards to
	simLeave                       // the queue towards to has sent it
	simDeliver                     // at to's host
)

type simEvent struct {
	at   time.Time
	seq  uint64
	kind simEventKind
	to   *simPort
	pkt  []byte
}

type simEvents []simEvent

func (h simEvents) Len() int { return len(h) }
func (h simEvents) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}
func (h simEvents) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *simEvents) Push(x any)   { *h = append(*h, x.(simEvent)) }
func (h *simEvents) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = simEvent{}
	*h = old[:len(old)-1]
	return e
}

// simEpoch is where every simulation's clock starts.
var simEpoch = time.Unix(1000, 0)

func newSimNet(delay time.Duration) *simNet {
	return &simNet{clock: NewManualClock(simEpoch), delay: delay}
}

// fabric creates a fabric on a new port whose host link sends rate bytes
// per second (0: at once); cfg's Wire and Clock are the simulation's.
func (n *simNet) fabric(t testing.TB, cfg Config, rate float64) (*Fabric, *simPort) {
	t.Helper()
	p := &simPort{n: n, rate: rate, closed: make(chan struct{})}
	cfg.Wire, cfg.Clock = p, n.clock
	f, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	p.f = f
	n.ports = append(n.ports, p)
	return f, p
}

// bottleneck puts an egress queue into a link of rate bytes per second in
// front of p's host.
func (p *simPort) bottleneck(rate float64, markAt, capBytes int) *simQueue {
	p.q = &simQueue{rate: rate, markAt: markAt, capBytes: capBytes}
	return p.q
}

func (n *simNet) schedule(at time.Time, kind simEventKind, to *simPort, pkt []byte) {
	n.seq++
	heap.Push(&n.events, simEvent{at: at, seq: n.seq, kind: kind, to: to, pkt: pkt})
}

// bytesTime is how long a link of rate bytes per second takes for n bytes.
func bytesTime(n int, rate float64) time.Duration {
	return time.Duration(float64(n) / rate * 1e9)
}

// route returns the port whose fabric owns the datagram's destination GID.
func (n *simNet) route(pkt []byte) *simPort {
	var rp roce.Packet
	if rp.Parse(pkt) != nil {
		return nil
	}
	dst := rp.DstGID()
	for _, p := range n.ports {
		if p.f != nil && p.f.lookupGID(dst) != nil {
			return p
		}
	}
	return nil
}

// Transmit puts the datagrams on the host's link at the clock's time.
func (p *simPort) Transmit(pkts []wire.Datagram) (int, error) {
	n := p.n
	if p.done {
		return 0, fmt.Errorf("sim transmit: %w", hostverbs.ErrClosed)
	}
	now := n.clock.Now()
	for _, d := range pkts {
		to := n.route(d.Packet)
		if to == nil {
			n.unrouted++
			continue
		}
		sent := now
		if p.rate > 0 {
			sent = maxTime(now, p.linkFree).Add(bytesTime(len(d.Packet), p.rate))
			p.linkFree = sent
		}
		pkt := append([]byte(nil), d.Packet...)
		if to.q != nil {
			n.schedule(sent.Add(n.delay), simArrive, to, pkt)
		} else {
			n.schedule(sent.Add(2*n.delay), simDeliver, to, pkt)
		}
	}
	return len(pkts), nil
}

func (p *simPort) Queues() int { return 1 }

// Receive waits for the end: the simulator delivers datagrams itself.
func (p *simPort) Receive(ctx context.Context, _ int, _, _ [][]byte) (int, error) {
	select {
	case <-p.closed:
		return 0, hostverbs.ErrClosed
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

func (p *simPort) Close() error {
	if !p.done {
		p.done = true
		close(p.closed)
	}
	return nil
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// step runs what comes next, the next event or the timers due before it,
// and reports whether there was anything.
func (n *simNet) step() bool {
	now := n.clock.Now()
	timer, armed := n.clock.Next()
	if len(n.events) == 0 && !armed {
		return false
	}
	if len(n.events) == 0 || armed && timer.Before(n.events[0].at) {
		n.clock.Advance(max(timer.Sub(now), 0))
		return true
	}
	e := heap.Pop(&n.events).(simEvent)
	if e.at.After(now) {
		n.clock.Advance(e.at.Sub(now)) // fires the timers due at the same time first
	}
	n.handle(e)
	return true
}

func (n *simNet) handle(e simEvent) {
	now := n.clock.Now()
	switch e.kind {
	case simArrive:
		q := e.to.q
		q.all = append(q.all, q.bytes)
		if !now.Before(q.sampleFrom) {
			q.depths = append(q.depths, q.bytes)
		}
		if q.bytes+len(e.pkt) > q.capBytes {
			q.drops++
			return
		}
		q.bytes += len(e.pkt)
		q.free = maxTime(now, q.free).Add(bytesTime(len(e.pkt), q.rate))
		n.schedule(q.free, simLeave, e.to, e.pkt)
	case simLeave:
		q := e.to.q
		if q.bytes > q.markAt {
			// Marked as it leaves (dequeue marking): the mark reflects
			// the queue now and reaches the receiver without waiting
			// behind it.
			if markCE(e.pkt) {
				q.marked++
			}
		}
		q.bytes -= len(e.pkt)
		n.schedule(now.Add(n.delay), simDeliver, e.to, e.pkt)
	case simDeliver:
		f := e.to.f
		tx := f.getTx()
		var rp roce.Packet
		var p packet
		f.receive(tx, e.pkt, nil, &rp, &p)
		tx.flush()
		f.putTx(tx)
	}
}

// runUntil steps the simulation until the clock reaches end, calling
// after (if set) after each step. It fails the test if the simulation
// ends before: nothing left to happen and nothing armed (the traffic
// stalled, or was never started).
func (n *simNet) runUntil(t testing.TB, end time.Time, after func()) {
	t.Helper()
	for n.clock.Now().Before(end) {
		if !n.step() {
			t.Fatalf("simulation ended at %v, %v before its end: nothing left to happen and no timer armed",
				n.clock.Now().Sub(simEpoch), end.Sub(n.clock.Now()))
			return
		}
		if after != nil {
			after()
		}
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the message and returns.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
}

// TestSimNetRunUntil: a simulation that has nothing left to happen before its end
// fails the test (a stalled run would otherwise pass with whatever it had counted);
// one whose timers carry it to the end does not.
func TestSimNetRunUntil(t *testing.T) {
	n := newSimNet(time.Microsecond)
	var rec fatalRecorder
	n.runUntil(&rec, n.clock.Now().Add(time.Second), nil)
	require.Contains(t, rec.msg, "simulation ended at 0s, 1s before its end")

	n = newSimNet(time.Microsecond)
	ticks := 0
	var tick func()
	tick = func() { ticks++; n.clock.AfterFunc(100*time.Millisecond, tick) }
	n.clock.AfterFunc(100*time.Millisecond, tick)
	rec = fatalRecorder{}
	n.runUntil(&rec, n.clock.Now().Add(time.Second), nil)
	require.Empty(t, rec.msg)
	require.Equal(t, 10, ticks)
}
