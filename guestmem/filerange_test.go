package guestmem

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestFileRange(t *testing.T) {
	fd, err := unix.MemfdCreate("fr", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, 0x4000))
	spec, err := MapFD(0x10000, 0x2000, ProtRead|ProtWrite, fd, 0x1000)
	require.NoError(t, err)
	m := New()
	require.NoError(t, m.Add(spec))
	require.NoError(t, m.Add(Bytes(0x12000, make([]byte, 0x1000), ProtRead|ProtWrite)))

	gotFD, off, pin, err := m.FileRange(0x11000, 0x1000, true)
	require.NoError(t, err)
	require.Equal(t, fd, gotFD)
	require.Equal(t, int64(0x2000), off, "the region's file offset plus the page's")
	// A removal waits for the pin: the descriptor stays valid while mapping.
	removed := make(chan struct{})
	go func() { _, _ = m.Remove(0x10000, 0x2000); close(removed) }()
	select {
	case <-removed:
		t.Fatal("Remove did not wait for the pin")
	case <-time.After(50 * time.Millisecond):
	}
	pin.Release()
	<-removed

	_, _, _, err = m.FileRange(0x12000, 0x1000, false)
	require.ErrorIs(t, err, ErrNoFile, "a region without a file")
	_, _, _, err = m.FileRange(0x20000, 0x1000, false)
	require.ErrorIs(t, err, ErrUnmapped)
	_, _, _, err = m.FileRange(0x12800, 0x1000, false)
	require.Error(t, err, "past the region's end")
	_, _, _, err = m.FileRange(^GPA(0), 2, false)
	require.ErrorIs(t, err, ErrRange)

	// A region the client mapped read-only gives its file for reading only.
	rofd, err := unix.MemfdCreate("fr-ro", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(rofd, 0x1000))
	ro, err := MapFD(0x30000, 0x1000, ProtRead, rofd, 0)
	require.NoError(t, err)
	require.NoError(t, m.Add(ro))
	_, _, _, err = m.FileRange(0x30000, 0x1000, true)
	require.ErrorIs(t, err, ErrReadOnly)
	_, _, pin, err = m.FileRange(0x30000, 0x1000, false)
	require.NoError(t, err)
	pin.Release()
}

// TestHold: a held region cannot be removed (ErrHeld) until the hold is
// released; RemoveAll ignores holds; a region being removed cannot be held.
func TestHold(t *testing.T) {
	m := New()
	add := func(base GPA) {
		fd, err := unix.MemfdCreate("hold", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		require.NoError(t, unix.Ftruncate(fd, 0x1000))
		spec, err := MapFD(base, 0x1000, ProtRead|ProtWrite, fd, 0)
		require.NoError(t, err)
		require.NoError(t, m.Add(spec))
	}
	add(0x10000)
	_, _, pin, err := m.FileRange(0x10000, 0x1000, true)
	require.NoError(t, err)
	h, err := pin.Hold()
	require.NoError(t, err)
	_, err = m.Remove(0x10000, 0x1000)
	require.ErrorIs(t, err, ErrHeld)
	require.Len(t, m.Regions(), 1, "still mapped")
	h.Release()
	h.Release() // twice: nothing
	_, err = m.Remove(0x10000, 0x1000)
	require.NoError(t, err)

	add(0x20000)
	_, _, pin, err = m.FileRange(0x20000, 0x1000, true)
	require.NoError(t, err)
	h, err = pin.Hold()
	require.NoError(t, err)
	require.NoError(t, m.RemoveAll(), "a disconnect takes everything")
	h.Release()

	var none Pin
	_, err = none.Hold()
	require.Error(t, err)
}
