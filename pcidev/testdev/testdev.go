// Package testdev is a small PCI device for tests of the vfio-user server
// and the PCI function model, in unit tests and in QEMU guests: a register
// BAR with a magic value, a scratch register, an access counter, an
// interrupt doorbell and a DMA engine, plus an MSI-X BAR. It is not part of
// the product.
//
// BAR1 registers (32-bit, little-endian; other sizes work byte-wise):
//
//	0x00 MAGIC     RO  0x7e57de71
//	0x04 SCRATCH   RW  any value
//	0x08 COUNTER   RO  BAR1 writes so far (a write adds its value instead)
//	0x0c IRQ       WO  write v: TriggerMSIX(v) (INTx if MSI-X is off)
//	0x10 DMA_LO    RW  guest address, low half
//	0x14 DMA_HI    RW  guest address, high half
//	0x18 DMA_LEN   RW  length, at most 1 MiB
//	0x1c DMA_CMD   WO  1: fill [addr, addr+len) with the pattern byte
//	                   (seed + i) & 0xff; 2: read it and store its CRC-32
//	                   (IEEE) in DMA_RESULT. The DMA runs after the write
//	                   returns (on its own goroutine), like a real engine:
//	                   poll DMA_BUSY. (Server-to-client DMA from inside
//	                   the write would deadlock QEMU, whose vCPU waits for
//	                   our reply while QEMU serves DMA on its main loop.)
//	0x20 DMA_SEED  RW  pattern seed
//	0x24 DMA_RES   RO  CRC-32 of the last read
//	0x28 DMA_ERR   RO  0 after a good DMA, else an errno (14 EFAULT:
//	                   guest memory not reachable, 1 EPERM: bus master
//	                   off or read-only memory)
//	0x2c LEVEL     RW  INTx level the device holds (1 asserts)
//	0x30 DMA_BUSY  RO  1 while a DMA runs (DMA_CMD is then refused, EBUSY)
package testdev

import (
	"context"
	"encoding/binary"
	"hash/crc32"
	"sync"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// PCI identity of the test device (a Red Hat / QEMU test ID).
const (
	VendorID  = 0x1b36
	DeviceID  = 0x0005
	ClassCode = 0x00ff00 // unclassified device
	Magic     = 0x7e57de71
)

// Register offsets in BAR1.
const (
	RegMagic   = 0x00
	RegScratch = 0x04
	RegCounter = 0x08
	RegIRQ     = 0x0c
	RegDMALo   = 0x10
	RegDMAHi   = 0x14
	RegDMALen  = 0x18
	RegDMACmd  = 0x1c
	RegDMASeed = 0x20
	RegDMARes  = 0x24
	RegDMAErr  = 0x28
	RegLevel   = 0x2c
	RegDMABusy = 0x30
	numRegs    = 13
)

// DMA commands.
const (
	DMAFill  = 1
	DMACheck = 2
)

// Geometry.
const (
	BAR0Size    = 4096 // MSI-X table at 0, PBA at 0x800
	BAR1Size    = 4096
	BAR2Size    = 1 << 21 // 64-bit, prefetchable, reads return the offset
	Vectors     = 4
	PBAOffset   = 0x800
	maxDMABytes = 1 << 20
)

// Device is one test device instance.
type Device struct {
	Fn  *pcidev.Function
	mem *guestmem.Memory

	mu   sync.Mutex
	regs [numRegs]uint32
	dmas sync.WaitGroup // DMA goroutines in flight
	// Accesses counts every BAR1 access (tests read it directly).
	accesses uint64
}

// config returns the device's PCI description with its callbacks bound
// to d.
func (d *Device) config() pcidev.Config {
	return pcidev.Config{
		VendorID: VendorID, DeviceID: DeviceID, SubVendorID: VendorID, SubDeviceID: 0x1100,
		Revision: 1, ClassCode: ClassCode, IntPin: 1,
		BARs: [6]pcidev.BAR{
			0: {Size: BAR0Size, Type: pcidev.BARMem32},
			1: {Size: BAR1Size, Type: pcidev.BARMem32, Read: d.read, Write: d.write},
			2: {Size: BAR2Size, Type: pcidev.BARMem64, Prefetchable: true, Read: readOffset},
		},
		MSIX:      &pcidev.MSIX{Vectors: Vectors, BAR: 0, TableOffset: 0, PBAOffset: PBAOffset},
		INTxLevel: func() bool { return d.reg(RegLevel) != 0 },
		Reset:     func(vfiouser.ResetReason) { d.dmas.Wait(); d.reset() },
		Close:     func() error { d.dmas.Wait(); return nil },
	}
}

// New makes a test device for the connection h.
func New(h *vfiouser.Host) (*Device, error) {
	d := &Device{mem: h.Memory}
	fn, err := pcidev.New(h, d.config())
	if err != nil {
		return nil, err
	}
	d.Fn = fn
	d.reset()
	return d, nil
}

// Factory is a vfiouser.NewDeviceFunc serving test devices. If created is
// non-nil it receives every device made.
func Factory(created chan<- *Device) vfiouser.NewDeviceFunc {
	return func(_ context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
		d, err := New(h)
		if err != nil {
			return nil, err
		}
		if created != nil {
			created <- d
		}
		return d.Fn, nil
	}
}

func (d *Device) reset() {
	d.mu.Lock()
	d.regs = [numRegs]uint32{}
	d.regs[RegMagic/4] = Magic
	d.mu.Unlock()
}

func (d *Device) reg(off int) uint32 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.regs[off/4]
}

