//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/proc"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// benchSteps are the workloads compared: the targets are ratios of
// our device to rxe in the guest, measured in the same run on the same host.
var benchSteps = []step{
	{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 1000 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 1000 -s 4096 $peer"},
	{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536 $peer"},
	{"ib_send_bw", "ib_send_bw -d $dev -x $g -F -n 200 -s 65536", "ib_send_bw -d $dev -x $g -F -n 200 -s 65536 $peer"},
	{"ib_write_lat", "ib_write_lat -d $dev -x $g -F -n 500 -s 2", "ib_write_lat -d $dev -x $g -F -n 500 -s 2 $peer"},
}

// pairFigures runs benchSteps on two guests and returns the client's
// figures: Mbit/s for rc_pingpong, MB/s for the bandwidths, usec for the
// latency.
func pairFigures(b *testing.B, img *vm.Image, cfgs [2]vm.Config) map[string]float64 {
	ctx := context.Background()
	nw, err := vm.NewNetwork(b, vm.NetworkConfig{})
	require.NoError(b, err)
	for i := range cfgs {
		cfgs[i].NoErrExit = true
		cfgs[i].Timeout = 10 * time.Minute
		cfgs[i].QuietConsole = true
		cfgs[i].MemLock = true // as production runs them
	}
	vms, err := vm.StartAll(ctx, b, img, nw, cfgs[0], cfgs[1])
	require.NoError(b, err)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(b, err)
	out := res[1].Output // the client's view
	f := map[string]float64{}
	pp, err := vm.ParsePingPong(vm.Section(out, "rc_pingpong"))
	require.NoError(b, err, "%s", out)
	f["rc_pingpong"] = pp.Mbps
	for _, tool := range []string{"ib_write_bw", "ib_send_bw"} {
		bw, err := vm.ParsePerftestBW(vm.Section(out, tool))
		require.NoError(b, err, "%s", out)
		f[tool] = bw[0].AvgMBps
	}
	lat, err := vm.ParsePerftestLat(vm.Section(out, "ib_write_lat"))
	require.NoError(b, err, "%s", out)
	f["ib_write_lat"] = lat[0].Typical
	return f
}

// BenchmarkVMvsRxe compares two guests RDMA-ing through pvrdma-backend with
// two guests running rxe in the guest, in the same run:
//
//	go test -tags vm -run '^$' -bench VMvsRxe -benchtime 1x ./tests/e2e
func BenchmarkVMvsRxe(b *testing.B) {
	img := image(b)
	for i := 0; i < b.N; i++ {
		rxe := func(name, ip, peer string, server bool) vm.Config {
			return vm.Config{Name: name, Modules: []string{"ib_core", "ib_uverbs"},
				NICs:     []vm.NIC{{Addr: "05.0", MAC: backend.DefaultMAC(name).String(), IP: ip + "/24"}},
				Scenario: "pvt_rxe eth0\n" + matrixScenario("rxe0", ip, peer, server, benchSteps)}
		}
		base := pairFigures(b, img, [2]vm.Config{rxe("brx1", "10.77.0.1", "", true), rxe("brx2", "10.77.0.2", "10.77.0.1", false)})

		d := daemon(b, backend.Config{Logger: quietLogger()}, "bpv1", "bpv2")
		ours := pairFigures(b, img, [2]vm.Config{
			pvrdmaGuest(d, "bpv1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, benchSteps)),
			pvrdmaGuest(d, "bpv2", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, benchSteps)),
		})

		w := os.Stdout
		fmt.Fprintf(w, "\n%-34s %14s %14s %9s %8s\n", "workload (client side, TCG guests)", "rxe in guest", "pvrdma", "ratio", "target")
		row := func(key, label, unit string, higherBetter bool, target float64) {
			r := ours[key] / base[key]
			if !higherBetter {
				r = base[key] / ours[key]
			}
			t := "-"
			if target > 0 {
				t = fmt.Sprintf(">=%gx", target)
			}
			fmt.Fprintf(w, "%-34s %10.2f %-3s %10.2f %-3s %8.1fx %8s\n", label, base[key], unit, ours[key], unit, r, t)
			b.ReportMetric(r, "x_"+key)
		}
		row("ib_write_bw", "ib_write_bw 64 KiB", "MB/s", true, 30)
		row("rc_pingpong", "ibv_rc_pingpong -s 4096", "Mb/s", true, 3)
		row("ib_send_bw", "ib_send_bw 64 KiB", "MB/s", true, 0)
		row("ib_write_lat", "ib_write_lat 2 B (typical; lower wins)", "us", false, 0)
	}
}

// guestPerfSteps are the guest workloads of BenchmarkGuestPerf.
var guestPerfSteps = []step{
	{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 5000 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 5000 -s 4096 $peer"},
	{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 50000 -s 65536", "ib_write_bw -d $dev -x $g -F -n 50000 -s 65536 $peer"},
}

// BenchmarkGuestPerf is two stock guests through pvrdma-backend and
// nothing else, for judging a change on the device path in the guests
// (scripts/bench-ab -T vm -p ./tests/e2e -b GuestPerf -t 1x -m pingpong_us
// REV_A REV_B): TCG guests on this machine swing 1.8x between runs of the
// same binary, so one run says nothing and alternating pairs do. It
// reports the client's ibv_rc_pingpong -s 4096 time per iteration
// (pingpong_us, 5000 iterations) and ib_write_bw 64 KiB average bandwidth
// (write_MB/s, 50000 writes, seconds of traffic): a window of a fraction of
// a second (the 5000 writes it ran before) swung as much between repeats
// in one boot as between boots. The guests lock their RAM as production's
// qemu-args has them do (vm.Config.MemLock).
//
// With PVRDMA_BENCH_DAEMON=PATH the guests use a daemon binary run as a
// process of its own (`PATH serve`) instead of the daemon of this test
// binary: the guard (scripts/bench-guard) and bisections run one harness,
// this one, against daemons built from other versions. It then logs which
// daemon served the guests ("bench daemon: process exe=... sha256=...
// vcs.revision=...", from the process's /proc/PID/exe), which the guard
// checks against the binary it built for each side.
func BenchmarkGuestPerf(b *testing.B) {
	img := image(b)
	for i := 0; i < b.N; i++ {
		var dir string
		if bin := os.Getenv("PVRDMA_BENCH_DAEMON"); bin != "" {
			var pid int
			dir, pid = daemonProcess(b, bin, "gp1", "gp2")
			id, err := binaryIdentity(fmt.Sprintf("/proc/%d/exe", pid))
			require.NoError(b, err, "the daemon's binary")
			b.Logf("bench daemon: process %s", id)
		} else {
			dir = filepath.Dir(daemon(b, backend.Config{Logger: quietLogger()}, "gp1", "gp2").SocketPath("gp1"))
		}
		ctx := context.Background()
		nw, err := vm.NewNetwork(b, vm.NetworkConfig{})
		require.NoError(b, err)
		cfgs := []vm.Config{
			pvrdmaGuestIn(dir, "gp1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, guestPerfSteps)),
			pvrdmaGuestIn(dir, "gp2", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, guestPerfSteps)),
		}
		for i := range cfgs {
			cfgs[i].NoErrExit, cfgs[i].Timeout, cfgs[i].QuietConsole = true, 10*time.Minute, true
			cfgs[i].MemLock = true // as production runs them
		}
		vms, err := vm.StartAll(ctx, b, img, nw, cfgs...)
		require.NoError(b, err)
		res, err := vm.WaitAll(ctx, vms...)
		require.NoError(b, err)
		out := res[1].Output // the client's view
		pp, err := vm.ParsePingPong(vm.Section(out, "rc_pingpong"))
		require.NoError(b, err, "%s", out)
		bw, err := vm.ParsePerftestBW(vm.Section(out, "ib_write_bw"))
		require.NoError(b, err, "%s", out)
		b.ReportMetric(pp.UsecPerIter, "pingpong_us")
		b.ReportMetric(bw[0].AvgMBps, "write_MB/s")
	}
}

// daemonProcess runs `bin serve` with the named VMs registered, the test
// bed's address pool and warnings only, in the test's network namespace
// (the guests' fabric is in process), and returns its socket directory and
// its process ID. It stops at cleanup.
func daemonProcess(b testing.TB, bin string, names ...string) (string, int) {
	b.Helper()
	dir := b.TempDir()
	args := []string{"serve", "--socket-dir", dir, "--gid-allow", "10.77.0.0/24", "--log-level", "warn"}
	for _, n := range names {
		args = append(args, "--vm", n)
	}
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	done, err := proc.Start(cmd)
	require.NoError(b, err)
	b.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	require.Eventually(b, func() bool {
		_, err := os.Stat(filepath.Join(dir, "control.sock"))
		return err == nil
	}, 30*time.Second, 20*time.Millisecond, "%s serve did not start", bin)
	return dir, cmd.Process.Pid
}
