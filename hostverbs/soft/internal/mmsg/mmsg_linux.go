//go:build linux

// Package mmsg wraps the socket system calls the soft transport's wires
// and benchmarks use and x/sys/unix does not: sendmmsg, recvmmsg, iovecs,
// socket filters (attached, read back) and control messages.
package mmsg

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SendMmsg and RecvMmsg wrap sendmmsg(2) and recvmmsg(2), which x/sys/unix does not wrap. The headers point
// at Go memory that the caller keeps alive for the duration of the call.

// SendMmsg is sendmmsg(2): it returns how many of hdrs were sent.
func SendMmsg(fd int, hdrs []unix.Mmsghdr) (int, error) {
	n, _, e := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hdrs[0])),
		uintptr(len(hdrs)), 0, 0, 0)
	if e != 0 {
		return int(n), e
	}
	return int(n), nil
}

// RecvMmsg is recvmmsg(2) without waiting (MSG_DONTWAIT).
func RecvMmsg(fd int, hdrs []unix.Mmsghdr) (int, error) {
	n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hdrs[0])),
		uintptr(len(hdrs)), unix.MSG_DONTWAIT, 0, 0)
	if e != 0 {
		return int(n), e
	}
	return int(n), nil
}

// SetIov points iov at b.
func SetIov(iov *unix.Iovec, b []byte) {
	iov.Base = unsafe.SliceData(b)
	iov.SetLen(len(b))
}

// SetName4 points the header's address at a sockaddr.
func SetName4(h *unix.Msghdr, sa *unix.RawSockaddrInet4) {
	h.Name = (*byte)(unsafe.Pointer(sa))
	h.Namelen = unix.SizeofSockaddrInet4
}

// SetName6 is SetName4 for an IPv6 address.
func SetName6(h *unix.Msghdr, sa *unix.RawSockaddrInet6) {
	h.Name = (*byte)(unsafe.Pointer(sa))
	h.Namelen = unix.SizeofSockaddrInet6
}

// AttachFilter installs a classic BPF socket filter.
func AttachFilter(fd int, prog []unix.SockFilter) error {
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: unsafe.SliceData(prog)}
	return unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &fp)
}

// Filter returns the classic BPF socket filter attached to fd
// (SO_GET_FILTER), nil if there is none.
func Filter(fd int) ([]unix.SockFilter, error) {
	// SO_GET_FILTER counts in instructions, not bytes; asked with a
	// length of 0 it reports the program's.
	var n uint32
	if err := getFilter(fd, nil, &n); err != nil || n == 0 {
		return nil, err
	}
	prog := make([]unix.SockFilter, n)
	if err := getFilter(fd, &prog[0], &n); err != nil {
		return nil, err
	}
	return prog[:min(int(n), len(prog))], nil
}

func getFilter(fd int, prog *unix.SockFilter, n *uint32) error {
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_GET_FILTER,
		uintptr(unsafe.Pointer(prog)), uintptr(unsafe.Pointer(n)), 0)
	if e != 0 {
		return fmt.Errorf("SO_GET_FILTER: %w", e)
	}
	return nil
}

// Cmsgs walks the control messages in oob, calling fn with each header's
// level, type and data.
func Cmsgs(oob []byte, fn func(level, typ int32, data []byte)) {
	for len(oob) >= unix.SizeofCmsghdr {
		h := (*unix.Cmsghdr)(unsafe.Pointer(unsafe.SliceData(oob)))
		l := int(h.Len)
		if l < unix.SizeofCmsghdr || l > len(oob) {
			return
		}
		fn(h.Level, h.Type, oob[unix.SizeofCmsghdr:l])
		next := unix.CmsgSpace(l - unix.SizeofCmsghdr)
		if next > len(oob) {
			return
		}
		oob = oob[next:]
	}
}

// SetBuffers sets a socket's receive and send buffers to n bytes, beyond
// the sysctl limits where the process may (SO_RCVBUFFORCE needs
// CAP_NET_ADMIN), else as far as they allow.
func SetBuffers(fd, n int) {
	for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
		if unix.SetsockoptInt(fd, unix.SOL_SOCKET, o[0], n) != nil {
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, o[1], n)
		}
	}
}
