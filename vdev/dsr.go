package vdev

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Limits of the device rings the DSR names. The driver uses 4 pages each
// (PVRDMA_NUM_RING_PAGES); one page table is the most the ABI's single
// table walk allows (CVE-2023-1544 read past it).
const (
	minDSRRingPages = 2 // ring state + at least one page of entries
	maxDSRRingPages = ringbuf.PageTableEntries
)

// Errnos the device stores in ERR (positive: the driver only tests for
// nonzero, and a negative value was one of QEMU's latent bugs).
const (
	errnoNoDSR = uint32(syscall.EFAULT)
	errnoInval = uint32(syscall.EINVAL)
)

// loadDSR runs on the DSRHIGH write: it reads the DSR the driver prepared,
// validates the slots and rings it names, builds the async-event and
// CQ-notification rings and only then writes the capabilities, which the
// driver reads back right after its write. A DSR that was already loaded
// is replaced after a full reset, so a second DSRHIGH never leaves rings
// or objects of the first behind.
func (d *Device) loadDSR() {
	gpa := guestmem.GPA(uint64(d.dsrHigh)<<32 | uint64(d.dsrLow))
	if d.dsr != nil {
		low, high := d.dsrLow, d.dsrHigh
		d.resetLocked()
		d.dsrLow, d.dsrHigh = low, high
	}
	if err := d.loadDSRAt(gpa); err != nil {
		d.fault = fmt.Errorf("pvrdma: device shared region at %v refused: %w", gpa, err)
		d.errReg = errnoOf(err)
		level := slog.LevelDebug
		if errors.Is(err, guestmem.ErrNotShared) {
			level = slog.LevelError // an operator error, say so loudly
		}
		d.lim.Log(context.Background(), level, "dsr-refused", "pvrdma: refusing device shared region", "dsr", gpa, "err", err)
		return
	}
	d.fault = nil
}

func (d *Device) loadDSRAt(gpa guestmem.GPA) error {
	if gpa.PageOffset()%8 != 0 {
		return fmt.Errorf("DSR at %v misaligned: %w", gpa, syscall.EINVAL)
	}
	var buf [abi.DSRSize]byte
	if err := d.mem.ReadAt(buf[:], gpa); err != nil {
		return fmt.Errorf("read DSR at %v: %w", gpa, err)
	}
	var dsr abi.DSR
	dsr.Decode(buf[:])
	st := &dsrState{
		gpa: gpa, driverVersion: dsr.DriverVersion,
		cmdSlot: guestmem.GPA(dsr.CmdSlot), respSlot: guestmem.GPA(dsr.RespSlot), uarPFN: dsr.UARPFN,
	}
	for _, s := range []struct {
		name string
		gpa  guestmem.GPA
	}{{"command slot", st.cmdSlot}, {"response slot", st.respSlot}} {
		if err := checkSlot(d.mem, s.gpa); err != nil {
			return fmt.Errorf("DSR %s: %w", s.name, err)
		}
	}
	async, err := d.deviceRing(dsr.AsyncRing, abi.EQESize)
	if err != nil {
		return fmt.Errorf("DSR async event ring: %w", err)
	}
	notify, err := d.deviceRing(dsr.CQRing, abi.CQNESize)
	if err != nil {
		return fmt.Errorf("DSR CQ notification ring: %w", err)
	}
	if dsr.DriverVersion < abi.VersionQPHandle {
		d.lim.Warn("old-driver", "pvrdma: guest driver predates device version 20 (QP handles); it may misbehave",
			"driver_version", dsr.DriverVersion)
	}
	var caps [abi.CapsSize]byte
	d.caps.Encode(caps[:])
	if d.rp != nil {
		// A restore: the driver read its capabilities at probe.
		d.rp.checkCaps(caps[:], gpa+abi.DSRCapsOffset)
	} else if err := d.mem.WriteAt(caps[:], gpa+abi.DSRCapsOffset); err != nil {
		return fmt.Errorf("write caps: %w", err)
	}
	d.asyncMu.Lock()
	d.async = async
	d.asyncMu.Unlock()
	d.notifyMu.Lock()
	d.notify = notify
	d.notifyMu.Unlock()
	d.dsr = st
	d.lim.Debug("dsr-loaded", "pvrdma: DSR loaded", "dsr", gpa, "driver_version", dsr.DriverVersion,
		"async_pages", dsr.AsyncRing.NumPages, "cq_pages", dsr.CQRing.NumPages)
	return nil
}

