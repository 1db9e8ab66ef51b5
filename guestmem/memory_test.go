package guestmem

import (
	"bytes"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// twoRegions: [0x1000,0x3000) and [0x3000,0x4000) adjacent, then a hole,
// then a read-only [0x10000,0x11000), and an fd-less [0x20000,0x21000).
func twoRegions(t *testing.T) (*Memory, []byte, []byte) {
	t.Helper()
	m := New()
	a := make([]byte, 0x2000)
	b := make([]byte, 0x1000)
	ro := bytes.Repeat([]byte{0xAB}, 0x1000)
	require.NoError(t, m.Add(Bytes(0x1000, a, ProtRead|ProtWrite)))
	require.NoError(t, m.Add(Bytes(0x3000, b, ProtRead|ProtWrite)))
	require.NoError(t, m.Add(Bytes(0x10000, ro, ProtRead)))
	require.NoError(t, m.Add(RegionSpec{Base: 0x20000, Size: 0x1000, Prot: ProtRead, FD: -1}))
	return m, a, b
}

func TestAddRejectsOverlapAndBadRanges(t *testing.T) {
	m, _, _ := twoRegions(t)
	for _, tc := range []struct {
		base GPA
		size uint64
		want error
	}{
		{0x0, 0x1001, ErrOverlap},
		{0x2fff, 0x2, ErrOverlap},
		{0x3fff, 0x1, ErrOverlap},
		{0x1000, 0x2000, ErrOverlap},
		{0x500, 0, ErrRange},
		{^GPA(0) - 10, 0x100, ErrRange},
	} {
		err := m.Add(RegionSpec{Base: tc.base, Size: tc.size, FD: -1})
		assert.ErrorIs(t, err, tc.want, "add %v+%#x", tc.base, tc.size)
	}
	require.NoError(t, m.Add(RegionSpec{Base: 0x4000, Size: 0x1000, FD: -1}), "adjacent above is fine")
}

func TestReadWriteSpansRegions(t *testing.T) {
	m, a, b := twoRegions(t)
	msg := []byte("hello across two regions")
	at := GPA(0x3000 - 5)
	require.NoError(t, m.WriteAt(msg, at))
	assert.Equal(t, msg[:5], a[len(a)-5:])
	assert.Equal(t, msg[5:], b[:len(msg)-5])
	got := make([]byte, len(msg))
	require.NoError(t, m.ReadAt(got, at))
	assert.Equal(t, msg, got)
}

func TestAccessErrors(t *testing.T) {
	m, _, _ := twoRegions(t)
	buf := make([]byte, 16)
	assert.ErrorIs(t, m.ReadAt(buf, 0x3ff8), ErrUnmapped, "runs off the end into the hole")
	assert.ErrorIs(t, m.ReadAt(buf, 0x0), ErrUnmapped)
	assert.ErrorIs(t, m.ReadAt(buf, ^GPA(0)-4), ErrRange, "overflowing range")
	assert.ErrorIs(t, m.WriteAt(buf, 0x10000), ErrReadOnly)
	require.NoError(t, m.ReadAt(buf, 0x10000))
	assert.Equal(t, byte(0xAB), buf[0])
	assert.ErrorIs(t, m.ReadAt(buf, 0x20000), ErrNotShared, "no fd and no remote")
	assert.Contains(t, m.ReadAt(buf, 0x20000).Error(), "share=on", "the error names the QEMU fix")
	_, err := m.Uint32(0x4000)
	assert.ErrorIs(t, err, ErrUnmapped)
	_, err = m.LoadUint32(0x1002)
	assert.ErrorIs(t, err, ErrAlign)
	_, err = m.FetchAddUint64(0x10000, 1)
	assert.ErrorIs(t, err, ErrReadOnly)
	assert.NoError(t, m.ReadAt(nil, 0x5), "empty read of an unmapped address touches nothing")
}

type fakeRemote struct{ reads, writes int }

func (f *fakeRemote) ReadAt(p []byte, gpa GPA) error  { f.reads++; clear(p); p[0] = 7; return nil }
func (f *fakeRemote) WriteAt(p []byte, gpa GPA) error { f.writes++; return nil }

func TestRemoteRegionAndRequireShared(t *testing.T) {
	r := &fakeRemote{}
	m := New(WithRemote(r))
	require.NoError(t, m.Add(RegionSpec{Base: 0xfffc0000, Size: 0x40000, Prot: ProtRead, FD: -1}))
	b := make([]byte, 4)
	require.NoError(t, m.ReadAt(b, 0xfffc0000))
	assert.Equal(t, byte(7), b[0])
	assert.Equal(t, 1, r.reads)
	m.RequireShared(true)
	assert.ErrorIs(t, m.ReadAt(b, 0xfffc0000), ErrNotShared)
	assert.Equal(t, 1, r.reads)
}

func TestAtomics(t *testing.T) {
	m, a, _ := twoRegions(t)
	require.NoError(t, m.PutUint64(0x1008, 5))
	old, err := m.CompareAndSwapUint64(0x1008, 5, 9)
	require.NoError(t, err)
	assert.Equal(t, uint64(5), old)
	old, err = m.CompareAndSwapUint64(0x1008, 5, 11)
	require.NoError(t, err)
	assert.Equal(t, uint64(9), old, "failed CAS returns the current value")
	old, err = m.FetchAddUint64(0x1008, 3)
	require.NoError(t, err)
	assert.Equal(t, uint64(9), old)
	v, _ := m.Uint64(0x1008)
	assert.Equal(t, uint64(12), v)
	require.NoError(t, m.StoreUint32(0x1010, 0xdeadbeef))
	w, err := m.LoadUint32(0x1010)
	require.NoError(t, err)
	assert.Equal(t, uint32(0xdeadbeef), w)
	assert.Equal(t, []byte{0xef, 0xbe, 0xad, 0xde}, a[0x10:0x14], "little-endian like the guest")
}

func TestRemoveWaitsForInflight(t *testing.T) {
	m, _, _ := twoRegions(t)
	released := make(chan struct{})
	require.NoError(t, m.Add(RegionSpec{Base: 0x100000, Size: 0x1000, Prot: ProtRead | ProtWrite,
		Data: make([]byte, 0x1000), FD: -1, Release: func() error { close(released); return nil }}))
	r := m.find(0x100000) // an access in flight
	require.NotNil(t, r)
	done := make(chan error)
	go func() { _, err := m.Remove(0x100000, 0x1000); done <- err }()
	select {
	case <-done:
		t.Fatal("Remove returned while an access was in flight")
	case <-time.After(50 * time.Millisecond):
	}
	// New accesses already miss: the region left the snapshot.
	assert.ErrorIs(t, m.ReadAt(make([]byte, 1), 0x100000), ErrUnmapped)
	// A nested access to another region still proceeds (no reader blocking).
	require.NoError(t, m.ReadAt(make([]byte, 1), 0x1000))
	r.exit()
	require.NoError(t, <-done)
	<-released
	_, err := m.Remove(0x100000, 0x1000)
	assert.ErrorIs(t, err, ErrNoRegion)
}

func TestRemoveExactMatchOnly(t *testing.T) {
	m, _, _ := twoRegions(t)
	_, err := m.Remove(0x1000, 0x1000)
	assert.ErrorIs(t, err, ErrNoRegion, "partial unmap")
	_, err = m.Remove(0x1800, 0x1800)
	assert.ErrorIs(t, err, ErrNoRegion)
	_, err = m.Remove(0x1000, 0x2000)
	assert.NoError(t, err)
	assert.Len(t, m.Regions(), 3)
	require.NoError(t, m.RemoveAll())
	assert.Empty(t, m.Regions())
}

func TestConcurrentAccessAndRemove(t *testing.T) {
	m := New()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := make([]byte, 64)
			// Each goroutine its own bytes: the race detector would flag
			// two writers of the same guest bytes, which this test is not
			// about.
			off := GPA(i * 128)
			for {
				select {
				case <-stop:
					return
				default:
				}
				_ = m.ReadAt(b, 0x1000+off)
				_ = m.WriteAt(b, 0x1040+off)
			}
		}()
	}
	for i := 0; i < 200; i++ {
		require.NoError(t, m.Add(Bytes(0x1000, make([]byte, 0x1000), ProtRead|ProtWrite)))
		_, err := m.Remove(0x1000, 0x1000)
		require.NoError(t, err)
	}
	close(stop)
	wg.Wait()
}

