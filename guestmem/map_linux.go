package guestmem

import (
	"errors"
	"fmt"

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
	if err := unix.Mlock(data); err != nil {
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
