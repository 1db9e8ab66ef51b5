package ringbuf

import (
	"encoding/binary"
	"errors"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// driverValid, driverSlot and driverInc are pvrdma_ring.h's arithmetic,
// written out literally so that Geometry can be compared against it.
func driverValid(idx, max uint32) bool { return idx&^((max<<1)-1) == 0 }
func driverSlot(idx, max uint32) int32 {
	if driverValid(idx, max) {
		return int32(idx & (max - 1))
	}
	return -1
}
func driverInc(idx, max uint32) uint32 { return (idx + 1) & ((max << 1) - 1) }

func TestGeometryMatchesDriverArithmetic(t *testing.T) {
	// Power-of-two rings and the DSR rings' non-power-of-two counts
	// (4-page async ring: 1536 EQEs; 4-page CQ-notify ring: 3072 CQNEs;
	// and other page counts the driver could choose).
	for _, slots := range []uint32{1, 2, 8, 512, 1024, 1536, 3072, 5120, 7168, 6144, 261632} {
		g, err := NewGeometry(slots)
		require.NoError(t, err)
		idx := uint32(0)
		seen := map[uint32]bool{}
		for step := 0; step < int(4*g.Len())+7; step++ {
			require.True(t, g.Valid(idx), "slots %d idx %d", slots, idx)
			require.True(t, driverValid(idx, slots))
			require.Equal(t, driverSlot(idx, slots), int32(g.Slot(idx)), "slots %d idx %d", slots, idx)
			seen[g.Slot(idx)] = true
			next := g.Inc(idx)
			require.Equal(t, driverInc(idx, slots), next, "slots %d idx %d", slots, idx)
			idx = next
		}
		assert.Len(t, seen, int(g.Len()), "slots %d", slots)
	}
	g, _ := NewGeometry(3072)
	assert.EqualValues(t, 1024, g.Len(), "CQ-notify ring: 1024 slots used, only page 1")
	g, _ = NewGeometry(1536)
	assert.EqualValues(t, 512, g.Len())
	// An index the driver's test accepts but its arithmetic never produces.
	g, _ = NewGeometry(3072)
	assert.True(t, driverValid(4096, 3072))
	assert.False(t, g.Valid(4096))
	assert.False(t, g.Valid(2048))
	_, err := NewGeometry(0)
	assert.ErrorIs(t, err, ErrGeometry)
	_, err = NewGeometry(1 << 31)
	assert.ErrorIs(t, err, ErrGeometry)
}

func TestAreaElem(t *testing.T) {
	pages := []guestmem.GPA{0x5000, 0x9000, 0x2000}
	a, err := NewArea(pages, guestmem.PageSize, 128, 64)
	require.NoError(t, err)
	assert.Equal(t, guestmem.GPA(0x9000), a.Elem(0))
	assert.Equal(t, guestmem.GPA(0x9000+31*128), a.Elem(31))
	assert.Equal(t, guestmem.GPA(0x2000), a.Elem(32))
	assert.Equal(t, guestmem.GPA(0x2000+128), a.Elem(33))
	assert.Equal(t, a.Elem(1), a.Elem(65), "slots wrap, never index out of range")

	_, err = NewArea(pages, guestmem.PageSize, 128, 65)
	assert.ErrorIs(t, err, ErrPageCount)
	_, err = NewArea(pages, 0, 96, 4)
	assert.ErrorIs(t, err, ErrGeometry)
	_, err = NewArea(pages, 0, 8192, 1)
	assert.ErrorIs(t, err, ErrGeometry)
	_, err = NewArea(pages, 4, 128, 1)
	assert.ErrorIs(t, err, ErrGeometry)
	_, err = NewArea(pages, 0, 64, 0)
	assert.ErrorIs(t, err, ErrPageCount)
}

const (
	stateGPA = 0x1000
	elemBase = 0x2000
)

func newRingMem(t *testing.T) (*guestmem.Memory, []byte) {
	t.Helper()
	return guestmem.NewFlat(0, 0x10000)
}

func TestConsumer(t *testing.T) {
	m, raw := newRingMem(t)
	g, _ := NewGeometry(4)
	a, err := NewArea([]guestmem.GPA{elemBase}, 0, 32, 4)
	require.NoError(t, err)
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 0xdead) // guest garbage in cons_head
	c, err := NewConsumer(m, stateGPA, g, a)
	require.NoError(t, err)
	assert.EqualValues(t, 0, binary.LittleEndian.Uint32(raw[stateGPA+4:]), "device initialises its index")

	n, err := c.Pending()
	require.NoError(t, err)
	assert.EqualValues(t, 0, n)

	// Guest produces 3, device consumes them, across the wrap bit.
	for round := 0; round < 5; round++ {
		tail := binary.LittleEndian.Uint32(raw[stateGPA:])
		for i := 0; i < 3; i++ {
			tail = g.Inc(tail)
		}
		binary.LittleEndian.PutUint32(raw[stateGPA:], tail)
		n, err = c.Pending()
		require.NoError(t, err)
		require.EqualValues(t, 3, n)
		for i := 0; i < 3; i++ {
			want := guestmem.GPA(elemBase + 32*g.Slot(c.HeadIndex()))
			require.Equal(t, want, c.Head())
			require.NoError(t, c.Advance())
		}
		assert.Equal(t, tail, binary.LittleEndian.Uint32(raw[stateGPA+4:]))
	}

	// Full ring (tail = head ^ n) is 4 pending.
	binary.LittleEndian.PutUint32(raw[stateGPA:], c.HeadIndex()^4)
	n, err = c.Pending()
	require.NoError(t, err)
	assert.EqualValues(t, 4, n)

	// Hostile tails: out of range, more than a ring ahead.
	for _, bad := range []uint32{8, 0xffffffff, 1 << 31} {
		binary.LittleEndian.PutUint32(raw[stateGPA:], bad)
		_, err = c.Pending()
		assert.ErrorIs(t, err, ErrIndex, "tail %#x", bad)
	}
	binary.LittleEndian.PutUint32(raw[stateGPA:], g.Inc(c.HeadIndex()^4))
	_, err = c.Pending()
	assert.ErrorIs(t, err, ErrIndex, "5 ahead of a 4-ring")

	require.NoError(t, c.Reset())
	assert.EqualValues(t, 0, binary.LittleEndian.Uint32(raw[stateGPA+4:]))
}