func TestCopyBetweenMemories(t *testing.T) {
	src, sdata := NewFlat(0x1000, 0x3000)
	dst := New()
	d1, d2 := make([]byte, 0x800), make([]byte, 0x2000)
	require.NoError(t, dst.Add(Bytes(0x8000, d1, ProtRead|ProtWrite)))
	require.NoError(t, dst.Add(Bytes(0x8800, d2, ProtRead|ProtWrite)))
	for i := range sdata {
		sdata[i] = byte(i * 7)
	}
	require.NoError(t, Copy(dst, 0x8100, src, 0x1100, 0x1800))
	got := make([]byte, 0x1800)
	require.NoError(t, dst.ReadAt(got, 0x8100))
	assert.Equal(t, sdata[0x100:0x1900], got)
	err := Copy(dst, 0x9f00, src, 0x1000, 0x1000)
	assert.ErrorIs(t, err, ErrUnmapped)
	assert.False(t, IsSourceFault(err), "the destination ran out")
	err = Copy(dst, 0x8000, src, 0x3800, 0x1000)
	assert.ErrorIs(t, err, ErrUnmapped)
	assert.True(t, IsSourceFault(err), "the source ran out")
	// Same memory, overlapping-free copy within one region.
	require.NoError(t, Copy(src, 0x3000, src, 0x1000, 0x100))
	assert.Equal(t, sdata[:0x100], sdata[0x2000:0x2100])
}

