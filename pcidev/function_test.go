package pcidev_test

import (
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

var le = binary.LittleEndian

const cfgRegion = vfiouser.RegionConfig

// pvrdmaLike is the shape the PVRDMA device uses: BAR0 16 KiB MSI-X (table
// at 0, PBA at 0x2000, 3 vectors), BAR1 4 KiB registers, BAR2 2 MiB UAR.
func pvrdmaLike(regs *regFile) pcidev.Config {
	return pcidev.Config{
		VendorID: 0x15ad, DeviceID: 0x0820, SubVendorID: 0x15ad, SubDeviceID: 0x0820,
		ClassCode: 0x028000, IntPin: 1,
		BARs: [6]pcidev.BAR{
			0: {Size: 16 << 10, Type: pcidev.BARMem32, Read: regs.read(0), Write: regs.write(0)},
			1: {Size: 4 << 10, Type: pcidev.BARMem32, Read: regs.read(1), Write: regs.write(1)},
			2: {Size: 2 << 20, Type: pcidev.BARMem64, Read: regs.read(2), Write: regs.write(2)},
		},
		MSIX:      &pcidev.MSIX{Vectors: 3, BAR: 0, TableOffset: 0, PBAOffset: 0x2000},
		INTxLevel: func() bool { return regs.level() },
	}
}

// regFile records BAR callback traffic.
type regFile struct {
	mu     sync.Mutex
	writes []access
	lvl    bool
}

type access struct {
	bar  int
	off  uint64
	data []byte
}

func (r *regFile) read(bar int) pcidev.AccessFunc {
	return func(off uint64, p []byte) error {
		for i := range p {
			p[i] = byte(bar*0x10 + int(off) + i)
		}
		return nil
	}
}

func (r *regFile) write(bar int) pcidev.AccessFunc {
	return func(off uint64, p []byte) error {
		r.mu.Lock()
		r.writes = append(r.writes, access{bar, off, append([]byte(nil), p...)})
		r.mu.Unlock()
		return nil
	}
}

func (r *regFile) level() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lvl
}

func (r *regFile) setLevel(v bool) {
	r.mu.Lock()
	r.lvl = v
	r.mu.Unlock()
}

