package wire

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// MemNet is an in-memory network joining the Wires it hands out: every
// datagram one port transmits reaches every other port (fabrics drop what
// is not addressed to their GIDs), after optional impairments drawn from a
// seeded generator. It exercises the whole wire codec (encoding, ICRC,
// parsing) without the kernel, for deterministic reliability tests.
type MemNet struct {
	mu     sync.Mutex
	rng    *rand.Rand
	imp    Impairment
	ports  []*memPort
	held   []heldPacket
	closed bool
	stop   chan struct{}
	stats  MemNetStats
}

// Impairment describes what MemNet does to datagrams in flight.
type Impairment struct {
	// Loss, Duplicate and Reorder are probabilities per datagram.
	Loss, Duplicate, Reorder float64
	// ReorderDepth is how many later datagrams overtake a reordered one
	// (default 3); a held datagram is released after at most HoldTime
	// (default 2 ms) even if no others follow.
	ReorderDepth int
	HoldTime     time.Duration
	// Drop, if set, is asked about every datagram first; true drops it.
	// The slice must not be retained.
	Drop func(pkt []byte) bool
}

// MemNetStats counts what the impairments did.
type MemNetStats struct {
	Sent, Delivered, Lost, Duplicated, Reordered, Overflowed uint64
}

type heldPacket struct {
	from    *memPort
	pkt     []byte
	overtak int
	since   time.Time
}

type memPort struct {
	net    *MemNet
	q      chan []byte
	done   chan struct{}
	once   sync.Once
	closed bool
}

// memQueueLen is each port's receive queue; a full queue drops, as a NIC
// ring does.
const memQueueLen = 8192

// NewMemNet returns a network whose impairments draw from seed.
func NewMemNet(seed uint64) *MemNet {
	n := &MemNet{rng: rand.New(rand.NewPCG(seed, seed+1)), stop: make(chan struct{})}
	go n.releaseLoop()
	return n
}

// SetImpairment changes the impairments for datagrams sent from now on.
func (n *MemNet) SetImpairment(imp Impairment) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if imp.ReorderDepth <= 0 {
		imp.ReorderDepth = 3
	}
	if imp.HoldTime <= 0 {
		imp.HoldTime = 2 * time.Millisecond
	}
	n.imp = imp
}

// Stats returns the impairment counters.
func (n *MemNet) Stats() MemNetStats {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.stats
}

// Attach returns a new port on the network.
func (n *MemNet) Attach() Wire {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := &memPort{net: n, q: make(chan []byte, memQueueLen), done: make(chan struct{})}
	n.ports = append(n.ports, p)
	return p
}

// Close stops the network's release timer; ports close on their own.
func (n *MemNet) Close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.closed {
		n.closed = true
		close(n.stop)
	}
}

func (n *MemNet) releaseLoop() {
	t := time.NewTicker(500 * time.Microsecond)
	defer t.Stop()
	for {
		select {
		case <-n.stop:
			return
		case now := <-t.C:
			n.mu.Lock()
			n.releaseLocked(func(h *heldPacket) bool { return now.Sub(h.since) >= n.imp.HoldTime })
			n.mu.Unlock()
		}
	}
}

// releaseLocked delivers the held datagrams release selects.
func (n *MemNet) releaseLocked(release func(h *heldPacket) bool) {
	kept := n.held[:0]
	for i := range n.held {
		h := n.held[i]
		if release(&h) {
			n.deliverLocked(h.from, h.pkt)
		} else {
			kept = append(kept, h)
		}
	}
	clear(n.held[len(kept):])
	n.held = kept
}

func (n *MemNet) deliverLocked(from *memPort, pkt []byte) {
	for _, p := range n.ports {
		if p == from || p.closed {
			continue
		}
		select {
		case p.q <- pkt:
			n.stats.Delivered++
		default:
			n.stats.Overflowed++
		}
	}
}

func (p *memPort) Transmit(pkts []Datagram) (int, error) {
	n := p.net
	n.mu.Lock()
	defer n.mu.Unlock()
	if p.closed {
		return 0, fmt.Errorf("memnet transmit: %w", hostverbs.ErrClosed)
	}
	imp := &n.imp
	for _, d := range pkts {
		n.stats.Sent++
		if imp.Drop != nil && imp.Drop(d.Packet) {
			n.stats.Lost++
			continue
		}
		if imp.Loss > 0 && n.rng.Float64() < imp.Loss {
			n.stats.Lost++
			continue
		}
		copies := 1
		if imp.Duplicate > 0 && n.rng.Float64() < imp.Duplicate {
			copies = 2
			n.stats.Duplicated++
		}
		for range copies {
			pkt := append([]byte(nil), d.Packet...)
			// Every datagram sent counts towards releasing held ones.
			for i := range n.held {
				n.held[i].overtak++
			}
			n.releaseLocked(func(h *heldPacket) bool { return h.overtak > imp.ReorderDepth })
			if imp.Reorder > 0 && n.rng.Float64() < imp.Reorder {
				n.stats.Reordered++
				n.held = append(n.held, heldPacket{from: p, pkt: pkt, since: time.Now()})
				continue
			}
			n.deliverLocked(p, pkt)
		}
	}
	return len(pkts), nil
}

func (p *memPort) Queues() int { return 1 }

func (p *memPort) Receive(ctx context.Context, _ int, bufs, out [][]byte) (int, error) {
	var first []byte
	select {
	case first = <-p.q:
	case <-p.done:
		return 0, fmt.Errorf("memnet receive: %w", hostverbs.ErrClosed)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	out[0] = bufs[0][:copy(bufs[0], first)]
	k := 1
	for k < len(bufs) {
		select {
		case pkt := <-p.q:
			out[k] = bufs[k][:copy(bufs[k], pkt)]
			k++
		default:
			return k, nil
		}
	}
	return k, nil
}

func (p *memPort) Close() error {
	p.once.Do(func() {
		p.net.mu.Lock()
		p.closed = true
		p.net.mu.Unlock()
		close(p.done)
	})
	return nil
}
