//go:build vm

package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// pairScenario runs tools on vmw_pvrdma0 as server (peer "") or client.
func pairScenario(self, peer string, tools ...string) string {
	connect, retry := "", ""
	if peer != "" {
		connect, retry = " "+peer, "pvt_retry 60 "
	}
	s := fmt.Sprintf("g=$(pvt_gid_index vmw_pvrdma0 %s)\n", self)
	for _, tool := range tools {
		s += fmt.Sprintf("echo '=== %s'\n%s%s -d vmw_pvrdma0 %s%s\n", firstWord(tool), retry, tool, gidFlag(tool), connect)
	}
	return s + "echo '=== end'\n"
}

func firstWord(s string) string {
	for i, c := range s {
		if c == ' ' {
			return s[:i]
		}
	}
	return s
}

// gidFlag is the GID-index flag of a tool (-g for the verbs examples, -x for perftest).
func gidFlag(tool string) string {
	if len(tool) > 4 && tool[:4] == "ibv_" {
		return "-g $g"
	}
	return "-x $g"
}

// TestPairRCPingpong: two VMs on one backend run ibv_rc_pingpong through our device.
func TestPairRCPingpong(t *testing.T) {
	img := image(t)
	d := daemon(t, backend.Config{}, "pv1", "pv2")
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	a := pvrdmaGuest(d, "pv1", "10.77.0.1/24", pairScenario("10.77.0.1", "", "ibv_rc_pingpong -n 1000 -s 4096"))
	b := pvrdmaGuest(d, "pv2", "10.77.0.2/24", pairScenario("10.77.0.2", "10.77.0.1", "ibv_rc_pingpong -n 1000 -s 4096"))
	a.Timeout, b.Timeout = 4*time.Minute, 4*time.Minute
	vms, err := vm.StartAll(ctx, t, img, nw, a, b)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	for _, r := range res {
		require.NoError(t, r.Err())
		pp, err := vm.ParsePingPong(vm.Section(r.Output, "ibv_rc_pingpong"))
		require.NoError(t, err, "%s:\n%s", r.VM, r.Output)
		require.EqualValues(t, 1000, pp.Iters)
		t.Logf("PVRDMA ibv_rc_pingpong 4096B vm=%s Mbps=%.2f usec_per_iter=%.2f", r.VM, pp.Mbps, pp.UsecPerIter)
	}
}