func TestProducer(t *testing.T) {
	m, raw := newRingMem(t)
	g, _ := NewGeometry(3072) // CQ-notify geometry: 1024 usable slots of 4 bytes
	a, err := NewArea([]guestmem.GPA{stateGPA, elemBase, 0x3000, 0x4000}, guestmem.PageSize, 4, g.Len())
	require.NoError(t, err)
	p, err := NewProducer(m, stateGPA, g, a)
	require.NoError(t, err)

	head := uint32(0)
	produced, fulls := 0, 0
	for step := 0; step < 3000; step++ {
		gpa, err := p.Reserve()
		if g.Used(head, p.TailIndex()) == g.Len() {
			require.ErrorIs(t, err, ErrFull)
			fulls++
		} else {
			require.NoError(t, err)
			require.GreaterOrEqual(t, gpa, guestmem.GPA(elemBase))
			require.Less(t, gpa, guestmem.GPA(elemBase+guestmem.PageSize), "only page 1 is ever used")
			require.NoError(t, m.PutUint32(gpa, uint32(step)))
			require.NoError(t, p.Commit())
			produced++
		}
		// The guest driver consumes with its own arithmetic, in bursts.
		if step%1100 == 1099 || (step > 2200 && step%3 == 0) {
			tail := binary.LittleEndian.Uint32(raw[stateGPA:])
			for head != tail {
				require.True(t, driverValid(head, 3072))
				head = driverInc(head, 3072)
			}
			binary.LittleEndian.PutUint32(raw[stateGPA+4:], head)
		}
	}
	assert.Greater(t, produced, 2048, "went around the index space more than once")
	assert.Greater(t, fulls, 0, "the ring filled up")

	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 4096) // driver-valid, never produced
	_, err = p.Reserve()
	assert.ErrorIs(t, err, ErrIndex)
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], g.Inc(g.Inc(p.TailIndex()))) // head ahead of tail
	_, err = p.Reserve()
	assert.ErrorIs(t, err, ErrIndex)
}

