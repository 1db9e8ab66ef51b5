package vfiouser

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// IRQs is a connection's interrupt table: for each interrupt index and
// vector, the eventfd the client assigned (DEVICE_SET_IRQS) and its mask
// state. The device signals an interrupt with Trigger, from any goroutine,
// concurrently with the client replacing or removing eventfds: a Trigger
// never writes to an eventfd after it was closed, so it never writes to a
// reused descriptor number.
type IRQs struct {
	sets [MaxIRQIndexes]irqSet
	n    atomic.Int32 // interrupt indexes in use; stored after sets (publication)
}

type irqSet struct {
	flags uint32
	slots []irqSlot
}

type irqSlot struct {
	efd     atomic.Pointer[eventFD]
	masked  atomic.Bool
	pending atomic.Bool
}

// eventFD is an assigned eventfd. signal holds the lock across the
// write, close takes it too, so the number is never written after close.
type eventFD struct {
	mu  sync.Mutex
	fd  int
	one [8]byte
	pfd [1]unix.PollFd
}

func newEventFD(fd int) *eventFD {
	e := &eventFD{fd: fd}
	e.one[0] = 1 // eventfd counters are host-endian u64
	e.pfd[0] = unix.PollFd{Fd: int32(fd), Events: unix.POLLOUT}
	return e
}

// signal adds 1 to the eventfd's counter without ever blocking. A write
// to an eventfd blocks while the counter is saturated unless O_NONBLOCK
// is set, and that flag belongs to the file description the client
// shares with us: checkEventFD sets it, but a client may clear it again.
// So signal first polls for writability (POLLOUT: the counter can take 1)
// and treats a saturated counter as what it is, an interrupt already
// pending. Signals of one eventfd are serialised, so the device's own
// concurrent triggers cannot race each other past the poll; only a
// client that clears O_NONBLOCK and fills its own counter between our
// poll and write could still stall us.
func (e *eventFD) signal() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.fd < 0 {
		return ErrNoIRQ
	}
	for {
		n, err := unix.Poll(e.pfd[:], 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("poll eventfd: %w", err)
		}
		if n == 0 || e.pfd[0].Revents&unix.POLLOUT == 0 {
			return nil // saturated: an interrupt is pending anyway
		}
		break
	}
	for {
		_, err := unix.Write(e.fd, e.one[:])
		switch err {
		case nil, unix.EAGAIN: // EAGAIN: the counter is saturated, an interrupt is pending anyway
			return nil
		case unix.EINTR:
			continue
		}
		return fmt.Errorf("signal eventfd: %w", err)
	}
}

// readable reports whether the eventfd's counter is non-zero: an
// interrupt signalled that the client has not taken yet (QEMU reads the
// counter when it handles the interrupt; reading resets it to zero).
func (e *eventFD) readable() (bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.fd < 0 {
		return false, ErrNoIRQ
	}
	pfd := [1]unix.PollFd{{Fd: int32(e.fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(pfd[:], 0)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return false, fmt.Errorf("poll eventfd: %w", err)
		}
		return n > 0 && pfd[0].Revents&unix.POLLIN != 0, nil
	}
}

func (e *eventFD) close() {
	e.mu.Lock()
	if e.fd >= 0 {
		_ = unix.Close(e.fd)
		e.fd = -1
	}
	e.mu.Unlock()
}

// checkEventFD verifies that fd is an eventfd (a client could otherwise
// hand us a pipe whose full buffer would block the device on Trigger) and
// makes writes to it non-blocking, as QEMU's own eventfds are: a blocking
// eventfd with a saturated counter would block the device as well (see
// eventFD.signal for the client that clears the flag again).
func checkEventFD(fd int) error {
	target, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return fmt.Errorf("inspect fd %d: %w", fd, err)
	}
	if target != "anon_inode:[eventfd]" {
		return fmt.Errorf("fd %d is %q, not an eventfd: %w", fd, target, ErrInvalid)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		return fmt.Errorf("eventfd %d: set O_NONBLOCK: %w", fd, err)
	}
	return nil
}

// configure sizes the table for a device's interrupt description. It runs
// once, before the connection serves its first message.
func (q *IRQs) configure(desc []IRQ) {
	for i, d := range desc {
		q.sets[i].flags = d.Flags | IRQInfoEventfd
		q.sets[i].slots = make([]irqSlot, d.Count)
	}
	q.n.Store(int32(len(desc)))
}

func (q *IRQs) set(index IRQIndex) *irqSet {
	if q == nil || uint64(index) >= uint64(q.n.Load()) {
		return nil
	}
	return &q.sets[index]
}

func (q *IRQs) slot(index IRQIndex, vector uint32) *irqSlot {
	s := q.set(index)
	if s == nil || uint64(vector) >= uint64(len(s.slots)) {
		return nil
	}
	return &s.slots[vector]
}

// Count returns the number of vectors of an interrupt index.
func (q *IRQs) Count(index IRQIndex) uint32 {
	if s := q.set(index); s != nil {
		return uint32(len(s.slots))
	}
	return 0
}

// Assigned reports whether the client assigned an eventfd to the vector.
func (q *IRQs) Assigned(index IRQIndex, vector uint32) bool {
	s := q.slot(index, vector)
	return s != nil && s.efd.Load() != nil
}