// Scratch returns the scratch register.
func (d *Device) Scratch() uint32 { return d.reg(RegScratch) }

// Counter returns the COUNTER register.
func (d *Device) Counter() uint32 { return d.reg(RegCounter) }

// Accesses returns how many BAR1 accesses reached the device.
func (d *Device) Accesses() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.accesses
}

// read serves BAR1 reads byte-wise over the register file.
func (d *Device) read(off uint64, p []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.accesses++
	var file [numRegs * 4]byte
	for i, r := range d.regs {
		binary.LittleEndian.PutUint32(file[4*i:], r)
	}
	for i := range p {
		if o := off + uint64(i); o < uint64(len(file)) {
			p[i] = file[o]
		} else {
			p[i] = 0
		}
	}
	return nil
}

// write serves BAR1 writes. Aligned 32-bit writes act on a register;
// other writes only count.
func (d *Device) write(off uint64, p []byte) error {
	d.mu.Lock()
	d.accesses++
	if len(p) != 4 || off%4 != 0 || off >= numRegs*4 {
		d.regs[RegCounter/4]++
		d.mu.Unlock()
		return nil
	}
	v := binary.LittleEndian.Uint32(p)
	reg := int(off)
	switch reg {
	case RegMagic, RegDMARes, RegDMAErr, RegDMABusy:
		d.regs[RegCounter/4]++
	case RegCounter:
		d.regs[RegCounter/4] += v
	case RegIRQ:
		d.regs[RegCounter/4]++
		d.mu.Unlock()
		d.Fn.Trigger(int(v))
		return nil
	case RegDMACmd:
		d.regs[RegCounter/4]++
		if d.regs[RegDMABusy/4] != 0 {
			d.regs[RegDMAErr/4] = uint32(syscall.EBUSY)
			d.mu.Unlock()
			return nil
		}
		d.regs[RegDMABusy/4] = 1
		d.dmas.Add(1)
		d.mu.Unlock()
		go d.dma(v)
		return nil
	default:
		d.regs[RegCounter/4]++
		d.regs[reg/4] = v
		if reg == RegLevel && v != 0 {
			d.mu.Unlock()
			d.Fn.Trigger(0) // MSI-X vector 0, or INTx when MSI-X is off
			return nil
		}
	}
	d.mu.Unlock()
	return nil
}

// dma runs a DMA command against guest memory (only with bus mastering).
func (d *Device) dma(cmd uint32) {
	defer d.dmas.Done()
	d.mu.Lock()
	addr := guestmem.GPA(uint64(d.regs[RegDMAHi/4])<<32 | uint64(d.regs[RegDMALo/4]))
	n := min(d.regs[RegDMALen/4], maxDMABytes)
	seed := d.regs[RegDMASeed/4]
	d.mu.Unlock()

	var res uint32
	var err error
	switch {
	case !d.Fn.BusMaster():
		err = syscall.EPERM
	case cmd == DMAFill:
		buf := make([]byte, n)
		for i := range buf {
			buf[i] = byte(seed + uint32(i))
		}
		err = d.mem.WriteAt(buf, addr)
	case cmd == DMACheck:
		buf := make([]byte, n)
		if err = d.mem.ReadAt(buf, addr); err == nil {
			res = crc32.ChecksumIEEE(buf)
		}
	default:
		err = syscall.EINVAL
	}
	errno := uint32(vfiouser.Errno(err))
	d.mu.Lock()
	d.regs[RegDMARes/4] = res
	d.regs[RegDMAErr/4] = errno
	d.regs[RegDMABusy/4] = 0
	d.mu.Unlock()
}

// readOffset fills BAR2 reads with the low bytes of the offset.
func readOffset(off uint64, p []byte) error {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], off)
	for i := range p {
		p[i] = b[i%8]
	}
	return nil
}

// Pattern returns the bytes DMA_CMD 1 writes for seed and length n.
func Pattern(seed uint32, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(seed + uint32(i))
	}
	return b
}
