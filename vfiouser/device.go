package vfiouser

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Device is one emulated device instance, made by the server's factory for
// one client connection and closed when that connection ends. Region and
// reset callbacks run on the connection's goroutine, one at a time and in
// message order; they must not block for long (every doorbell is a
// synchronous round trip for the guest's vCPU).
type Device interface {
	// Describe returns the device's regions and interrupts. It is called
	// once, right after the factory returns; the answer must not change.
	Describe() Description
	// ReadRegion fills p from region index at offset. The server has
	// checked that [offset, offset+len(p)) lies inside the region and that
	// the region is readable; len(p) > 0.
	ReadRegion(index uint32, offset uint64, p []byte) error
	// WriteRegion writes p to region index at offset, checked likewise.
	// p is only valid during the call.
	WriteRegion(index uint32, offset uint64, p []byte) error
	// Reset returns the device to its power-on state (DEVICE_RESET, or the
	// client going away). Guest memory and interrupt assignments belong to
	// the connection and are handled by the server.
	Reset(reason ResetReason) error
	// Close releases the device. It is called once, after the last
	// callback, when the connection ends.
	Close() error
}

// IRQNotifier is implemented by devices that want to know how the client
// configures their interrupts (DEVICE_SET_IRQS): a level-triggered INTx
// source re-asserts on unmask, an MSI-X source delivers a vector it left
// pending once the vector gets its eventfd. It is called on the
// connection's goroutine after the change took effect.
type IRQNotifier interface {
	IRQChanged(index IRQIndex, start, count uint32, ev IRQEvent)
}

// IRQEvent is a change to a range of interrupt vectors.
type IRQEvent int

// Interrupt configuration changes.
const (
	IRQAssigned   IRQEvent = iota // eventfds installed
	IRQDeassigned                 // eventfds removed (or the whole index disabled)
	IRQMasked
	IRQUnmasked
)

func (e IRQEvent) String() string {
	switch e {
	case IRQAssigned:
		return "assigned"
	case IRQDeassigned:
		return "deassigned"
	case IRQMasked:
		return "masked"
	case IRQUnmasked:
		return "unmasked"
	}
	return fmt.Sprintf("IRQEvent(%d)", int(e))
}

// DMANotifier is implemented by devices that want to know about guest
// memory changes. DMAMapped runs after a region was added, DMAUnmapped
// after one was removed (and no access is in flight any more).
type DMANotifier interface {
	DMAMapped(r guestmem.RegionSpec)
	DMAUnmapped(base guestmem.GPA, size uint64)
}

// ResetReason says why a device is reset.
type ResetReason int

// Reset reasons.
const (
	// ResetClient: the client sent DEVICE_RESET (QEMU does so on machine
	// reset, often twice).
	ResetClient ResetReason = iota
	// ResetDisconnect: the client went away.
	ResetDisconnect
)

func (r ResetReason) String() string {
	switch r {
	case ResetClient:
		return "client"
	case ResetDisconnect:
		return "disconnect"
	}
	return fmt.Sprintf("ResetReason(%d)", int(r))
}

// Description is what a device offers: its regions (indexed as the client
// sees them; PCI devices use indexes 0-8 with 7 the config space) and its
// interrupt types (indexed by IRQIndex).
type Description struct {
	// PCI marks a PCI device (VFIO_DEVICE_FLAGS_PCI).
	PCI bool
	// Regions, at most MaxRegions.
	Regions []Region
	// IRQs, one entry per interrupt index, at most MaxIRQIndexes.
	IRQs []IRQ
	// RequireSharedMemory says the device reads and writes guest RAM in
	// place: an access to guest memory that the client mapped without a
	// file descriptor then fails with guestmem.ErrNotShared (an error that
	// names the QEMU options to use) instead of going through DMA_READ and
	// DMA_WRITE messages. Such maps are still accepted.
	RequireSharedMemory bool
}

