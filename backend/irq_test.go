package backend

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Trigger, called from whatever goroutine produced a completion, only sets
// a bit and wakes the connection's signaller: it returns at once however
// many vectors are raised and whatever the signaller is doing, and the
// signaller stops with the connection.
func TestFnIRQTriggerNeverBlocks(t *testing.T) {
	i := newFnIRQ() // no function yet: the signaller drops what it is woken for
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