func TestPageList(t *testing.T) {
	m, data := NewFlat(0, 0x10000)
	for i := range data {
		data[i] = byte(i >> 12) // each page filled with its page number
	}
	// An MR at an unaligned VA spanning 3 pages, pages scattered.
	pl, err := NewPageList(0x7f0000000ff0, 0x1020, []GPA{0x5000, 0x2000, 0x9000})
	require.NoError(t, err)
	got := make([]byte, 0x1020)
	require.NoError(t, pl.ReadAt(m, got, 0x7f0000000ff0))
	assert.Equal(t, byte(5), got[0])
	assert.Equal(t, byte(5), got[15])
	assert.Equal(t, byte(2), got[16])
	assert.Equal(t, byte(9), got[0x1010])
	g, err := pl.Translate(0x7f0000001000)
	require.NoError(t, err)
	assert.Equal(t, GPA(0x2000), g)
	assert.ErrorIs(t, pl.ReadAt(m, got[:1], 0x7f0000000fef), ErrOutOfRange)
	assert.ErrorIs(t, pl.WriteAt(m, got[:2], 0x7f000000200f), ErrOutOfRange)
	require.NoError(t, pl.WriteAt(m, []byte{1, 2}, 0x7f0000001fff))
	assert.Equal(t, []byte{1}, data[0x2fff:0x3000])
	assert.Equal(t, byte(2), data[0x9000])
	assert.False(t, pl.Contains(^uint64(0)-1, 4))

	_, err = NewPageList(0x1000, 0x2000, []GPA{0x1000}) // CVE-2021-3582 shape
	assert.ErrorIs(t, err, ErrRange)
	_, err = NewPageList(0x1000, 0x1000, []GPA{0x1008})
	assert.ErrorIs(t, err, ErrAlign)
	_, err = NewPageList(^uint64(0), 2, nil)
	assert.ErrorIs(t, err, ErrRange)
	empty, err := NewPageList(0x1234, 0, nil)
	require.NoError(t, err)
	assert.NoError(t, empty.ReadAt(m, nil, 0x1234))

	id := Identity()
	require.NoError(t, id.ReadAt(m, got[:4], 0x3000))
	assert.Equal(t, byte(3), got[0])
}

func TestMapFDLocksAndReleases(t *testing.T) {
	fd, err := unix.MemfdCreate("guestmem-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, 0x4000))
	spec, err := MapFD(0x100000, 0x2000, ProtRead|ProtWrite, fd, 0x1000)
	if errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.EPERM) {
		unix.Close(fd)
		t.Skipf("cannot mlock here: %v", err)
	}
	require.NoError(t, err)
	m := New()
	require.NoError(t, m.Add(spec))
	assert.Equal(t, uint64(0x2000), m.LockedBytes())
	require.NoError(t, m.PutUint32(0x100000, 0x11223344))
	var b [4]byte
	_, err = unix.Pread(fd, b[:], 0x1000)
	require.NoError(t, err)
	assert.Equal(t, []byte{0x44, 0x33, 0x22, 0x11}, b[:], "written through the shared mapping at the fd offset")
	_, err = m.Remove(0x100000, 0x2000)
	require.NoError(t, err)
	assert.Equal(t, uint64(0), m.LockedBytes())
	assert.ErrorIs(t, unix.Close(fd), unix.EBADF, "Release closed the fd")
}

func TestCopyDoesNotAllocate(t *testing.T) {
	src, _ := NewFlat(0x1000, 0x4000)
	dst, _ := NewFlat(0x10000, 0x4000)
	allocs := testing.AllocsPerRun(100, func() {
		if err := Copy(dst, 0x10000, src, 0x1000, 0x3000); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs, "the same-host data path copies without allocating")
}
