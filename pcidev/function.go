package pcidev

import (
	"errors"
	"fmt"
	"log/slog"
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// ErrNoINTx is returned when a function without an interrupt pin is asked
// to assert INTx (MSI-X disabled or absent).
var ErrNoINTx = errors.New("function has no INTx pin")

// Function is a PCI function served over vfio-user. It implements
// vfiouser.Device (and vfiouser.IRQNotifier) and tells the device model
// about the bus: whether memory decode and bus mastering are on, and how to
// raise interrupts.
type Function struct {
	cfg  Config
	irqs *vfiouser.IRQs
	log  *slog.Logger
	desc vfiouser.Description

	mu    sync.Mutex // config space and MSI-X table/PBA
	space *configSpace
	msix  *msixState // nil without MSI-X

	// Copies of the command register and MSI-X message control, written
	// under mu, read lock-free by the device model.
	command  atomic.Uint32
	msixCtrl atomic.Uint32
}

// New builds the function described by cfg for the connection h.
func New(h *vfiouser.Host, cfg Config) (*Function, error) {
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("pcidev %04x:%04x: %w", cfg.VendorID, cfg.DeviceID, err)
	}
	log := slog.Default()
	var irqs *vfiouser.IRQs
	if h != nil {
		irqs = h.IRQs
		if h.Logger != nil {
			log = h.Logger
		}
	}
	f := &Function{cfg: cfg, irqs: irqs, log: log, space: buildSpace(&cfg)}
	if cfg.MSIX != nil {
		f.msix = newMSIXState(cfg.MSIX)
	}
	f.desc = f.describe()
	return f, nil
}

func (f *Function) describe() vfiouser.Description {
	d := vfiouser.Description{PCI: true, RequireSharedMemory: f.cfg.RequireSharedMemory}
	d.Regions = make([]vfiouser.Region, vfiouser.NumPCIRegions)
	for i := 0; i < 6; i++ {
		b := &f.cfg.BARs[i]
		if b.Type == BARNone {
			continue
		}
		d.Regions[i] = vfiouser.Region{Size: b.Size, Read: true, Write: true, Mmap: b.Mmap}
	}
	d.Regions[vfiouser.RegionConfig] = vfiouser.Region{Size: uint64(f.space.size), Read: true, Write: true}
	d.IRQs = make([]vfiouser.IRQ, vfiouser.NumPCIIRQs)
	if f.cfg.IntPin != 0 {
		d.IRQs[vfiouser.IRQINTx] = vfiouser.IRQ{Count: 1, Flags: vfiouser.IRQInfoMaskable | vfiouser.IRQInfoAutomasked}
	}
	if f.cfg.MSIX != nil {
		d.IRQs[vfiouser.IRQMSIX] = vfiouser.IRQ{Count: uint32(f.cfg.MSIX.Vectors)}
	}
	// One ERR and one REQ vector: with none, QEMU warns "Could not enable
	// error recovery for the device".
	d.IRQs[vfiouser.IRQErr] = vfiouser.IRQ{Count: 1}
	d.IRQs[vfiouser.IRQReq] = vfiouser.IRQ{Count: 1}
	return d
}

// Describe implements vfiouser.Device.
func (f *Function) Describe() vfiouser.Description { return f.desc }

// Command returns the command register.
func (f *Function) Command() uint16 { return uint16(f.command.Load()) }

// BusMaster reports whether the guest allows the function to master the
// bus: DMA to guest memory and MSI-X messages.
func (f *Function) BusMaster() bool { return f.Command()&CommandBusMaster != 0 }

// MemoryEnabled reports whether the function decodes its memory BARs.
func (f *Function) MemoryEnabled() bool { return f.Command()&CommandMemory != 0 }

// IOEnabled reports whether the function decodes its I/O BARs.
func (f *Function) IOEnabled() bool { return f.Command()&CommandIO != 0 }

// ReadRegion implements vfiouser.Device.
func (f *Function) ReadRegion(index uint32, off uint64, p []byte) error {
	switch {
	case index == vfiouser.RegionConfig:
		f.readConfig(int(off), p)
		return nil
	case index < 6:
		return f.accessBAR(int(index), off, p, false)
	}
	fill(p, 0xff)
	return nil
}

// WriteRegion implements vfiouser.Device.
func (f *Function) WriteRegion(index uint32, off uint64, p []byte) error {
	switch {
	case index == vfiouser.RegionConfig:
		f.writeConfig(int(off), p)
		return nil
	case index < 6:
		return f.accessBAR(int(index), off, p, true)
	}
	return nil
}

func fill(p []byte, v byte) {
	for i := range p {
		p[i] = v
	}
}

func (f *Function) readConfig(off int, p []byte) {
	f.mu.Lock()
	if overlaps(off, len(p), offStatus, 2) && f.cfg.INTxLevel != nil {
		// Interrupt status follows the device's INTx level.
		st := f.space.u16(offStatus) &^ StatusINTx
		if f.cfg.IntPin != 0 && f.cfg.INTxLevel() {
			st |= StatusINTx
		}
		f.space.put16(offStatus, st)
	}
	f.space.read(off, p)
	f.mu.Unlock()
}

