package vfiouser

import (
	"errors"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Sentinel errors. Handlers wrap them with context; the connection turns
// them into the errno of an error reply (Errno) only when it replies.
var (
	// ErrInvalid: a malformed message or an argument out of range.
	ErrInvalid = errors.New("invalid message")
	// ErrUnsupported: a command or option this server does not implement.
	ErrUnsupported = errors.New("not supported")
	// ErrTooBig: a transfer larger than the negotiated maximum.
	ErrTooBig = errors.New("transfer too large")
	// ErrNoIRQ: an interrupt that has no eventfd assigned (or no such
	// interrupt). Trigger returns it; it is not a protocol error.
	ErrNoIRQ = errors.New("interrupt not assigned")
	// ErrMasked: Trigger found the interrupt masked and left it pending.
	ErrMasked = errors.New("interrupt masked")
	// ErrDisconnected: the client went away (or the server closed the
	// connection) while a request was outstanding.
	ErrDisconnected = errors.New("vfio-user client disconnected")
	// ErrTimeout: the client did not answer a server-to-client request in
	// time.
	ErrTimeout = errors.New("vfio-user client did not reply in time")
	// ErrServerClosed is returned by Serve after Shutdown or Close.
	ErrServerClosed = errors.New("vfio-user server closed")
)

// Errno maps an error from a handler or a device callback to the errno an
// error reply carries.
func Errno(err error) syscall.Errno {
	var e syscall.Errno
	switch {
	case err == nil:
		return 0
	case errors.Is(err, ErrTooBig):
		return syscall.E2BIG
	case errors.Is(err, ErrUnsupported):
		return syscall.ENOTSUP
	case errors.Is(err, guestmem.ErrOverlap):
		return syscall.EEXIST
	case errors.Is(err, guestmem.ErrNoRegion):
		return syscall.ENOENT
	case errors.Is(err, ErrInvalid), errors.Is(err, guestmem.ErrRange), errors.Is(err, guestmem.ErrAlign):
		return syscall.EINVAL
	case errors.Is(err, guestmem.ErrUnmapped), errors.Is(err, guestmem.ErrNotShared):
		return syscall.EFAULT
	case errors.Is(err, guestmem.ErrReadOnly):
		return syscall.EPERM
	case errors.Is(err, guestmem.ErrHeld):
		return syscall.EBUSY
	case errors.Is(err, ErrTimeout):
		return syscall.ETIMEDOUT
	case errors.Is(err, ErrDisconnected):
		return syscall.ENOTCONN
	case errors.As(err, &e) && e != 0:
		return e
	}
	return syscall.EIO
}
