//go:build linux && cgo

package ibverbs

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// TestAliasPagesHonoursReadOnly: an MR's host alias of guest pages is no
// more writable than the client's DMA map (issue 23: read-only maps were
// aliased read-write, so the host device could write them): a writable
// alias of a read-only region is refused, a read-only one is mapped
// read-only, and a writable region gives a writable alias.
func TestAliasPagesHonoursReadOnly(t *testing.T) {
	m := guestmem.New()
	add := func(base guestmem.GPA, prot guestmem.Prot) {
		fd, err := unix.MemfdCreate("alias", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		require.NoError(t, unix.Ftruncate(fd, 2*guestmem.PageSize))
		spec, err := guestmem.MapFD(base, 2*guestmem.PageSize, prot, fd, 0)
		require.NoError(t, err)
		require.NoError(t, m.Add(spec))
	}
	add(0x100000, guestmem.ProtRead)
	add(0x200000, guestmem.ProtRead|guestmem.ProtWrite)
	t.Cleanup(func() { _ = m.RemoveAll() })

	_, _, _, err := aliasPages(m, []guestmem.GPA{0x100000, 0x101000}, true)
	require.ErrorIs(t, err, guestmem.ErrReadOnly)

	perms := func(p unsafe.Pointer) string {
		b, err := os.ReadFile("/proc/self/maps")
		require.NoError(t, err)
		want := fmt.Sprintf("%x-", uintptr(p))
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, want) {
				return strings.Fields(l)[1]
			}
		}
		t.Fatalf("alias %p not in /proc/self/maps", p)
		return ""
	}
	ro, n, holds, err := aliasPages(m, []guestmem.GPA{0x100000, 0x101000}, false)
	require.NoError(t, err)
	require.Equal(t, "r--s", perms(ro))
	require.NoError(t, unix.MunmapPtr(ro, n))
	releaseHolds(holds)
	rw, n, holds, err := aliasPages(m, []guestmem.GPA{0x200000}, true)
	require.NoError(t, err)
	require.Equal(t, "rw-s", perms(rw))

	// While the MR lives its region cannot be unmapped (issue 23: after
	// DMA_UNMAP the pages stayed pinned by the host device while the lock
	// budget went back); once it is deregistered, it can.
	_, err = m.Remove(0x200000, 2*guestmem.PageSize)
	require.ErrorIs(t, err, guestmem.ErrHeld)
	require.NoError(t, unix.MunmapPtr(rw, n))
	releaseHolds(holds)
	_, err = m.Remove(0x200000, 2*guestmem.PageSize)
	require.NoError(t, err)
}
