package guestmem

// Bytes returns a RegionSpec backed by an ordinary Go slice (no file, not
// locked): guest memory for tests and for in-process tools. data must be
// 8-byte aligned, which Go allocations of 8 bytes or more are.
func Bytes(base GPA, data []byte, prot Prot) RegionSpec {
	return RegionSpec{Base: base, Size: uint64(len(data)), Prot: prot, Data: data, FD: -1}
}

// NewFlat returns a Memory holding one read-write region of size bytes at
// base, and that region's bytes: the simplest guest for tests.
func NewFlat(base GPA, size uint64) (*Memory, []byte) {
	m := New()
	data := make([]byte, size)
	if err := m.Add(Bytes(base, data, ProtRead|ProtWrite)); err != nil {
		panic(err) // only on a size that cannot be a region: a test bug
	}
	return m, data
}
