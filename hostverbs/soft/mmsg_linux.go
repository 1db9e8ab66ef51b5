//go:build linux

package soft

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// sendmmsg and recvmmsg, which x/sys/unix does not wrap. The headers point
// at Go memory that the caller keeps alive for the duration of the call.

func sendmmsg(fd int, hdrs []unix.Mmsghdr) (int, error) {
	n, _, e := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hdrs[0])),
		uintptr(len(hdrs)), 0, 0, 0)
	if e != 0 {
		return int(n), e
	}
	return int(n), nil
}

func recvmmsg(fd int, hdrs []unix.Mmsghdr) (int, error) {
	n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hdrs[0])),
		uintptr(len(hdrs)), unix.MSG_DONTWAIT, 0, 0)
	if e != 0 {
		return int(n), e
	}
	return int(n), nil
}

// setIov points iov at b.
func setIov(iov *unix.Iovec, b []byte) {
	iov.Base = unsafe.SliceData(b)
	iov.SetLen(len(b))
}

// setName points the header's address at a sockaddr.
func setName4(h *unix.Msghdr, sa *unix.RawSockaddrInet4) {
	h.Name = (*byte)(unsafe.Pointer(sa))
	h.Namelen = unix.SizeofSockaddrInet4
}

func setName6(h *unix.Msghdr, sa *unix.RawSockaddrInet6) {
	h.Name = (*byte)(unsafe.Pointer(sa))
	h.Namelen = unix.SizeofSockaddrInet6
}

// attachFilter installs a classic BPF socket filter.
func attachFilter(fd int, prog []unix.SockFilter) error {
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: unsafe.SliceData(prog)}
	return unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &fp)
}

// cmsgs walks the control messages in oob, calling fn with each header's
// level, type and data.
func cmsgs(oob []byte, fn func(level, typ int32, data []byte)) {
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