// Masked reports whether the client (or auto-masking) masked the vector.
func (q *IRQs) Masked(index IRQIndex, vector uint32) bool {
	s := q.slot(index, vector)
	return s != nil && s.masked.Load()
}

// Trigger signals an interrupt. It returns an error wrapping ErrNoIRQ when
// the vector does not exist or has no eventfd, and ErrMasked when the
// vector is masked: the interrupt is then left pending and fires on unmask
// (for auto-masked indexes such as INTx, the device re-asserts instead,
// see IRQNotifier). For an auto-masked index a successful Trigger
// masks the vector until the client unmasks it.
func (q *IRQs) Trigger(index IRQIndex, vector uint32) error {
	s := q.slot(index, vector)
	if s == nil {
		return fmt.Errorf("%v vector %d: no such interrupt: %w", index, vector, ErrNoIRQ)
	}
	e := s.efd.Load()
	if e == nil {
		return fmt.Errorf("%v vector %d: %w", index, vector, ErrNoIRQ)
	}
	if q.sets[index].flags&IRQInfoAutomasked != 0 {
		if !s.masked.CompareAndSwap(false, true) {
			return fmt.Errorf("%v vector %d: %w", index, vector, ErrMasked)
		}
	} else if s.masked.Load() {
		s.pending.Store(true)
		return fmt.Errorf("%v vector %d: %w", index, vector, ErrMasked)
	}
	if err := e.signal(); err != nil {
		return fmt.Errorf("%v vector %d: %w", index, vector, err)
	}
	return nil
}

// awaitStep is how often AwaitConsumed looks at the eventfd again.
const awaitStep = 20 * time.Microsecond

// AwaitConsumed waits at most bound for the client to take the interrupt
// last signalled on a vector: until its eventfd's counter is zero again
// (not readable). It never blocks on the eventfd: it polls it with a zero
// timeout every awaitStep, and the eventfd's lock is not held in between,
// so the client may replace or remove it meanwhile. It reports whether
// the counter was read within the bound (true at once when nothing is
// pending), and an error wrapping ErrNoIRQ when the vector has no eventfd.
func (q *IRQs) AwaitConsumed(index IRQIndex, vector uint32, bound time.Duration) (bool, error) {
	s := q.slot(index, vector)
	if s == nil {
		return false, fmt.Errorf("%v vector %d: no such interrupt: %w", index, vector, ErrNoIRQ)
	}
	deadline := time.Now().Add(bound)
	for {
		e := s.efd.Load()
		if e == nil {
			return false, fmt.Errorf("%v vector %d: %w", index, vector, ErrNoIRQ)
		}
		pending, err := e.readable()
		if err != nil {
			return false, fmt.Errorf("%v vector %d: %w", index, vector, err)
		}
		if !pending {
			return true, nil
		}
		if !time.Now().Before(deadline) {
			return false, nil
		}
		time.Sleep(awaitStep)
	}
}

// assign installs eventfds for vectors [start, start+len(fds)), unmasked,
// closing the ones they replace. The table owns fds from then on.
func (q *IRQs) assign(index IRQIndex, start uint32, fds []int) {
	s := q.set(index)
	for i, fd := range fds {
		slot := &s.slots[start+uint32(i)]
		slot.masked.Store(false)
		slot.pending.Store(false)
		if old := slot.efd.Swap(newEventFD(fd)); old != nil {
			old.close()
		}
	}
}

// deassign removes the eventfds of vectors [start, start+count).
func (q *IRQs) deassign(index IRQIndex, start, count uint32) {
	s := q.set(index)
	for i := start; i < start+count; i++ {
		slot := &s.slots[i]
		if old := slot.efd.Swap(nil); old != nil {
			old.close()
		}
		slot.masked.Store(false)
		slot.pending.Store(false)
	}
}

// setMasked masks or unmasks the vectors whose bool is set (nil: all of
// [start, start+count)). Unmasking a vector with a pending interrupt of a
// non-auto-masked index signals it.
func (q *IRQs) setMasked(index IRQIndex, start, count uint32, bools []byte, masked bool) error {
	s := q.set(index)
	var first error
	for i := uint32(0); i < count; i++ {
		if bools != nil && bools[i] == 0 {
			continue
		}
		slot := &s.slots[start+i]
		slot.masked.Store(masked)
		if masked || !slot.pending.Swap(false) {
			continue
		}
		if e := slot.efd.Load(); e != nil {
			if err := e.signal(); err != nil && first == nil {
				first = err
			}
		}
	}
	return first
}

// clientTrigger signals vectors on the client's behalf (SET_IRQS
// ACTION_TRIGGER with DATA_NONE or DATA_BOOL), ignoring unassigned ones.
func (q *IRQs) clientTrigger(index IRQIndex, start, count uint32, bools []byte) error {
	s := q.set(index)
	for i := uint32(0); i < count; i++ {
		if bools != nil && bools[i] == 0 {
			continue
		}
		if e := s.slots[start+i].efd.Load(); e != nil {
			if err := e.signal(); err != nil && !errors.Is(err, ErrNoIRQ) {
				return err
			}
		}
	}
	return nil
}

// closeAll closes every eventfd (client disconnect).
func (q *IRQs) closeAll() {
	for i := 0; i < int(q.n.Load()); i++ {
		q.deassign(IRQIndex(i), 0, uint32(len(q.sets[i].slots)))
	}
}
