package vdev

import (
	"container/heap"
)

// table hands out the handles of one object type: the lowest free value in
// [first, max). Handles index the guest driver's own tables (qp_tbl[handle
// % max_qp], cq_tbl, srq_tbl), so they must stay below the caps or objects
// collide; the provider looks CQE QPs up with handle & 0xFFFF. Slots are
// allocated as handles are handed out, so memory follows use, never the
// (guest-visible) maximum. Freed handles wait in a min-heap, so an
// allocation costs O(log n), not a scan of every slot (a VM with 64k MRs
// made each registration scan them all).
type table[T comparable] struct {
	items []T
	first uint32
	max   uint32
	n     int
	// freed holds handles below len(items) that were freed, lowest first;
	// an entry may be stale (its slot taken again by set): alloc skips it.
	freed handleHeap
}

func newTable[T comparable](first, max uint32) table[T] {
	return table[T]{first: first, max: max}
}

// alloc stores v under the lowest free handle; false when full.
func (t *table[T]) alloc(v T) (uint32, bool) {
	var zero T
	for t.freed.Len() > 0 {
		h := heap.Pop(&t.freed).(uint32)
		if h < uint32(len(t.items)) && t.items[h] == zero {
			t.items[h] = v
			t.n++
			return h, true
		}
	}
	h := max(uint32(len(t.items)), t.first)
	if h >= t.max {
		return 0, false
	}
	for uint32(len(t.items)) < h {
		t.items = append(t.items, zero) // below first: never a handle
	}
	t.items = append(t.items, v)
	t.n++
	return h, true
}

// get returns the object with handle h (any value is safe).
func (t *table[T]) get(h uint32) (T, bool) {
	var zero T
	if h >= uint32(len(t.items)) || t.items[h] == zero {
		return zero, false
	}
	return t.items[h], true
}

// free releases handle h.
func (t *table[T]) free(h uint32) {
	var zero T
	if h < uint32(len(t.items)) && t.items[h] != zero {
		t.items[h] = zero
		t.n--
		heap.Push(&t.freed, h)
	}
}

// len is the number of live objects.
func (t *table[T]) len() int { return t.n }

// each calls fn for every live object in handle order.
func (t *table[T]) each(fn func(h uint32, v T)) {
	var zero T
	for h, v := range t.items {
		if v != zero {
			fn(uint32(h), v)
		}
	}
}

// set stores v under the specific handle h; false if h is out of range
// or taken.
func (t *table[T]) set(h uint32, v T) bool {
	var zero T
	if h < t.first || h >= t.max {
		return false
	}
	for uint32(len(t.items)) <= h {
		if i := uint32(len(t.items)); i >= t.first && i < h {
			heap.Push(&t.freed, i) // a handle skipped over: free
		}
		t.items = append(t.items, zero)
	}
	if t.items[h] != zero {
		return false
	}
	t.items[h] = v
	t.n++
	return true
}

// handleHeap is a min-heap of handles (container/heap).
type handleHeap []uint32

func (h handleHeap) Len() int           { return len(h) }
func (h handleHeap) Less(i, j int) bool { return h[i] < h[j] }
func (h handleHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *handleHeap) Push(x any)        { *h = append(*h, x.(uint32)) }
func (h *handleHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
