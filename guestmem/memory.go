// Package guestmem is the guest-physical address space of one VM as the
// device sees it: a set of regions (added and removed only by the vfio-user
// server as DMA_MAP and DMA_UNMAP arrive), with bounds-checked, all-or-error
// access that never panics on a guest-supplied address.
//
// Every accessor takes a GPA and a length that may come straight from a
// guest: ranges are overflow-checked, may span adjacent regions, and fail
// with an error wrapping ErrUnmapped, ErrReadOnly or ErrNotShared. A region
// removal waits until accesses in flight on that region have finished, so a
// DMA_UNMAP reply means the device no longer touches that memory.
package guestmem

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
)

// PageSize is the guest page size the PVRDMA ABI and vfio-user use.
const PageSize = 4096

// PageShift is log2(PageSize).
const PageShift = 12

// GPA is a guest-physical address (a vfio-user IOVA).
type GPA uint64

// Add returns g+n and whether the addition did not overflow.
func (g GPA) Add(n uint64) (GPA, bool) {
	s := uint64(g) + n
	return GPA(s), s >= uint64(g)
}

// PageOffset is the offset of g inside its guest page.
func (g GPA) PageOffset() uint64 { return uint64(g) & (PageSize - 1) }

// String formats g in hex.
func (g GPA) String() string { return fmt.Sprintf("%#x", uint64(g)) }

// Errors returned (wrapped) by accessors.
var (
	// ErrUnmapped: some byte of the range is not in any region.
	ErrUnmapped = errors.New("guest address not mapped")
	// ErrReadOnly: a write touched a region mapped without write permission.
	ErrReadOnly = errors.New("guest memory is read-only")
	// ErrNotShared: the range lies in guest RAM that QEMU mapped without a
	// file descriptor, so this process cannot reach it.
	ErrNotShared = errors.New("guest RAM is not shared with the device: start QEMU with " +
		"-object memory-backend-memfd,id=ram,size=<RAM size>,share=on -machine memory-backend=ram " +
		"(and -overcommit mem-lock=on)")
	// ErrOverlap: a new region overlaps an existing one.
	ErrOverlap = errors.New("region overlaps an existing mapping")
	// ErrNoRegion: a removal did not match a region exactly.
	ErrNoRegion = errors.New("no region with that exact address and size")
	// ErrHeld: a region cannot be removed while a long-lived user holds it
	// (Pin.Hold: pages a host device has registered).
	ErrHeld = errors.New("guest region is held by a registered memory region")
	// ErrAlign: an atomic access was not naturally aligned.
	ErrAlign = errors.New("misaligned atomic access")
	// ErrRange: the length or address arithmetic overflowed.
	ErrRange = errors.New("address range overflows")
)

// Prot is the access a region allows.
type Prot uint8

// Region protections.
const (
	ProtRead  Prot = 1 << 0
	ProtWrite Prot = 1 << 1
)

// Remote serves accesses to a region that is not mapped into this process
// (vfio-user DMA_READ/DMA_WRITE messages to the client). It is optional.
type Remote interface {
	ReadAt(p []byte, gpa GPA) error
	WriteAt(p []byte, gpa GPA) error
}

// RegionSpec describes a region to add.
type RegionSpec struct {
	Base GPA
	Size uint64
	Prot Prot
	// Data is the mapping of the region (len(Data) == Size), or nil when the
	// client gave no file descriptor.
	Data []byte
	// FD and Offset name the backing file, for providers that need to map
	// the same pages again (ibverbs aliases). FD is -1 when absent. The
	// Memory owns Data and FD from a successful Add on: Release undoes both.
	FD     int
	Offset int64
	// Locked is the number of bytes of Data charged as locked (MapFD locks
	// on fault: the whole range counts from the start).
	Locked uint64
	// Release unmaps Data and closes FD. It is called once, after the region
	// is removed and no access is in flight.
	Release func() error
}

// region is one live mapping. Accessors count themselves in inflight while
// they touch Data; removal sets dead, then waits for inflight to drain.
// Readers never block, so nested accesses (guest-to-guest copies) cannot
// deadlock against a removal.
type region struct {
	RegionSpec
	inflight atomic.Int64
	dead     atomic.Bool
	mu       sync.Mutex // guards drained's waiters, holds and Remove's dead
	drained  *sync.Cond
	holders  int // long-lived users (Hold); Remove refuses while > 0
}