func TestProducerResize(t *testing.T) {
	m, raw := newRingMem(t)
	g, _ := NewGeometry(8)
	pages := []guestmem.GPA{stateGPA, elemBase}
	a, _ := NewArea(pages, guestmem.PageSize, 64, 8)
	p, err := NewProducer(m, stateGPA, g, a)
	require.NoError(t, err)
	_, err = p.Reserve()
	require.NoError(t, err)
	require.NoError(t, p.Commit())
	g2, _ := NewGeometry(64)
	assert.ErrorIs(t, p.Resize(g2, 64), ErrFull, "not empty")
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 1)
	require.NoError(t, p.Resize(g2, 64))
	assert.EqualValues(t, 64, p.Len())
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 0) // the guest restarts its head too
	g3, _ := NewGeometry(128)
	assert.ErrorIs(t, p.Resize(g3, 64), ErrPageCount, "does not fit the pages")
}

func TestUnmappedRingState(t *testing.T) {
	m, _ := newRingMem(t)
	g, _ := NewGeometry(4)
	a, _ := NewArea([]guestmem.GPA{elemBase}, 0, 32, 4)
	_, err := NewConsumer(m, 0x100000, g, a)
	assert.ErrorIs(t, err, guestmem.ErrUnmapped)
	_, err = NewProducer(m, 0x100000, g, a)
	assert.ErrorIs(t, err, guestmem.ErrUnmapped)
	// Misaligned state cannot be loaded atomically.
	_, err = NewConsumer(m, stateGPA+2, g, a)
	assert.True(t, errors.Is(err, guestmem.ErrAlign))
}

func newTestConsumer(t *testing.T, slots uint32) (*Consumer, Geometry, []byte) {
	t.Helper()
	m, raw := newRingMem(t)
	g, err := NewGeometry(slots)
	require.NoError(t, err)
	a, err := NewArea([]guestmem.GPA{elemBase}, 0, 32, g.Len())
	require.NoError(t, err)
	c, err := NewConsumer(m, stateGPA, g, a)
	require.NoError(t, err)
	return c, g, raw
}

func consHead(raw []byte) uint32   { return binary.LittleEndian.Uint32(raw[stateGPA+4:]) }
func setTail(raw []byte, v uint32) { binary.LittleEndian.PutUint32(raw[stateGPA:], v) }

