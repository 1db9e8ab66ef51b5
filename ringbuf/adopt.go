package ringbuf

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Adopting a running ring: a restarted device rebuilds its rings over the
// guest's, which kept running. The index the device owns is then taken
// from guest memory, where the previous device mirrored it after every
// change, instead of being reset to 0 (NewConsumer, NewProducer): nothing
// is written, so the guest sees no index move. The loaded index must be
// one the geometry can produce; a guest that overwrote it gets ErrIndex,
// as for its own indices.
//
// (Minimal helpers for the replay branch; the data-path branch may grow
// an equivalent option on NewConsumer/NewProducer, and the two merge.)

// AdoptConsumer returns the consumer side of a running ring whose struct
// pvrdma_ring is at state, with cons_head loaded from guest memory.
func AdoptConsumer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Consumer, error) {
	if a.Len() < g.Len() {
		return nil, fmt.Errorf("ring of %d elements in an area of %d: %w", g.Len(), a.Len(), ErrGeometry)
	}
	c := &Consumer{mem: m, geo: g, area: a,
		tail: guestIndex{gpa: state + offProdTail}, head: deviceIndex{gpa: state + offConsHead}}
	v, err := guestIndex{gpa: c.head.gpa}.load(m, g)
	if err != nil {
		return nil, fmt.Errorf("adopt cons_head: %w", err)
	}
	c.head.val = v
	return c, nil
}

// AdoptProducer returns the producer side of a running ring whose struct
// pvrdma_ring is at state, with prod_tail loaded from guest memory.
func AdoptProducer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Producer, error) {
	if a.Len() < g.Len() {
		return nil, fmt.Errorf("ring of %d elements in an area of %d: %w", g.Len(), a.Len(), ErrGeometry)
	}
	p := &Producer{mem: m, geo: g, area: a,
		head: guestIndex{gpa: state + offConsHead}, tail: deviceIndex{gpa: state + offProdTail}}
	v, err := guestIndex{gpa: p.tail.gpa}.load(m, g)
	if err != nil {
		return nil, fmt.Errorf("adopt prod_tail: %w", err)
	}
	p.tail.val = v
	return p, nil
}

// Empty reports whether the guest has consumed everything produced: its
// cons_head (loaded once) equals prod_tail. An invalid cons_head is an
// ErrIndex.
func (p *Producer) Empty() (bool, error) {
	h, err := p.head.load(p.mem, p.geo)
	if err != nil {
		return false, err
	}
	return h == p.tail.val, nil
}
