package ringbuf

import (
	"fmt"
	"math/bits"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// RingStateSize is sizeof(struct pvrdma_ring): u32 prod_tail, u32 cons_head.
const RingStateSize = 8

// Offsets inside struct pvrdma_ring.
const (
	offProdTail = 0
	offConsHead = 4
)

// Geometry is a ring's index arithmetic, reproduced exactly as the guest
// driver computes it from an element count ("slots"):
//
//	valid(i) = i & ^(2*slots-1) == 0
//	slot(i)  = i & (slots-1)
//	inc(i)   = (i+1) & (2*slots-1)
//
// For a power-of-two count this is the usual wrap-bit ring of slots
// elements. The driver also applies it to the async-event and
// CQ-notification rings, whose counts are (pages-1)*4096/entry size and not
// powers of two (3072 for a 4-page CQ-notify ring). The arithmetic then
// cycles through indices [0, 2n) over n slots, where n is the largest power
// of two dividing slots (1024 for 3072): inc wraps to 0 when i+1 == 2n
// because bit log2(2n) of 2*slots-1 is clear, and slot(i) == i & (n-1) for
// every i < 2n. Geometry works in those effective terms, so the device
// writes exactly the slots the driver reads (a natural modulo-slots producer
// would write others, and after 2n entries write indices the driver refuses).
type Geometry struct {
	slots uint32 // count as the driver computes it
	n     uint32 // effective element count: lowest set bit of slots
}

// NewGeometry returns the geometry of a ring the driver sizes with slots
// elements. slots must be nonzero and below 2^31 (indices carry one more
// bit).
func NewGeometry(slots uint32) (Geometry, error) {
	if slots == 0 || slots >= 1<<31 {
		return Geometry{}, fmt.Errorf("ring of %d elements: %w", slots, ErrGeometry)
	}
	return Geometry{slots: slots, n: slots & -slots}, nil
}

// Slots is the element count the driver uses in its arithmetic.
func (g Geometry) Slots() uint32 { return g.slots }

// Len is the number of distinct element slots the ring really uses.
func (g Geometry) Len() uint32 { return g.n }

// Valid reports whether idx is an index the driver's arithmetic can
// produce: it passes the driver's own validity test and lies in [0, 2n).
func (g Geometry) Valid(idx uint32) bool {
	return idx&^(2*g.slots-1) == 0 && idx < 2*g.n
}

// Inc returns the index after idx.
func (g Geometry) Inc(idx uint32) uint32 { return (idx + 1) & (2*g.n - 1) }

// Slot returns the element slot of idx.
func (g Geometry) Slot(idx uint32) uint32 { return idx & (g.n - 1) }

// Used returns how many elements lie between head and tail (both valid).
func (g Geometry) Used(head, tail uint32) uint32 { return (tail - head) & (2*g.n - 1) }

// Area is the element array of a ring: n elements of stride bytes starting
// base bytes into the virtually contiguous span of the ring's pages. The
// stride is a power of two no larger than a page and base is a multiple of
// the stride, so an element never straddles two pages.
type Area struct {
	pages  []guestmem.GPA
	base   uint64
	shift  uint8 // log2(stride)
	n      uint32
	stride uint32
}

// NewArea describes n elements of stride bytes at byte offset base of
// pages. It fails unless stride is a power of two in [1, 4096], base is
// stride-aligned, and the elements fit inside the pages.
func NewArea(pages []guestmem.GPA, base uint64, stride, n uint32) (Area, error) {
	if stride == 0 || stride > guestmem.PageSize || stride&(stride-1) != 0 {
		return Area{}, fmt.Errorf("element stride %d: %w", stride, ErrGeometry)
	}
	if base%uint64(stride) != 0 {
		return Area{}, fmt.Errorf("element base %#x not %d-aligned: %w", base, stride, ErrGeometry)
	}
	end := base + uint64(n)*uint64(stride)
	if n == 0 || end > uint64(len(pages))*guestmem.PageSize {
		return Area{}, fmt.Errorf("%d elements of %d bytes at %#x need %d bytes, pages hold %d: %w",
			n, stride, base, end, uint64(len(pages))*guestmem.PageSize, ErrPageCount)
	}
	return Area{pages: pages, base: base, shift: uint8(bits.TrailingZeros32(stride)), n: n, stride: stride}, nil
}

// Stride is the size of one element.
func (a Area) Stride() uint32 { return a.stride }

// Len is the number of elements.
func (a Area) Len() uint32 { return a.n }

// Elem returns the guest address of element slot (taken modulo Len, so any
// slot value is safe).
func (a Area) Elem(slot uint32) guestmem.GPA {
	off := a.base + uint64(slot%a.n)<<a.shift
	return a.pages[off>>guestmem.PageShift] + guestmem.GPA(off&(guestmem.PageSize-1))
}

// guestIndex is an index the guest owns: the device loads it atomically,
// once per use, validates it, and never writes it.
type guestIndex struct{ gpa guestmem.GPA }

func (gi guestIndex) load(m *guestmem.Memory, g Geometry) (uint32, error) {
	v, err := m.LoadUint32(gi.gpa)
	if err != nil {
		return 0, fmt.Errorf("load ring index at %v: %w", gi.gpa, err)
	}
	if !g.Valid(v) {
		return 0, fmt.Errorf("ring index %#x at %v (ring of %d): %w", v, gi.gpa, g.slots, ErrIndex)
	}
	return v, nil
}

// deviceIndex is an index the device owns: its truth is val, mirrored to
// guest memory after every change. What the guest writes there is ignored.
type deviceIndex struct {
	gpa guestmem.GPA
	val uint32
}

// adopt takes the index's value from guest memory, where a previous
// device left it, and validates it like an index the guest owns.
func (di *deviceIndex) adopt(m *guestmem.Memory, g Geometry) (uint32, error) {
	v, err := guestIndex{gpa: di.gpa}.load(m, g)
	if err != nil {
		return 0, fmt.Errorf("adopt: %w", err)
	}
	di.val = v
	return v, nil
}

func (di *deviceIndex) store(m *guestmem.Memory, v uint32) error {
	di.val = v
	if err := m.StoreUint32(di.gpa, v); err != nil {
		return fmt.Errorf("store ring index at %v: %w", di.gpa, err)
	}
	return nil
}

// Consumer is a ring the guest produces and the device consumes (send,
// receive and shared receive queues). It owns cons_head. A Consumer is not
// safe for concurrent use.
//
// It keeps two cursors. The posted cursor, in Go memory only, is the next
// element to read and hand on (Next, Take); cons_head, mirrored to guest
// memory, is where the guest may reuse slots from, and moves only when the
// caller releases elements (Release). Between them lie the elements taken
// but not released: work handed on that has not completed. A ring whose
// elements complete in order releases up to an element when it completes,
// so that guest memory always shows, between cons_head and prod_tail,
// every element posted that has not completed; one whose elements may
// complete out of order (a shared receive queue) releases at once with
// Advance.
type Consumer struct {
	mem    *guestmem.Memory
	geo    Geometry
	area   Area
	tail   guestIndex
	head   deviceIndex // cons_head: everything before it is released
	posted uint32      // the next element to take
}

// NewConsumer returns the consumer side of the ring whose struct
// pvrdma_ring is at state, and sets cons_head to 0. The area must hold the
// geometry's elements.
func NewConsumer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Consumer, error) {
	c, err := newConsumer(m, state, g, a)
	if err != nil {
		return nil, err
	}
	if err := c.Reset(); err != nil {
		return nil, err
	}
	return c, nil
}

