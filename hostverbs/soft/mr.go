package soft

import (
	crand "crypto/rand"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Memory regions. An MR maps an IOVA range onto guest pages of its
// device's memory. Its lkey and rkey are the same 32-bit key: a table
// index in the upper 24 bits and a random key byte in the lower (a new one,
// unlike the last, at every registration), so keys cannot be predicted and
// a key freed and reused quickly does not resolve to the new MR. Keys are
// per device: an rkey arriving in a packet is resolved in the device the
// packet is addressed to.

// errAccess is returned (wrapped) when a key, PD, access right or range
// check fails.
var errAccess = errors.New("memory access violation")

type mr struct {
	dev    *device
	pd     *pd
	key    uint32
	access hostverbs.Access
	pages  guestmem.PageList
	mem    *guestmem.Memory
	// fr is set on the registrations of a fast-registration MR (frmr.go):
	// each REG_MR publishes a new, immutable mr in the key's slot, and an
	// invalidation publishes one with free set, which no lookup returns.
	fr   *frmr
	free bool
	// users counts the copies through a peer's key that hold this
	// registration, waiters the invalidations waiting for them to end
	// (mraccess.go).
	users, waiters atomic.Int32
}

func (m *mr) LKey() uint32 { return m.key }

func (m *mr) RKey() uint32 {
	if m.access&(hostverbs.AccessRemoteWrite|hostverbs.AccessRemoteRead|hostverbs.AccessRemoteAtomic) == 0 {
		return 0
	}
	return m.key
}

func (m *mr) Dereg() error {
	d := m.dev
	d.mu.Lock()
	if !d.keys.remove(m.key, m) {
		d.mu.Unlock()
		return fmt.Errorf("dereg mr %#x: %w", m.key, hostverbs.ErrNotFound)
	}
	d.nMR--
	d.mrBytes -= m.pages.Length
	m.pd.refs.Add(-1)
	d.mu.Unlock()
	m.waitAccesses() // the pages are the guest's again once no copy uses them
	return nil
}

// check verifies that [iova, iova+n) lies in the MR and that the MR grants
// want (local read is always granted).
func (m *mr) check(iova, n uint64, want hostverbs.Access) error {
	if m.access&want != want {
		return fmt.Errorf("key %#x lacks access %#x: %w", m.key, uint32(want), errAccess)
	}
	if !m.pages.Contains(iova, n) {
		return fmt.Errorf("key %#x: %#x+%#x outside the region: %w", m.key, iova, n, errAccess)
	}
	return nil
}

// keyTable maps keys to MRs. Lookups are lock-free; inserts and removals
// are serialised by the device lock. A key is a table index above a key
// byte drawn at random for each registration (rxe randomises it too), never
// the byte the index had last, so neither another tenant nor the guest
// itself can predict a key from the order of registrations, and a stale
// key never names the MR that reuses its index. A fast-reg MR changes its
// key byte at every REG_MR (the guest's consumer byte): gen follows it, and
// the bytes its index had during the MR's life (byteSet) are avoided by
// the next MR on the index, as long as any byte is left.
type keyTable struct {
	slots []atomic.Pointer[mr]
	gen   []uint8
	free  []uint32
	next  uint32
	rng   *rand.ChaCha8
	// retired holds, for a free index a fast-reg MR had, the key bytes
	// that named it.
	retired map[uint32]*byteSet
}

// byteSet is a set of key bytes.
type byteSet [4]uint64

func (b *byteSet) add(v uint8)       { b[v>>6] |= 1 << (v & 63) }
func (b *byteSet) has(v uint8) bool  { return b[v>>6]&(1<<(v&63)) != 0 }
func (b *byteSet) full() bool        { return b[0]&b[1]&b[2]&b[3] == ^uint64(0) }
func (b *byteSet) addKey(key uint32) { b.add(uint8(key)) }

func newKeyTable(max int) keyTable {
	var seed [32]byte
	_, _ = crand.Read(seed[:]) // never fails (it would crash the program)
	return keyTable{slots: make([]atomic.Pointer[mr], max+1), gen: make([]uint8, max+1), next: 1,
		rng: rand.NewChaCha8(seed), retired: map[uint32]*byteSet{}}
}

// alloc reserves a key; the caller stores the MR with set. An index in
// the free list whose slot is taken (by take) is skipped.
func (t *keyTable) alloc() (uint32, bool) {
	var idx uint32
	for {
		if len(t.free) > 0 {
			idx = t.free[0]
			t.free = t.free[1:]
			if t.slots[idx].Load() != nil {
				continue
			}
			break
		}
		if int(t.next) < len(t.slots) {
			idx = t.next
			t.next++
			break
		}
		return 0, false
	}
	t.gen[idx] = t.pickByte(idx)
	return idx<<8 | uint32(t.gen[idx]), true
}

// pickByte draws the key byte of the next MR on idx: never the byte idx
// had last, nor, while one is left, any byte a fast-reg MR retired from
// idx had.
func (t *keyTable) pickByte(idx uint32) uint8 {
	last := t.gen[idx]
	avoid := t.retired[idx]
	delete(t.retired, idx)
	if avoid == nil {
		avoid = &byteSet{}
	}
	if avoid.add(last); avoid.full() {
		avoid = &byteSet{}
		avoid.add(last)
	}
	v := uint8(t.rng.Uint64())
	for avoid.has(v) {
		v++ // a byte is left: the set is not full
	}
	return v
}

// retire records that the fast-reg MR on idx, which the caller removes,
// was named by the key bytes in used.
func (t *keyTable) retire(idx uint32, used *byteSet) {
	if idx == 0 || int(idx) >= len(t.slots) {
		return
	}
	b := *used
	t.retired[idx] = &b
}

// rename records that the MR on key's index now has key's byte (a
// fast-reg MR's REG_MR): a stale key is judged against the index's last
// byte.
func (t *keyTable) rename(key uint32) {
	if idx := key >> 8; idx != 0 && int(idx) < len(t.slots) {
		t.gen[idx] = uint8(key)
	}
}

// take reserves exactly key (MRAttr.LKey); the caller stores the MR with
// set before the device lock is released. Indices skipped over join the
// free list; one already there stays, and alloc skips it while taken.
func (t *keyTable) take(key uint32) error {
	idx := key >> 8
	if idx == 0 || int(idx) >= len(t.slots) {
		return fmt.Errorf("key %#x outside this device's %d keys: %w", key, len(t.slots)-1, hostverbs.ErrNotSupported)
	}
	if t.slots[idx].Load() != nil {
		return fmt.Errorf("key index %#x in use: %w", idx, hostverbs.ErrBusy)
	}
	for ; t.next <= idx; t.next++ {
		if t.next < idx {
			t.free = append(t.free, t.next)
		}
	}
	t.gen[idx] = uint8(key)
	delete(t.retired, idx)
	return nil
}

func (t *keyTable) set(key uint32, m *mr) { t.slots[key>>8].Store(m) }

func (t *keyTable) lookup(key uint32) *mr {
	idx := key >> 8
	if idx == 0 || int(idx) >= len(t.slots) {
		return nil
	}
	m := t.slots[idx].Load()
	if m == nil || m.key != key || m.free {
		return nil
	}
	return m
}

// slot returns whatever holds key's index, a free fast-registration MR
// included, whatever its key byte.
func (t *keyTable) slot(key uint32) *mr {
	idx := key >> 8
	if idx == 0 || int(idx) >= len(t.slots) {
		return nil
	}
	return t.slots[idx].Load()
}

// replace publishes next in place of cur (the same index).
func (t *keyTable) replace(cur, next *mr) bool {
	return t.slots[cur.key>>8].CompareAndSwap(cur, next)
}

func (t *keyTable) remove(key uint32, m *mr) bool {
	idx := key >> 8
	if idx == 0 || int(idx) >= len(t.slots) || !t.slots[idx].CompareAndSwap(m, nil) {
		return false
	}
	// Recycle indices FIFO so a stale key's index is reused late.
	t.free = append(t.free, idx)
	return true
}

// seg is one resolved piece of a scatter/gather list: n bytes at iova in
// mr.
type seg struct {
	mr   *mr
	iova uint64
	n    uint64
	// guard: a peer's access through a key. A READ response's source is
	// held by the copy itself, which fails if the key no longer names the
	// registration; a WRITE's destination is held by respWrite around the
	// copy (mraccess.go).
	guard bool
}

// resolveSGL checks an SGL against the QP's PD and the access a direction
// needs and appends the segments to dst. Zero-length SGEs are skipped.
func resolveSGL(dev *device, p *pd, sgl []hostverbs.SGE, want hostverbs.Access, dst []seg) ([]seg, uint64, error) {
	var total uint64
	for i := range sgl {
		s := &sgl[i]
		if s.Length == 0 {
			continue
		}
		m := dev.keys.lookup(s.LKey)
		if m == nil {
			return dst, 0, fmt.Errorf("sge %d: lkey %#x: %w", i, s.LKey, errAccess)
		}
		if m.pd != p {
			return dst, 0, fmt.Errorf("sge %d: lkey %#x belongs to another PD: %w", i, s.LKey, errAccess)
		}
		if err := m.check(s.Addr, uint64(s.Length), want); err != nil {
			return dst, 0, fmt.Errorf("sge %d: %w", i, err)
		}
		dst = append(dst, seg{mr: m, iova: s.Addr, n: uint64(s.Length)})
		total += uint64(s.Length)
	}
	return dst, total, nil
}

// walkSegs calls fn for each piece of [off, off+n) of the message the
// segments describe. It fails if the segments are shorter.
func walkSegs(segs []seg, off, n uint64, fn func(s *seg, iova, cnt uint64) error) error {
	for i := range segs {
		if n == 0 {
			return nil
		}
		s := &segs[i]
		if off >= s.n {
			off -= s.n
			continue
		}
		cnt := min(s.n-off, n)
		if err := fn(s, s.iova+off, cnt); err != nil {
			return err
		}
		n -= cnt
		off = 0
	}
	if n != 0 {
		return fmt.Errorf("scatter/gather list too short by %d bytes: %w", n, errLength)
	}
	return nil
}

var errLength = errors.New("length exceeds the buffer")

// pageRun returns the physically contiguous run of pl that starts at iova, at
// most n bytes long: adjacent guest pages are copied in one piece. The
// range was checked against the MR when its segment was resolved; a page
// list that ends early yields a short run (and the access then fails in
// guestmem rather than here).
func pageRun(pl *guestmem.PageList, iova, n uint64) (guestmem.GPA, uint64) {
	if pl.Pages == nil {
		return guestmem.GPA(iova), n
	}
	idx := iova>>guestmem.PageShift - pl.IOVA>>guestmem.PageShift
	if idx >= uint64(len(pl.Pages)) {
		return ^guestmem.GPA(0), 0
	}
	off := iova & (guestmem.PageSize - 1)
	gpa := pl.Pages[idx] + guestmem.GPA(off)
	cnt := min(n, guestmem.PageSize-off)
	for cnt < n && idx+1 < uint64(len(pl.Pages)) && pl.Pages[idx+1] == pl.Pages[idx]+guestmem.PageSize {
		idx++
		cnt = min(n, cnt+guestmem.PageSize)
	}
	return gpa, cnt
}

// errShortPages is returned when a page list does not cover a range it
// was checked to cover (it cannot happen for lists built by NewPageList).
var errShortPages = errors.New("page list shorter than its range")

// gather copies len(dst) bytes at message offset off of segs into dst.
func gather(dst []byte, segs []seg, off uint64) error {
	done := uint64(0)
	return walkSegs(segs, off, uint64(len(dst)), func(s *seg, iova, cnt uint64) error {
		if err := s.enterErr(); err != nil {
			return err
		}
		defer s.leaveSeg()
		hook := s.copyHook()
		for cnt > 0 {
			if hook != nil && done > 0 {
				hook(s.mr)
			}
			gpa, c := pageRun(&s.mr.pages, iova, cnt)
			if c == 0 {
				return errShortPages
			}
			if err := s.mr.mem.ReadAt(dst[done:done+c], gpa); err != nil {
				return err
			}
			done, iova, cnt = done+c, iova+c, cnt-c
		}
		return nil
	})
}

// scatter copies src to message offset off of segs.
func scatter(segs []seg, off uint64, src []byte) error {
	done := uint64(0)
	return walkSegs(segs, off, uint64(len(src)), func(s *seg, iova, cnt uint64) error {
		for cnt > 0 {
			gpa, c := pageRun(&s.mr.pages, iova, cnt)
			if c == 0 {
				return errShortPages
			}
			if err := s.mr.mem.WriteAt(src[done:done+c], gpa); err != nil {
				return err
			}
			done, iova, cnt = done+c, iova+c, cnt-c
		}
		return nil
	})
}

// copySegs copies n bytes from offset srcOff of src to offset dstOff of
// dst, guest memory to guest memory: the single copy of the same-host path.
func copySegs(dst []seg, dstOff uint64, src []seg, srcOff, n uint64) error {
	// One Copier for the message: its page runs mostly fall in the same
	// guest memory regions.
	var c guestmem.Copier
	defer c.Release()
	return walkSegs(src, srcOff, n, func(ss *seg, siova, scnt uint64) error {
		// A guarded source is a READ response's: the responder's
		// registration, held for the copy.
		if err := ss.enterErr(); err != nil {
			return sourceGone(err)
		}
		defer ss.leaveSeg()
		hook := hookOf(ss)
		err := walkSegs(dst, dstOff, scnt, func(ds *seg, diova, dcnt uint64) error {
			h := hook
			if h == nil {
				h = hookOf(ds)
			}
			err := copyRange(&c, ds.mr, diova, ss.mr, siova, dcnt, h)
			siova += dcnt
			return err
		})
		dstOff += scnt
		return err
	})
}

// hookOf returns the test hook a guarded copy from or to s calls between
// pieces, or nil.
func hookOf(s *seg) func() {
	if h := s.copyHook(); h != nil {
		m := s.mr
		return func() { h(m) }
	}
	return nil
}

// copyRange copies n bytes between the IOVA ranges of two MRs, one
// physically contiguous run at a time; hook, if set, is called between
// runs.
func copyRange(c *guestmem.Copier, dm *mr, diova uint64, sm *mr, siova, n uint64, hook func()) error {
	for first := true; n > 0; first = false {
		if hook != nil && !first {
			hook()
		}
		sgpa, sc := pageRun(&sm.pages, siova, n)
		dgpa, dc := pageRun(&dm.pages, diova, sc)
		if sc == 0 || dc == 0 {
			return errShortPages
		}
		if err := c.Copy(dm.mem, dgpa, sm.mem, sgpa, dc); err != nil {
			return err
		}
		siova, diova, n = siova+dc, diova+dc, n-dc
	}
	return nil
}