func TestConsumerPostedCursor(t *testing.T) {
	c, g, raw := newTestConsumer(t, 4)
	setTail(raw, 3)
	n, err := c.Pending()
	require.NoError(t, err)
	require.EqualValues(t, 3, n)

	// Taking moves the posted cursor only: guest memory keeps cons_head.
	for i := uint32(0); i < 3; i++ {
		require.Equal(t, guestmem.GPA(elemBase+32*i), c.Next())
		require.Equal(t, i, c.NextIndex())
		require.NoError(t, c.Take())
	}
	assert.EqualValues(t, 0, consHead(raw), "nothing released")
	assert.EqualValues(t, 0, c.HeadIndex())
	assert.Equal(t, guestmem.GPA(elemBase), c.Head(), "the oldest unreleased element")
	assert.EqualValues(t, 3, c.Outstanding())
	n, err = c.Pending()
	require.NoError(t, err)
	assert.Zero(t, n, "pending counts from the posted cursor")

	// Release is monotonic and bounded by the posted cursor.
	require.NoError(t, c.Release(2))
	assert.EqualValues(t, 2, consHead(raw))
	assert.EqualValues(t, 1, c.Outstanding())
	require.NoError(t, c.Release(1), "behind cons_head: already released")
	require.NoError(t, c.Release(2), "at cons_head")
	assert.EqualValues(t, 2, consHead(raw))
	assert.ErrorIs(t, c.Release(4), ErrIndex, "past the posted cursor")
	assert.ErrorIs(t, c.Release(8), ErrIndex, "not an index")
	assert.EqualValues(t, 2, consHead(raw))

	// Untake gives the last element back; not past cons_head.
	require.NoError(t, c.Untake())
	assert.EqualValues(t, 2, c.NextIndex())
	assert.ErrorIs(t, c.Untake(), ErrIndex)
	n, err = c.Pending()
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)

	// Fill the ring: the guest may have a whole ring outstanding, no more.
	setTail(raw, g.Inc(g.Inc(g.Inc(g.Inc(2))))) // 6: four ahead of cons_head
	n, err = c.Pending()
	require.NoError(t, err)
	require.EqualValues(t, 4, n)
	for i := 0; i < 4; i++ {
		require.NoError(t, c.Take())
	}
	assert.ErrorIs(t, c.Take(), ErrFull)
	require.NoError(t, c.Release(6))
	assert.EqualValues(t, 6, consHead(raw))

	// A guest moving prod_tail behind what was taken is caught.
	require.NoError(t, c.Release(6))
	setTail(raw, 7)
	_, err = c.Pending()
	require.NoError(t, err)
	require.NoError(t, c.Take())
	setTail(raw, 6)
	_, err = c.Pending()
	assert.ErrorIs(t, err, ErrIndex, "prod_tail behind the posted cursor")

	// Advance is take-and-release, across the wrap.
	c2, g2, raw2 := newTestConsumer(t, 4)
	for i := 0; i < 11; i++ {
		setTail(raw2, g2.Inc(c2.NextIndex()))
		require.NoError(t, c2.Advance())
		require.Equal(t, c2.NextIndex(), consHead(raw2))
		require.Zero(t, c2.Outstanding())
	}
	assert.Equal(t, c2.Elem(c2.HeadIndex()), c2.Head())
	assert.Equal(t, g2, c2.Geometry())

	require.NoError(t, c.Reset())
	assert.Zero(t, consHead(raw))
	assert.Zero(t, c.NextIndex())
}

// TestConsumerModel runs random takes, untakes and releases against a
// plain model of the two cursors, across many wraps of a ring whose count
// is not a power of two.
func TestConsumerModel(t *testing.T) {
	for _, slots := range []uint32{1, 4, 12, 16} {
		c, g, raw := newTestConsumer(t, slots)
		rng := rand.New(rand.NewSource(int64(slots)))
		head, posted, tail := uint32(0), uint32(0), uint32(0)
		used := func(a, b uint32) uint32 { return g.Used(a, b) }
		for step := 0; step < 20000; step++ {
			switch rng.Intn(4) {
			case 0: // the guest produces, if there is room
				if used(head, tail) < g.Len() {
					tail = g.Inc(tail)
					setTail(raw, tail)
				}
			case 1:
				n, err := c.Pending()
				require.NoError(t, err)
				require.Equal(t, used(posted, tail), n)
				if n > 0 {
					require.NoError(t, c.Take())
					posted = g.Inc(posted)
				}
			case 2:
				if rng.Intn(4) == 0 && posted != head {
					require.NoError(t, c.Untake())
					posted = (posted - 1) & (2*g.Len() - 1)
				}
			case 3:
				k := uint32(rng.Intn(int(used(head, posted)) + 1))
				to := head
				for i := uint32(0); i < k; i++ {
					to = g.Inc(to)
				}
				require.NoError(t, c.Release(to))
				head = to
			}
			require.Equal(t, head, consHead(raw), "step %d", step)
			require.Equal(t, head, c.HeadIndex())
			require.Equal(t, posted, c.NextIndex())
			require.Equal(t, used(head, posted), c.Outstanding())
		}
	}
}

