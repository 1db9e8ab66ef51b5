package pcidev

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// A function's state outlives the daemon's process with SaveState and
// RestoreState: the configuration space as the client wrote it (command
// register, BAR addresses, MSI-X control), the MSI-X table and the pending
// bits. A state crosses a process boundary and is validated like client
// input: only bits the client may write are taken from it.

// stateMagic and stateVersion open a saved state.
const (
	stateMagic   = 0x50434946 // "PCIF"
	stateVersion = 1
)

// ErrState reports a saved state this function cannot take.
var ErrState = errors.New("invalid saved PCI function state")

// SaveState returns the function's state, versioned.
func (f *Function) SaveState() []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	var table, pending []byte
	if f.msix != nil {
		table = f.msix.table
		pending = make([]byte, 8*len(f.msix.pending))
		for i, w := range f.msix.pending {
			binary.LittleEndian.PutUint64(pending[8*i:], w)
		}
	}
	b := make([]byte, 0, 16+f.space.size+len(table)+len(pending))
	b = binary.LittleEndian.AppendUint32(b, stateMagic)
	b = binary.LittleEndian.AppendUint16(b, stateVersion)
	b = binary.LittleEndian.AppendUint16(b, uint16(f.space.size/256))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(table)))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(pending)))
	b = append(b, f.space.b[:f.space.size]...)
	b = append(b, table...)
	return append(b, pending...)
}

// RestoreState takes up a state SaveState returned (in this process or an
// earlier one) for a function of the same configuration. Read-only bits
// keep this function's values. The cached registers follow; no callback
// runs.
func (f *Function) RestoreState(b []byte) error {
	if len(b) < 16 || binary.LittleEndian.Uint32(b) != stateMagic {
		return fmt.Errorf("%w: no header", ErrState)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != stateVersion {
		return fmt.Errorf("%w: version %d, this daemon reads %d", ErrState, v, stateVersion)
	}
	size := int(binary.LittleEndian.Uint16(b[6:])) * 256
	tlen := int(binary.LittleEndian.Uint32(b[8:]))
	plen := int(binary.LittleEndian.Uint32(b[12:]))
	var wantT, wantP int
	if f.msix != nil {
		wantT, wantP = len(f.msix.table), 8*len(f.msix.pending)
	}
	if size != f.space.size || tlen != wantT || plen != wantP || len(b) != 16+size+tlen+plen {
		return fmt.Errorf("%w: layout %d/%d/%d bytes of %d, this function has %d/%d/%d", ErrState, size, tlen, plen, len(b),
			f.space.size, wantT, wantP)
	}
	cfg := b[16 : 16+size]
	f.mu.Lock()
	s := f.space
	s.b = s.init
	for i := 0; i < size; i++ {
		s.b[i] = s.init[i]&^s.wmask[i] | cfg[i]&s.wmask[i]
	}
	if f.msix != nil {
		copy(f.msix.table, b[16+size:16+size+tlen])
		p := b[16+size+tlen:]
		for i := range f.msix.pending {
			f.msix.pending[i] = binary.LittleEndian.Uint64(p[8*i:])
		}
		// Bits past the last vector are not pending.
		if r := f.msix.cfg.Vectors % 64; r != 0 {
			f.msix.pending[len(f.msix.pending)-1] &= 1<<r - 1
		}
	}
	f.command.Store(uint32(s.u16(offCommand)))
	if s.msix != 0 {
		f.msixCtrl.Store(uint32(s.u16(s.msix + 2)))
	}
	f.mu.Unlock()
	return nil
}

// CheckState reports whether this daemon reads the format of a saved state
// (its header and version; the layout is checked against the function at
// RestoreState).
func CheckState(b []byte) error {
	if len(b) < 16 || binary.LittleEndian.Uint32(b) != stateMagic {
		return fmt.Errorf("%w: no header", ErrState)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != stateVersion {
		return fmt.Errorf("%w: version %d, this daemon reads %d", ErrState, v, stateVersion)
	}
	return nil
}