// Limits on what a device may describe (QEMU's client refuses more than
// 100 regions and 50 interrupt indexes).
const (
	MaxRegions    = 100
	MaxIRQIndexes = 50
	// MaxIRQVectors bounds the vectors of one interrupt index (the MSI-X
	// maximum).
	MaxIRQVectors = 2048
)

// Region describes one device region.
type Region struct {
	// Size in bytes; 0 means the region is absent.
	Size uint64
	// Read and Write say which accesses the client may make.
	Read, Write bool
	// Mmap, if set, offers parts of the region for the client to map
	// (VFIO_REGION_INFO_FLAG_MMAP with a sparse-mmap capability).
	Mmap *RegionMmap
}

// RegionMmap describes the mappable parts of a region.
type RegionMmap struct {
	// FD is a file the client may mmap; the device keeps ownership (the
	// server sends a duplicate with each GET_REGION_INFO reply).
	FD int
	// Offset is the file offset of the region's byte 0.
	Offset uint64
	// Areas are the mappable parts relative to the region; none means the
	// whole region.
	Areas []MmapArea
}

// IRQ describes one interrupt index.
type IRQ struct {
	// Count is the number of vectors (sub-indexes).
	Count uint32
	// Flags are IRQInfo* flags; IRQInfoEventfd is always added. Use
	// IRQInfoMaskable|IRQInfoAutomasked for INTx.
	Flags uint32
}

// Host is what the connection gives the device it serves: the guest's
// memory, the interrupt lines and a logger. The factory keeps what it needs.
type Host struct {
	// Name identifies the connection in logs (socket path and a sequence
	// number).
	Name string
	// Memory is the guest-physical address space that DMA_MAP and
	// DMA_UNMAP build. Only the server adds or removes regions.
	Memory *guestmem.Memory
	// IRQs signals the device's interrupts through the eventfds the client
	// assigns. Safe for concurrent use from any goroutine.
	IRQs *IRQs
	// Logger is the connection's logger.
	Logger *slog.Logger
	// PeerPID is the client's process ID as the kernel gave it when the
	// socket connected (SO_PEERCRED); 0 if unknown (not a unix socket).
	PeerPID int32
	// Resumed is set when the connection was taken over from another
	// process (Server.Resume): guest memory is mapped already, and the
	// device must take up the state the guest left it in.
	Resumed bool
	// Keeper, if the factory sets it, is told about the connection's
	// descriptors and session from then on (see Keeper).
	Keeper Keeper

	conn *conn
}

// NewDeviceFunc makes the device for one connection. ctx is canceled when
// the connection ends.
type NewDeviceFunc func(ctx context.Context, h *Host) (Device, error)

// validate checks a description against the protocol's limits.
func (d *Description) validate() error {
	if len(d.Regions) > MaxRegions {
		return fmt.Errorf("%d regions (max %d): %w", len(d.Regions), MaxRegions, ErrInvalid)
	}
	if len(d.IRQs) > MaxIRQIndexes {
		return fmt.Errorf("%d interrupt indexes (max %d): %w", len(d.IRQs), MaxIRQIndexes, ErrInvalid)
	}
	for i, r := range d.Regions {
		if r.Mmap == nil {
			continue
		}
		if r.Mmap.FD < 0 {
			return fmt.Errorf("region %d: mmap without a file: %w", i, ErrInvalid)
		}
		for _, a := range r.Mmap.Areas {
			if end := a.Offset + a.Size; end < a.Offset || end > r.Size || a.Size == 0 {
				return fmt.Errorf("region %d: mmap area %#x+%#x outside the region: %w", i, a.Offset, a.Size, ErrInvalid)
			}
		}
	}
	for i, q := range d.IRQs {
		if q.Count > MaxIRQVectors {
			return fmt.Errorf("irq index %d: %d vectors (max %d): %w", i, q.Count, MaxIRQVectors, ErrInvalid)
		}
	}
	return nil
}
