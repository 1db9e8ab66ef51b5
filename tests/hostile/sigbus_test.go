package hostile

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
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
	v.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd})
	e.healthy()
}

// TestLockedMemoryBounded: a QEMU makes the daemon lock more guest memory
// than its VM has. Registered with its RAM size, the VM may have that
// (plus backend.LockSlack) mapped and locked, no more: a sparse memfd of
// 2 GiB is refused, and so is mapping the same file range twice at other
// guest addresses (aliases lock the same pages again); overlapping guest
// ranges are refused too. Before, one sparse memfd locked 2 GiB for a
// 16 MiB VM.
func TestLockedMemoryBounded(t *testing.T) {
	e := newEnvConfig(t, vdev.Limits{}, testLogger(t), func(c *backend.Config) {
		for i := range c.VMs {
			c.VMs[i].MemBytes = ramSize
		}
	})
	require.EqualValues(t, ramSize+backend.LockSlack, e.vmStatus(vmEvil).LockedLimit)
	v, err := e.dial(vmEvil)
	require.NoError(t, err)
	rw := uint32(vfiouser.DMAFlagRead | vfiouser.DMAFlagWrite)

	const sparse = 2 << 30
	big, _, err := guestRAMNoMap(sparse)
	require.NoError(t, err)
	err = v.c.DMAMap(1<<32, sparse, rw, big, 0)
	require.NoError(t, unix.Close(big))
	require.ErrorIs(t, err, syscall.EINVAL, "2 GiB for a VM of %d MiB", ramSize>>20)
	require.Zero(t, e.vmStatus(vmEvil).LockedBytes)

	v.mapRAM()
	err = v.c.DMAMap(1<<32, ramSize, rw, v.ramFD, 0)
	require.ErrorIs(t, err, syscall.EINVAL, "the same RAM again at another address")
	err = v.c.DMAMap(1<<32, 4096, rw, v.ramFD, ramSize-4096)
	require.ErrorIs(t, err, syscall.EINVAL, "one page of it again")
	err = v.c.DMAMap(4096, 4096, rw, v.ramFD, 0)
	require.Error(t, err, "a guest range that overlaps RAM")
	require.EqualValues(t, ramSize, e.vmStatus(vmEvil).LockedBytes)

	v.pciSetup()
	v.probe()
	v.Close()
	// The budget came back with the disconnect: the VM boots again.
	e.healthy()
	w := e.boot(vmEvil)
	w.Close()
}

// guestRAMNoMap is guestRAM of size bytes, not mapped here (sparse: nothing
// is allocated until someone touches it).
func guestRAMNoMap(size int) (int, []byte, error) {
	fd, err := unix.MemfdCreate("hostile-sparse", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return -1, nil, err
	}
	return fd, nil, nil
}

// TestLockedMemoryDefaultCap: a VM registered without its RAM size gets
// backend.DefaultVMLocked, not the daemon-wide cap (issue 23: without
// mem=, one 2 GiB DMA map locked 2 GiB): its QEMU's 2 GiB map is refused,
// while its RAM within the default still maps and the device works.
func TestLockedMemoryDefaultCap(t *testing.T) {
	e := newEnvConfig(t, vdev.Limits{}, testLogger(t), func(c *backend.Config) {
		for i := range c.VMs {
			c.VMs[i].MemBytes = 0
		}
	})
	require.EqualValues(t, backend.DefaultVMLocked, e.vmStatus(vmEvil).LockedLimit)
	v, err := e.dial(vmEvil)
	require.NoError(t, err)
	const sparse = 2 << 30
	big, _, err := guestRAMNoMap(sparse)
	require.NoError(t, err)
	err = v.c.DMAMap(1<<32, sparse, uint32(vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite), big, 0)
	require.NoError(t, unix.Close(big))
	require.ErrorIs(t, err, syscall.EINVAL, "2 GiB for a VM registered without its size")
	require.Zero(t, e.vmStatus(vmEvil).LockedBytes)
	v.mapRAM()
	v.pciSetup()
	v.probe()
	v.Close()
	e.healthy()
}
