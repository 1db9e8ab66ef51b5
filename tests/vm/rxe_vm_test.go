//go:build vm

package vm_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// rxeScenario runs soft-RoCE (rxe) on eth0 and the baseline tools as server (peer "")
// or as client of peer. Each tool's output is in a section named after it.
func rxeScenario(self, peer string) string {
	connect := ""
	retry := ""
	if peer != "" {
		connect = " " + peer
		retry = "pvt_retry 60 "
	}
	return fmt.Sprintf(`
pvt_rxe eth0
g=$(pvt_gid_index rxe0 %[1]s)
echo "=== devices"
ibv_devices
rdma link show
echo "gid index $g: $(cat /sys/class/infiniband/rxe0/ports/1/gids/$g) $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$g)"
echo "=== ibv_rc_pingpong"
%[3]sibv_rc_pingpong -d rxe0 -g $g -n 1000 -s 4096%[2]s
echo "=== ib_send_bw"
%[3]sib_send_bw -d rxe0 -x $g -F -n 200 -s 65536%[2]s
echo "=== ib_write_bw"
%[3]sib_write_bw -d rxe0 -x $g -F -n 200 -s 65536%[2]s
echo "=== ib_write_lat"
%[3]sib_write_lat -d rxe0 -x $g -F -n 200 -s 2%[2]s
echo "=== end"
`, self, connect, retry)
}

// TestRxeBaseline runs two guests with rxe over the bridge: ibv_rc_pingpong (RoCE v2,
// IPv4 GID), ib_send_bw and ib_write_bw. The figures are the baseline our device is
// compared with, and rxe is the soft transport's interop peer.
func TestRxeBaseline(t *testing.T) {
	t.Parallel() // its own network; overlaps TestHarnessTimeout's wait
	img := image(t)
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{HostAddr: "10.77.0.254/24"})
	require.NoError(t, err)
	mods := []string{"ib_core", "ib_uverbs"}
	vms, err := vm.StartAll(ctx, t, img, nw,
		vm.Config{Name: "rxe1", Modules: mods, Timeout: 4 * time.Minute,
			NICs:     []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:01", IP: "10.77.0.1/24"}},
			Scenario: rxeScenario("10.77.0.1", "")},
		vm.Config{Name: "rxe2", Modules: mods, Timeout: 4 * time.Minute,
			NICs:     []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:02", IP: "10.77.0.2/24"}},
			Scenario: rxeScenario("10.77.0.2", "10.77.0.1")},
	)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)

	for i, r := range res {
		self := fmt.Sprintf("10.77.0.%d", i+1)
		dev := vm.Section(r.Output, "devices")
		require.Contains(t, dev, "rxe0")
		require.Contains(t, dev, "0000:0000:0000:0000:0000:ffff:0a4d:000"+fmt.Sprint(i+1)+" RoCE v2", "RoCE v2 IPv4 GID")

		pp, err := vm.ParsePingPong(vm.Section(r.Output, "ibv_rc_pingpong"))
		require.NoError(t, err, "%s ibv_rc_pingpong", r.VM)
		require.EqualValues(t, 1000, pp.Iters)
		require.EqualValues(t, 2*1000*4096, pp.Bytes, "rc_pingpong counts both directions")
		require.Positive(t, pp.Mbps)
		t.Logf("BASELINE rxe ibv_rc_pingpong 4096B vm=%s side=%s Mbps=%.2f usec_per_iter=%.2f",
			r.VM, side(i), pp.Mbps, pp.UsecPerIter)
		require.Contains(t, vm.Section(r.Output, "ibv_rc_pingpong"), "::ffff:"+self)

		for _, tool := range []string{"ib_send_bw", "ib_write_bw"} {
			bw, err := vm.ParsePerftestBW(vm.Section(r.Output, tool))
			require.NoError(t, err, "%s %s:\n%s", r.VM, tool, vm.Section(r.Output, tool))
			require.Len(t, bw, 1)
			require.EqualValues(t, 65536, bw[0].Bytes)
			require.Positive(t, bw[0].AvgMBps)
			t.Logf("BASELINE rxe %s 65536B vm=%s side=%s avg_MBps=%.2f peak_MBps=%.2f msg_rate_Mpps=%.6f",
				tool, r.VM, side(i), bw[0].AvgMBps, bw[0].PeakMBps, bw[0].MsgRateMpps)
		}
		lat, err := vm.ParsePerftestLat(vm.Section(r.Output, "ib_write_lat"))
		require.NoError(t, err, "%s ib_write_lat", r.VM)
		require.Len(t, lat, 1)
		require.Positive(t, lat[0].Typical)
		t.Logf("BASELINE rxe ib_write_lat 2B vm=%s side=%s typical_usec=%.2f avg_usec=%.2f p99_usec=%.2f",
			r.VM, side(i), lat[0].Typical, lat[0].Avg, lat[0].P99)
	}
	t.Logf("TIMING rxe pair: %s total=%v, %s total=%v", res[0].VM, res[0].Timings.Total.Round(time.Millisecond),
		res[1].VM, res[1].Timings.Total.Round(time.Millisecond))
	require.Contains(t, res[1].Output, "=== end")
}

func side(i int) string {
	if i == 0 {
		return "server"
	}
	return "client"
}
