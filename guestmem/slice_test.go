package guestmem

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSlice(t *testing.T) {
	m, a, _ := twoRegions(t)
	b, pin, err := m.Slice(0x1100, 0x20, true)
	require.NoError(t, err)
	b[0] = 0x5a
	assert.Equal(t, byte(0x5a), a[0x100], "the slice is the mapping itself")
	assert.Equal(t, 0x20, cap(b), "no access past the range through append")
	pin.Release()
	pin.Release() // idempotent

	for _, tc := range []struct {
		gpa   GPA
		n     uint64
		write bool
		want  error
	}{
		{0x2ff0, 0x20, false, ErrNotContiguous}, // into the adjacent region
		{0x3ff0, 0x20, false, ErrUnmapped},      // into the hole
		{0x500, 4, false, ErrUnmapped},
		{0x10000, 4, true, ErrReadOnly},
		{0x20000, 4, false, ErrNotShared},
		{^GPA(0) - 1, 4, false, ErrRange},
	} {
		_, _, err := m.Slice(tc.gpa, tc.n, tc.write)
		assert.ErrorIs(t, err, tc.want, "%v+%#x", tc.gpa, tc.n)
	}
	// Failed slices hold nothing: removal does not wait.
	_, err = m.Remove(0x3000, 0x1000)
	require.NoError(t, err)
}

func TestSlicePinDelaysRemove(t *testing.T) {
	m, _, _ := twoRegions(t)
	_, pin, err := m.Slice(0x1000, 0x2000, false)
	require.NoError(t, err)
	done := make(chan error)
	go func() { _, err := m.Remove(0x1000, 0x2000); done <- err }()
	select {
	case <-done:
		t.Fatal("Remove returned while a slice was pinned")
	case <-time.After(50 * time.Millisecond):
	}
	pin.Release()
	require.NoError(t, <-done)
}
