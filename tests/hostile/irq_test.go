package hostile

import (
	"encoding/binary"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// TestHostileInterruptDescriptors plays a hostile QEMU (the vfio-user
// client) with its interrupt descriptors: descriptors that are no
// eventfds, a blocking eventfd whose counter is saturated (an eventfd
// write then waits for a reader: before the fix in vfiouser/irqs.go the
// innocent peer's SEND doorbell, which delivers into the hostile VM and
// completes there, hung forever), O_NONBLOCK cleared again after the
// assignment, and vectors taken away mid-traffic.
func TestHostileInterruptDescriptors(t *testing.T) {
	e := newEnv(t)
	a, b := e.pair(vmPeer, vmEvil) // b is the hostile one
	// Descriptors that are not eventfds are refused.
	memfd, _, err := guestRAM(4096)
	require.NoError(t, err)
	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	for _, fd := range []int{memfd, pipe[1], b.v.ramFD} {
		err := b.v.c.SetIRQs(vfiouser.IRQMSIX, msixTrigger, abi.VectorCQ, 1, nil, fd)
		require.ErrorIs(t, err, syscall.EINVAL)
	}
	for _, fd := range []int{memfd, pipe[0], pipe[1]} {
		require.NoError(t, unix.Close(fd))
	}

	// A blocking eventfd, saturated, for the CQ vector.
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	var max [8]byte
	binary.LittleEndian.PutUint64(max[:], 0xfffffffffffffffe)
	_, err = unix.Write(efd, max[:])
	require.NoError(t, err)
	require.NoError(t, b.v.c.SetIRQs(vfiouser.IRQMSIX, msixTrigger, abi.VectorCQ, 1, nil, efd))
	for round, clear := range []bool{false, true} {
		if clear {
			require.NoError(t, unix.SetNonblock(efd, false)) // the client takes O_NONBLOCK back
		}
		b.rcq.arm()
		b.qp.postRecv(uint64(round), b.mr.sge(0, 64))
		a.qp.writeSend(sendWQE(uint64(10+round)), a.mr.sge(0, 8))
		done := make(chan error, 1)
		go func() { done <- a.v.tryDoorbell(a.qp.uar, abi.UARQPOffset, abi.UARQPSend|a.qp.handle) }()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(5 * time.Second):
			var drain [8]byte
			_, _ = unix.Read(efd, drain[:]) // unblock the daemon, so the test can end
			t.Fatalf("round %d: the innocent VM's doorbell blocked on the hostile VM's eventfd", round)
		}
		requireCQE(t, a.scq.wait(), a.qp, uint64(10+round), hostverbs.WCSend, hostverbs.WCSuccess)
		requireCQE(t, b.rcq.wait(), b.qp, uint64(round), hostverbs.WCRecv, hostverbs.WCSuccess)
		require.Equal(t, []uint32{b.rcq.handle}, b.v.notifications(), "the notification is in the ring all the same")
	}

	// Vectors taken away mid-traffic: completions and notifications go
	// on, interrupts wait (pending) until a vector is assigned again.
	require.NoError(t, b.v.c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 0, 0, nil))
	b.rcq.arm()
	b.qp.postRecv(5, b.mr.sge(0, 64))
	a.qp.postSend(sendWQE(15), a.mr.sge(0, 8))
	requireCQE(t, b.rcq.wait(), b.qp, 5, hostverbs.WCRecv, hostverbs.WCSuccess)
	requireCQE(t, a.scq.wait(), a.qp, 15, hostverbs.WCSend, hostverbs.WCSuccess)
	fresh, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	require.NoError(t, err)
	require.NoError(t, b.v.c.SetIRQs(vfiouser.IRQMSIX, msixTrigger, abi.VectorCQ, 1, nil, fresh))
	// The connection's interrupt goroutine signals it, after the reply:
	// wait for it (the bound only keeps a lost interrupt from hanging).
	for {
		_, err = unix.Poll([]unix.PollFd{{Fd: int32(fresh), Events: unix.POLLIN}}, 10_000)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	require.NoError(t, err)
	var n [8]byte
	_, err = unix.Read(fresh, n[:])
	require.NoError(t, err, "the pending CQ interrupt fires on assignment")
	require.Equal(t, []uint32{b.rcq.handle}, b.v.notifications())
	require.NoError(t, unix.Close(efd))
	require.NoError(t, unix.Close(fresh))
	e.healthy()
}
