package guestmem

import (
	"encoding/binary"
	"fmt"
)

// Uint32 reads a little-endian uint32 at gpa (plain load).
func (m *Memory) Uint32(gpa GPA) (uint32, error) {
	var b [4]byte
	if err := m.ReadAt(b[:], gpa); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint32(b[:]), nil
}

// Uint64 reads a little-endian uint64 at gpa (plain load).
func (m *Memory) Uint64(gpa GPA) (uint64, error) {
	var b [8]byte
	if err := m.ReadAt(b[:], gpa); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b[:]), nil
}

// PutUint32 writes a little-endian uint32 at gpa (plain store).
func (m *Memory) PutUint32(gpa GPA, v uint32) error {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	return m.WriteAt(b[:], gpa)
}

// PutUint64 writes a little-endian uint64 at gpa (plain store).
func (m *Memory) PutUint64(gpa GPA, v uint64) error {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	return m.WriteAt(b[:], gpa)
}

// word returns the entered region holding the naturally aligned size-byte
// word at gpa, and the offset inside its mapping. The caller must exit r.
func (m *Memory) word(gpa GPA, size uint64, write bool) (*region, uint64, error) {
	if uint64(gpa)%size != 0 {
		return nil, 0, fmt.Errorf("atomic %d-byte access at %v: %w", size, gpa, ErrAlign)
	}
	r := m.find(gpa)
	if r == nil {
		return nil, 0, fmt.Errorf("atomic access at %v: %w", gpa, ErrUnmapped)
	}
	off := uint64(gpa) - uint64(r.Base)
	switch {
	case r.Data == nil:
		r.exit()
		return nil, 0, fmt.Errorf("atomic access at %v: %w", gpa, ErrNotShared)
	case off+size > r.Size: // an aligned word cannot straddle unless the region is odd-sized
		r.exit()
		return nil, 0, fmt.Errorf("atomic access at %v: %w", gpa, ErrUnmapped)
	case write && r.Prot&ProtWrite == 0:
		r.exit()
		return nil, 0, fmt.Errorf("atomic access at %v: %w", gpa, ErrReadOnly)
	case r.Prot&ProtRead == 0:
		r.exit()
		return nil, 0, fmt.Errorf("atomic access at %v: %w", gpa, ErrUnmapped)
	}
	return r, off, nil
}

// LoadUint32 atomically loads the aligned uint32 at gpa: for indices that
// the guest updates concurrently (ring prod/cons).
func (m *Memory) LoadUint32(gpa GPA) (uint32, error) {
	r, off, err := m.word(gpa, 4, false)
	if err != nil {
		return 0, err
	}
	defer r.exit()
	return atomicLoad32(r.Data, off), nil
}

// StoreUint32 atomically stores the aligned uint32 at gpa.
func (m *Memory) StoreUint32(gpa GPA, v uint32) error {
	r, off, err := m.word(gpa, 4, true)
	if err != nil {
		return err
	}
	defer r.exit()
	atomicStore32(r.Data, off, v)
	return nil
}

// CompareAndSwapUint64 atomically replaces the aligned uint64 at gpa with
// swap if it equals cmp, and returns the value it held (IBA atomic
// CmpSwap semantics).
func (m *Memory) CompareAndSwapUint64(gpa GPA, cmp, swap uint64) (uint64, error) {
	r, off, err := m.word(gpa, 8, true)
	if err != nil {
		return 0, err
	}
	defer r.exit()
	return atomicCAS64(r.Data, off, cmp, swap), nil
}

// FetchAddUint64 atomically adds add to the aligned uint64 at gpa and
// returns the value it held before (IBA atomic FetchAdd semantics).
func (m *Memory) FetchAddUint64(gpa GPA, add uint64) (uint64, error) {
	r, off, err := m.word(gpa, 8, true)
	if err != nil {
		return 0, err
	}
	defer r.exit()
	return atomicAdd64(r.Data, off, add) - add, nil
}
