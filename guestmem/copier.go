package guestmem

// Copier makes many Copy calls between guest memories (a message copied
// page run by page run between two scattered page lists) while keeping
// the regions of its last call entered: a run inside the same source and
// destination regions costs no region lookup and no in-flight accounting.
// A region it holds is not removed until Release (its DMA_UNMAP waits, as
// for any access in progress), so a Copier lives for one message; the
// zero value is ready to use, and Release must be called when done.
type Copier struct {
	dm, sm *Memory
	dr, sr *region
}

// Copy is Copy (the package function) through the held regions.
func (c *Copier) Copy(dst *Memory, dstGPA GPA, src *Memory, srcGPA GPA, n uint64) error {
	if c.sm == src && c.dm == dst && c.sr.holds(srcGPA, n) && c.dr.holds(dstGPA, n) {
		so, do := uint64(srcGPA-c.sr.Base), uint64(dstGPA-c.dr.Base)
		copy(c.dr.Data[do:do+n], c.sr.Data[so:so+n])
		return nil
	}
	c.Release()
	sr := src.find(srcGPA)
	if sr == nil {
		return Copy(dst, dstGPA, src, srcGPA, n) // the package function reports it
	}
	dr := dst.find(dstGPA)
	if dr == nil || !sr.holds(srcGPA, n) || !dr.holds(dstGPA, n) || !sr.readable() || !dr.writable() {
		sr.exit()
		if dr != nil {
			dr.exit()
		}
		return Copy(dst, dstGPA, src, srcGPA, n) // spans regions, or fails: the general path
	}
	c.dm, c.sm, c.dr, c.sr = dst, src, dr, sr
	so, do := uint64(srcGPA-sr.Base), uint64(dstGPA-dr.Base)
	copy(dr.Data[do:do+n], sr.Data[so:so+n])
	return nil
}

// Release lets go of the held regions.
func (c *Copier) Release() {
	if c.sr != nil {
		c.sr.exit()
	}
	if c.dr != nil {
		c.dr.exit()
	}
	*c = Copier{}
}

// holds reports whether r (possibly nil) covers [gpa, gpa+n) in mapped
// memory.
func (r *region) holds(gpa GPA, n uint64) bool {
	if r == nil || gpa < r.Base || r.Data == nil {
		return false
	}
	off := uint64(gpa - r.Base)
	return off <= r.Size && n <= r.Size-off
}

func (r *region) readable() bool { return r.Prot&ProtRead != 0 && r.Data != nil }
func (r *region) writable() bool { return r.Prot&ProtWrite != 0 && r.Data != nil }