// enter registers an access; false means the region is being removed.
func (r *region) enter() bool {
	r.inflight.Add(1)
	if r.dead.Load() {
		r.exit()
		return false
	}
	return true
}

func (r *region) exit() {
	if r.inflight.Add(-1) == 0 && r.dead.Load() {
		r.mu.Lock()
		r.drained.Broadcast()
		r.mu.Unlock()
	}
}

func (r *region) end() uint64 { return uint64(r.Base) + r.Size } // Add checked it doesn't overflow

// Memory is a guest-physical address space. The zero value is not usable;
// call New. All methods are safe for concurrent use.
type Memory struct {
	mu      sync.Mutex                // serializes Add/Remove
	regions atomic.Pointer[[]*region] // sorted by Base, replaced on change
	locked  atomic.Uint64
	remote  Remote
	// requireShared makes accesses to fd-less regions fail with ErrNotShared
	// instead of going through Remote.
	requireShared atomic.Bool
}

// Option configures a Memory.
type Option func(*Memory)

// WithRemote serves accesses to regions without a mapping through r.
func WithRemote(r Remote) Option { return func(m *Memory) { m.remote = r } }

// New returns an empty address space.
func New(opts ...Option) *Memory {
	m := &Memory{}
	empty := []*region{}
	m.regions.Store(&empty)
	for _, o := range opts {
		o(m)
	}
	return m
}

// RequireShared makes every access that reaches a region without a mapping
// fail with ErrNotShared (the map itself is still accepted). Devices that
// need guest RAM in place, such as PVRDMA, set it.
func (m *Memory) RequireShared(on bool) { m.requireShared.Store(on) }

// LockedBytes reports the bytes of guest memory currently mlocked.
func (m *Memory) LockedBytes() uint64 { return m.locked.Load() }

