package guestmem

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MapFD maps size bytes of fd at offset, shared, with the given protection,
// and locks the mapping on fault (mlock2 MLOCK_ONFAULT): each page is locked
// in memory from the device's first touch of it, and never paged out while
// mapped. The whole size is charged against RLIMIT_MEMLOCK at once, as a
// full mlock is, so a limit refuses the mapping here; but no page table
// entry is made up front, so mapping and unmapping cost what the device
// touched, not the region's size (a full mlock of a resident 512 MiB memfd
// takes 20-22 ms, and tearing the entries down again, at munmap or at a
// live upgrade's exec, about as long). Pages the device never touched stay
// resident as long as QEMU keeps them so (qemu-args: -overcommit
// mem-lock=on). It returns a RegionSpec ready for Add that owns fd: on
// success fd is closed by Release, on error it is left to the caller.
//
// If the lock fails (no CAP_IPC_LOCK and RLIMIT_MEMLOCK too small) the
// mapping is undone and the error says so: the device refuses unlocked
// memory rather than silently running without the guarantee.
func MapFD(base GPA, size uint64, prot Prot, fd int, offset int64) (RegionSpec, error) {
	if size == 0 || size > 1<<46 {
		return RegionSpec{}, fmt.Errorf("map %v: size %#x: %w", base, size, ErrRange)
	}
	if offset < 0 {
		return RegionSpec{}, fmt.Errorf("map %v: negative offset: %w", base, ErrRange)
	}
	p := unix.PROT_NONE
	if prot&ProtRead != 0 {
		p |= unix.PROT_READ
	}
	if prot&ProtWrite != 0 {
		p |= unix.PROT_WRITE
	}
	data, err := unix.Mmap(fd, offset, int(size), p, unix.MAP_SHARED_VALIDATE)
	if err != nil {
		return RegionSpec{}, fmt.Errorf("mmap guest memory %v+%#x (fd offset %#x): %w", base, size, offset, err)
	}
	if err := mlockOnFault(data); err != nil {
		_ = unix.Munmap(data)
		if errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.EPERM) {
			return RegionSpec{}, fmt.Errorf("mlock guest memory %v+%#x: %w (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK)", base, size, err)
		}
		return RegionSpec{}, fmt.Errorf("mlock guest memory %v+%#x: %w", base, size, err)
	}
	return RegionSpec{
		Base: base, Size: size, Prot: prot, Data: data, FD: fd, Offset: offset, Locked: size,
		Release: func() error {
			err := unix.Munmap(data) // also unlocks
			if cerr := unix.Close(fd); err == nil {
				err = cerr
			}
			return err
		},
	}, nil
}

// mlockOnFault is mlock2(2) with MLOCK_ONFAULT.
func mlockOnFault(b []byte) error {
	_, _, e := unix.Syscall(unix.SYS_MLOCK2, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.MLOCK_ONFAULT)
	if e != 0 {
		return e
	}
	return nil
}
