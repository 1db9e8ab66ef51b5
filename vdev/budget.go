package vdev

import (
	"fmt"
	"sync/atomic"
)

// Budget is a number of bytes of daemon memory that guest-created objects
// may cost, charged as objects are created and released as they go. A
// device has one of its own (Limits.MaxBytes) whose charges also go to an
// optional parent: the whole daemon's (Config.Budget), shared by all VMs.
// A charge that either would exceed fails, and changes neither.
type Budget struct {
	limit  uint64
	used   atomic.Uint64
	parent *Budget
}

// NewBudget returns a budget of limit bytes whose charges also count
// against parent, if not nil.
func NewBudget(limit uint64, parent *Budget) *Budget {
	return &Budget{limit: limit, parent: parent}
}

// Charge takes n bytes, or fails with ErrLimit.
func (b *Budget) Charge(n uint64) error {
	for {
		u := b.used.Load()
		if u+n < u || u+n > b.limit {
			return fmt.Errorf("%d bytes with %d of %d in use: %w", n, u, b.limit, ErrLimit)
		}
		if b.used.CompareAndSwap(u, u+n) {
			break
		}
	}
	if b.parent != nil {
		if err := b.parent.Charge(n); err != nil {
			b.used.Add(-n)
			return err
		}
	}
	return nil
}

// Release gives back n bytes charged before.
func (b *Budget) Release(n uint64) {
	b.used.Add(-n)
	if b.parent != nil {
		b.parent.Release(n)
	}
}

// Used is the number of bytes charged.
func (b *Budget) Used() uint64 { return b.used.Load() }

// Limit is the budget's size in bytes.
func (b *Budget) Limit() uint64 { return b.limit }

// What guest objects cost the daemon, in bytes: the device model's own
// state, the page lists of rings and MRs (8 bytes a guest page) and what
// the soft provider allocates for them, measured by TestObjectCosts (which
// checks each against the heap). A QP's base includes the responder's
// READ/atomic resources (up to 128 of them) allocated at RTR.
const (
	costQP        = 16 << 10
	costSendWQE   = 256 // the soft provider's send WQE with its WR
	costSendSGE   = 48  // the SGE and its resolved segment (soft: seg, 32 bytes with its peer-access guard)
	costRecvWQE   = 48
	costRecvSGE   = 16
	costSRQ       = 1 << 10
	costCQ        = 704 // with the scratch completion the device translates into, and its journal records (Checkpoint)
	costMR        = 512
	costPD        = 128
	costPageEntry = 8
)

func queueCost(wr, sge uint32, wqe, perSGE uint64) uint64 {
	return uint64(wr) * (wqe + uint64(sge)*perSGE)
}
