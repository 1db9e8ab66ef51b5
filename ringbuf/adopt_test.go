package ringbuf

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// TestAdopt: a ring adopted by a new Consumer or Producer continues from
// the index the previous one left in guest memory, writes nothing while
// adopting, and refuses an index the geometry cannot produce.
func TestAdopt(t *testing.T) {
	mem, raw := guestmem.NewFlat(0, 4*guestmem.PageSize)
	pages := []guestmem.GPA{0, guestmem.PageSize, 2 * guestmem.PageSize}
	g, err := NewGeometry(8)
	require.NoError(t, err)
	a, err := NewArea(pages, guestmem.PageSize, 64, 8)
	require.NoError(t, err)
	load := func(gpa guestmem.GPA) uint32 {
		v, err := mem.LoadUint32(gpa)
		require.NoError(t, err)
		return v
	}

	// Consumer: the guest produced 11, the old device consumed 5.
	c, err := NewConsumer(mem, 0, g, a)
	require.NoError(t, err)
	require.NoError(t, mem.StoreUint32(0, 11))
	for range 5 {
		require.NoError(t, c.Advance())
	}
	before := append([]byte(nil), raw[:16]...)
	c2, err := AdoptConsumer(mem, 0, g, a)
	require.NoError(t, err)
	require.Equal(t, before, raw[:16], "adopting writes nothing")
	require.EqualValues(t, 5, c2.HeadIndex())
	n, err := c2.Pending()
	require.NoError(t, err)
	require.EqualValues(t, 6, n)
	require.Equal(t, c.Head(), c2.Head())

	// Producer (rx half at 8): the old device produced 9, the guest took 3.
	p, err := NewProducer(mem, 8, g, a)
	require.NoError(t, err)
	for range 9 {
		_, err := p.Reserve()
		require.NoError(t, err)
		require.NoError(t, p.Commit())
		if load(12) < 3 {
			require.NoError(t, mem.StoreUint32(12, load(12)+1))
		}
	}
	p2, err := AdoptProducer(mem, 8, g, a)
	require.NoError(t, err)
	require.EqualValues(t, 9, p2.TailIndex())
	empty, err := p2.Empty()
	require.NoError(t, err)
	require.False(t, empty)
	gpa, err := p2.Reserve()
	require.NoError(t, err)
	want, _ := p.Reserve()
	require.Equal(t, want, gpa, "the next element is the same")
	require.NoError(t, mem.StoreUint32(12, 9))
	empty, err = p2.Empty()
	require.NoError(t, err)
	require.True(t, empty)

	// Indices the geometry cannot produce are refused.
	require.NoError(t, mem.StoreUint32(4, 16))
	_, err = AdoptConsumer(mem, 0, g, a)
	require.ErrorIs(t, err, ErrIndex)
	require.NoError(t, mem.StoreUint32(8, 0xFFFFFFFF))
	_, err = AdoptProducer(mem, 8, g, a)
	require.ErrorIs(t, err, ErrIndex)
	_, err = AdoptProducer(mem, 8, g, Area{})
	require.ErrorIs(t, err, ErrGeometry)
}
