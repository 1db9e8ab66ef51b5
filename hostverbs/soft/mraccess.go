package soft

import (
	"errors"
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Accesses through a key, and invalidations that wait for them. A peer's
// READ, WRITE or atomic passes the key check (checkRKey) and then copies
// from or to the registration's pages, possibly much later: an in-process
// READ response is copied when the requester takes it, a 2 MiB one in one
// piece. An invalidation (LOCAL_INV, a SEND with invalidate) or a
// deregistration that completed meanwhile would let the guest reuse pages
// still being read or written. So every copy through a peer's key holds
// the registration (mr.enter) for its duration and checks that the key
// still names it, and an invalidation or deregistration publishes the new
// state, then waits until no copy holds the old registration
// (mr.waitAccesses) before it completes. A copy that starts after the
// invalidation fails (a remote access error for the peer) and moves
// nothing; one under way finishes with the bytes as they were before the
// invalidation completed.
//
// The wait cannot deadlock: a copy takes no lock while it holds a
// registration (it is a memory copy, nothing else), so it ends whatever
// the invalidating goroutine holds.

// errInvalidated is returned (wrapped) by a copy through a key that no
// longer names the registration the access was checked against.
var errInvalidated = errors.New("the key was invalidated or deregistered during the access")

// accessHooks let tests see the points of an access and an invalidation.
// Nil in production.
type accessHooks struct {
	// copying is called by a copy holding m, between pieces of it.
	copying func(m *mr)
	// waiting is called when an invalidation of m starts waiting for the
	// copies that hold it.
	waiting func(m *mr)
}

// enter holds m for a copy through its key; false if the key no longer
// names m (the copy must not happen). leave ends it.
func (m *mr) enter() bool {
	m.users.Add(1)
	if m.dev.keys.slot(m.key) != m {
		m.leave()
		return false
	}
	return true
}

func (m *mr) leave() {
	if m.users.Add(-1) == 0 && m.waiters.Load() != 0 {
		d := m.dev
		d.accessMu.Lock()
		d.accessCond.Broadcast()
		d.accessMu.Unlock()
	}
}

// waitAccesses returns once no copy holds m. The caller has taken m out
// of its key's slot, so no new copy can hold it.
func (m *mr) waitAccesses() {
	if m.users.Load() == 0 {
		return
	}
	d := m.dev
	if h := d.f.hooks.Load(); h != nil && h.waiting != nil {
		h.waiting(m)
	}
	m.waiters.Add(1)
	d.accessMu.Lock()
	for m.users.Load() != 0 {
		d.accessCond.Wait()
	}
	d.accessMu.Unlock()
	m.waiters.Add(-1)
}

// enterErr holds s's registration for a copy if s is guarded (a peer's
// access); the error says why it may not copy.
func (s *seg) enterErr() error {
	if !s.guard || s.mr.enter() {
		return nil
	}
	return fmt.Errorf("key %#x: %w: %w", s.mr.key, errInvalidated, errAccess)
}

// leaveSeg ends what enterErr began.
func (s *seg) leaveSeg() {
	if s.guard {
		s.mr.leave()
	}
}

// copyHook returns the hook a guarded copy from or to s calls between
// pieces, or nil.
func (s *seg) copyHook() func(*mr) {
	if !s.guard {
		return nil
	}
	if h := s.mr.dev.f.hooks.Load(); h != nil {
		return h.copying
	}
	return nil
}

// sourceGone wraps err as the source's fault of an in-process copy, as
// guestmem reports an unreadable source: the responder's memory, a remote
// error for the requester.
func sourceGone(err error) error {
	return &guestmem.CopyError{Source: true, Err: err}
}
