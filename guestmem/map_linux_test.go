package guestmem

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// lockedKB reads the Locked: line of the mapping that starts at data
// (/proc/self/smaps).
func lockedKB(t *testing.T, data []byte) int {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	require.NoError(t, err)
	defer f.Close()
	start := fmt.Sprintf("%x-", uintptr(unsafe.Pointer(&data[0])))
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		f := strings.Fields(line)
		if len(f) > 0 && !strings.HasSuffix(f[0], ":") { // a mapping's first line
			in = strings.HasPrefix(line, start)
			continue
		}
		if in && strings.HasPrefix(line, "Locked:") {
			n, err := strconv.Atoi(strings.Fields(line)[1])
			require.NoError(t, err)
			return n
		}
	}
	t.Fatalf("no mapping at %s in smaps", start)
	return 0
}

// TestMapFDOnFault: a lock-on-fault mapping locks no page up front (so it
// costs the same for any size), charges its whole size, locks every page
// with LockAll, and a LockAll after Release does nothing.
func TestMapFDOnFault(t *testing.T) {
	const size = 32 << 20
	newFile := func() int {
		fd, err := unix.MemfdCreate("onfault", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		require.NoError(t, unix.Ftruncate(fd, size))
		// Resident, as QEMU's preallocated guest RAM is.
		require.NoError(t, unix.Fallocate(fd, 0, 0, size))
		return fd
	}
	spec, err := MapFDOnFault(0, size, ProtRead|ProtWrite, newFile(), 0)
	require.NoError(t, err)
	assert.Equal(t, uint64(size), spec.Locked, "the whole mapping is charged")
	require.NotNil(t, spec.LockAll)
	assert.Zero(t, lockedKB(t, spec.Data), "nothing locked before a page is touched")
	spec.Data[0] = 1
	assert.Equal(t, 4, lockedKB(t, spec.Data), "a touched page is locked")
	require.NoError(t, spec.LockAll())
	assert.Equal(t, size>>10, lockedKB(t, spec.Data), "LockAll locks every page")
	require.NoError(t, spec.Release())
	require.NoError(t, spec.LockAll(), "after Release: nothing to lock")

	plain, err := MapFD(0, size, ProtRead, newFile(), 0)
	require.NoError(t, err)
	assert.Nil(t, plain.LockAll, "MapFD locks everything at once")
	assert.Equal(t, size>>10, lockedKB(t, plain.Data))
	require.NoError(t, plain.Release())

	// LockAll racing Release: either order, never a lock of an unmapped
	// range (run with -race to check the exclusion).
	for range 20 {
		s, err := MapFDOnFault(0, size, ProtRead, newFile(), 0)
		require.NoError(t, err)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); assert.NoError(t, s.LockAll()) }()
		go func() { defer wg.Done(); assert.NoError(t, s.Release()) }()
		wg.Wait()
	}
}
