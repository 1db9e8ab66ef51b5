//go:build vm

package e2e

import (
	"context"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestRelayOverRxe: the ibverbs relay end to end. Guest A runs our daemon,
// `pvrdma-backend serve --transport ibverbs --create-rxe eth0`, and the hostile
// package's test binary, whose driver plays vmw_pvrdma over vfio-user (there
// is no QEMU inside a TCG guest) on the daemon's socket, and
// is the server of ibv_rc_pingpong, ibv_ud_pingpong, rdmacheck, ib_write_bw,
// ib_read_bw and ib_atomic_bw; guest B runs the stock clients over its own
// kernel rxe. Every byte A receives is checked, and after A's
// VM disconnects `rdma resource show` counts none of its objects.
func TestRelayOverRxe(t *testing.T) {
	t.Parallel() // beside TestRoCEModeTable, which mostly waits
	img := image(t)
	bin := filepath.Join(t.TempDir(), "hostile.test")
	build := exec.Command("go", "test", "-c", "-o", bin, "./tests/hostile")
	build.Dir = repoDir(t)
	build.Env = append(build.Environ(), "CGO_ENABLED=1")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build the hostile test binary with cgo (needs gcc and libibverbs-dev: make deps): %s", out)
	daemonBin := filepath.Join(t.TempDir(), "pvrdma-backend")
	build = exec.Command("go", "build", "-o", daemonBin, "./cmd/pvrdma-backend")
	build.Dir = repoDir(t)
	build.Env = append(build.Environ(), "CGO_ENABLED=1")
	out, err = build.CombinedOutput()
	require.NoError(t, err, "build the daemon with cgo: %s", out)
	rdmacheck := filepath.Join(t.TempDir(), "rdmacheck")
	out, err = exec.Command("gcc", "-O2", "-Wall", "-o", rdmacheck,
		filepath.Join(repoDir(t), "hostverbs/soft/testdata/interop/rdmacheck.c"), "-libverbs").CombinedOutput()
	require.NoError(t, err, "build rdmacheck: %s", out)

	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	a := vm.Config{
		Name: "relaya", Modules: []string{"ib_core", "ib_uverbs"}, MemMiB: 768, Timeout: 6 * time.Minute,
		NICs:      []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:01:01", IP: "10.77.0.1/24"}},
		HostFiles: map[string]string{"/usr/bin/hostile.test": bin, "/usr/bin/pvrdma-backend": daemonBin},
		Scenario: `
modprobe crc32_generic
modprobe rdma_rxe
pvrdma-backend serve --transport ibverbs --create-rxe eth0 --socket-dir /run/pvrdma --vm peer --gid-allow 10.77.0.0/24 > /tmp/daemon.log 2>&1 &
daemon=$!
i=0
until [ -S /run/pvrdma/control.sock ]; do i=$((i+1)); [ $i -lt 100 ] || { cat /tmp/daemon.log; exit 1; }; sleep 0.1; done
pvrdma-backend status --socket-dir /run/pvrdma
rc=0
PVRDMA_RELAY_SOCKET_DIR=/run/pvrdma PVRDMA_RELAY_NETDEV=eth0 PVRDMA_RELAY_GID=10.77.0.11 PVRDMA_RELAY_ITERS=100 \
	PVRDMA_RELAY_RDMACHECK=1 PVRDMA_RELAY_PERFTEST=1 \
	/usr/bin/hostile.test -test.v -test.count=1 -test.run '^TestRelayPingPong$' -test.timeout 5m || rc=$?
kill -TERM $daemon
wait $daemon && echo "daemon exited 0" || echo "daemon exited $?"
echo "=== daemon log"
cat /tmp/daemon.log
echo "=== rdma links after"
rdma link show
exit $rc
`,
	}
	b := vm.Config{
		Name: "relayb", Modules: []string{"ib_core", "ib_uverbs"}, Timeout: 6 * time.Minute,
		NICs:      []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:01:02", IP: "10.77.0.2/24"}},
		HostFiles: map[string]string{"/usr/bin/rdmacheck": rdmacheck},
		Scenario: `
pvt_rxe eth0
g=$(pvt_gid_index rxe0 10.77.0.2)
pvt_retry 120 ibv_rc_pingpong -d rxe0 -g $g -n 100 -s 4096 10.77.0.1
echo "=== ud"
pvt_retry 120 ibv_ud_pingpong -d rxe0 -g $g -n 100 -s 1024 -r 50 -p 18516 10.77.0.1
echo "=== rdmacheck"
# rdmacheck says "FAIL connect" until guest A listens (pvt_retry does not know that message).
i=0
until rdmacheck 10.77.0.1 18520 rxe0 $g; do i=$((i+1)); [ $i -lt 60 ] || exit 1; sleep 1; done
for t in "ib_write_bw 18531" "ib_read_bw 18532" "ib_atomic_bw 18533"; do
	set -- $t
	echo "=== $1"
	pvt_retry 120 $1 -d rxe0 -x $g -F -n 200 -u 18 -p $2 10.77.0.1 # -u: see perftestQPTimeout
done
`,
	}
	ctx := context.Background()
	vms, err := vm.StartAll(ctx, t, img, nw, a, b)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	outA, outB := res[0].Output, res[1].Output
	require.Regexp(t, regexp.MustCompile(`(?m)^--- PASS: TestRelayPingPong `), outA)
	require.Regexp(t, regexp.MustCompile(`(?m)^\s*819200 bytes in [\d.]+ seconds = [\d.]+ Mbit/sec`), outB)
	require.Regexp(t, regexp.MustCompile(`(?m)^\s*100 iters in [\d.]+ seconds = [\d.]+ usec/iter`), outB)
	require.Regexp(t, regexp.MustCompile(`(?m)^\s*204800 bytes in [\d.]+ seconds = [\d.]+ Mbit/sec`), outB, "ibv_ud_pingpong")
	require.Contains(t, outB, "rdmacheck: ALL OK")
	// perftest's result rows: #bytes #iterations BW peak BW average MsgRate.
	perf := regexp.MustCompile(`(?m)^\s*(65536|8)\s+200\s+[\d.]+\s+[\d.]+\s+[\d.]+`).FindAllString(outB, -1)
	require.Len(t, perf, 3, "ib_write_bw, ib_read_bw and ib_atomic_bw each report a result row")
	for _, tool := range []string{"ib_write_bw", "ib_read_bw", "ib_atomic_bw"} {
		require.Contains(t, outA, "RELAY_PERFTEST "+tool)
	}
	t.Logf("perftest through the relay (bytes iterations peak avg MB/s, Mpps): %q", perf)
	require.Contains(t, outA, "RELAY_RDMACHECK")
	// The daemon (the CLI, stopped with SIGTERM) exited cleanly and removed
	// the rxe link it created.
	require.Contains(t, outA, "daemon exited 0")
	require.Contains(t, outA, "created rxe link")
	require.Contains(t, outA, "removed rxe link")
	// Its shutdown logged no error (closing the event descriptors ends
	// their waits on purpose).
	for _, l := range strings.Split(outA, "\n") {
		require.False(t, strings.Contains(l, "level=ERROR") && strings.Contains(l, "component=relay"), "daemon error: %s", l)
	}
	require.NotRegexp(t, regexp.MustCompile(`link rxe_eth0/`), vm.Section(outA, "rdma links after"))
	t.Logf("guest A (daemon, relay): %s", regexp.MustCompile(`RELAY_PINGPONG .*`).FindString(outA))
	t.Logf("guest A: %s", regexp.MustCompile(`RELAY_UD_PINGPONG .*`).FindString(outA))
	t.Logf("guest B (stock ibv_rc_pingpong, ibv_ud_pingpong): %q", regexp.MustCompile(`100 iters in .*`).FindAllString(outB, -1))
}
