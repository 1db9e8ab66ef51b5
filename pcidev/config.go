package pcidev

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// BARType is the kind of a base address register.
type BARType uint8

// BAR types. The zero value is an unused BAR.
const (
	BARNone  BARType = iota
	BARMem32         // 32-bit memory
	BARMem64         // 64-bit memory (takes the next BAR slot as its upper half)
	BARIO            // I/O space
)

func (t BARType) String() string {
	switch t {
	case BARNone:
		return "none"
	case BARMem32:
		return "mem32"
	case BARMem64:
		return "mem64"
	case BARIO:
		return "io"
	}
	return fmt.Sprintf("BARType(%d)", uint8(t))
}

// AccessFunc serves a guest access to a BAR at offset off; len(p) is the
// access size (1, 2, 4 or 8 for CPU accesses, possibly more). Reads fill p.
// An error fails the client's request (QEMU logs it and the guest reads
// all-ones), so devices answer oddities with values instead of errors.
type AccessFunc func(off uint64, p []byte) error

// BAR describes one base address register.
type BAR struct {
	// Size in bytes: a power of two, at least 16 for memory and 4 for I/O
	// (at most 256).
	Size uint64
	Type BARType
	// Prefetchable sets the prefetchable bit of a memory BAR.
	Prefetchable bool
	// Read and Write serve accesses; nil reads as zeros and ignores writes.
	// Accesses to the MSI-X table and PBA never reach them.
	Read, Write AccessFunc
	// Mmap offers parts of the BAR for the client to map directly.
	Mmap *vfiouser.RegionMmap
}

// MSIX describes an MSI-X capability whose table and PBA live in a memory
// BAR of the function.
type MSIX struct {
	// Vectors is the table size, 1 to 2048.
	Vectors int
	// BAR is the index of the BAR holding table and PBA.
	BAR int
	// TableOffset and PBAOffset are 8-byte aligned offsets in that BAR.
	TableOffset, PBAOffset uint32
}

// Capability is an extra entry of the capability list (after MSI-X): its
// ID and the bytes that follow the ID and next-pointer bytes. WriteMask,
// if set, has the same length and marks the bits the guest may change.
type Capability struct {
	ID        uint8
	Data      []byte
	WriteMask []byte
}

// Config describes a PCI function.
type Config struct {
	VendorID, DeviceID       uint16
	SubVendorID, SubDeviceID uint16
	Revision                 uint8
	// ClassCode is class << 16 | subclass << 8 | programming interface.
	ClassCode uint32
	// IntPin is the INTx pin: 0 none, 1-4 INTA-INTD.
	IntPin uint8
	BARs   [6]BAR
	MSIX   *MSIX
	// Capabilities are appended to the capability list after MSI-X.
	Capabilities []Capability
	// ExtendedConfig makes the config space 4 KiB (PCIe) instead of 256 B.
	ExtendedConfig bool
	// RequireSharedMemory: the device reads guest RAM in place (see
	// vfiouser.Description).
	RequireSharedMemory bool

	// Reset is called after the function's own state was reset (client
	// DEVICE_RESET or disconnect).
	Reset func(reason vfiouser.ResetReason)
	// Close is called when the connection ends, after the last access.
	Close func() error
	// StateChanged, if set, is called after the client changed state that
	// SaveState captures (config space, the MSI-X table), outside the
	// function's lock: a daemon that must survive its own restart saves it.
	StateChanged func()
	// INTxLevel reports whether the device still asserts its interrupt
	// (for PVRDMA: the ICR register is non-zero). The function polls it
	// when the client unmasks INTx or the guest re-enables it, and
	// re-asserts. nil means the device only ever pulses INTx.
	INTxLevel func() bool
	// CommandChanged is called after the guest changed the command
	// register (for example when it enables bus mastering).
	CommandChanged func(old, new uint16)
}

// Limits of the model.
const (
	maxMSIXVectors = 2048
	capStart       = 0x40
	stdConfigSize  = 256
	extConfigSize  = 4096
)

func isPow2(n uint64) bool { return n != 0 && n&(n-1) == 0 }

