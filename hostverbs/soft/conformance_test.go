package soft

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/conformance"
)

// TestConformance runs the providers' common suite against the soft
// transport, two devices in process (the ibverbs relay runs the same suite
// over kernel rxe in a test-bed guest).
func TestConformance(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	n := 0
	conformance.Run(t, conformance.Env{
		Open: func(t *testing.T, name string, mem *guestmem.Memory, lim hostverbs.Limits, events func(hostverbs.AsyncEvent)) (hostverbs.Device, hostverbs.GID) {
			n++
			d, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: mem, Limits: lim, Events: events, MAC: [6]byte{0x52, 0x54, 0, 0, 1, byte(n)}})
			require.NoError(t, err)
			g := hostverbs.GIDFromAddr(netip.AddrFrom4([4]byte{10, 99, byte(n >> 8), byte(n)}))
			require.NoError(t, d.SetGID(0, hostverbs.GIDEntry{GID: g, Type: hostverbs.GIDTypeRoCEv2}))
			return d, g
		},
	})
}
