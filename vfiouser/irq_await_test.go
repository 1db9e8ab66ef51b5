package vfiouser

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// awaitIRQs is an interrupt table with one MSI-X vector whose eventfd, a
// real one, is returned for the test to read as QEMU's main loop would.
func awaitIRQs(t *testing.T) (*IRQs, int) {
	t.Helper()
	q := &IRQs{}
	q.configure([]IRQ{IRQINTx: {Count: 1}, IRQMSI: {}, IRQMSIX: {Count: 1}})
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	require.NoError(t, err)
	qemu, err := unix.Dup(efd) // the client's copy; the table owns efd
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(qemu); q.closeAll() })
	q.assign(IRQMSIX, 0, []int{efd})
	return q, qemu
}

// mainLoop stands in for QEMU's main loop: it waits for the eventfd to
// become readable and reads it (resetting the counter), as QEMU's handler
// of a vector's eventfd does before it injects the MSI, and returns the
// count it read.
func mainLoop(t *testing.T, fd int) <-chan uint64 {
	t.Helper()
	got := make(chan uint64, 1)
	go func() {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(pfd, -1); err != nil && err != unix.EINTR {
				got <- 0
				return
			}
			var b [8]byte
			if n, err := unix.Read(fd, b[:]); err == nil && n == 8 {
				got <- binary.NativeEndian.Uint64(b[:])
				return
			}
		}
	}()
	return got
}

// TestAwaitConsumedReturnsOnceTheClientReads: after a Trigger,
// AwaitConsumed returns true as soon as the client has read the eventfd
// (its counter is zero again), and true at once when nothing is pending.
// The bound is generous: it only keeps a broken wait from hanging the test.
func TestAwaitConsumedReturnsOnceTheClientReads(t *testing.T) {
	q, qemu := awaitIRQs(t)
	taken, err := q.AwaitConsumed(IRQMSIX, 0, time.Minute)
	require.NoError(t, err)
	assert.True(t, taken, "nothing signalled: nothing to wait for")

	for round := 0; round < 3; round++ {
		got := mainLoop(t, qemu)
		require.NoError(t, q.Trigger(IRQMSIX, 0))
		taken, err = q.AwaitConsumed(IRQMSIX, 0, time.Minute)
		require.NoError(t, err)
		assert.True(t, taken, "round %d: the client read the eventfd", round)
		assert.Equal(t, uint64(1), <-got, "round %d: one interrupt read", round)
	}
}

// TestAwaitConsumedGivesUpAtTheBound: with no client reading (QEMU's main
// loop held up, as it is while a vCPU holds the BQL), AwaitConsumed
// returns false after its bound instead of waiting on, and leaves the
// interrupt pending for the client to read later.
func TestAwaitConsumedGivesUpAtTheBound(t *testing.T) {
	q, qemu := awaitIRQs(t)
	require.NoError(t, q.Trigger(IRQMSIX, 0))
	taken, err := q.AwaitConsumed(IRQMSIX, 0, time.Millisecond)
	require.NoError(t, err)
	assert.False(t, taken, "nobody read the eventfd")

	got := mainLoop(t, qemu)
	assert.Equal(t, uint64(1), <-got, "the interrupt is still there for the client")
}

// TestAwaitConsumedWithoutEventfd: a vector with no eventfd, or none that
// exists, has nothing to wait for: an error wrapping ErrNoIRQ at once.
func TestAwaitConsumedWithoutEventfd(t *testing.T) {
	q, _ := awaitIRQs(t)
	_, err := q.AwaitConsumed(IRQINTx, 0, time.Minute)
	assert.ErrorIs(t, err, ErrNoIRQ)
	_, err = q.AwaitConsumed(IRQMSIX, 1, time.Minute)
	assert.ErrorIs(t, err, ErrNoIRQ)
	q.deassign(IRQMSIX, 0, 1)
	_, err = q.AwaitConsumed(IRQMSIX, 0, time.Minute)
	assert.ErrorIs(t, err, ErrNoIRQ)
}
