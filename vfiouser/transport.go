package vfiouser

import (
	"errors"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// transport is the byte stream a connection runs on: a unix socket with
// SCM_RIGHTS (unixTransport) or, for fuzzing and one-step tests, an
// in-memory script (memTransport). The seam follows libvfio-user's
// transport_ops.
type transport interface {
	// read reads at most len(p) bytes. File descriptors that arrived with
	// those bytes are appended to fds and returned; truncated reports that
	// the kernel dropped some (MSG_CTRUNC). At the end of the stream it
	// returns 0, io.EOF. A read that times out returns an error for which
	// isTimeout is true and no bytes.
	read(p []byte, fds []int) (n int, out []int, truncated bool, err error)
	// write writes all of p with fds attached to its first byte.
	write(p []byte, fds []int) error
	// setReadDeadline bounds the reads that follow (zero: no bound).
	setReadDeadline(t time.Time) error
	// close shuts the stream down and unblocks reads and writes.
	close() error
}

func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// Segment is one chunk of an in-memory stream: bytes, and the file
// descriptors sent with them (attached to the first byte, as sendmsg does).
type Segment struct {
	Data []byte
	FDs  []int
}

// memTransport replays a fixed list of segments as the client's side of the
// stream and records what the server writes. It mimics a unix stream socket:
// a read may span segments, but stops right after a segment that carries
// descriptors (the kernel never merges past SCM_RIGHTS), and descriptors
// beyond maxFDs per read are closed and reported as truncated.
type memTransport struct {
	mu      sync.Mutex
	segs    []Segment
	maxFDs  int
	written [][]byte
	wfds    [][]int
	closed  bool
	// onWrite, if set, is called with every message written (after it was
	// recorded) and may append segments (a scripted peer).
	onWrite func(t *memTransport, p []byte, fds []int)
}

func newMemTransport(segs []Segment, maxFDs int) *memTransport {
	return &memTransport{segs: segs, maxFDs: maxFDs}
}

func (t *memTransport) read(p []byte, fds []int) (int, []int, bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, fds, false, io.EOF
	}
	n := 0
	trunc := false
	for n < len(p) && len(t.segs) > 0 {
		s := &t.segs[0]
		c := copy(p[n:], s.Data)
		n += c
		s.Data = s.Data[c:]
		hadFDs := len(s.FDs) > 0
		for _, fd := range s.FDs {
			if len(fds) < t.maxFDs {
				fds = append(fds, fd)
			} else {
				_ = unix.Close(fd)
				trunc = true
			}
		}
		s.FDs = nil
		if len(s.Data) == 0 {
			t.segs = t.segs[1:]
		}
		if hadFDs {
			break
		}
	}
	if n == 0 && !trunc {
		return 0, fds, false, io.EOF
	}
	return n, fds, trunc, nil
}

func (t *memTransport) write(p []byte, fds []int) error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return io.ErrClosedPipe
	}
	b := append([]byte(nil), p...)
	t.written = append(t.written, b)
	f := append([]int(nil), fds...)
	t.wfds = append(t.wfds, f)
	hook := t.onWrite
	t.mu.Unlock()
	if hook != nil {
		hook(t, b, f)
	}
	return nil
}

func (t *memTransport) setReadDeadline(time.Time) error { return nil }

// close closes the stream and every descriptor still queued in it.
func (t *memTransport) close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	for _, s := range t.segs {
		for _, fd := range s.FDs {
			_ = unix.Close(fd)
		}
	}
	t.segs = nil
	return nil
}

// Written returns the messages the server wrote, in order.
func (t *memTransport) Written() [][]byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([][]byte(nil), t.written...)
}
