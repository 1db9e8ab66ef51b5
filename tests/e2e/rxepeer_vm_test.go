//go:build vm

package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestRxePeer: a VM on our backend and a guest running Linux rxe (a real
// RoCE v2 peer) on the same bridge. The daemon runs in L2 mode on that
// bridge: RoCE frames carry the pvrdma VM's own MAC, as the guest's ARP
// expects, so the rxe guest needs nothing special.
func TestRxePeer(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	d := daemonIn(t, nw, backend.FabricConfig{Bridge: nw.Bridge()}, "pvr1")

	steps := []step{
		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096 $peer"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536 $peer"},
		{"ib_read_bw", "ib_read_bw -d $dev -x $g -F -n 200 -s 65536", "ib_read_bw -d $dev -x $g -F -n 200 -s 65536 $peer"},
	}
	// The pvrdma VM serves; the rxe guest is the client.
	a := pvrdmaGuest(d, "pvr1", "10.77.0.1/24",
		matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps))
	r := vm.Config{Name: "rxe1", Modules: []string{"ib_core", "ib_uverbs"},
		NICs:     []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:02", IP: "10.77.0.2/24"}},
		Scenario: "pvt_rxe eth0\n" + matrixScenario("rxe0", "10.77.0.2", "10.77.0.1", false, steps)}
	res := runGuests(ctx, t, img, nw, 8*time.Minute, a, r)
	checkSteps(t, res, steps)
	t.Logf("fabric counters: %v", nonzero(d.Status().Counters))
	for i, r := range res {
		for _, tool := range []string{"ib_write_bw", "ib_read_bw"} {
			if bw, err := vm.ParsePerftestBW(vm.Section(r.Output, tool)); err == nil && len(bw) == 1 {
				t.Logf("PVRDMA-RXE %s 65536B vm=%s side=%s avg_MBps=%.2f", tool, r.VM, side(i), bw[0].AvgMBps)
			}
		}
		if pp, err := vm.ParsePingPong(vm.Section(r.Output, "rc_pingpong")); err == nil {
			t.Logf("PVRDMA-RXE ibv_rc_pingpong 4096B vm=%s Mbps=%.2f usec_per_iter=%.2f", r.VM, pp.Mbps, pp.UsecPerIter)
		}
	}
}

func nonzero(m map[string]uint64) string {
	var b strings.Builder
	for k, v := range m {
		if v != 0 {
			fmt.Fprintf(&b, "%s=%d ", k, v)
		}
	}
	return b.String()
}
