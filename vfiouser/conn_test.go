package vfiouser_test

import (
	"encoding/binary"
	"hash/crc32"
	"io"
	"log/slog"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

const (
	bar0   = 0
	bar1   = 1
	bar2   = 2
	cfgReg = vfiouser.RegionConfig
)

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// newServer returns a server of test devices and a channel that receives
// each device it makes.
func newServer(t testing.TB, mod func(*vfiouser.Config)) (*vfiouser.Server, chan *testdev.Device) {
	t.Helper()
	devs := make(chan *testdev.Device, 16)
	cfg := vfiouser.Config{NewDevice: testdev.Factory(devs), Logger: testLogger(t), DMATimeout: 2 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := vfiouser.NewServer(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	return srv, devs
}

// connect negotiates like QEMU and returns the client and its device.
func connect(t testing.TB, srv *vfiouser.Server, devs chan *testdev.Device) (*vfiousertest.Client, *testdev.Device) {
	t.Helper()
	c := vfiousertest.Pair(t, srv)
	caps, err := c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	require.Equal(t, 16, caps.Capabilities.MaxMsgFDs)
	select {
	case d := <-devs:
		return c, d
	case <-time.After(5 * time.Second):
		t.Fatal("no device made")
	}
	return nil, nil
}

func cfg32(t testing.TB, c *vfiousertest.Client, off uint64) uint32 {
	t.Helper()
	v, err := c.Read32(cfgReg, off)
	require.NoError(t, err)
	return v
}

func cfgWrite(t testing.TB, c *vfiousertest.Client, off uint64, b ...byte) {
	t.Helper()
	require.NoError(t, c.RegionWrite(cfgReg, off, b, false))
}

// TestQEMUSequence replays, step by step, what QEMU 11's vfio-user-pci
// sends at realize and what the guest driver then does (as seen from QEMU 11
// and the 6.1 driver),
// and checks every answer.
func TestQEMUSequence(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, dev := connect(t, srv, devs)

	// Guest RAM as a memfd (with fd), the BIOS ROM without one.
	const ramSize = 1 << 20
	fd, ram, err := vfiousertest.Memfd(ramSize)
	require.NoError(t, err)
	defer unix.Munmap(ram)
	require.NoError(t, c.DMAMap(0, ramSize, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, 0))
	unix.Close(fd) // the server holds its own reference
	rom := make([]byte, 0x40000)
	for i := range rom {
		rom[i] = byte(i * 13)
	}
	c.ServeMemory(0xfffc0000, rom)
	require.NoError(t, c.DMAMap(0xfffc0000, 0x40000, vfiouser.DMAFlagRead, -1, 0))
	assert.Equal(t, uint64(ramSize), srv.Stats().LockedBytes, "the memfd map is mlocked and accounted")

	info, err := c.DeviceInfo()
	require.NoError(t, err)
	assert.Equal(t, vfiouser.DeviceInfo{Argsz: 16, Flags: vfiouser.DeviceFlagReset | vfiouser.DeviceFlagPCI, NumRegions: 9, NumIRQs: 5}, info)

	wantSize := map[uint32]uint64{0: testdev.BAR0Size, 1: testdev.BAR1Size, 2: testdev.BAR2Size, 3: 0, 4: 0, 5: 0, 7: 256}
	for _, idx := range []uint32{0, 1, 2, 3, 4, 5, 7} {
		ri, caps, fds, err := c.RegionInfo(idx, vfiouser.RegionInfoSize)
		require.NoError(t, err, "region %d", idx)
		assert.Empty(t, caps)
		assert.Empty(t, fds)
		assert.Equal(t, wantSize[idx], ri.Size, "region %d size", idx)
		assert.Equal(t, idx, ri.Index)
		if ri.Size > 0 {
			assert.Equal(t, vfiouser.RegionFlagRead|vfiouser.RegionFlagWrite, ri.Flags, "region %d flags", idx)
		}
	}
	errInfo, err := c.IRQInfo(uint32(vfiouser.IRQErr))
	require.NoError(t, err)
	assert.Equal(t, uint32(1), errInfo.Count, "ERR count 1 keeps QEMU from warning")

	// The whole config space in one read, as QEMU does.
	space, err := c.RegionRead(cfgReg, 0, 256)
	require.NoError(t, err)
	le := binary.LittleEndian
	assert.Equal(t, uint16(testdev.VendorID), le.Uint16(space[0:]))
	assert.Equal(t, uint16(testdev.DeviceID), le.Uint16(space[2:]))
	assert.Equal(t, uint32(testdev.ClassCode), le.Uint32(space[8:])>>8)
	assert.Equal(t, pcidev.StatusCapList, le.Uint16(space[6:])&pcidev.StatusCapList)
	capPtr := space[0x34]
	require.Equal(t, byte(0x40), capPtr)
	assert.Equal(t, byte(0x11), space[capPtr], "MSI-X capability")
	assert.Equal(t, uint16(testdev.Vectors-1), le.Uint16(space[capPtr+2:]))
	assert.Equal(t, uint32(0), le.Uint32(space[capPtr+4:]), "table at BAR0+0")
	assert.Equal(t, uint32(testdev.PBAOffset), le.Uint32(space[capPtr+8:]), "PBA at BAR0+0x800")
	assert.Equal(t, byte(1), space[0x3d], "INTA")

	// ROM sizing finds no ROM.
	cfgWrite(t, c, 0x30, 0x00, 0xf8, 0xff, 0xff)
	assert.Equal(t, uint32(0), cfg32(t, c, 0x30))
	// BAR sizing.
	for bar, want := range map[uint64]uint32{0: ^uint32(testdev.BAR0Size - 1), 1: ^uint32(testdev.BAR1Size - 1), 2: ^uint32(testdev.BAR2Size-1) | 0xc} {
		cfgWrite(t, c, 0x10+4*bar, 0xff, 0xff, 0xff, 0xff)
		assert.Equal(t, want, cfg32(t, c, 0x10+4*bar), "BAR%d sizing", bar)
	}
	cfgWrite(t, c, 0x14+4*2, 0xff, 0xff, 0xff, 0xff)
	assert.Equal(t, uint32(0xffffffff), cfg32(t, c, 0x18+4), "upper half of a 2 MiB 64-bit BAR is all address bits")

	// Interrupts: INTx and ERR eventfds, then MSI-X with all vectors.
	intx, err := vfiousertest.Eventfd()
	require.NoError(t, err)
	defer unix.Close(intx)
	require.NoError(t, c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, 1, nil, intx))
	errfd, err := vfiousertest.Eventfd()
	require.NoError(t, err)
	defer unix.Close(errfd)
	require.NoError(t, c.SetIRQs(vfiouser.IRQErr, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, 1, nil, errfd))

	// Memory decode off: BAR reads master-abort to all-ones.
	v, err := c.Read32(bar1, testdev.RegMagic)
	require.NoError(t, err)
	assert.Equal(t, uint32(0xffffffff), v)
	cfgWrite(t, c, 0x04, 0x07, 0x01) // memory | bus master | SERR
	assert.True(t, dev.Fn.BusMaster())
	assert.True(t, dev.Fn.MemoryEnabled())

	v, err = c.Read32(bar1, testdev.RegMagic)
	require.NoError(t, err)
	assert.Equal(t, uint32(testdev.Magic), v)
	require.NoError(t, c.Write32(bar1, testdev.RegScratch, 0xcafef00d))
	assert.Equal(t, uint32(0xcafef00d), dev.Scratch(), "the write reached the device")
	v, err = c.Read32(bar1, testdev.RegScratch)
	require.NoError(t, err)
	assert.Equal(t, uint32(0xcafef00d), v)
	b2, err := c.RegionRead(bar2, 0x123458, 8)
	require.NoError(t, err)
	assert.Equal(t, uint64(0x123458), le.Uint64(b2), "64-bit BAR callback")

	// INTx while MSI-X is off: level asserted, eventfd signalled, then
	// auto-masked until the client unmasks.
	require.NoError(t, c.Write32(bar1, testdev.RegLevel, 1))
	n, err := vfiousertest.ReadEventfd(intx)
	require.NoError(t, err)
	assert.Equal(t, uint64(1), n, "INTx signalled")
	st := cfg32(t, c, 0x04) >> 16
	assert.NotZero(t, uint16(st)&pcidev.StatusINTx, "status shows the INTx level")
	require.NoError(t, c.Write32(bar1, testdev.RegIRQ, 0))
	n, _ = vfiousertest.ReadEventfd(intx)
	assert.Zero(t, n, "masked until the EOI/unmask")
	require.NoError(t, c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionUnmask, 0, 1, nil))
	n, _ = vfiousertest.ReadEventfd(intx)
	assert.Equal(t, uint64(1), n, "unmask with the level still held re-asserts")
	require.NoError(t, c.Write32(bar1, testdev.RegLevel, 0))
	require.NoError(t, c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionUnmask, 0, 1, nil))
	n, _ = vfiousertest.ReadEventfd(intx)
	assert.Zero(t, n, "level dropped: nothing more")

	// MSI-X: enable with function mask (as the driver does), then QEMU's
	// "enable with no vector" (eventfd data, no descriptors), then vectors.
	msixCtl := uint64(0x40 + 2)
	cfgWrite(t, c, msixCtl, 0x03, 0xc0)
	require.NoError(t, c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 0, 0, nil))
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, 1, nil))
	require.NoError(t, c.Write32(bar1, testdev.RegIRQ, 2)) // function masked: pending
	assert.True(t, dev.Fn.PendingMSIX(2))
	pba, err := c.Read32(bar0, testdev.PBAOffset)
	require.NoError(t, err)
	assert.Equal(t, uint32(1<<2), pba, "PBA reads are answered from the pending bits")
	cfgWrite(t, c, msixCtl, 0x03, 0x80) // unmask the function
	vecs := make([]int, testdev.Vectors)
	for i := range vecs {
		vecs[i], err = vfiousertest.Eventfd()
		require.NoError(t, err)
		defer unix.Close(vecs[i])
	}
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, testdev.Vectors, nil, vecs...))
	n, _ = vfiousertest.ReadEventfd(vecs[2])
	assert.Equal(t, uint64(1), n, "the pending vector fires once it has an eventfd")
	assert.False(t, dev.Fn.PendingMSIX(2))
	for v := 0; v < testdev.Vectors; v++ {
		require.NoError(t, c.Write32(bar1, testdev.RegIRQ, uint32(v)))
		n, _ = vfiousertest.ReadEventfd(vecs[v])
		assert.Equal(t, uint64(1), n, "vector %d", v)
	}
	// Replacing one vector's eventfd closes the old one on the server side.
	nv, err := vfiousertest.Eventfd()
	require.NoError(t, err)
	defer unix.Close(nv)
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 1, 1, nil, nv))
	require.NoError(t, c.Write32(bar1, testdev.RegIRQ, 1))
	n, _ = vfiousertest.ReadEventfd(nv)
	assert.Equal(t, uint64(1), n)
	n, _ = vfiousertest.ReadEventfd(vecs[1])
	assert.Zero(t, n)

	// DMA into the memfd RAM: the device writes guest memory in place.
	writeRegs(t, c, map[uint64]uint32{testdev.RegDMALo: 0x3000, testdev.RegDMAHi: 0, testdev.RegDMALen: 5000, testdev.RegDMASeed: 7})
	runDMA(t, c, testdev.DMAFill)
	assert.Zero(t, reg(t, c, testdev.RegDMAErr))
	assert.Equal(t, testdev.Pattern(7, 5000), ram[0x3000:0x3000+5000])
	runDMA(t, c, testdev.DMACheck)
	assert.Equal(t, crc32.ChecksumIEEE(ram[0x3000:0x3000+5000]), reg(t, c, testdev.RegDMARes))

	// DMA from the fd-less ROM goes through server-to-client DMA_READ,
	// issued by the device's DMA goroutine while the client polls.
	writeRegs(t, c, map[uint64]uint32{testdev.RegDMALo: 0xfffc0100, testdev.RegDMALen: 0x3f000})
	runDMA(t, c, testdev.DMACheck)
	require.Zero(t, reg(t, c, testdev.RegDMAErr))
	assert.Equal(t, crc32.ChecksumIEEE(rom[0x100:0x100+0x3f000]), reg(t, c, testdev.RegDMARes))
	assert.Equal(t, 1, c.DMARequests(), "252 KiB in one request (max_data_xfer_size 1 MiB)")
	// Writing the read-only ROM is refused by the server before any message.
	runDMA(t, c, testdev.DMAFill)
	assert.Equal(t, uint32(syscall.EPERM), reg(t, c, testdev.RegDMAErr))

	// Bus master off: no DMA.
	cfgWrite(t, c, 0x04, 0x03, 0x01)
	runDMA(t, c, testdev.DMACheck)
	assert.Equal(t, uint32(syscall.EPERM), reg(t, c, testdev.RegDMAErr))

	// DEVICE_RESET twice (QEMU on system_reset): registers and config back
	// to power-on, mappings kept.
	require.NoError(t, c.Reset())
	require.NoError(t, c.Reset())
	assert.Zero(t, dev.Scratch())
	assert.Zero(t, cfg32(t, c, 0x04)&0xffff, "command register cleared")
	assert.False(t, dev.Fn.BusMaster())
	assert.Equal(t, uint64(ramSize), srv.Stats().LockedBytes)

	require.NoError(t, c.DMAUnmap(0xfffc0000, 0x40000, 0))
	require.NoError(t, c.DMAUnmap(0, ramSize, 0))
	assert.Zero(t, srv.Stats().LockedBytes)
}

func reg(t testing.TB, c *vfiousertest.Client, off uint64) uint32 {
	t.Helper()
	v, err := c.Read32(bar1, off)
	require.NoError(t, err)
	return v
}

func writeRegs(t testing.TB, c *vfiousertest.Client, regs map[uint64]uint32) {
	t.Helper()
	for off, v := range regs {
		require.NoError(t, c.Write32(bar1, off, v))
	}
}

// runDMA starts a DMA command and polls DMA_BUSY until it finished (the
// client answers the server's DMA requests while it waits for replies).
func runDMA(t testing.TB, c *vfiousertest.Client, cmd uint32) {
	t.Helper()
	require.NoError(t, c.Write32(bar1, testdev.RegDMACmd, cmd))
	deadline := time.Now().Add(5 * time.Second)
	for reg(t, c, testdev.RegDMABusy) != 0 {
		require.True(t, time.Now().Before(deadline), "DMA did not finish")
	}
}