// AdoptConsumer is NewConsumer for a ring that already holds work: a
// device rebuilt over a running guest (a journal replay after a crash)
// takes cons_head from guest memory instead of resetting it, and starts
// its posted cursor there, so that the elements between cons_head and
// prod_tail, which no completion released, are read and posted again. An
// index the ring's arithmetic cannot produce is an ErrIndex.
func AdoptConsumer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Consumer, error) {
	c, err := newConsumer(m, state, g, a)
	if err != nil {
		return nil, err
	}
	if err := c.Adopt(); err != nil {
		return nil, err
	}
	return c, nil
}

func newConsumer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Consumer, error) {
	if a.Len() < g.Len() {
		return nil, fmt.Errorf("ring of %d elements in an area of %d: %w", g.Len(), a.Len(), ErrGeometry)
	}
	return &Consumer{mem: m, geo: g, area: a,
		tail: guestIndex{gpa: state + offProdTail}, head: deviceIndex{gpa: state + offConsHead}}, nil
}

// Pending loads the guest's prod_tail once and returns how many elements
// wait to be taken (prod_tail - posted). An invalid tail, one more than a
// ring ahead of cons_head, or one behind the posted cursor is an ErrIndex.
func (c *Consumer) Pending() (uint32, error) {
	t, err := c.tail.load(c.mem, c.geo)
	if err != nil {
		return 0, err
	}
	used := c.geo.Used(c.head.val, t)
	if used > c.geo.Len() {
		return 0, fmt.Errorf("prod_tail %#x is %d ahead of cons_head %#x (ring of %d): %w",
			t, used, c.head.val, c.geo.Len(), ErrIndex)
	}
	taken := c.Outstanding()
	if used < taken {
		return 0, fmt.Errorf("prod_tail %#x is behind the %d elements taken from cons_head %#x: %w",
			t, taken, c.head.val, ErrIndex)
	}
	return used - taken, nil
}

