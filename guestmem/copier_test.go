package guestmem

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCopierMatchesCopy: runs within held regions, runs that move to
// another region or memory, and runs spanning two regions all copy what
// Copy copies; errors keep their side.
func TestCopierMatchesCopy(t *testing.T) {
	src, sdata := NewFlat(0x1000, 0x3000)
	for i := range sdata {
		sdata[i] = byte(i * 7)
	}
	dst := New()
	d1, d2 := make([]byte, 0x800), make([]byte, 0x2000)
	require.NoError(t, dst.Add(Bytes(0x8000, d1, ProtRead|ProtWrite)))
	require.NoError(t, dst.Add(Bytes(0x8800, d2, ProtRead|ProtWrite)))
	var c Copier
	defer c.Release()
	// Page runs in reverse order within one region each side.
	for i := 3; i >= 0; i-- {
		require.NoError(t, c.Copy(dst, GPA(0x8800+i*0x100), src, GPA(0x1000+i*0x100), 0x100))
	}
	assert.Equal(t, sdata[:0x400], d2[:0x400])
	// Into another region of dst, then spanning both.
	require.NoError(t, c.Copy(dst, 0x8000, src, 0x2000, 0x100))
	assert.Equal(t, sdata[0x1000:0x1100], d1[:0x100])
	require.NoError(t, c.Copy(dst, 0x8700, src, 0x1000, 0x200))
	assert.Equal(t, sdata[0x100:0x200], d2[:0x100])
	// Between memories and back within one.
	require.NoError(t, c.Copy(src, 0x3000, src, 0x1000, 0x10))
	assert.Equal(t, sdata[:0x10], sdata[0x2000:0x2010])
	err := c.Copy(dst, 0x9f00, src, 0x1000, 0x1000)
	assert.ErrorIs(t, err, ErrUnmapped)
	assert.False(t, IsSourceFault(err))
	err = c.Copy(dst, 0x8000, src, 0x3800, 0x1000)
	assert.ErrorIs(t, err, ErrUnmapped)
	assert.True(t, IsSourceFault(err))
	// A read-only destination is refused, held or not.
	ro := New()
	require.NoError(t, ro.Add(Bytes(0x1000, make([]byte, 0x1000), ProtRead)))
	assert.ErrorIs(t, c.Copy(ro, 0x1000, src, 0x1000, 0x10), ErrReadOnly)
}

// TestCopierHoldsRegions: a region a Copier holds is not removed until
// Release (DMA_UNMAP waits for the message in progress), and is released
// exactly once.
func TestCopierHoldsRegions(t *testing.T) {
	src, _ := NewFlat(0x1000, 0x1000)
	dst := New()
	released := make(chan struct{})
	require.NoError(t, dst.Add(RegionSpec{Base: 0x100000, Size: 0x1000, Prot: ProtRead | ProtWrite,
		Data: make([]byte, 0x1000), FD: -1, Release: func() error { close(released); return nil }}))
	var c Copier
	require.NoError(t, c.Copy(dst, 0x100000, src, 0x1000, 0x10))
	done := make(chan error, 1)
	go func() { _, err := dst.Remove(0x100000, 0x1000); done <- err }()
	select {
	case <-done:
		t.Fatal("Remove returned while a Copier held the region")
	case <-time.After(50 * time.Millisecond):
	}
	// The held region still takes the rest of the message.
	require.NoError(t, c.Copy(dst, 0x100010, src, 0x1010, 0x10))
	c.Release()
	require.NoError(t, <-done)
	<-released
	c.Release() // twice: nothing more
	assert.ErrorIs(t, c.Copy(dst, 0x100000, src, 0x1000, 0x10), ErrUnmapped)
}

func TestCopierDoesNotAllocate(t *testing.T) {
	src, _ := NewFlat(0x1000, 0x4000)
	dst, _ := NewFlat(0x10000, 0x4000)
	allocs := testing.AllocsPerRun(100, func() {
		var c Copier
		for i := 3; i >= 0; i-- {
			if err := c.Copy(dst, GPA(0x10000+i*0x1000), src, GPA(0x1000+i*0x1000), 0x1000); err != nil {
				t.Fatal(err)
			}
		}
		c.Release()
	})
	assert.Zero(t, allocs)
}
