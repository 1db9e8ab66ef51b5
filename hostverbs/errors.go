package hostverbs

import (
	"errors"
	"syscall"
)

// Sentinel errors. Providers wrap them with context; the device model maps
// them to an errno with Errno.
var (
	// ErrInvalid: an argument, attribute, mask or transition is invalid.
	ErrInvalid = errors.New("invalid argument")
	// ErrNoResources: a capability or quota would be exceeded.
	ErrNoResources = errors.New("out of resources")
	// ErrNotSupported: the provider does not implement the operation.
	ErrNotSupported = errors.New("operation not supported")
	// ErrBusy: the object is still in use.
	ErrBusy = errors.New("object in use")
	// ErrNotFound: no such object (key, index, QPN).
	ErrNotFound = errors.New("no such object")
	// ErrQueueFull: a work queue has no free slot.
	ErrQueueFull = errors.New("work queue full")
	// ErrClosed: the device or provider is closed.
	ErrClosed = errors.New("closed")
)

// Errno maps an error from a provider to the errno the IB core would give.
func Errno(err error) syscall.Errno {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, ErrInvalid):
		return syscall.EINVAL
	case errors.Is(err, ErrNoResources), errors.Is(err, ErrQueueFull):
		return syscall.ENOMEM
	case errors.Is(err, ErrNotSupported):
		return syscall.EOPNOTSUPP
	case errors.Is(err, ErrBusy):
		return syscall.EBUSY
	case errors.Is(err, ErrNotFound):
		return syscall.ENOENT
	case errors.Is(err, ErrClosed):
		return syscall.ENODEV
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	return syscall.EIO
}
