//go:build linux

package wire

import (
	"fmt"
	"sync"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"golang.org/x/sys/unix"
)

// txSock is a KernelWire send socket. It is deliberately not registered
// with the Go runtime's poller: a socket in the poller's epoll set has a
// waiter on its wait queue, so the kernel signals write space (EPOLLOUT)
// to epoll for every datagram the socket releases, which wakes an idle
// poller thread per send batch for nothing. A send that finds the buffer
// full (rare: the socket buffer holds megabytes) waits in poll(2) instead.
type txSock struct {
	fd     int
	closed chan struct{}
	// mu serialises senders and keeps the descriptor open during a send
	// (Close takes it before closing the descriptor).
	mu     sync.Mutex
	shut   bool
	pollFd [1]unix.PollFd
}

// txPollTimeout bounds a wait for buffer space between checks for Close.
const txPollTimeout = 50 * time.Millisecond

func openTx(family, buf int, closed chan struct{}) (*txSock, error) {
	fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, err
	}
	mmsg.SetBuffers(fd, buf)
	return &txSock{fd: fd, closed: closed}, nil
}

// close closes the descriptor once no send is using it.
func (s *txSock) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.shut {
		s.shut = true
		unix.Close(s.fd)
	}
}

// closeTx closes the send sockets that are open (nil ones are skipped).
func closeTx(socks ...*txSock) {
	for _, s := range socks {
		if s != nil {
			s.close()
		}
	}
}

// sendmmsg sends hdrs, waiting for buffer space, until all are sent or an
// error stops it.
func (s *txSock) sendmmsg(hdrs []unix.Mmsghdr) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shut {
		return 0, fmt.Errorf("kernel wire: %w", hostverbs.ErrClosed)
	}
	sent := 0
	for sent < len(hdrs) {
		n, err := mmsg.SendMmsg(s.fd, hdrs[sent:])
		switch err {
		case nil:
			sent += n
		case unix.EINTR:
		case unix.EAGAIN:
			if err := s.waitWritable(); err != nil {
				return sent, err
			}
		default:
			return sent, err
		}
	}
	return sent, nil
}

// waitWritable blocks until the socket has buffer space or the wire is
// closed.
func (s *txSock) waitWritable() error {
	for {
		select {
		case <-s.closed:
			return fmt.Errorf("kernel wire: %w", hostverbs.ErrClosed)
		default:
		}
		s.pollFd[0] = unix.PollFd{Fd: int32(s.fd), Events: unix.POLLOUT}
		n, err := unix.Poll(s.pollFd[:], int(txPollTimeout/time.Millisecond))
		if err != nil && err != unix.EINTR {
			return fmt.Errorf("kernel wire: poll: %w", err)
		}
		if n > 0 {
			return nil
		}
	}
}
