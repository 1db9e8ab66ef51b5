package wire

// What the kernel wires share to let a successor (a daemon handing over
// to a new binary, or one restarted with systemd's descriptor store) take
// their receive sockets over with what is queued on them: the receive
// gate, and taking a duplicate of an inherited socket that fits.

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// rxGate is the receive gate of a wire whose receive sockets a successor
// can inherit (UDPWire, PacketWire). PauseReceive closes it, ResumeReceive
// opens it; while it is closed the wire's receivers take nothing from the
// kernel and wait at it. Its zero value is open.
type rxGate struct {
	paused atomic.Bool
	mu     sync.Mutex
	open   chan struct{} // made by PauseReceive, closed by ResumeReceive
}

// PauseReceive stops taking packets from the kernel: what arrives stays
// in the receive sockets' buffers (up to their size) for ResumeReceive or
// for a successor that inherits the sockets. Packets already read are
// still handed out, and sending goes on.
func (g *rxGate) PauseReceive() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.paused.Swap(true) {
		g.open = make(chan struct{})
	}
}

// ResumeReceive ends PauseReceive (or the configuration's Paused).
func (g *rxGate) ResumeReceive() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused.Swap(false) {
		close(g.open)
	}
}

// receivePaused reports whether receiving is paused: a receiver checks it
// before each system call that would take packets from the kernel.
func (g *rxGate) receivePaused() bool { return g.paused.Load() }

// waitGate blocks while receiving is paused: true once it resumes, false
// if closed or done (nil: never) is closed first.
func (g *rxGate) waitGate(closed, done <-chan struct{}) bool {
	g.mu.Lock()
	open, paused := g.open, g.paused.Load()
	g.mu.Unlock()
	if !paused {
		return true
	}
	select {
	case <-open:
		return true
	case <-closed:
		return false
	case <-done:
		return false
	}
}

// dupInherited returns a non-blocking, close-on-exec duplicate of the
// socket f if match accepts its descriptor, and -1 if it does not (or f
// is no longer open). f stays the caller's. what (e.g. "udp wire: take
// over udp 4791 socket") starts its errors.
func dupInherited(f *os.File, what string, match func(fd int) bool) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, nil
	}
	fd, matched := -1, false
	if cerr := rc.Control(func(raw uintptr) {
		if matched = match(int(raw)); matched {
			fd, err = unix.FcntlInt(raw, unix.F_DUPFD_CLOEXEC, 0)
		}
	}); cerr != nil || !matched {
		return -1, nil
	}
	if err != nil {
		return -1, fmt.Errorf("%s: %w", what, err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("%s: %w", what, err)
	}
	return fd, nil
}
