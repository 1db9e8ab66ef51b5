package backend

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// Trigger, called from whatever goroutine produced a completion, only sets
// a bit and wakes the connection's signaller: it returns at once however
// many vectors are raised and whatever the signaller is doing, and the
// signaller stops with the connection.
func TestFnIRQTriggerNeverBlocks(t *testing.T) {
	i := newFnIRQ() // no function yet: the signaller keeps what it is woken for
	done := make(chan struct{})
	go func() {
		for n := 0; n < 100000; n++ {
			i.Trigger(n % 70) // vectors past 63 are ignored
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(hangBound): // bounds a hang only
		t.Fatal("Trigger blocked")
	}
	i.stop()
	i.Trigger(1) // after the connection: still returns
	require.Len(t, i.wake, 1)
}

// TestFnIRQKeepsWhatCameBeforeTheFunction: a device rebuilt from its
// journal raises interrupts (CQ notifications, events) before its PCI
// function exists; they are signalled once it does, not dropped (a guest
// waiting for a CQ event through a live upgrade would wait forever). Here
// the function has MSI-X on and no eventfd yet, so the vector ends up
// pending in the function, as a resumed connection's is until its
// eventfds are assigned again.
func TestFnIRQKeepsWhatCameBeforeTheFunction(t *testing.T) {
	i := newFnIRQ()
	defer i.stop()
	i.Trigger(2)
	time.Sleep(10 * time.Millisecond) // the signaller wakes with no function
	fn := msixFunction(t)
	i.setFn(fn)
	require.Eventually(t, func() bool { return fn.PendingMSIX(2) }, hangBound, time.Millisecond,
		"the vector raised before the function existed is signalled (pending: no eventfd yet)")
}

// TestFnIRQTriggerSyncSignalsBeforeReturning: TriggerSync (the device's
// command completion, raised on the goroutine answering the REQUEST write)
// reaches the function before it returns, not through the signaller, which
// may run after the write's reply: here the signaller is stopped, so only
// a synchronous signal can leave the vector pending in the function (MSI-X
// on, no eventfd yet). Before the function exists it is kept for the
// signaller like any vector.
func TestFnIRQTriggerSyncSignalsBeforeReturning(t *testing.T) {
	i := newFnIRQ()
	fn := msixFunction(t)

	i.TriggerSync(1) // no function yet: left to the signaller, which has none either
	i.stop()
	i.fn.Store(fn)
	i.TriggerSync(0)
	require.True(t, fn.PendingMSIX(0), "signalled on the caller's goroutine, before TriggerSync returned")
	require.False(t, fn.PendingMSIX(1), "the stopped signaller delivered nothing")
	require.Equal(t, uint64(1), i.syncPending.Load(), "counted as not taken by QEMU (no eventfd: pending)")
	require.Zero(t, i.syncTaken.Load())
}

// msixFunction is a PCI function with MSI-X on (3 vectors) and no eventfd
// assigned: a signalled vector stays pending in it.
func msixFunction(t *testing.T) *pcidev.Function {
	t.Helper()
	fn, err := pcidev.New(&vfiouser.Host{IRQs: &vfiouser.IRQs{}}, pcidev.Config{
		VendorID: 0x15ad, DeviceID: 0x0820, ClassCode: 0x028000,
		BARs: [6]pcidev.BAR{0: {Size: 16 << 10, Type: pcidev.BARMem32}},
		MSIX: &pcidev.MSIX{Vectors: 3, BAR: 0, TableOffset: 0, PBAOffset: 0x2000},
	})
	require.NoError(t, err)
	require.NoError(t, fn.WriteRegion(vfiouser.RegionConfig, 0x04, []byte{0x06, 0x00})) // memory, bus master
	msix := uint64(0)
	for off := uint64(0x40); off < 0x100; off += 4 {
		b := make([]byte, 1)
		require.NoError(t, fn.ReadRegion(vfiouser.RegionConfig, off, b))
		if b[0] == 0x11 {
			msix = off
			break
		}
	}
	require.NotZero(t, msix)
	require.NoError(t, fn.WriteRegion(vfiouser.RegionConfig, msix+3, []byte{0x80})) // MSI-X enable
	return fn
}
