package supervise

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// pipe returns a pipe whose read end the test gives away and whose write
// end tells whether any copy of the read end is still open (EPIPE when
// none is).
func pipe(t *testing.T) (r, w int) {
	t.Helper()
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK))
	t.Cleanup(func() { _ = unix.Close(p[1]) })
	return p[0], p[1]
}

// readerOpen reports whether some copy of the read end of the pipe whose
// write end is w is open.
func readerOpen(t *testing.T, w int) bool {
	t.Helper()
	_, err := unix.Write(w, []byte{1})
	if errors.Is(err, unix.EPIPE) {
		return false
	}
	require.NoError(t, err)
	return true
}

func dup(t *testing.T, fd int) int {
	t.Helper()
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	return d
}

func TestStoreAddRemove(t *testing.T) {
	s := NewStore(0)
	defer s.Close()
	r1, w1 := pipe(t)
	r2, w2 := pipe(t)
	r3, w3 := pipe(t)
	for _, c := range []struct {
		name string
		fd   int
	}{{"vm1.conn", r1}, {"vm1.i2-0", r2}, {"vm1.i2-0", r3}} {
		ok, err := s.Add(c.name, c.fd)
		require.NoError(t, err)
		require.True(t, ok, c.name)
	}
	assert.Equal(t, 3, s.Len())
	assert.Equal(t, []string{"vm1.conn", "vm1.i2-0", "vm1.i2-0"}, s.Names())

	// Handed back newest first, named in the same order.
	fds, env := s.Listen()
	assert.Equal(t, []int{r3, r2, r1}, fds)
	assert.Equal(t, []string{"LISTEN_FDS=3", "LISTEN_FDNAMES=vm1.i2-0:vm1.i2-0:vm1.conn"}, env)

	// FDSTOREREMOVE closes every descriptor of the name.
	assert.Equal(t, 2, s.Remove("vm1.i2-0"))
	assert.False(t, readerOpen(t, w2))
	assert.False(t, readerOpen(t, w3))
	assert.True(t, readerOpen(t, w1))
	assert.Zero(t, s.Remove("vm1.i2-0"))
	assert.Equal(t, []string{"vm1.conn"}, s.Names())

	s.Close()
	assert.False(t, readerOpen(t, w1))
	assert.Zero(t, s.Len())
	fds, env = s.Listen()
	assert.Nil(t, fds)
	assert.Nil(t, env)
}

// TestStoreOneCopyPerFile: a file description given again, under its name
// or another, is closed and the first name stays (a restarted worker
// stores again what it got back).
func TestStoreOneCopyPerFile(t *testing.T) {
	s := NewStore(0)
	defer s.Close()
	r, w := pipe(t)
	ok, err := s.Add("first", r)
	require.NoError(t, err)
	require.True(t, ok)
	for _, name := range []string{"first", "second"} {
		d := dup(t, r)
		ok, err := s.Add(name, d)
		require.NoError(t, err)
		assert.False(t, ok, "a copy of a stored file under %q", name)
		_, err = unix.FcntlInt(uintptr(d), unix.F_GETFD, 0)
		assert.ErrorIs(t, err, unix.EBADF, "the copy was closed")
	}
	assert.Equal(t, []string{"first"}, s.Names())
	assert.Equal(t, 1, s.Remove("first"))
	assert.False(t, readerOpen(t, w))
}

func TestStoreLimitAndNames(t *testing.T) {
	s := NewStore(2)
	defer s.Close()
	r1, _ := pipe(t)
	r2, _ := pipe(t)
	r3, w3 := pipe(t)
	for _, fd := range []int{r1, r2} {
		ok, err := s.Add("x", fd)
		require.NoError(t, err)
		require.True(t, ok)
	}
	ok, err := s.Add("x", r3)
	assert.ErrorIs(t, err, ErrStoreFull)
	assert.False(t, ok)
	assert.False(t, readerOpen(t, w3), "a descriptor beyond the limit is closed")

	r4, w4 := pipe(t)
	ok, err = s.Add("a:b", r4)
	assert.Error(t, err)
	assert.False(t, ok)
	assert.False(t, readerOpen(t, w4), "a descriptor with a bad name is closed")
	assert.Equal(t, 2, s.Len())
}

// TestStoreWithoutKcmp: where the kernel cannot compare open files, a
// file with an inode of its own (a memfd, a socket) given again is the
// same file; anonymous inodes (eventfds, all on one inode) are the same
// only under the same name.
func TestStoreWithoutKcmp(t *testing.T) {
	s := NewStore(0)
	s.same = func(a, b int) (bool, error) { return false, errCannotCompare }
	defer s.Close()
	mfd, err := unix.MemfdCreate("guest", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	ok, err := s.Add("vm.m1", mfd)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = s.Add("vm.m1", dup(t, mfd))
	require.NoError(t, err)
	assert.False(t, ok, "the same memfd")

	e1, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	require.NoError(t, err)
	e2, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	require.NoError(t, err)
	var st1, st2 unix.Stat_t
	require.NoError(t, unix.Fstat(e1, &st1))
	require.NoError(t, unix.Fstat(e2, &st2))
	require.Equal(t, st1.Ino, st2.Ino, "eventfds share an inode")
	ok, err = s.Add("vm.i2-0", e1)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = s.Add("vm.i2-1", e2)
	require.NoError(t, err)
	assert.True(t, ok, "another eventfd under another name is kept")
	ok, err = s.Add("vm.i2-0", dup(t, e1))
	require.NoError(t, err)
	assert.False(t, ok, "the eventfd stored again under its name")
	assert.Equal(t, []string{"vm.m1", "vm.i2-0", "vm.i2-1"}, s.Names())
}

// TestSameFile: kcmp tells copies of one open file from two opens.
func TestSameFile(t *testing.T) {
	e1, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(e1)
	e2, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(e2)
	d := dup(t, e1)
	defer unix.Close(d)
	same, err := sameFile(e1, d)
	if errors.Is(err, errCannotCompare) {
		t.Skip("no kcmp here")
	}
	require.NoError(t, err)
	assert.True(t, same)
	same, err = sameFile(e1, e2)
	require.NoError(t, err)
	assert.False(t, same)
}
