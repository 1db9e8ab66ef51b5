package pcidev

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// MSI-X table and PBA (MSI-X ECN). The table is 16 bytes per vector:
// message address low/high, message data, vector control (bit 0 masked,
// set at reset). The PBA has one pending bit per vector.
//
// Under QEMU the client emulates the table (guest table accesses never
// reach us) and applies per-vector masks itself, but forwards PBA reads.
// So the table here is storage for clients that do forward it, and vector
// masks in it are not applied; the function mask, the enable bit and bus
// mastering (all in config space, which we see) are. A vector that cannot
// be delivered (function masked, bus master off, or no eventfd yet, which
// is how QEMU leaves a vector the guest has not unmasked) becomes pending
// and is delivered when that changes.

const (
	msixEntrySize   = 16
	msixVectorCtrl  = 12
	msixVectorMaskd = 1
)

// msixState is guarded by Function.mu.
type msixState struct {
	cfg     MSIX
	table   []byte
	pending []uint64
}

func newMSIXState(x *MSIX) *msixState {
	m := &msixState{cfg: *x, table: make([]byte, msixEntrySize*x.Vectors), pending: make([]uint64, pbaBytes(x.Vectors)/8)}
	m.reset()
	return m
}

func (m *msixState) reset() {
	clear(m.table)
	for v := 0; v < m.cfg.Vectors; v++ {
		binary.LittleEndian.PutUint32(m.table[v*msixEntrySize+msixVectorCtrl:], msixVectorMaskd)
	}
	clear(m.pending)
}

func (m *msixState) setPending(v int)   { m.pending[v/64] |= 1 << (v % 64) }
func (m *msixState) clearPending(v int) { m.pending[v/64] &^= 1 << (v % 64) }

// inTable / inPBA report whether BAR offset off lies in the table / PBA.
func (m *msixState) inTable(off uint64) bool {
	return off >= uint64(m.cfg.TableOffset) && off < uint64(m.cfg.TableOffset)+uint64(len(m.table))
}

func (m *msixState) inPBA(off uint64) bool {
	return off >= uint64(m.cfg.PBAOffset) && off < uint64(m.cfg.PBAOffset)+8*uint64(len(m.pending))
}

// accessByte reads or writes one byte of the table or PBA.
func (m *msixState) accessByte(off uint64, b *byte, write bool) {
	switch {
	case m.inTable(off):
		i := off - uint64(m.cfg.TableOffset)
		if write {
			m.table[i] = *b
		} else {
			*b = m.table[i]
		}
	case m.inPBA(off):
		if !write { // the PBA is read-only
			i := off - uint64(m.cfg.PBAOffset)
			*b = byte(m.pending[i/8] >> (8 * (i % 8)))
		}
	}
}

// msixDeliverable reports whether a vector may be signalled now: MSI-X
// enabled, function not masked, bus mastering on (an MSI is a memory
// write by the function).
func (f *Function) msixDeliverable() bool {
	ctrl := uint16(f.msixCtrl.Load())
	return ctrl&msixCtrlEnable != 0 && ctrl&msixCtrlMask == 0 && f.BusMaster()
}

// MSIXEnabled reports whether the guest enabled MSI-X.
func (f *Function) MSIXEnabled() bool {
	return f.msix != nil && f.msixCtrl.Load()&msixCtrlEnable != 0
}

// TriggerMSIX signals MSI-X vector. If MSI-X is disabled (or absent) it
// asserts INTx instead; the device then reports its level through
// Config.INTxLevel. A vector that cannot be delivered yet is left pending
// (visible in the PBA) and delivered later; that is not an error. Safe for
// concurrent use from any goroutine.
func (f *Function) TriggerMSIX(vector int) error {
	if f.msix == nil || f.msixCtrl.Load()&msixCtrlEnable == 0 {
		return f.AssertINTx()
	}
	if vector < 0 || vector >= f.msix.cfg.Vectors {
		return fmt.Errorf("MSI-X vector %d of %d: %w", vector, f.msix.cfg.Vectors, vfiouser.ErrNoIRQ)
	}
	if f.msixDeliverable() {
		err := f.irqs.Trigger(vfiouser.IRQMSIX, uint32(vector))
		if !errors.Is(err, vfiouser.ErrNoIRQ) {
			if errors.Is(err, vfiouser.ErrMasked) {
				return nil // the client holds it pending
			}
			return err
		}
	}
	// Slow path: decide under the lock that writers of the enable, mask
	// and bus-master bits hold, so a vector cannot be left pending after
	// the change that would deliver it.
	f.mu.Lock()
	if f.msixDeliverable() && f.irqs.Assigned(vfiouser.IRQMSIX, uint32(vector)) {
		f.mu.Unlock()
		return f.signalMSIX(vector)
	}
	f.msix.setPending(vector)
	f.mu.Unlock()
	return nil
}

func (f *Function) signalMSIX(vector int) error {
	err := f.irqs.Trigger(vfiouser.IRQMSIX, uint32(vector))
	switch {
	case err == nil, errors.Is(err, vfiouser.ErrMasked):
		return nil
	case errors.Is(err, vfiouser.ErrNoIRQ): // de-assigned meanwhile
		f.mu.Lock()
		f.msix.setPending(vector)
		f.mu.Unlock()
		return nil
	}
	return err
}

// AwaitConsumed waits at most bound for the client to take the interrupt
// TriggerMSIX last signalled for vector: the MSI-X vector's eventfd, or
// the INTx eventfd when MSI-X is off, read again (vfiouser.IRQs
// AwaitConsumed). It reports whether it was within the bound, and an
// error wrapping vfiouser.ErrNoIRQ when there is no eventfd to look at
// (an interrupt that could not be signalled is left pending).
func (f *Function) AwaitConsumed(vector int, bound time.Duration) (bool, error) {
	if f.msix == nil || f.msixCtrl.Load()&msixCtrlEnable == 0 {
		return f.irqs.AwaitConsumed(vfiouser.IRQINTx, 0, bound)
	}
	return f.irqs.AwaitConsumed(vfiouser.IRQMSIX, uint32(vector), bound)
}

// deliverPending signals the pending vectors that can be delivered now.
func (f *Function) deliverPending() {
	if f.msix == nil {
		return
	}
	var ready []int
	f.mu.Lock()
	if f.msixDeliverable() {
		for w, bitsW := range f.msix.pending {
			for bitsW != 0 {
				b := trailingZeros(bitsW)
				bitsW &^= 1 << b
				v := w*64 + b
				if f.irqs.Assigned(vfiouser.IRQMSIX, uint32(v)) {
					f.msix.clearPending(v)
					ready = append(ready, v)
				}
			}
		}
	}
	f.mu.Unlock()
	for _, v := range ready {
		if err := f.signalMSIX(v); err != nil {
			f.log.Warn("MSI-X delivery failed", "vector", v, "err", err)
		}
	}
}

// Trigger signals vector like TriggerMSIX and logs instead of returning an
// error: the interrupt sink the device model holds.
func (f *Function) Trigger(vector int) {
	if err := f.TriggerMSIX(vector); err != nil {
		f.log.Debug("interrupt not delivered", "vector", vector, "err", err)
	}
}
