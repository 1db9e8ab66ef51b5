package guestmem

import (
	"sync/atomic"
	"unsafe"
)

// The helpers below operate on naturally aligned words inside a mapping;
// callers (word) have checked bounds and alignment. Guest memory is
// little-endian like the host (amd64), so native atomics are the guest's
// view as well.

func atomicLoad32(b []byte, off uint64) uint32 {
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(&b[off])))
}

func atomicStore32(b []byte, off uint64, v uint32) {
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&b[off])), v)
}

func atomicCAS64(b []byte, off uint64, cmp, swap uint64) uint64 {
	p := (*uint64)(unsafe.Pointer(&b[off]))
	for {
		cur := atomic.LoadUint64(p)
		if cur != cmp {
			return cur
		}
		if atomic.CompareAndSwapUint64(p, cmp, swap) {
			return cmp
		}
	}
}

func atomicAdd64(b []byte, off uint64, add uint64) uint64 {
	return atomic.AddUint64((*uint64)(unsafe.Pointer(&b[off])), add)
}
