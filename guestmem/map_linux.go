package guestmem

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MapFD maps size bytes of fd at offset, shared, with the given protection,
// and mlocks the mapping (guest memory the device reads in place must not be
// paged out). It returns a RegionSpec ready for Add that owns fd: on success
// fd is closed by Release, on error it is left to the caller.
//
// If mlock fails (no CAP_IPC_LOCK and RLIMIT_MEMLOCK too small) the mapping
// is undone and the error says so: the device refuses unlocked memory rather
// than silently running without the guarantee.
func MapFD(base GPA, size uint64, prot Prot, fd int, offset int64) (RegionSpec, error) {
	return mapFD(base, size, prot, fd, offset, false)
}

// MapFDOnFault is MapFD for a mapping the device needs at once (a daemon
// resuming a VM under a pause): mlock2(MLOCK_ONFAULT) locks each page as
// it is first touched, which is as quick for 512 MiB as for 4 KiB, while
// a full mlock populates every page table entry first (about 20 ms per
// 512 MiB here). RLIMIT_MEMLOCK is charged for the whole mapping at once
// all the same, so a cap refuses it here as it would refuse MapFD. The
// spec's LockAll then locks every page, off the critical path.
func MapFDOnFault(base GPA, size uint64, prot Prot, fd int, offset int64) (RegionSpec, error) {
	return mapFD(base, size, prot, fd, offset, true)
}

func mapFD(base GPA, size uint64, prot Prot, fd int, offset int64, onFault bool) (RegionSpec, error) {
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
	if onFault {
		err = mlockOnFault(data)
	} else {
		err = unix.Mlock(data)
	}
	if err != nil {
		_ = unix.Munmap(data)
		if errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.EPERM) {
			return RegionSpec{}, fmt.Errorf("mlock guest memory %v+%#x: %w (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK)", base, size, err)
		}
		return RegionSpec{}, fmt.Errorf("mlock guest memory %v+%#x: %w", base, size, err)
	}
	// LockAll and Release exclude each other: a lock never runs on a
	// range that is unmapped (or mapped again by someone else).
	var mu sync.Mutex
	released := false
	spec := RegionSpec{
		Base: base, Size: size, Prot: prot, Data: data, FD: fd, Offset: offset, Locked: size,
		Release: func() error {
			mu.Lock()
			released = true
			mu.Unlock()
			err := unix.Munmap(data) // also unlocks
			if cerr := unix.Close(fd); err == nil {
				err = cerr
			}
			return err
		},
	}
	if onFault {
		spec.LockAll = func() error {
			mu.Lock()
			defer mu.Unlock()
			if released {
				return nil
			}
			if err := unix.Mlock(data); err != nil {
				return fmt.Errorf("mlock guest memory %v+%#x: %w", base, size, err)
			}
			return nil
		}
	}
	return spec, nil
}

// mlockOnFault is mlock2(2) with MLOCK_ONFAULT.
func mlockOnFault(b []byte) error {
	_, _, e := unix.Syscall(unix.SYS_MLOCK2, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.MLOCK_ONFAULT)
	if e != 0 {
		return e
	}
	return nil
}
