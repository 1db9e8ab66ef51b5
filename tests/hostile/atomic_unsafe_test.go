package hostile

import (
	"sync/atomic"
	"unsafe"
)

// Ring indices in guest RAM are shared with the device, which updates
// them from other goroutines through its own mapping of the same memfd;
// the driver reads and writes them as atomic_t, and so does this one.

func load32(ram []byte, gpa uint64) uint32 {
	p := &ram[gpa : gpa+4][0]
	if uintptr(unsafe.Pointer(p))&3 != 0 {
		panic("unaligned ring index")
	}
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(p)))
}

func store32(ram []byte, gpa uint64, v uint32) {
	p := &ram[gpa : gpa+4][0]
	if uintptr(unsafe.Pointer(p))&3 != 0 {
		panic("unaligned ring index")
	}
	atomic.StoreUint32((*uint32)(unsafe.Pointer(p)), v)
}