func TestAdoptConsumer(t *testing.T) {
	m, raw := newRingMem(t)
	g, _ := NewGeometry(8)
	a, _ := NewArea([]guestmem.GPA{elemBase}, 0, 32, 8)
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 13) // cons_head left by the previous device
	setTail(raw, 1)                                     // the guest posted 4 more, across the wrap
	c, err := AdoptConsumer(m, stateGPA, g, a)
	require.NoError(t, err)
	assert.EqualValues(t, 13, consHead(raw), "guest memory untouched")
	assert.EqualValues(t, 13, c.HeadIndex())
	assert.EqualValues(t, 13, c.NextIndex(), "re-post from cons_head")
	assert.Equal(t, guestmem.GPA(elemBase+5*32), c.Next())
	n, err := c.Pending()
	require.NoError(t, err)
	assert.EqualValues(t, 4, n)

	// A device reset in adopt mode reloads it.
	require.NoError(t, c.Take())
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 2)
	require.NoError(t, c.Adopt())
	assert.EqualValues(t, 2, c.HeadIndex())
	assert.EqualValues(t, 2, c.NextIndex())

	for _, bad := range []uint32{16, 0xffffffff, 1 << 31} {
		binary.LittleEndian.PutUint32(raw[stateGPA+4:], bad)
		_, err = AdoptConsumer(m, stateGPA, g, a)
		assert.ErrorIs(t, err, ErrIndex, "cons_head %#x", bad)
		assert.ErrorIs(t, c.Adopt(), ErrIndex)
	}
	_, err = AdoptConsumer(m, 0x100000, g, a)
	assert.ErrorIs(t, err, guestmem.ErrUnmapped)
	small, _ := NewArea([]guestmem.GPA{elemBase}, 0, 32, 4)
	_, err = AdoptConsumer(m, stateGPA, g, small)
	assert.ErrorIs(t, err, ErrGeometry)
}

func TestAdoptProducer(t *testing.T) {
	m, raw := newRingMem(t)
	g, _ := NewGeometry(3072) // non-power-of-two count: indices below 2048
	pages := []guestmem.GPA{stateGPA, elemBase, 0x3000, 0x4000}
	a, _ := NewArea(pages, guestmem.PageSize, 4, g.Len())
	binary.LittleEndian.PutUint32(raw[stateGPA:], 2000)   // prod_tail
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 1990) // the guest has 10 to consume
	p, err := AdoptProducer(m, stateGPA, g, a)
	require.NoError(t, err)
	assert.EqualValues(t, 2000, p.TailIndex())
	gpa, err := p.Reserve()
	require.NoError(t, err)
	assert.Equal(t, guestmem.GPA(elemBase+4*(2000&1023)), gpa)
	require.NoError(t, p.Commit())
	assert.EqualValues(t, 2001, binary.LittleEndian.Uint32(raw[stateGPA:]))

	for _, bad := range []uint32{2048, 4096, 0xffffffff} {
		binary.LittleEndian.PutUint32(raw[stateGPA:], bad)
		_, err = AdoptProducer(m, stateGPA, g, a)
		assert.ErrorIs(t, err, ErrIndex, "prod_tail %#x", bad)
	}
	_, err = AdoptProducer(m, 0x100000, g, a)
	assert.ErrorIs(t, err, guestmem.ErrUnmapped)

	// A resize replayed over a ring in use keeps the guest's prod_tail.
	g8, _ := NewGeometry(8)
	a8, _ := NewArea(pages, guestmem.PageSize, 64, 8)
	binary.LittleEndian.PutUint32(raw[stateGPA:], 3)
	binary.LittleEndian.PutUint32(raw[stateGPA+4:], 0)
	p, err = AdoptProducer(m, stateGPA, g8, a8)
	require.NoError(t, err)
	g16, _ := NewGeometry(16)
	binary.LittleEndian.PutUint32(raw[stateGPA:], 20)
	require.NoError(t, p.ResizeAdopt(g16, 64))
	assert.EqualValues(t, 20, p.TailIndex())
	assert.EqualValues(t, 16, p.Len())
	binary.LittleEndian.PutUint32(raw[stateGPA:], 40)
	g32, _ := NewGeometry(32)
	assert.ErrorIs(t, p.ResizeAdopt(g16, 64), ErrIndex, "40 is no index of a 16-ring")
	assert.EqualValues(t, 20, p.TailIndex(), "unchanged on an error")
	assert.EqualValues(t, 16, p.Len())
	assert.ErrorIs(t, p.ResizeAdopt(g32, 4096), ErrPageCount)
}
