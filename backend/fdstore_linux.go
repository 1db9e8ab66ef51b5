package backend

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// FDStore is systemd's file descriptor store (sd_notify(3) FDSTORE=1,
// FDNAME=, FDSTOREREMOVE=1; the unit's FileDescriptorStoreMax=): the
// service manager holds copies of descriptors the daemon gives it and
// hands them back (LISTEN_FDS, LISTEN_FDNAMES) when the service starts
// again after a crash or a restart. The daemon keeps each VM's vfio-user
// connection, guest memory files and interrupt eventfds there, so that
// QEMU never sees its device's socket close.
//
// go-systemd (v22.7.0) sends notify messages without descriptors, and the
// protocol is one datagram with SCM_RIGHTS, so this is its own small
// sender; READY/STOPPING/STATUS go through go-systemd's daemon.SdNotify.
type FDStore struct {
	mu   sync.Mutex
	fd   int
	addr *unix.SockaddrUnix
}

// OpenFDStore connects to the service manager's notify socket (the value
// of NOTIFY_SOCKET: a path, or an abstract name starting with '@').
func OpenFDStore(notifySocket string) (*FDStore, error) {
	if notifySocket == "" {
		return nil, errors.New("no NOTIFY_SOCKET: not run by systemd")
	}
	// x/sys maps a leading '@' to the abstract namespace, as systemd means it.
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("notify socket %s: %w", notifySocket, err)
	}
	return &FDStore{fd: fd, addr: &unix.SockaddrUnix{Name: notifySocket}}, nil
}

// checkFDName refuses names the protocol cannot carry (sd_notify(3): at
// most 255 characters, printable ASCII, no ':').
func checkFDName(name string) error {
	if name == "" || len(name) > 255 {
		return fmt.Errorf("fd store name %q: length %d", name, len(name))
	}
	for _, c := range name {
		if c < 0x21 || c > 0x7e || c == ':' {
			return fmt.Errorf("fd store name %q: character %q", name, c)
		}
	}
	return nil
}

// Store gives the service manager a copy of fd under name. The manager
// keeps one copy of an open file however often it is given (the first
// name stays).
func (s *FDStore) Store(name string, fd int) error {
	if err := checkFDName(name); err != nil {
		return err
	}
	return s.send("FDSTORE=1\nFDNAME="+name, unix.UnixRights(fd))
}

// Remove drops every stored descriptor named name.
func (s *FDStore) Remove(name string) error {
	if err := checkFDName(name); err != nil {
		return err
	}
	return s.send("FDSTOREREMOVE=1\nFDNAME="+name, nil)
}

func (s *FDStore) send(state string, oob []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := unix.Sendmsg(s.fd, []byte(state), oob, s.addr, 0); err != nil {
		return fmt.Errorf("notify %q: %w", strings.ReplaceAll(state, "\n", " "), err)
	}
	return nil
}

// Barrier waits, at most timeout, until the service manager has handled
// every message sent before it (sd_notify_barrier(3): it closes its copy
// of a pipe's write end once it gets there).
func (s *FDStore) Barrier(timeout time.Duration) error {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return fmt.Errorf("notify barrier: %w", err)
	}
	defer unix.Close(p[0])
	err := s.send("BARRIER=1", unix.UnixRights(p[1]))
	unix.Close(p[1])
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("notify barrier: the service manager did not answer within %v", timeout)
		}
		fds := []unix.PollFd{{Fd: int32(p[0])}}
		n, err := unix.Poll(fds, int(left.Milliseconds())+1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("notify barrier: %w", err)
		}
		if n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLERR) != 0 {
			return nil
		}
	}
}

// Close closes the notify socket (stored descriptors stay stored).
func (s *FDStore) Close() error { return unix.Close(s.fd) }
