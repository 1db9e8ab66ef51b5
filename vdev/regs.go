package vdev

import (
	"encoding/binary"
	"fmt"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// ReadBAR answers a guest read of len(p) bytes at offset off of BAR bar.
// Every offset inside a BAR is answered (CVE-2018-20191 was a BAR without a
// read handler): BAR0 reads zeros (QEMU emulates the MSI-X table; the PBA
// it forwards has no pending bits of ours), BAR1 reads the register file
// (unimplemented registers read zero), BAR2 (UAR) reads all-ones.
func (d *Device) ReadBAR(bar int, off uint64, p []byte) error {
	if err := checkAccess(bar, off, len(p)); err != nil {
		d.stats.badBARAccesses.Add(1)
		return err
	}
	switch bar {
	case abi.MSIXBAR:
		clear(p)
	case abi.UARBAR:
		for i := range p {
			p[i] = 0xff
		}
	case abi.RegsBAR:
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.closed {
			return ErrClosed
		}
		// Assemble the aligned registers the access touches; any size and
		// alignment is answered from the same view.
		var window [16]byte
		base := off &^ 3
		end := (off + uint64(len(p)) + 3) &^ 3
		if end-base > uint64(len(window)) {
			d.stats.badBARAccesses.Add(1)
			return fmt.Errorf("read BAR1 %#x+%d: %w", off, len(p), ErrAccess)
		}
		for r := base; r < end; r += 4 {
			binary.LittleEndian.PutUint32(window[r-base:], d.readReg(r))
		}
		copy(p, window[off-base:])
	}
	return nil
}

// readReg returns register reg (4-aligned). ICR is read-to-clear.
func (d *Device) readReg(reg uint64) uint32 {
	switch reg {
	case abi.RegVersion:
		return abi.DeviceVersion
	case abi.RegErr:
		return d.errReg
	case abi.RegICR:
		// The driver's INTx handler completes a command only if ICR reads
		// exactly RESPONSE; in that mode it ignores the async and CQ causes
		// anyway, so a pending response hides them rather than being hidden.
		v := d.icr.Swap(0)
		if v&(1<<abi.VectorResponse) != 0 {
			return 1 << abi.VectorResponse
		}
		return v
	case abi.RegIMR:
		return d.imr.Load()
	case abi.RegMACL:
		return d.macl
	case abi.RegMACH:
		return d.mach
	}
	return 0
}

// WriteBAR applies a guest write of p at offset off of BAR bar. Register
// writes must be 32-bit and aligned (the ABI's only access size); UAR
// doorbells are 32-bit writes at offsets 0, 4 and 8 of a UAR page and run
// synchronously: the ring is drained and posted before WriteBAR returns.
func (d *Device) WriteBAR(bar int, off uint64, p []byte) error {
	if err := checkAccess(bar, off, len(p)); err != nil {
		d.stats.badBARAccesses.Add(1)
		return err
	}
	if bar == abi.MSIXBAR {
		return nil // table and PBA belong to the PCI framework
	}
	if len(p) != 4 || off&3 != 0 {
		d.stats.badBARAccesses.Add(1)
		return fmt.Errorf("write BAR%d %#x+%d: only aligned 32-bit writes: %w", bar, off, len(p), ErrAccess)
	}
	v := binary.LittleEndian.Uint32(p)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	// The guest goes on: a hand-over in progress is abandoned before
	// anything it does changes the device.
	d.resumeTransportsLocked()
	if bar == abi.UARBAR {
		d.doorbell(off, v)
		return nil
	}
	d.writeReg(off, v)
	return nil
}

func (d *Device) writeReg(reg uint64, v uint32) {
	switch reg {
	case abi.RegDSRLow, abi.RegDSRHigh:
		if d.active {
			// The driver writes the DSR at probe and after a RESET,
			// never while the device runs: replacing it under live
			// objects would tear them all down on a guest's whim.
			d.stats.badBARAccesses.Add(1)
			d.errReg = uint32(syscall.EBUSY)
			d.lim.Warn("dsr-active", "pvrdma: DSR write while the device is active refused; RESET first", "reg", reg)
			return
		}
		if reg == abi.RegDSRLow {
			d.dsrLow = v
			d.journalReg(reg, v)
			return
		}
		d.dsrHigh = v
		d.loadDSR()
		d.journalReg(reg, v)
	case abi.RegCtl:
		d.control(v)
	case abi.RegRequest:
		d.execCommand()
	case abi.RegIMR:
		d.imr.Store(v)
		d.journalReg(reg, v)
	case abi.RegMACL:
		d.macl = v
		d.journalReg(reg, v)
	case abi.RegMACH:
		d.mach = v & 0xffff
		d.journalReg(reg, v)
	default:
		d.stats.badBARAccesses.Add(1) // read-only or unimplemented: ignored
	}
}

// control runs a CTL write.
func (d *Device) control(v uint32) {
	switch v {
	case abi.CtlActivate:
		if d.dsr == nil {
			d.errReg = errnoNoDSR
			return
		}
		d.errReg = 0
		if !d.active {
			d.active = true
			d.journalReg(abi.RegCtl, v)
			if d.rp != nil {
				break // a restore: the guest saw the event long ago
			}
			if pa, err := d.verbs.QueryPort(1); err == nil && pa.State == 4 {
				d.pushEvent(uint32(eventPortActive), 1)
			}
		}
	case abi.CtlUnquiesce:
		if d.dsr == nil {
			d.errReg = errnoNoDSR
			return
		}
		d.errReg = 0
	case abi.CtlReset:
		d.resetLocked()
		d.journalReg(abi.RegCtl, v)
	default:
		d.errReg = errnoInval
	}
}

func checkAccess(bar int, off uint64, n int) error {
	var size uint64
	switch bar {
	case abi.MSIXBAR:
		size = BAR0Size
	case abi.RegsBAR:
		size = BAR1Size
	case abi.UARBAR:
		size = BAR2Size
	default:
		return fmt.Errorf("BAR%d: %w", bar, ErrAccess)
	}
	if n <= 0 || n > 8 || off >= size || uint64(n) > size-off {
		return fmt.Errorf("BAR%d %#x+%d outside %#x bytes: %w", bar, off, n, size, ErrAccess)
	}
	return nil
}
