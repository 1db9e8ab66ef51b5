package soft

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Fast registration (IBA 10.6.1, kernel consumers' FRWR). A fast-reg MR
// owns one index of the device's key table for its life. It starts free:
// its slot holds an mr with free set, which lookups never return, under
// the base key. A REG_MR publishes a new immutable mr in the slot, with
// the registration's pages, access and key (same index, the consumer's
// low byte); an invalidation, local or remote, publishes a free one.
// Lookups stay lock-free (the responder resolves rkeys per packet) and a
// key that was invalidated, or whose byte is another registration's,
// resolves to nothing. State changes take the device lock.

// maxFastRegPages is the largest page list of a fast-reg MR (the PVRDMA
// ABI's PVRDMA_MAX_FAST_REG_PAGES is lower; the device caps it).
const maxFastRegPages = 512

// frmr is a fast-registration MR (hostverbs.FastRegMR).
type frmr struct {
	dev      *device
	pd       *pd
	maxPages int
	// cur is what the slot holds; guarded by dev.mu. nil once
	// deregistered.
	cur *mr
	// used are the key bytes the MR had (its base key's and every
	// registration's); guarded by dev.mu. The next MR on its index avoids
	// them (keyTable.retire).
	used byteSet
}

var (
	_ hostverbs.FastRegPD = (*pd)(nil)
	_ hostverbs.FastRegMR = (*frmr)(nil)
)

// AllocFastRegMR creates a free fast-registration MR. Its pages are
// charged to the registered-bytes quota at their capacity.
func (p *pd) AllocFastRegMR(attr hostverbs.FastRegAttr) (hostverbs.FastRegMR, error) {
	d := p.dev
	if attr.MaxPages < 1 || attr.MaxPages > maxFastRegPages {
		return nil, fmt.Errorf("alloc fast-reg mr: %d pages (max %d): %w", attr.MaxPages, maxFastRegPages, hostverbs.ErrInvalid)
	}
	bytes := uint64(attr.MaxPages) * guestmem.PageSize
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("alloc fast-reg mr: %w", hostverbs.ErrClosed)
	}
	if _, ok := d.pds[p]; !ok {
		return nil, fmt.Errorf("alloc fast-reg mr: pd was deallocated: %w", hostverbs.ErrNotFound)
	}
	if d.nMR >= d.attr.MaxMR {
		return nil, fmt.Errorf("alloc fast-reg mr: %d MRs: %w", d.nMR, hostverbs.ErrNoResources)
	}
	if lim := d.cfg.Limits.MaxMRBytes; lim > 0 && d.mrBytes+bytes > lim {
		return nil, fmt.Errorf("alloc fast-reg mr: %d + %d bytes registered exceeds %d: %w", d.mrBytes, bytes, lim, hostverbs.ErrNoResources)
	}
	key := attr.Key
	if key != 0 {
		if err := d.keys.take(key); err != nil {
			return nil, fmt.Errorf("alloc fast-reg mr: %w", err)
		}
	} else {
		var ok bool
		if key, ok = d.keys.alloc(); !ok {
			return nil, fmt.Errorf("alloc fast-reg mr: key space: %w", hostverbs.ErrNoResources)
		}
	}
	f := &frmr{dev: d, pd: p, maxPages: attr.MaxPages}
	f.used.addKey(key)
	f.cur = &mr{dev: d, pd: p, key: key, mem: d.mem, fr: f, free: true}
	d.keys.set(key, f.cur)
	d.nMR++
	d.mrBytes += bytes
	p.refs.Add(1)
	return f, nil
}

// LKey is the MR's current key: the base key until the first
// registration, then the last registration's.
func (f *frmr) LKey() uint32 {
	f.dev.mu.Lock()
	defer f.dev.mu.Unlock()
	if f.cur == nil {
		return 0
	}
	return f.cur.key
}

// RKey is the current key while free (as rxe reports a new fast-reg MR)
// or while the registration grants remote access, else zero.
func (f *frmr) RKey() uint32 {
	f.dev.mu.Lock()
	defer f.dev.mu.Unlock()
	if f.cur == nil {
		return 0
	}
	if f.cur.free {
		return f.cur.key
	}
	return f.cur.RKey()
}