func (f *Function) writeConfig(off int, p []byte) {
	f.mu.Lock()
	oldCmd := f.space.u16(offCommand)
	var oldCtrl uint16
	if f.space.msix != 0 {
		oldCtrl = f.space.u16(f.space.msix + 2)
	}
	f.space.write(off, p)
	newCmd := f.space.u16(offCommand)
	newCtrl := oldCtrl
	if f.space.msix != 0 {
		newCtrl = f.space.u16(f.space.msix + 2)
	}
	f.command.Store(uint32(newCmd))
	f.msixCtrl.Store(uint32(newCtrl))
	f.mu.Unlock()

	if newCmd != oldCmd {
		f.log.Debug("PCI command register", "old", fmt.Sprintf("%#04x", oldCmd), "new", fmt.Sprintf("%#04x", newCmd))
		if f.cfg.CommandChanged != nil {
			f.cfg.CommandChanged(oldCmd, newCmd)
		}
		if oldCmd&CommandINTxDisable != 0 && newCmd&CommandINTxDisable == 0 {
			f.reassertINTx()
		}
	}
	if newCtrl != oldCtrl {
		f.log.Debug("MSI-X control", "old", fmt.Sprintf("%#04x", oldCtrl), "new", fmt.Sprintf("%#04x", newCtrl))
		if oldCtrl&msixCtrlEnable != 0 && newCtrl&msixCtrlEnable == 0 {
			f.reassertINTx() // back to INTx: a level still held shows there
		}
	}
	if newCmd != oldCmd || newCtrl != oldCtrl {
		f.deliverPending()
	}
	if f.cfg.StateChanged != nil {
		f.cfg.StateChanged()
	}
}

// accessBAR serves a BAR access: decode gating, then the MSI-X table and
// PBA, then the device's callbacks, splitting an access that straddles
// them.
func (f *Function) accessBAR(i int, off uint64, p []byte, write bool) error {
	b := &f.cfg.BARs[i]
	enabled := f.MemoryEnabled()
	if b.Type == BARIO {
		enabled = f.IOEnabled()
	}
	if !enabled {
		// No decode: the guest's access would master-abort. Reads return
		// all-ones, writes are dropped.
		if !write {
			fill(p, 0xff)
		}
		return nil
	}
	x := f.msix
	if x == nil || x.cfg.BAR != i {
		return callBAR(b, off, p, write)
	}
	for len(p) > 0 {
		if x.inTable(off) || x.inPBA(off) {
			n := 0
			f.mu.Lock()
			for n < len(p) && (x.inTable(off+uint64(n)) || x.inPBA(off+uint64(n))) {
				x.accessByte(off+uint64(n), &p[n], write)
				n++
			}
			f.mu.Unlock()
			if write && f.cfg.StateChanged != nil {
				f.cfg.StateChanged()
			}
			off, p = off+uint64(n), p[n:]
			continue
		}
		n := 1
		for n < len(p) && !x.inTable(off+uint64(n)) && !x.inPBA(off+uint64(n)) {
			n++
		}
		if err := callBAR(b, off, p[:n], write); err != nil {
			return err
		}
		off, p = off+uint64(n), p[n:]
	}
	return nil
}

func callBAR(b *BAR, off uint64, p []byte, write bool) error {
	if write {
		if b.Write != nil {
			return b.Write(off, p)
		}
		return nil
	}
	if b.Read != nil {
		return b.Read(off, p)
	}
	clear(p)
	return nil
}

// AssertINTx signals the INTx pin unless the guest disabled INTx in the
// command register. While the client has it masked (after the previous
// assertion, until the guest's EOI) nothing more is sent; on unmask the
// function asks Config.INTxLevel and re-asserts if the device still holds
// the line.
func (f *Function) AssertINTx() error {
	if f.cfg.IntPin == 0 {
		return ErrNoINTx
	}
	if f.Command()&CommandINTxDisable != 0 {
		return nil
	}
	err := f.irqs.Trigger(vfiouser.IRQINTx, 0)
	if errors.Is(err, vfiouser.ErrMasked) || errors.Is(err, vfiouser.ErrNoIRQ) {
		// Masked: already asserted. Not assigned: re-asserted on
		// assignment if the level is still high.
		return nil
	}
	return err
}

func (f *Function) reassertINTx() {
	if f.cfg.INTxLevel == nil || f.MSIXEnabled() || !f.cfg.INTxLevel() {
		return
	}
	if err := f.AssertINTx(); err != nil {
		f.log.Debug("INTx re-assert failed", "err", err)
	}
}

// IRQChanged implements vfiouser.IRQNotifier: an unmasked or newly
// assigned INTx re-asserts a held level; a newly assigned MSI-X vector
// receives what was pending for it.
func (f *Function) IRQChanged(index vfiouser.IRQIndex, start, count uint32, ev vfiouser.IRQEvent) {
	switch {
	case index == vfiouser.IRQINTx && (ev == vfiouser.IRQUnmasked || ev == vfiouser.IRQAssigned):
		f.reassertINTx()
	case index == vfiouser.IRQMSIX && ev == vfiouser.IRQAssigned:
		f.deliverPending()
	}
}

// Reset implements vfiouser.Device: config space, MSI-X state and the
// cached registers return to power-on values, then Config.Reset runs.
func (f *Function) Reset(reason vfiouser.ResetReason) error {
	f.mu.Lock()
	f.space.reset()
	if f.msix != nil {
		f.msix.reset()
	}
	f.command.Store(0)
	f.msixCtrl.Store(0)
	f.mu.Unlock()
	if f.cfg.Reset != nil {
		f.cfg.Reset(reason)
	}
	return nil
}

// Close implements vfiouser.Device.
func (f *Function) Close() error {
	if f.cfg.Close != nil {
		return f.cfg.Close()
	}
	return nil
}

// PendingMSIX reports whether vector is pending (set in the PBA).
func (f *Function) PendingMSIX(vector int) bool {
	if f.msix == nil || vector < 0 || vector >= f.msix.cfg.Vectors {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.msix.pending[vector/64]&(1<<(vector%64)) != 0
}

func trailingZeros(x uint64) int { return bits.TrailingZeros64(x) }
