package vfiouser_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// A client that assigns a blocking eventfd whose counter is saturated (or
// clears O_NONBLOCK on it after assigning it) must not block the device:
// an eventfd write would wait until someone reads the counter, and the
// device signals from its BAR handlers and from provider goroutines that
// serve other VMs. Trigger returns at once (the interrupt is pending
// anyway), later triggers deliver once the client reads, and the
// connection still tears down.
func TestTriggerNeverBlocksOnASaturatedEventfd(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, _ := connect(t, srv, devs)
	cfgWrite(t, c, 0x04, 0x06)                    // memory decode, bus master
	cfgWrite(t, c, 0x40+2, 0x03, 0x80)            // MSI-X on, function unmasked
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC) // blocking, as QEMU's are not
	require.NoError(t, err)
	defer unix.Close(efd)
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], 0xfffffffffffffffe) // the most an eventfd holds
	_, err = unix.Write(efd, b[:])
	require.NoError(t, err)
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, 1, nil, efd))

	trigger := func(what string) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- c.Write32(bar1, testdev.RegIRQ, 0) }()
		select {
		case err := <-done:
			require.NoError(t, err, what)
		case <-time.After(5 * time.Second):
			var drain [8]byte
			_, _ = unix.Read(efd, drain[:]) // let the blocked write finish, so teardown can
			t.Fatalf("%s: the device blocked on the client's eventfd", what)
		}
	}
	trigger("O_NONBLOCK set by the server")
	require.NoError(t, unix.SetNonblock(efd, false)) // the client takes it back
	trigger("O_NONBLOCK cleared by the client")

	_, err = unix.Read(efd, b[:])
	require.NoError(t, err)
	require.Equal(t, uint64(0xfffffffffffffffe), binary.LittleEndian.Uint64(b[:]), "saturated, unchanged")
	trigger("after the client read")
	_, err = unix.Read(efd, b[:])
	require.NoError(t, err)
	require.Equal(t, uint64(1), binary.LittleEndian.Uint64(b[:]), "delivered again")
}