// Register executes a REG_MR.
func (f *frmr) Register(r hostverbs.FastReg) error {
	if r.Access&^accessAll != 0 || r.Access&hostverbs.AccessZeroBased != 0 {
		return fmt.Errorf("fast register: access %#x: %w", uint32(r.Access), hostverbs.ErrInvalid)
	}
	if r.Access&(hostverbs.AccessRemoteWrite|hostverbs.AccessRemoteAtomic) != 0 &&
		r.Access&hostverbs.AccessLocalWrite == 0 {
		return fmt.Errorf("fast register: remote write/atomic without local write: %w", hostverbs.ErrInvalid)
	}
	if r.Pages.Pages == nil || len(r.Pages.Pages) > f.maxPages {
		return fmt.Errorf("fast register: %d pages, the MR holds %d: %w", len(r.Pages.Pages), f.maxPages, hostverbs.ErrInvalid)
	}
	// Re-validate: the page list comes straight from a guest.
	pl, err := guestmem.NewPageList(r.Pages.IOVA, r.Pages.Length, r.Pages.Pages)
	if err != nil {
		return fmt.Errorf("fast register: %w: %w", err, hostverbs.ErrInvalid)
	}
	d := f.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	cur := f.cur
	switch {
	case cur == nil || d.closed:
		return fmt.Errorf("fast register: %w", hostverbs.ErrClosed)
	case r.Key>>8 != cur.key>>8:
		return fmt.Errorf("fast register: key %#x is not of this MR (%#x): %w", r.Key, cur.key, hostverbs.ErrInvalid)
	case !cur.free:
		return fmt.Errorf("fast register: MR %#x is valid (invalidate it first): %w", cur.key, hostverbs.ErrBusy)
	}
	next := &mr{dev: d, pd: f.pd, key: r.Key, access: r.Access, pages: pl, mem: d.mem, fr: f}
	if !d.keys.replace(cur, next) {
		return fmt.Errorf("fast register: MR %#x lost its key: %w", cur.key, hostverbs.ErrNotFound)
	}
	f.cur = next
	f.used.addKey(r.Key)
	d.keys.rename(r.Key)
	return nil
}

// Invalidate executes a LOCAL_INV. It returns once no copy through the
// key is under way (mraccess.go).
func (f *frmr) Invalidate(key uint32) error {
	d := f.dev
	d.mu.Lock()
	if f.cur == nil || d.closed {
		d.mu.Unlock()
		return fmt.Errorf("local invalidate: %w", hostverbs.ErrClosed)
	}
	old, err := f.invalidateLocked(key)
	d.mu.Unlock()
	if old != nil {
		old.waitAccesses()
	}
	return err
}

// invalidateLocked makes the MR free if key is its current key, and
// returns the registration it ended (nil if none), whose accesses the
// caller waits for once it lets go of the device lock.
func (f *frmr) invalidateLocked(key uint32) (*mr, error) {
	cur := f.cur
	if key != cur.key {
		return nil, fmt.Errorf("invalidate key %#x: the MR's key is %#x: %w", key, cur.key, hostverbs.ErrInvalid)
	}
	if cur.free {
		return nil, nil
	}
	next := &mr{dev: f.dev, pd: f.pd, key: cur.key, mem: f.dev.mem, fr: f, free: true}
	if !f.dev.keys.replace(cur, next) {
		return nil, fmt.Errorf("invalidate key %#x: %w", key, hostverbs.ErrNotFound)
	}
	f.cur = next
	return cur, nil
}

// Registration returns the state and, when valid, the registration.
func (f *frmr) Registration() (hostverbs.MRState, hostverbs.FastReg) {
	f.dev.mu.Lock()
	defer f.dev.mu.Unlock()
	cur := f.cur
	if cur == nil || cur.free {
		return hostverbs.MRFree, hostverbs.FastReg{}
	}
	return hostverbs.MRValid, hostverbs.FastReg{Pages: cur.pages, Access: cur.access, Key: cur.key}
}

// Dereg destroys the MR whatever its state, once no copy through its
// key is under way.
func (f *frmr) Dereg() error {
	d := f.dev
	d.mu.Lock()
	cur := f.cur
	if cur == nil || !d.keys.remove(cur.key, cur) {
		d.mu.Unlock()
		return fmt.Errorf("dereg fast-reg mr: %w", hostverbs.ErrNotFound)
	}
	defer cur.waitAccesses()
	defer d.mu.Unlock()
	d.keys.retire(cur.key>>8, &f.used)
	f.cur = nil
	d.nMR--
	d.mrBytes -= uint64(f.maxPages) * guestmem.PageSize
	f.pd.refs.Add(-1)
	return nil
}

// remoteInvalidate executes the invalidation a SEND with invalidate asks
// of the QP's device (IBA 10.6.7.2.4): key must be the current key of a
// fast-reg MR in the QP's PD. It returns why it refused.
func (d *device) remoteInvalidate(p *pd, key uint32) error {
	d.mu.Lock()
	m := d.keys.slot(key)
	var err error
	switch {
	case m == nil:
		err = fmt.Errorf("no MR with key %#x: %w", key, hostverbs.ErrNotFound)
	case m.fr == nil:
		err = fmt.Errorf("key %#x names an MR that is not fast-registered: %w", key, hostverbs.ErrInvalid)
	case m.pd != p:
		err = fmt.Errorf("key %#x names an MR of another PD: %w", key, hostverbs.ErrInvalid)
	}
	var old *mr
	if err == nil {
		old, err = m.fr.invalidateLocked(key)
	}
	d.mu.Unlock()
	if old != nil {
		// The receive completes (and the guest may reuse the pages)
		// once the copies that passed the key check are over.
		old.waitAccesses()
	}
	return err
}