func newFn(t testing.TB, cfg pcidev.Config) *pcidev.Function {
	t.Helper()
	fn, err := pcidev.New(&vfiouser.Host{IRQs: &vfiouser.IRQs{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, cfg)
	require.NoError(t, err)
	return fn
}

func rd(t testing.TB, fn *pcidev.Function, region uint32, off uint64, n int) []byte {
	t.Helper()
	p := make([]byte, n)
	require.NoError(t, fn.ReadRegion(region, off, p))
	return p
}

func rd32(t testing.TB, fn *pcidev.Function, region uint32, off uint64) uint32 {
	return le.Uint32(rd(t, fn, region, off, 4))
}

func wr(t testing.TB, fn *pcidev.Function, region uint32, off uint64, b ...byte) {
	t.Helper()
	require.NoError(t, fn.WriteRegion(region, off, b))
}

func wr32(t testing.TB, fn *pcidev.Function, region uint32, off uint64, v uint32) {
	var b [4]byte
	le.PutUint32(b[:], v)
	wr(t, fn, region, off, b[:]...)
}

func TestConfigHeader(t *testing.T) {
	regs := &regFile{}
	fn := newFn(t, pvrdmaLike(regs))
	assert.Equal(t, uint32(0x0820_15ad), rd32(t, fn, cfgRegion, 0))
	assert.Equal(t, uint32(0x02800000), rd32(t, fn, cfgRegion, 8), "class network/other, revision 0")
	assert.Equal(t, uint32(0x0820_15ad), rd32(t, fn, cfgRegion, 0x2c), "subsystem")
	assert.Equal(t, uint16(pcidev.StatusCapList), le.Uint16(rd(t, fn, cfgRegion, 6, 2)))
	assert.Equal(t, byte(0), rd(t, fn, cfgRegion, 0x0e, 1)[0], "header type 0")
	assert.Equal(t, byte(1), rd(t, fn, cfgRegion, 0x3d, 1)[0], "INTA")
	assert.Equal(t, byte(0x40), rd(t, fn, cfgRegion, 0x34, 1)[0])
	assert.Equal(t, []byte{0x11, 0x00, 0x02, 0x00}, rd(t, fn, cfgRegion, 0x40, 4), "MSI-X, last cap, 3 vectors")
	assert.Equal(t, uint32(0x0), rd32(t, fn, cfgRegion, 0x44), "table BAR0+0")
	assert.Equal(t, uint32(0x2000), rd32(t, fn, cfgRegion, 0x48), "PBA BAR0+0x2000")

	// Read-only registers ignore writes; RW ones keep them.
	wr32(t, fn, cfgRegion, 0, 0xffffffff)
	wr32(t, fn, cfgRegion, 8, 0xffffffff)
	wr(t, fn, cfgRegion, 0x3d, 4)
	wr(t, fn, cfgRegion, 0x44, 0xff, 0xff)
	assert.Equal(t, uint32(0x0820_15ad), rd32(t, fn, cfgRegion, 0))
	assert.Equal(t, uint32(0x02800000), rd32(t, fn, cfgRegion, 8))
	assert.Equal(t, byte(1), rd(t, fn, cfgRegion, 0x3d, 1)[0])
	assert.Equal(t, uint32(0), rd32(t, fn, cfgRegion, 0x44))
	wr(t, fn, cfgRegion, 0x0c, 0x40)
	wr(t, fn, cfgRegion, 0x3c, 0x0b)
	assert.Equal(t, byte(0x40), rd(t, fn, cfgRegion, 0x0c, 1)[0], "cache line size")
	assert.Equal(t, byte(0x0b), rd(t, fn, cfgRegion, 0x3c, 1)[0], "interrupt line")
	// Status: the capability bit is read-only, error bits write-1-to-clear.
	wr(t, fn, cfgRegion, 6, 0xff, 0xff)
	assert.Equal(t, uint16(pcidev.StatusCapList), le.Uint16(rd(t, fn, cfgRegion, 6, 2)))
	// Command: only the defined bits stick.
	wr(t, fn, cfgRegion, 4, 0xff, 0xff)
	assert.Equal(t, uint16(0x0547), le.Uint16(rd(t, fn, cfgRegion, 4, 2)))
	assert.True(t, fn.BusMaster() && fn.MemoryEnabled() && fn.IOEnabled())
	// No ROM: sizing reads 0.
	wr32(t, fn, cfgRegion, 0x30, 0xfffff800)
	assert.Zero(t, rd32(t, fn, cfgRegion, 0x30))
	// Unaligned and odd-sized accesses work byte-wise.
	assert.Equal(t, []byte{0x15, 0x20, 0x08}, rd(t, fn, cfgRegion, 1, 3))
}

func TestBARSizing(t *testing.T) {
	cfg := pcidev.Config{VendorID: 0x1234, BARs: [6]pcidev.BAR{
		0: {Size: 16, Type: pcidev.BARMem32},
		1: {Size: 256, Type: pcidev.BARIO},
		2: {Size: 8 << 30, Type: pcidev.BARMem64, Prefetchable: true},
		5: {Size: 1 << 20, Type: pcidev.BARMem32, Prefetchable: true},
	}}
	fn := newFn(t, cfg)
	want := map[uint64][2]uint32{ // BAR offset -> {value at reset, after writing ones}
		0x10: {0x0, 0xfffffff0},
		0x14: {0x1, 0xffffff01},
		0x18: {0xc, 0x0000000c},
		0x1c: {0x0, 0xfffffffe},
		0x20: {0x0, 0x0},
		0x24: {0x8, 0xfff00008},
	}
	for off, w := range want {
		assert.Equal(t, w[0], rd32(t, fn, cfgRegion, off), "BAR at %#x before", off)
		wr32(t, fn, cfgRegion, off, 0xffffffff)
		assert.Equal(t, w[1], rd32(t, fn, cfgRegion, off), "BAR at %#x sized", off)
	}
	wr32(t, fn, cfgRegion, 0x10, 0xfe001234)
	assert.Equal(t, uint32(0xfe001230), rd32(t, fn, cfgRegion, 0x10), "address bits kept, type bits fixed")

	d := fn.Describe()
	assert.True(t, d.PCI)
	require.Len(t, d.Regions, 9)
	assert.Equal(t, uint64(16), d.Regions[0].Size)
	assert.Equal(t, uint64(256), d.Regions[1].Size)
	assert.Equal(t, uint64(8<<30), d.Regions[2].Size)
	assert.Zero(t, d.Regions[3].Size, "upper half of the 64-bit BAR")
	assert.Zero(t, d.Regions[4].Size)
	assert.Equal(t, uint64(256), d.Regions[7].Size)
	require.Len(t, d.IRQs, 5)
	assert.Zero(t, d.IRQs[vfiouser.IRQINTx].Count, "no pin, no INTx")
	assert.Zero(t, d.IRQs[vfiouser.IRQMSIX].Count)
	assert.Equal(t, uint32(1), d.IRQs[vfiouser.IRQErr].Count)
	assert.Zero(t, rd32(t, fn, cfgRegion, 0x34), "no capabilities")
	assert.Zero(t, le.Uint16(rd(t, fn, cfgRegion, 6, 2))&pcidev.StatusCapList)
}

func TestDecodeGating(t *testing.T) {
	regs := &regFile{}
	cfg := pvrdmaLike(regs)
	cfg.BARs[3] = pcidev.BAR{}
	cfg.BARs[4] = pcidev.BAR{Size: 16, Type: pcidev.BARIO, Read: regs.read(4), Write: regs.write(4)}
	fn := newFn(t, cfg)
	assert.Equal(t, []byte{0xff, 0xff, 0xff, 0xff}, rd(t, fn, 1, 0x10, 4), "memory decode off: master abort")
	wr(t, fn, 1, 0x10, 1, 2, 3, 4)
	assert.Empty(t, regs.writes, "dropped")
	wr(t, fn, cfgRegion, 4, 0x02, 0) // memory on, I/O off
	assert.Equal(t, []byte{0x20, 0x21}, rd(t, fn, 1, 0x10, 2))
	assert.Equal(t, []byte{0xff}, rd(t, fn, 4, 0, 1), "I/O decode off")
	wr(t, fn, 1, 0x10, 1, 2, 3, 4)
	require.Len(t, regs.writes, 1)
	assert.Equal(t, access{1, 0x10, []byte{1, 2, 3, 4}}, regs.writes[0])
	wr(t, fn, cfgRegion, 4, 0x03, 0)
	assert.Equal(t, []byte{0x40}, rd(t, fn, 4, 0, 1))
}

func TestMSIXTableAndSplitAccess(t *testing.T) {
	regs := &regFile{}
	fn := newFn(t, pvrdmaLike(regs))
	wr(t, fn, cfgRegion, 4, 0x02, 0)
	// Table entries reset masked (vector control bit 0).
	for v := 0; v < 3; v++ {
		assert.Equal(t, uint32(1), rd32(t, fn, 0, uint64(16*v+12)), "vector %d masked at reset", v)
	}
	wr32(t, fn, 0, 16+0, 0xfee00000)
	wr32(t, fn, 0, 16+8, 0x4041)
	wr32(t, fn, 0, 16+12, 0)
	assert.Equal(t, []byte{0, 0, 0xe0, 0xfe}, rd(t, fn, 0, 16, 4))
	assert.Equal(t, uint32(0x4041), rd32(t, fn, 0, 24))
	assert.Empty(t, regs.writes, "table accesses never reach the device")
	// An access straddling the table's end and the device's space.
	b := rd(t, fn, 0, 3*16-4, 8)
	assert.Equal(t, []byte{1, 0, 0, 0}, b[:4], "vector 2 control")
	assert.Equal(t, []byte{0x30, 0x31, 0x32, 0x33}, b[4:], "device callback from offset 0x30")
	wr(t, fn, 0, 3*16-2, 9, 9, 9, 9)
	require.Len(t, regs.writes, 1)
	assert.Equal(t, access{0, 0x30, []byte{9, 9}}, regs.writes[0])
	// PBA reads zero, writes are ignored.
	wr32(t, fn, 0, 0x2000, 0xffffffff)
	assert.Zero(t, rd32(t, fn, 0, 0x2000))
}

func TestReset(t *testing.T) {
	regs := &regFile{}
	resets := 0
	cfg := pvrdmaLike(regs)
	cfg.Reset = func(vfiouser.ResetReason) { resets++ }
	fn := newFn(t, cfg)
	wr(t, fn, cfgRegion, 4, 0x06, 0)
	wr32(t, fn, cfgRegion, 0x10, 0xfebf0000)
	wr(t, fn, cfgRegion, 0x42, 0x02, 0xc0)
	wr32(t, fn, 0, 12, 0)
	require.NoError(t, fn.Reset(vfiouser.ResetClient))
	assert.Equal(t, 1, resets)
	assert.Zero(t, le.Uint16(rd(t, fn, cfgRegion, 4, 2)))
	assert.False(t, fn.BusMaster())
	assert.False(t, fn.MSIXEnabled())
	assert.Zero(t, rd32(t, fn, cfgRegion, 0x10))
	assert.Equal(t, []byte{0x02, 0x00}, rd(t, fn, cfgRegion, 0x42, 2))
	wr(t, fn, cfgRegion, 4, 0x02, 0)
	assert.Equal(t, uint32(1), rd32(t, fn, 0, 12), "table masked again")
}

func TestExtendedConfigAndCapabilities(t *testing.T) {
	cfg := pcidev.Config{VendorID: 0x1234, ExtendedConfig: true, IntPin: 1,
		BARs: [6]pcidev.BAR{0: {Size: 4096, Type: pcidev.BARMem32}},
		MSIX: &pcidev.MSIX{Vectors: 1, BAR: 0, TableOffset: 0x800, PBAOffset: 0x100},
		Capabilities: []pcidev.Capability{
			{ID: 0x09, Data: []byte{6, 0xaa, 0xbb, 0xcc}, WriteMask: []byte{0, 0xff, 0, 0}}, // vendor specific
			{ID: 0x01, Data: []byte{0x03, 0x00, 0x00, 0x00, 0x00, 0x00}},                    // power management
		}}
	fn := newFn(t, cfg)
	assert.Equal(t, uint64(4096), fn.Describe().Regions[vfiouser.RegionConfig].Size)
	assert.Zero(t, rd32(t, fn, cfgRegion, 0x100), "no extended capabilities")
	wr32(t, fn, cfgRegion, 0x100, 0xffffffff)
	assert.Zero(t, rd32(t, fn, cfgRegion, 0x100))
	// Chain: 0x40 MSI-X -> 0x4c vendor -> 0x54 PM -> end.
	assert.Equal(t, []byte{0x11, 0x4c}, rd(t, fn, cfgRegion, 0x40, 2))
	assert.Equal(t, []byte{0x09, 0x54, 6, 0xaa, 0xbb, 0xcc}, rd(t, fn, cfgRegion, 0x4c, 6))
	assert.Equal(t, []byte{0x01, 0x00, 0x03}, rd(t, fn, cfgRegion, 0x54, 3))
	wr(t, fn, cfgRegion, 0x4e, 1, 2, 3)
	assert.Equal(t, []byte{6, 2, 0xbb}, rd(t, fn, cfgRegion, 0x4e, 3), "only the masked byte is writable")
}

func TestConfigValidation(t *testing.T) {
	ok := pcidev.Config{VendorID: 0x1234, BARs: [6]pcidev.BAR{0: {Size: 4096, Type: pcidev.BARMem32}}}
	bad := []func(c *pcidev.Config){
		func(c *pcidev.Config) { c.VendorID = 0xffff },
		func(c *pcidev.Config) { c.ClassCode = 1 << 24 },
		func(c *pcidev.Config) { c.IntPin = 5 },
		func(c *pcidev.Config) { c.BARs[0].Size = 3000 },
		func(c *pcidev.Config) { c.BARs[0].Size = 8 },
		func(c *pcidev.Config) { c.BARs[0] = pcidev.BAR{Size: 8 << 30, Type: pcidev.BARMem32} },
		func(c *pcidev.Config) { c.BARs[5] = pcidev.BAR{Size: 4096, Type: pcidev.BARMem64} },
		func(c *pcidev.Config) {
			c.BARs[0] = pcidev.BAR{Size: 4096, Type: pcidev.BARMem64}
			c.BARs[1] = pcidev.BAR{Size: 4096, Type: pcidev.BARMem32}
		},
		func(c *pcidev.Config) { c.BARs[1] = pcidev.BAR{Size: 512, Type: pcidev.BARIO} },
		func(c *pcidev.Config) { c.BARs[1] = pcidev.BAR{Size: 16, Type: pcidev.BARIO, Prefetchable: true} },
		func(c *pcidev.Config) { c.BARs[2] = pcidev.BAR{Size: 0x1000} },
		func(c *pcidev.Config) { c.MSIX = &pcidev.MSIX{Vectors: 0} },
		func(c *pcidev.Config) { c.MSIX = &pcidev.MSIX{Vectors: 4, BAR: 1} },
		func(c *pcidev.Config) { c.MSIX = &pcidev.MSIX{Vectors: 300, TableOffset: 0, PBAOffset: 0x800} },
		func(c *pcidev.Config) { c.MSIX = &pcidev.MSIX{Vectors: 4, TableOffset: 0x10, PBAOffset: 0x20} },
		func(c *pcidev.Config) { c.MSIX = &pcidev.MSIX{Vectors: 4, TableOffset: 4, PBAOffset: 0x800} },
		func(c *pcidev.Config) { c.Capabilities = []pcidev.Capability{{ID: 0x11}} },
		func(c *pcidev.Config) { c.Capabilities = []pcidev.Capability{{ID: 9, Data: make([]byte, 200)}} },
		func(c *pcidev.Config) {
			c.Capabilities = []pcidev.Capability{{ID: 9, Data: []byte{1}, WriteMask: []byte{1, 2}}}
		},
	}
	_, err := pcidev.New(nil, ok)
	require.NoError(t, err)
	for i, mod := range bad {
		c := ok
		mod(&c)
		_, err := pcidev.New(nil, c)
		assert.Error(t, err, "case %d", i)
	}
}

// Interrupts need eventfds the client assigns: these tests run the
// function behind a real vfio-user connection.

type irqRig struct {
	t    *testing.T
	c    *vfiousertest.Client
	fn   *pcidev.Function
	regs *regFile
}

func newIRQRig(t *testing.T) *irqRig {
	regs := &regFile{}
	fns := make(chan *pcidev.Function, 1)
	srv, err := vfiouser.NewServer(vfiouser.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		NewDevice: func(_ context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
			fn, err := pcidev.New(h, pvrdmaLike(regs))
			fns <- fn
			return fn, err
		}})
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	c := vfiousertest.Pair(t, srv)
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	return &irqRig{t: t, c: c, fn: <-fns, regs: regs}
}

func (r *irqRig) cfg(off uint64, b ...byte) {
	r.t.Helper()
	require.NoError(r.t, r.c.RegionWrite(cfgRegion, off, b, false))
}

func (r *irqRig) eventfds(n int) []int {
	fds := make([]int, n)
	for i := range fds {
		fd, err := vfiousertest.Eventfd()
		require.NoError(r.t, err)
		fds[i] = fd
		r.t.Cleanup(func() { unix.Close(fd) })
	}
	return fds
}

func count(t testing.TB, fd int) uint64 {
	t.Helper()
	n, err := vfiousertest.ReadEventfd(fd)
	require.NoError(t, err)
	return n
}

const efdTrigger = vfiouser.IRQSetDataEventfd | vfiouser.IRQSetActionTrigger

func TestMSIXDelivery(t *testing.T) {
	r := newIRQRig(t)
	vec := r.eventfds(3)
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQMSIX, efdTrigger, 0, 3, nil, vec...))
	intx := r.eventfds(1)
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQINTx, efdTrigger, 0, 1, nil, intx...))

	// MSI-X off: TriggerMSIX falls back to INTx (if not disabled).
	r.cfg(4, 0x06, 0x00)
	require.NoError(t, r.fn.TriggerMSIX(2))
	assert.Equal(t, uint64(1), count(t, intx[0]))
	assert.Zero(t, count(t, vec[2]))

	// Enabled but bus master off: pending, delivered when it comes on.
	r.cfg(4, 0x02, 0x04) // memory, INTx disabled
	r.cfg(0x42, 0x02, 0x80)
	require.True(t, r.fn.MSIXEnabled())
	require.NoError(t, r.fn.TriggerMSIX(1))
	assert.True(t, r.fn.PendingMSIX(1))
	pba, err := r.c.Read32(0, 0x2000)
	require.NoError(t, err)
	assert.Equal(t, uint32(2), pba)
	r.cfg(4, 0x06, 0x04)
	assert.Equal(t, uint64(1), count(t, vec[1]), "delivered on bus-master enable")
	assert.False(t, r.fn.PendingMSIX(1))

	// Function mask: pending, delivered on unmask; once only.
	r.cfg(0x43, 0xc0)
	require.NoError(t, r.fn.TriggerMSIX(0))
	require.NoError(t, r.fn.TriggerMSIX(0))
	assert.Zero(t, count(t, vec[0]))
	r.cfg(0x43, 0x80)
	assert.Equal(t, uint64(1), count(t, vec[0]))

	// No eventfd yet for a vector (QEMU's state for a vector the guest
	// has not unmasked): pending until it is assigned.
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQMSIX, efdTrigger, 2, 1, nil))
	require.NoError(t, r.fn.TriggerMSIX(2))
	assert.True(t, r.fn.PendingMSIX(2))
	nv := r.eventfds(1)
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQMSIX, efdTrigger, 2, 1, nil, nv...))
	assert.Equal(t, uint64(1), count(t, nv[0]))

	// Direct deliveries, and the Trigger sink.
	for i := 0; i < 5; i++ {
		r.fn.Trigger(1)
	}
	assert.Equal(t, uint64(5), count(t, vec[1]))
	assert.ErrorIs(t, r.fn.TriggerMSIX(3), vfiouser.ErrNoIRQ)
	assert.Zero(t, count(t, intx[0]), "INTx untouched while MSI-X is on")
}

