package vfiouser

import (
	"fmt"
	"io"
	"net"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// oobFDs is how many descriptors one recvmsg can carry before the kernel
// truncates (MSG_CTRUNC). It is larger than any max_msg_fds we announce so
// that "too many descriptors" is seen and refused, not silently truncated.
const oobFDs = 64

// unixTransport is a transport over a connected AF_UNIX stream socket. It
// receives with a raw recvmsg through the runtime poller (no allocation
// per read, MSG_CMSG_CLOEXEC on received descriptors) and sends with the
// net package.
type unixTransport struct {
	c  *net.UnixConn
	rc syscall.RawConn

	// recvmsg state, reused by every read; only one goroutine reads at a
	// time (the connection's read token).
	msg    unix.Msghdr
	iov    unix.Iovec
	oob    [(oobFDs*4 + 64)]byte
	n      int
	errno  syscall.Errno
	readFn func(fd uintptr) bool
	peekFn func(fd uintptr) bool
	peekP  []byte
}

func newUnixTransport(c *net.UnixConn) (*unixTransport, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("raw socket: %w", err)
	}
	t := &unixTransport{c: c, rc: rc}
	t.readFn = t.recvmsg
	t.peekFn = t.recvPeek
	return t, nil
}

// recvmsg runs inside RawConn.Read: false asks the poller to wait for the
// socket to become readable.
func (t *unixTransport) recvmsg(fd uintptr) bool {
	for {
		n, _, e := unix.Syscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&t.msg)), unix.MSG_CMSG_CLOEXEC)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		t.n, t.errno = int(n), e
		return true
	}
}

// recvPeek runs inside RawConn.Read: it copies the next bytes into peekP
// without taking them (and without descriptors: they stay with the bytes).
func (t *unixTransport) recvPeek(fd uintptr) bool {
	for {
		n, _, e := unix.Syscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&t.peekP[0])), uintptr(len(t.peekP)),
			unix.MSG_PEEK, 0, 0)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		t.n, t.errno = int(n), e
		return true
	}
}

// peek copies the next len(p) bytes of the stream, or fewer if fewer are
// there, leaving them in the socket. At the end of the stream it returns
// 0, io.EOF.
func (t *unixTransport) peek(p []byte) (int, error) {
	t.peekP = p
	if err := t.rc.Read(t.peekFn); err != nil {
		return 0, err
	}
	if t.errno != 0 {
		return 0, fmt.Errorf("recv peek: %w", t.errno)
	}
	if t.n == 0 {
		return 0, io.EOF
	}
	return t.n, nil
}

// waitHangup waits at most d for the client to close its end of the
// socket or shut it down for writing (POLLRDHUP; a closed peer also sets
// POLLHUP) and reports whether it did.
func (t *unixTransport) waitHangup(d time.Duration) bool {
	hup := false
	ms := int(max(d/time.Millisecond, 0))
	_ = t.rc.Control(func(fd uintptr) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		for {
			n, err := unix.Poll(pfd, ms)
			if err == unix.EINTR {
				continue
			}
			hup = err == nil && n > 0 && pfd[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR|unix.POLLNVAL) != 0
			return
		}
	})
	return hup
}

func (t *unixTransport) read(p []byte, fds []int) (int, []int, bool, error) {
	if len(p) == 0 {
		return 0, fds, false, nil
	}
	t.iov.Base = &p[0]
	t.iov.SetLen(len(p))
	t.msg = unix.Msghdr{Iov: &t.iov, Iovlen: 1, Control: &t.oob[0]}
	t.msg.SetControllen(len(t.oob))
	if err := t.rc.Read(t.readFn); err != nil {
		return 0, fds, false, err // closed, or the read deadline passed
	}
	if t.errno != 0 {
		return 0, fds, false, fmt.Errorf("recvmsg: %w", t.errno)
	}
	n := t.n
	truncated := t.msg.Flags&unix.MSG_CTRUNC != 0
	if oobn := int(t.msg.Controllen); oobn > 0 {
		var err error
		fds, err = parseRights(t.oob[:oobn], fds)
		if err != nil {
			return n, fds, true, nil // malformed control data: refuse the message, keep the stream
		}
	}
	if n == 0 && len(fds) == 0 {
		return 0, fds, truncated, io.EOF
	}
	return n, fds, truncated, nil
}

// parseRights appends the descriptors of every SCM_RIGHTS message in oob to
// fds. Other control messages are ignored.
func parseRights(oob []byte, fds []int) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return fds, fmt.Errorf("parse control messages: %w", err)
	}
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		r, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return fds, fmt.Errorf("parse SCM_RIGHTS: %w", err)
		}
		fds = append(fds, r...)
	}
	return fds, nil
}

func (t *unixTransport) write(p []byte, fds []int) error {
	if len(fds) == 0 {
		_, err := t.c.Write(p)
		return err
	}
	n, _, err := t.c.WriteMsgUnix(p, unix.UnixRights(fds...), nil)
	if err != nil {
		return err
	}
	if n < len(p) {
		_, err = t.c.Write(p[n:])
	}
	return err
}

// sysfd is the socket's descriptor (for a keeper to duplicate).
func (t *unixTransport) sysfd() int {
	fd := -1
	_ = t.rc.Control(func(s uintptr) { fd = int(s) })
	return fd
}

func (t *unixTransport) setReadDeadline(d time.Time) error { return t.c.SetReadDeadline(d) }

func (t *unixTransport) close() error { return t.c.Close() }

// peerPID returns the process at the other end of a unix socket as the
// kernel recorded it at connect (SO_PEERCRED), or 0.
func peerPID(c *net.UnixConn) int32 {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var pid int32
	_ = rc.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			pid = cred.Pid
		}
	})
	return pid
}
