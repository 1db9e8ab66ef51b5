//go:build vm

package e2e

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// tosCount counts the IPv4 TOS bytes of RoCE v2 frames from one MAC.
type tosCount struct {
	mu  sync.Mutex
	tos map[byte]int
}

func (c *tosCount) snapshot() map[byte]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[byte]int{}
	for k, v := range c.tos {
		out[k] = v
	}
	return out
}

// captureTOS counts, until the test ends, the TOS of every IPv4 RoCE v2
// frame on the network's bridge whose source MAC is src: what the daemon
// puts on the wire.
func captureTOS(t *testing.T, nw *vm.Network, src net.HardwareAddr) *tosCount {
	t.Helper()
	c := &tosCount{tos: map[byte]int{}}
	captureRoCE(t, nw, func(from net.HardwareAddr, _ vlanTag, tos byte) {
		if bytes.Equal(from, src) {
			c.mu.Lock()
			c.tos[tos]++
			c.mu.Unlock()
		}
	})
	return c
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// TestTrafficClassOnTheWire: a guest's traffic class (perftest --tclass,
// the GRH traffic class of its QP's address vector) is the IPv4 TOS of the
// RoCE v2 frames the daemon sends for it, captured on the bridge in L2 mode
// against a kernel rxe peer (issue 14's DSCP marking, end to end).
func TestTrafficClassOnTheWire(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	d := daemonIn(t, nw, backend.FabricConfig{Bridge: nw.Bridge()}, "tc1")
	caps := captureTOS(t, nw, backend.DefaultMAC("tc1"))

	const tclass = 0x6a // DSCP 26 (AF31), ECN ECT(0): the daemon's DCQCN makes its packets ECN-capable
	steps := []step{
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 100 -s 65536", "ib_write_bw -d $dev -x $g -F -n 100 -s 65536 --tclass=104 $peer"},
	}
	a := pvrdmaGuest(d, "tc1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "10.77.0.2", false, steps))
	r := vm.Config{Name: "tcrxe", Modules: []string{"ib_core", "ib_uverbs"},
		NICs:     []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:12", IP: "10.77.0.2/24"}},
		Scenario: "pvt_rxe eth0\n" + matrixScenario("rxe0", "10.77.0.2", "", true, steps)}
	res := runGuests(ctx, t, img, nw, 6*time.Minute, a, r)
	checkSteps(t, res, steps)
	got := caps.snapshot()
	t.Logf("TOS of the daemon's RoCE v2 frames for tc1 (tos: frames): %v", got)
	require.Greater(t, got[tclass], 100, "the WRITEs carry the guest's traffic class as TOS")
	for tos, n := range got {
		require.Equal(t, byte(tclass), tos, "%d frames with TOS %#x", n, tos)
	}
}