// Next returns the address of the element at the posted cursor: the next
// one to take.
func (c *Consumer) Next() guestmem.GPA { return c.area.Elem(c.geo.Slot(c.posted)) }

// NextIndex returns the posted cursor.
func (c *Consumer) NextIndex() uint32 { return c.posted }

// Take moves the posted cursor past the element at Next, leaving it
// unreleased. The caller checks Pending first; taking a ring's worth more
// than cons_head is an ErrFull.
func (c *Consumer) Take() error {
	if c.Outstanding() >= c.geo.Len() {
		return fmt.Errorf("take beyond a ring of %d from cons_head %#x: %w", c.geo.Len(), c.head.val, ErrFull)
	}
	c.posted = c.geo.Inc(c.posted)
	return nil
}

// Untake gives back the element the last Take took, which could not be
// handed on (a full provider queue): it is the next one again. It fails
// with ErrIndex when no element is taken.
func (c *Consumer) Untake() error {
	if c.posted == c.head.val {
		return fmt.Errorf("untake at cons_head %#x with nothing taken: %w", c.head.val, ErrIndex)
	}
	c.posted = (c.posted - 1) & (2*c.geo.n - 1)
	return nil
}

// Outstanding returns how many elements are taken and not released.
func (c *Consumer) Outstanding() uint32 { return c.geo.Used(c.head.val, c.posted) }

// Release moves cons_head forward to upTo (the index after the last
// element released) and stores it in guest memory. Release is monotonic:
// an upTo at or behind cons_head changes nothing. One beyond the posted
// cursor, or not an index of the ring, is an ErrIndex and changes nothing.
func (c *Consumer) Release(upTo uint32) error {
	if !c.geo.Valid(upTo) {
		return fmt.Errorf("release to %#x (ring of %d): %w", upTo, c.geo.slots, ErrIndex)
	}
	ahead := c.geo.Used(c.head.val, upTo)
	switch {
	case ahead == 0:
		return nil
	case ahead <= c.Outstanding():
		return c.head.store(c.mem, upTo)
	case ahead >= c.geo.Len():
		return nil // behind cons_head: released already
	}
	return fmt.Errorf("release to %#x past the posted cursor %#x (cons_head %#x): %w",
		upTo, c.posted, c.head.val, ErrIndex)
}

// Advance takes the element at Next and releases everything taken: the
// behaviour of a ring whose elements are done once handed on (or may
// complete out of order, so that none can be held back).
func (c *Consumer) Advance() error {
	if err := c.Take(); err != nil {
		return err
	}
	return c.Release(c.posted)
}

// Head returns the address of the element at cons_head: the oldest one not
// released.
func (c *Consumer) Head() guestmem.GPA { return c.area.Elem(c.geo.Slot(c.head.val)) }

// HeadIndex returns cons_head.
func (c *Consumer) HeadIndex() uint32 { return c.head.val }

// Elem returns the address of the element at index idx (any value is
// safe; only its slot counts).
func (c *Consumer) Elem(idx uint32) guestmem.GPA { return c.area.Elem(c.geo.Slot(idx)) }

// Geometry returns the ring's index arithmetic.
func (c *Consumer) Geometry() Geometry { return c.geo }

// Reset sets cons_head and the posted cursor back to 0, as the guest does
// to both indices when it resets the queue.
func (c *Consumer) Reset() error {
	c.posted = 0
	return c.head.store(c.mem, 0)
}

// Adopt loads cons_head from guest memory, validates it and restarts the
// posted cursor there, forgetting what was taken: what a rebuilt device
// does where a new one would Reset (see AdoptConsumer).
func (c *Consumer) Adopt() error {
	v, err := c.head.adopt(c.mem, c.geo)
	if err != nil {
		return err
	}
	c.posted = v
	return nil
}

// Stride is the element size.
func (c *Consumer) Stride() uint32 { return c.area.Stride() }

// Len is the ring's element count.
func (c *Consumer) Len() uint32 { return c.geo.Len() }