func TestINTxLevel(t *testing.T) {
	r := newIRQRig(t)
	intx := r.eventfds(1)
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQINTx, efdTrigger, 0, 1, nil, intx...))
	r.cfg(4, 0x06, 0x04) // INTx disabled
	r.regs.setLevel(true)
	require.NoError(t, r.fn.AssertINTx())
	assert.Zero(t, count(t, intx[0]), "INTx disabled in the command register")
	st, err := r.c.RegionRead(cfgRegion, 6, 2)
	require.NoError(t, err)
	assert.NotZero(t, le.Uint16(st)&pcidev.StatusINTx, "status shows the level anyway")
	r.cfg(4, 0x06, 0x00) // INTx enabled: the held level shows at once
	assert.Equal(t, uint64(1), count(t, intx[0]))
	require.NoError(t, r.fn.AssertINTx())
	assert.Zero(t, count(t, intx[0]), "auto-masked until the EOI")
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionUnmask, 0, 1, nil))
	assert.Equal(t, uint64(1), count(t, intx[0]), "level still high at unmask")
	r.regs.setLevel(false)
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionUnmask, 0, 1, nil))
	assert.Zero(t, count(t, intx[0]))
	st, err = r.c.RegionRead(cfgRegion, 6, 2)
	require.NoError(t, err)
	assert.Zero(t, le.Uint16(st)&pcidev.StatusINTx)
	// A client-side trigger (DATA_NONE|TRIGGER) loops back to the eventfd.
	require.NoError(t, r.c.SetIRQs(vfiouser.IRQINTx, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 0, 1, nil))
	assert.Equal(t, uint64(1), count(t, intx[0]))

	noPin := newFn(t, pcidev.Config{VendorID: 0x1234})
	assert.ErrorIs(t, noPin.TriggerMSIX(0), pcidev.ErrNoINTx)
}
