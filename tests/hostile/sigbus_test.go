package hostile

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// TestTruncatedGuestRAM: a compromised QEMU DMA-maps guest RAM from a file
// it can shrink, truncates it and makes the daemon touch the vanished
// pages. Before, that was a SIGBUS in guestmem that took every VM's device
// down. Now a file that cannot be sealed against shrinking is refused at
// DMA_MAP (a memfd made without MFD_ALLOW_SEALING, a regular file), and a
// memfd that allows sealing is sealed by the daemon, so the truncation
// itself fails. The daemon serves other VMs throughout.
func TestTruncatedGuestRAM(t *testing.T) {
	e := newEnv(t)
	v, err := e.dial(vmEvil)
	require.NoError(t, err)
	rw := uint32(vfiouser.DMAFlagRead | vfiouser.DMAFlagWrite)

	unsealable, err := unix.MemfdCreate("no-sealing", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(unsealable, ramSize))
	err = v.c.DMAMap(0, ramSize, rw, unsealable, 0)
	require.NoError(t, unix.Close(unsealable))
	require.ErrorIs(t, err, syscall.EINVAL, "a memfd that cannot be sealed is refused")

	path := filepath.Join(t.TempDir(), "ram")
	f, err := os.Create(path)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(ramSize))
	err = v.c.DMAMap(0, ramSize, rw, int(f.Fd()), 0)
	require.NoError(t, f.Close())
	require.ErrorIs(t, err, syscall.EINVAL, "a regular file is refused")

	// A memfd that allows sealing but has no seal: the daemon seals it,
	// and the attacker's truncation fails.
	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, ramSize))
	mem, err := unix.Mmap(fd, 0, ramSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	v.ramFD, v.ram = fd, mem
	require.NoError(t, v.c.DMAMap(0, ramSize, rw, fd, 0))
	require.ErrorIs(t, unix.Ftruncate(fd, 4096), syscall.EPERM, "the daemon sealed guest RAM against shrinking")
	v.pciSetup()
	v.probe()
	pd := v.createPD(0)
	v.mustCmd(vdev.CmdDestroyPD, vdev.DestroyPD{PDHandle: pd})
	e.healthy()
}
