package guestmem

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
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

// TestMapFDLocksOnFault: a mapping locks no page up front (so mapping and
// unmapping cost what the device touched, not the region's size), charges
// its whole size, and locks each page the device touches.
func TestMapFDLocksOnFault(t *testing.T) {
	const size = 32 << 20
	fd, err := unix.MemfdCreate("onfault", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, size))
	// Resident, as QEMU's preallocated guest RAM is.
	require.NoError(t, unix.Fallocate(fd, 0, 0, size))
	spec, err := MapFD(0, size, ProtRead|ProtWrite, fd, 0)
	require.NoError(t, err)
	defer spec.Release()
	assert.Equal(t, uint64(size), spec.Locked, "the whole mapping is charged")
	assert.Zero(t, lockedKB(t, spec.Data), "nothing locked before a page is touched")
	spec.Data[0] = 1
	spec.Data[size-1] = 1
	assert.Equal(t, 8, lockedKB(t, spec.Data), "each touched page is locked")
	for i := 0; i < size; i += 4096 {
		spec.Data[i]++
	}
	assert.Equal(t, size>>10, lockedKB(t, spec.Data), "all of it, once all is touched")
}
