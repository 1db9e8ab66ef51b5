package guestmem

import (
	"errors"
	"fmt"
)

// ErrNotContiguous: a Slice range crosses from one region into another, so
// it has no single host mapping (use ReadAt/WriteAt, which span regions).
var ErrNotContiguous = errors.New("guest range spans regions")

// Pin keeps a region mapped while a Slice of it is in use: a removal of
// the region (DMA_UNMAP) waits until the pin is released. The zero Pin is
// released already.
type Pin struct{ r *region }

// Release ends the pin; calling it again does nothing.
func (p *Pin) Release() {
	if p.r != nil {
		p.r.exit()
		p.r = nil
	}
}

// Hold turns the pin into a long-lived hold on its region and releases
// the pin: until the Hold is released, Remove refuses the region
// (ErrHeld), so its pages stay the client's as long as a host device uses
// them (an ibverbs MR registered over a mapping of the region's file).
// RemoveAll (disconnect, reset) ignores holds: the holder's objects go
// with the connection. It fails if the region is being removed.
func (p *Pin) Hold() (Hold, error) {
	r := p.r
	if r == nil {
		return Hold{}, fmt.Errorf("hold: %w", ErrUnmapped)
	}
	defer p.Release()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		return Hold{}, fmt.Errorf("hold %v+%#x: %w", r.Base, r.Size, ErrUnmapped)
	}
	r.holders++
	return Hold{r: r}, nil
}

// Hold keeps a region from being removed (Pin.Hold).
type Hold struct{ r *region }

// Release ends the hold; calling it again does nothing.
func (h *Hold) Release() {
	if h.r != nil {
		h.r.mu.Lock()
		h.r.holders--
		h.r.mu.Unlock()
		h.r = nil
	}
}

// Slice returns the host mapping of [gpa, gpa+n) for access in place
// (zero-copy I/O from or into guest memory), and a Pin that keeps the
// region mapped until Release. The range must lie inside one mapped region
// (ErrNotContiguous otherwise) that allows the access (write: ErrReadOnly;
// a region without a mapping: ErrNotShared). The slice must not be used
// after Release; hold pins briefly, since a DMA_UNMAP waits for them.
func (m *Memory) Slice(gpa GPA, n uint64, write bool) ([]byte, Pin, error) {
	if _, ok := gpa.Add(n); !ok {
		return nil, Pin{}, fmt.Errorf("slice %v+%#x: %w", gpa, n, ErrRange)
	}
	r := m.find(gpa)
	if r == nil {
		return nil, Pin{}, fmt.Errorf("slice %v+%#x: %w", gpa, n, ErrUnmapped)
	}
	off := uint64(gpa) - uint64(r.Base)
	var err error
	switch {
	case n > r.Size-off:
		err = ErrUnmapped
		if next := m.find(r.Base + GPA(r.Size)); next != nil { // r.end() cannot overflow
			next.exit()
			err = ErrNotContiguous
		}
	case r.Prot&ProtRead == 0 && !write:
		err = ErrUnmapped
	case write && r.Prot&ProtWrite == 0:
		err = ErrReadOnly
	case r.Data == nil:
		err = ErrNotShared
	}
	if err != nil {
		r.exit()
		return nil, Pin{}, fmt.Errorf("slice %v+%#x: %w", gpa, n, err)
	}
	return r.Data[off : off+n : off+n], Pin{r: r}, nil
}

// ErrNoFile: a region has no backing file descriptor (FileRange).
var ErrNoFile = errors.New("guest region has no backing file")

// FileRange returns the file that backs [gpa, gpa+n), the offset of gpa in
// it, and a Pin that keeps the region (and so the descriptor) alive until
// Release: a provider that maps the same pages again (an ibverbs MR alias)
// must map them before releasing the pin. The range must lie inside one
// region that has a file (ErrNotContiguous, ErrUnmapped or ErrNoFile
// otherwise) and, for write, that the client mapped writable (ErrReadOnly):
// a mapping made from the file must not allow more than the client's map.
func (m *Memory) FileRange(gpa GPA, n uint64, write bool) (fd int, offset int64, pin Pin, err error) {
	if _, ok := gpa.Add(n); !ok {
		return -1, 0, Pin{}, fmt.Errorf("file range %v+%#x: %w", gpa, n, ErrRange)
	}
	r := m.find(gpa)
	if r == nil {
		return -1, 0, Pin{}, fmt.Errorf("file range %v+%#x: %w", gpa, n, ErrUnmapped)
	}
	off := uint64(gpa) - uint64(r.Base)
	switch {
	case n > r.Size-off:
		err = ErrNotContiguous
	case r.FD < 0 || r.Data == nil:
		err = ErrNoFile
	case write && r.Prot&ProtWrite == 0:
		err = ErrReadOnly
	case !write && r.Prot&ProtRead == 0:
		err = ErrUnmapped
	}
	if err != nil {
		r.exit()
		return -1, 0, Pin{}, fmt.Errorf("file range %v+%#x: %w", gpa, n, err)
	}
	return r.FD, r.Offset + int64(off), Pin{r: r}, nil
}