// Add inserts a region. It fails with ErrOverlap if it overlaps a live
// region, and with ErrRange for an empty or overflowing range. On failure
// the caller still owns spec.Data and spec.FD.
func (m *Memory) Add(spec RegionSpec) error {
	if spec.Size == 0 {
		return fmt.Errorf("add region %v: %w: size 0", spec.Base, ErrRange)
	}
	if _, ok := spec.Base.Add(spec.Size); !ok {
		return fmt.Errorf("add region %v+%#x: %w", spec.Base, spec.Size, ErrRange)
	}
	if spec.Data != nil && spec.Base%8 != 0 {
		return fmt.Errorf("add region %v: mapped regions must be 8-byte aligned: %w", spec.Base, ErrAlign)
	}
	if spec.Data != nil && uint64(len(spec.Data)) != spec.Size {
		return fmt.Errorf("add region %v: mapping is %d bytes, region %d: %w", spec.Base, len(spec.Data), spec.Size, ErrRange)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	old := *m.regions.Load()
	i := sort.Search(len(old), func(i int) bool { return old[i].Base >= spec.Base })
	end := uint64(spec.Base) + spec.Size
	if i > 0 && old[i-1].end() > uint64(spec.Base) {
		return fmt.Errorf("add region %v+%#x: %w (%v+%#x)", spec.Base, spec.Size, ErrOverlap, old[i-1].Base, old[i-1].Size)
	}
	if i < len(old) && uint64(old[i].Base) < end {
		return fmt.Errorf("add region %v+%#x: %w (%v+%#x)", spec.Base, spec.Size, ErrOverlap, old[i].Base, old[i].Size)
	}
	next := make([]*region, 0, len(old)+1)
	next = append(next, old[:i]...)
	nr := &region{RegionSpec: spec}
	nr.drained = sync.NewCond(&nr.mu)
	next = append(next, nr)
	next = append(next, old[i:]...)
	m.regions.Store(&next)
	m.locked.Add(spec.Locked)
	return nil
}

// Remove deletes the region that starts at base with exactly size bytes. It
// waits until every access in flight on the region has finished, then
// releases the mapping. It returns the removed region's spec (with Data
// and FD no longer valid).
func (m *Memory) Remove(base GPA, size uint64) (RegionSpec, error) {
	m.mu.Lock()
	old := *m.regions.Load()
	i := sort.Search(len(old), func(i int) bool { return old[i].Base >= base })
	if i == len(old) || old[i].Base != base || old[i].Size != size {
		m.mu.Unlock()
		return RegionSpec{}, fmt.Errorf("remove %v+%#x: %w", base, size, ErrNoRegion)
	}
	r := old[i]
	r.mu.Lock()
	if r.holders > 0 {
		n := r.holders
		r.mu.Unlock()
		m.mu.Unlock()
		return RegionSpec{}, fmt.Errorf("remove %v+%#x: %d holds: %w", base, size, n, ErrHeld)
	}
	r.dead.Store(true) // no new hold from here on
	r.mu.Unlock()
	next := make([]*region, 0, len(old)-1)
	next = append(next, old[:i]...)
	next = append(next, old[i+1:]...)
	m.regions.Store(&next)
	m.mu.Unlock()
	return r.RegionSpec, m.retire(r)
}

// RemoveAll deletes every region (client disconnect, reset), waiting for
// accesses in flight. It returns the first release error.
func (m *Memory) RemoveAll() error {
	m.mu.Lock()
	old := *m.regions.Load()
	empty := []*region{}
	m.regions.Store(&empty)
	m.mu.Unlock()
	var first error
	for _, r := range old {
		if err := m.retire(r); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (m *Memory) retire(r *region) error {
	r.dead.Store(true)
	r.mu.Lock()
	for r.inflight.Load() != 0 {
		r.drained.Wait()
	}
	r.mu.Unlock()
	m.locked.Add(-r.Locked)
	if r.Release != nil {
		if err := r.Release(); err != nil {
			return fmt.Errorf("release region %v+%#x: %w", r.Base, r.Size, err)
		}
	}
	return nil
}

// Regions returns a snapshot of the live regions (Data omitted).
func (m *Memory) Regions() []RegionSpec {
	rs := *m.regions.Load()
	out := make([]RegionSpec, len(rs))
	for i, r := range rs {
		out[i] = r.RegionSpec
		out[i].Data = nil
		out[i].Release = nil
	}
	return out
}

// find returns the live region holding gpa, entered, or nil. The caller
// must exit it.
func (m *Memory) find(gpa GPA) *region {
	for {
		rs := *m.regions.Load()
		i := sort.Search(len(rs), func(i int) bool { return rs[i].end() > uint64(gpa) })
		if i == len(rs) || rs[i].Base > gpa {
			return nil
		}
		r := rs[i]
		if r.enter() {
			return r
		}
		// Being removed: a fresh snapshot no longer holds it.
	}
}

// span visits [gpa, gpa+n) one region at a time, calling fn with the region
// (entered for the duration of the call) and the offset and length
// inside it. It fails with ErrUnmapped if some byte is not covered.
func (m *Memory) span(gpa GPA, n uint64, fn func(r *region, off, cnt uint64) error) error {
	if _, ok := gpa.Add(n); !ok {
		return fmt.Errorf("guest range %v+%#x: %w", gpa, n, ErrRange)
	}
	for n > 0 {
		r := m.find(gpa)
		if r == nil {
			return fmt.Errorf("guest range %v+%#x: %w", gpa, n, ErrUnmapped)
		}
		off := uint64(gpa) - uint64(r.Base)
		cnt := min(n, r.Size-off)
		err := fn(r, off, cnt)
		r.exit()
		if err != nil {
			return err
		}
		gpa += GPA(cnt)
		n -= cnt
	}
	return nil
}

// ReadAt fills p from guest memory at gpa. It reads all of p or returns an
// error (and then p's contents are unspecified).
func (m *Memory) ReadAt(p []byte, gpa GPA) error {
	done := uint64(0)
	return m.span(gpa, uint64(len(p)), func(r *region, off, cnt uint64) error {
		if r.Prot&ProtRead == 0 {
			return fmt.Errorf("read %v: region %v not readable: %w", gpa, r.Base, ErrUnmapped)
		}
		dst := p[done : done+cnt]
		done += cnt
		if r.Data == nil {
			return m.remoteAccess(r, dst, r.Base+GPA(off), false)
		}
		copy(dst, r.Data[off:off+cnt])
		return nil
	})
}

// WriteAt copies p into guest memory at gpa, all of it or none of it being
// guaranteed only in the error-free case.
func (m *Memory) WriteAt(p []byte, gpa GPA) error {
	done := uint64(0)
	return m.span(gpa, uint64(len(p)), func(r *region, off, cnt uint64) error {
		if r.Prot&ProtWrite == 0 {
			return fmt.Errorf("write %v: region %v: %w", gpa, r.Base, ErrReadOnly)
		}
		src := p[done : done+cnt]
		done += cnt
		if r.Data == nil {
			return m.remoteAccess(r, src, r.Base+GPA(off), true)
		}
		copy(r.Data[off:off+cnt], src)
		return nil
	})
}

// Zero clears n bytes of guest memory at gpa.
func (m *Memory) Zero(gpa GPA, n uint64) error {
	return m.span(gpa, n, func(r *region, off, cnt uint64) error {
		if r.Prot&ProtWrite == 0 {
			return fmt.Errorf("zero %v: region %v: %w", gpa, r.Base, ErrReadOnly)
		}
		if r.Data == nil {
			return fmt.Errorf("zero %v: %w", gpa, ErrNotShared)
		}
		clear(r.Data[off : off+cnt])
		return nil
	})
}

func (m *Memory) remoteAccess(r *region, p []byte, gpa GPA, write bool) error {
	if m.requireShared.Load() || m.remote == nil {
		return fmt.Errorf("guest range %v+%#x: %w", gpa, len(p), ErrNotShared)
	}
	var err error
	if write {
		err = m.remote.WriteAt(p, gpa)
	} else {
		err = m.remote.ReadAt(p, gpa)
	}
	if err != nil {
		return fmt.Errorf("guest range %v+%#x via client: %w", gpa, len(p), err)
	}
	return nil
}

// CopyError is the error of a Copy: Source tells which side failed, so
// that a caller moving data between two guests can blame the right one.
type CopyError struct {
	Source bool // the source range could not be read (else: the destination written)
	Err    error
}

func (e *CopyError) Error() string {
	if e.Source {
		return "copy source: " + e.Err.Error()
	}
	return "copy destination: " + e.Err.Error()
}

func (e *CopyError) Unwrap() error { return e.Err }

// IsSourceFault reports whether err is a Copy error on the source side.
func IsSourceFault(err error) bool {
	var ce *CopyError
	return errors.As(err, &ce) && ce.Source
}

// Copy copies n bytes from src at srcGPA to dst at dstGPA: guest-to-guest
// (the same-host path between two VMs) with no intermediate buffer. dst and
// src may be the same Memory. Errors are *CopyError.
func Copy(dst *Memory, dstGPA GPA, src *Memory, srcGPA GPA, n uint64) error {
	err := src.span(srcGPA, n, func(sr *region, soff, scnt uint64) error {
		if sr.Prot&ProtRead == 0 || sr.Data == nil {
			return &CopyError{Source: true, Err: fmt.Errorf("%v: %w", sr.Base+GPA(soff), ErrNotShared)}
		}
		from := sr.Data[soff : soff+scnt]
		err := dst.span(dstGPA, scnt, func(dr *region, doff, dcnt uint64) error {
			if dr.Prot&ProtWrite == 0 {
				return fmt.Errorf("%v: %w", dr.Base+GPA(doff), ErrReadOnly)
			}
			if dr.Data == nil {
				return fmt.Errorf("%v: %w", dr.Base+GPA(doff), ErrNotShared)
			}
			copy(dr.Data[doff:doff+dcnt], from[:dcnt])
			from = from[dcnt:]
			return nil
		})
		dstGPA += GPA(scnt)
		if err != nil {
			return &CopyError{Err: err}
		}
		return nil
	})
	if err != nil {
		return sourceUnlessSided(err)
	}
	return nil
}

// sourceUnlessSided makes err a source-side CopyError unless it already is
// a CopyError (the source range itself was unmapped). It is kept off
// Copy's success path: the errors.As target escapes to the heap.
func sourceUnlessSided(err error) error {
	var ce *CopyError
	if errors.As(err, &ce) {
		return err
	}
	return &CopyError{Source: true, Err: err}
}