// validate checks the description; every field is the device author's,
// but a bad one would make a function QEMU or the guest misreads.
func (c *Config) validate() error {
	if c.VendorID == 0 || c.VendorID == 0xffff {
		return fmt.Errorf("vendor ID %#04x is invalid", c.VendorID)
	}
	if c.ClassCode > 0xffffff {
		return fmt.Errorf("class code %#x has more than 24 bits", c.ClassCode)
	}
	if c.IntPin > 4 {
		return fmt.Errorf("interrupt pin %d (0-4)", c.IntPin)
	}
	for i := 0; i < 6; i++ {
		b := &c.BARs[i]
		switch b.Type {
		case BARNone:
			if b.Size != 0 || b.Read != nil || b.Write != nil || b.Mmap != nil {
				return fmt.Errorf("BAR%d: unused BAR with a size or handlers", i)
			}
		case BARMem32, BARMem64:
			if !isPow2(b.Size) || b.Size < 16 {
				return fmt.Errorf("BAR%d: size %#x is not a power of two >= 16", i, b.Size)
			}
			if b.Type == BARMem32 && b.Size > 1<<31 {
				return fmt.Errorf("BAR%d: 32-bit BAR of %#x bytes", i, b.Size)
			}
			if b.Type == BARMem64 {
				if i == 5 {
					return fmt.Errorf("BAR5 cannot be 64-bit")
				}
				if c.BARs[i+1].Type != BARNone {
					return fmt.Errorf("BAR%d is the upper half of 64-bit BAR%d and must be unused", i+1, i)
				}
				i++ // skip the upper half
			}
		case BARIO:
			if !isPow2(b.Size) || b.Size < 4 || b.Size > 256 {
				return fmt.Errorf("BAR%d: I/O size %#x is not a power of two in [4, 256]", i, b.Size)
			}
			if b.Prefetchable || b.Mmap != nil {
				return fmt.Errorf("BAR%d: I/O BARs are neither prefetchable nor mappable", i)
			}
		default:
			return fmt.Errorf("BAR%d: unknown type %v", i, b.Type)
		}
	}
	if x := c.MSIX; x != nil {
		if x.Vectors < 1 || x.Vectors > maxMSIXVectors {
			return fmt.Errorf("MSI-X: %d vectors (1-%d)", x.Vectors, maxMSIXVectors)
		}
		if x.BAR < 0 || x.BAR > 5 {
			return fmt.Errorf("MSI-X: BAR %d", x.BAR)
		}
		b := &c.BARs[x.BAR]
		if b.Type != BARMem32 && b.Type != BARMem64 {
			return fmt.Errorf("MSI-X: BAR%d is not a memory BAR", x.BAR)
		}
		tEnd := uint64(x.TableOffset) + 16*uint64(x.Vectors)
		pEnd := uint64(x.PBAOffset) + pbaBytes(x.Vectors)
		switch {
		case x.TableOffset%8 != 0 || x.PBAOffset%8 != 0:
			return fmt.Errorf("MSI-X: table %#x or PBA %#x not 8-byte aligned", x.TableOffset, x.PBAOffset)
		case tEnd > b.Size || pEnd > b.Size:
			return fmt.Errorf("MSI-X: table or PBA outside BAR%d (%#x bytes)", x.BAR, b.Size)
		case uint64(x.TableOffset) < pEnd && uint64(x.PBAOffset) < tEnd:
			return fmt.Errorf("MSI-X: table and PBA overlap")
		}
	}
	used := 0
	if c.MSIX != nil {
		used = msixCapSize
	}
	for i, cp := range c.Capabilities {
		if cp.WriteMask != nil && len(cp.WriteMask) != len(cp.Data) {
			return fmt.Errorf("capability %d: write mask of %d bytes for %d", i, len(cp.WriteMask), len(cp.Data))
		}
		if cp.ID == capIDMSIX {
			return fmt.Errorf("capability %d: MSI-X goes in Config.MSIX", i)
		}
		used += alignUp(2+len(cp.Data), 4)
	}
	if capStart+used > stdConfigSize {
		return fmt.Errorf("capabilities need %d bytes; only %d fit", used, stdConfigSize-capStart)
	}
	return nil
}

func pbaBytes(vectors int) uint64 { return 8 * ((uint64(vectors) + 63) / 64) }

func alignUp(n, a int) int { return (n + a - 1) &^ (a - 1) }