// Producer is a ring the device produces and the guest consumes
// (completion queues, the async-event and CQ-notification rings). It owns
// prod_tail. A Producer is not safe for concurrent use.
type Producer struct {
	mem  *guestmem.Memory
	geo  Geometry
	area Area
	head guestIndex
	tail deviceIndex
}

// NewProducer returns the producer side of the ring whose struct
// pvrdma_ring is at state, and sets prod_tail to 0.
func NewProducer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Producer, error) {
	p, err := newProducer(m, state, g, a)
	if err != nil {
		return nil, err
	}
	if err := p.tail.store(m, 0); err != nil {
		return nil, err
	}
	return p, nil
}

// AdoptProducer is NewProducer for a ring that already holds elements: a
// device rebuilt over a running guest (a journal replay after a crash)
// takes prod_tail from guest memory instead of resetting it, so that the
// guest's unconsumed elements stay and new ones follow them. An index the
// ring's arithmetic cannot produce is an ErrIndex.
func AdoptProducer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Producer, error) {
	p, err := newProducer(m, state, g, a)
	if err != nil {
		return nil, err
	}
	if _, err := p.tail.adopt(m, g); err != nil {
		return nil, err
	}
	return p, nil
}

func newProducer(m *guestmem.Memory, state guestmem.GPA, g Geometry, a Area) (*Producer, error) {
	if a.Len() < g.Len() {
		return nil, fmt.Errorf("ring of %d elements in an area of %d: %w", g.Len(), a.Len(), ErrGeometry)
	}
	return &Producer{mem: m, geo: g, area: a,
		head: guestIndex{gpa: state + offConsHead}, tail: deviceIndex{gpa: state + offProdTail}}, nil
}

// Reserve loads the guest's cons_head once and returns the address of the
// free element at prod_tail. It fails with ErrFull when the guest has not
// consumed enough, and with ErrIndex when cons_head is invalid. The element
// is published by Commit.
func (p *Producer) Reserve() (guestmem.GPA, error) {
	h, err := p.head.load(p.mem, p.geo)
	if err != nil {
		return 0, err
	}
	used := p.geo.Used(h, p.tail.val)
	if used > p.geo.Len() {
		return 0, fmt.Errorf("cons_head %#x is %d behind prod_tail %#x (ring of %d): %w",
			h, used, p.tail.val, p.geo.Len(), ErrIndex)
	}
	if used == p.geo.Len() {
		return 0, ErrFull
	}
	return p.area.Elem(p.geo.Slot(p.tail.val)), nil
}

// Commit publishes the element returned by the last Reserve. The caller
// orders its element writes before Commit (guestmem stores are not
// reordered past the atomic index store on amd64, and Go's atomics are
// sequentially consistent).
func (p *Producer) Commit() error { return p.tail.store(p.mem, p.geo.Inc(p.tail.val)) }

// TailIndex returns prod_tail.
func (p *Producer) TailIndex() uint32 { return p.tail.val }

// Reset sets prod_tail back to 0.
func (p *Producer) Reset() error { return p.tail.store(p.mem, 0) }

// Len is the ring's element count.
func (p *Producer) Len() uint32 { return p.geo.Len() }

// Resize changes the element count to g (the guest's pages must hold it),
// keeping the area's pages. It is allowed only while the ring is empty;
// both indices restart at 0 and the caller tells the guest so.
func (p *Producer) Resize(g Geometry, stride uint32) error {
	h, err := p.head.load(p.mem, p.geo)
	if err != nil {
		return err
	}
	if h != p.tail.val {
		return fmt.Errorf("resize a ring holding %d elements: %w", p.geo.Used(h, p.tail.val), ErrFull)
	}
	a, err := NewArea(p.area.pages, p.area.base, stride, g.Len())
	if err != nil {
		return err
	}
	p.geo, p.area = g, a
	return p.tail.store(p.mem, 0)
}

// ResizeAdopt is Resize for a device rebuilt over a running guest (see
// AdoptProducer): the resize happened long ago, so the ring need not be
// empty and prod_tail is taken from guest memory, validated against g.
// On an error the ring is unchanged.
func (p *Producer) ResizeAdopt(g Geometry, stride uint32) error {
	a, err := NewArea(p.area.pages, p.area.base, stride, g.Len())
	if err != nil {
		return err
	}
	tail := p.tail
	if _, err := tail.adopt(p.mem, g); err != nil {
		return err
	}
	p.geo, p.area, p.tail = g, a, tail
	return nil
}