// deviceRing builds the producer side of a DSR ring (prod_tail reset, or
// adopted, see Device.SetAdoptRings): page 0 holds struct
// pvrdma_ring_state, whose rx half (byte 8) the device produces on; entries
// of size bytes start at page 1, (pages-1)*4096/size of them as the driver
// counts (see ringbuf.Geometry for why that count need not be a power of
// two).
func (d *Device) deviceRing(info abi.RingPageInfo, size uint32) (*ringbuf.Producer, error) {
	if info.NumPages < minDSRRingPages || info.NumPages > maxDSRRingPages {
		return nil, fmt.Errorf("%d pages (allowed %d..%d): %w", info.NumPages, minDSRRingPages, maxDSRRingPages, ringbuf.ErrPageCount)
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(info.PDirDMA), int(info.NumPages), maxDSRRingPages)
	if err != nil {
		return nil, err
	}
	geo, err := ringbuf.NewGeometry((info.NumPages - 1) * guestmem.PageSize / size)
	if err != nil {
		return nil, err
	}
	area, err := ringbuf.NewArea(pages, guestmem.PageSize, size, geo.Len())
	if err != nil {
		return nil, err
	}
	return d.newProducer(pages[0]+ringStateRx, geo, area)
}

// ringStateRx is the offset of the rx ring in struct pvrdma_ring_state
// (tx at 0, rx at 8): CQs, SRQs and the DSR rings use rx; QPs keep the SQ
// ring at 0 and the RQ ring at 8.
const ringStateRx = 8

// checkSlot validates a command or response slot: a page-aligned page of
// guest RAM.
func checkSlot(m *guestmem.Memory, gpa guestmem.GPA) error {
	if gpa.PageOffset() != 0 {
		return fmt.Errorf("%v not page-aligned: %w", gpa, ringbuf.ErrPageAddr)
	}
	var b [1]byte
	if err := m.ReadAt(b[:], gpa); err != nil {
		return err
	}
	end, ok := gpa.Add(guestmem.PageSize - 1)
	if !ok {
		return fmt.Errorf("%v: %w", gpa, ringbuf.ErrPageAddr)
	}
	return m.ReadAt(b[:], end)
}

// pushEvent appends an async event to the guest's event ring and raises
// vector 1. A full ring drops the event (counted): the guest stopped
// consuming, and blocking would stall the provider.
func (d *Device) pushEvent(typ, info uint32) {
	d.asyncMu.Lock()
	if d.async == nil {
		d.asyncMu.Unlock()
		d.stats.asyncDropped.Add(1)
		return
	}
	gpa, err := d.async.Reserve()
	if err == nil {
		abi.EQE{Type: typ, Info: info}.Encode(d.eqeBuf[:])
		if err = d.mem.WriteAt(d.eqeBuf[:], gpa); err == nil {
			err = d.async.Commit()
		}
	}
	d.asyncMu.Unlock()
	if err != nil {
		d.stats.asyncDropped.Add(1)
		return
	}
	d.stats.asyncEvents.Add(1)
	d.raise(abi.VectorAsync)
}

// pushCQNotify appends a CQ handle to the CQ-notification ring and raises
// vector 2.
func (d *Device) pushCQNotify(handle uint32) {
	d.notifyMu.Lock()
	if d.notify == nil {
		d.notifyMu.Unlock()
		d.stats.notifyDropped.Add(1)
		return
	}
	gpa, err := d.notify.Reserve()
	if err == nil {
		abi.CQNE{Info: handle}.Encode(d.cqneBuf[:])
		if err = d.mem.WriteAt(d.cqneBuf[:], gpa); err == nil {
			err = d.notify.Commit()
		}
	}
	d.notifyMu.Unlock()
	if err != nil {
		d.stats.notifyDropped.Add(1)
		return
	}
	d.stats.cqNotifications.Add(1)
	d.raise(abi.VectorCQ)
}
