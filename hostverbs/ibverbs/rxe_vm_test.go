//go:build vm

package ibverbs

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/conformance"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestRelayOverKernelRxe builds this package's tests (cgo, against bookworm's
// libibverbs-dev, the guest's rdma-core) and runs them in a test-bed guest
// with kernel rxe on its NIC: the providers' conformance suite through the
// relay, the GID checks and the teardown count of `rdma resource show`.
func TestRelayOverKernelRxe(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "ibverbs.test")
	build := exec.Command("go", "test", "-c", "-o", bin, ".")
	build.Env = append(build.Environ(), "CGO_ENABLED=1")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build the guest's test binary (needs gcc and libibverbs-dev: make deps): %s", out)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	g, err := vm.Start(context.Background(), t, img, nil, vm.Config{
		Name:      "relay",
		Modules:   []string{"ib_core", "ib_uverbs"},
		MemMiB:    768,
		Timeout:   8 * time.Minute,
		NICs:      []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:21", IP: "10.0.2.15/24"}},
		HostFiles: map[string]string{"/usr/bin/ibverbs.test": bin},
		Scenario: `
pvt_rxe eth0
pvt_gid_index rxe0 10.0.2.15
PVRDMA_IBDEV=rxe0 /usr/bin/ibverbs.test -test.v -test.count=1 -test.timeout 6m -test.run 'TestConformanceRelay|TestUnknownGIDRefused|TestTeardownLeavesNothing|TestAliasMappingsCapped|TestUmadCMAgentVersusKernelCM'
`,
	})
	require.NoError(t, err)
	res, err := g.WaitOK(context.Background())
	require.NoError(t, err)
	for _, name := range []string{"TestConformanceRelay", "TestConformanceRelayBusyPoll", "TestUnknownGIDRefused", "TestTeardownLeavesNothing", "TestAliasMappingsCapped", "TestUmadCMAgentVersusKernelCM"} {
		require.Regexp(t, regexp.MustCompile(`(?m)^--- PASS: `+name+` `), res.Output, "%s did not pass in the guest", name)
	}
	require.NotContains(t, res.Output, "--- SKIP")
	require.NotContains(t, res.Output, "--- FAIL")
	var passed []string
	for _, l := range strings.Split(res.Output, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "--- PASS: TestConformanceRelay/") {
			passed = append(passed, strings.TrimSpace(l))
		}
	}
	t.Logf("conformance through the relay over kernel rxe:\n%s", strings.Join(passed, "\n"))
	for _, c := range conformance.Names() {
		require.Contains(t, res.Output, "--- PASS: TestConformanceRelay/"+c+" ", "the suite's case %s", c)
		require.Contains(t, res.Output, "--- PASS: TestConformanceRelayBusyPoll/"+c+" ", "the suite's case %s with busy polling", c)
	}
	require.Len(t, passed, len(conformance.Names()))
}

// benchCPUs is the relay benchmark guest's vCPU count: PVRDMA_BENCH_CPUS, or 1.
func benchCPUs() int {
	n, _ := strconv.Atoi(os.Getenv("PVRDMA_BENCH_CPUS"))
	return max(n, 1)
}

// benchEnv is extra environment for the relay's side of the benchmark
// (PVRDMA_BENCH_ENV, for example GOMAXPROCS=2), as NAME=VALUE words.
func benchEnv() string {
	var words []string
	for _, w := range strings.Fields(os.Getenv("PVRDMA_BENCH_ENV")) {
		if regexp.MustCompile(`^[A-Z_][A-Z0-9_]*=[A-Za-z0-9_.,=:-]*$`).MatchString(w) {
			words = append(words, w)
		}
	}
	return strings.Join(words, " ")
}

// BenchmarkRelayVsPlainLibibverbs runs, in one guest with kernel rxe, the
// relay's benchmarks and testdata/plainbench.c (plain libibverbs, the same
// loopback and work) and prints the ratios: 64 KiB WRITE throughput
// (relay/plain, goal >= 0.9) and 8 B SEND post-to-completion time
// (relay/plain, goal <= 1.2). Run with -benchtime 1x: each side runs its
// own fixed count.
func BenchmarkRelayVsPlainLibibverbs(b *testing.B) {
	dir := b.TempDir()
	bin := filepath.Join(dir, "ibverbs.test")
	build := exec.Command("go", "test", "-c", "-o", bin, ".")
	build.Env = append(build.Environ(), "CGO_ENABLED=1")
	out, err := build.CombinedOutput()
	require.NoError(b, err, "%s", out)
	plain := filepath.Join(dir, "plainbench")
	out, err = exec.Command("gcc", "-O2", "-Wall", "-o", plain, "testdata/plainbench.c", "-libverbs").CombinedOutput()
	require.NoError(b, err, "build plainbench (needs gcc and libibverbs-dev): %s", out)
	img, err := vm.EnsureImage(context.Background(), b.Logf)
	require.NoError(b, err)
	var res vm.Result
	for range b.N {
		g, err := vm.Start(context.Background(), b, img, nil, vm.Config{
			Name: "relaybench", Modules: []string{"ib_core", "ib_uverbs"}, MemMiB: 768, Timeout: 10 * time.Minute,
			CPUs:      benchCPUs(),
			NICs:      []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:22", IP: "10.0.2.15/24"}},
			HostFiles: map[string]string{"/usr/bin/ibverbs.test": bin, "/usr/bin/plainbench": plain},
			Scenario: `
pvt_rxe eth0
g=$(pvt_gid_index rxe0 10.0.2.15)
for round in 1 2 3; do
	plainbench rxe0 $g 2000 2000
	` + benchEnv() + ` PVRDMA_IBDEV=rxe0 ibverbs.test -test.run '^$' -test.bench 'RelayWrite64K|RelaySend8|CgoCall' -test.benchtime 2000x
done
`,
		})
		require.NoError(b, err)
		res, err = g.WaitOK(context.Background())
		require.NoError(b, err)
	}
	num := func(re string) []float64 {
		var v []float64
		for _, m := range regexp.MustCompile(re).FindAllStringSubmatch(res.Output, -1) {
			f, err := strconv.ParseFloat(m[1], 64)
			require.NoError(b, err)
			v = append(v, f)
		}
		require.Len(b, v, 3, "three rounds of %s", re)
		return v
	}
	pw, ps, pse := num(`WRITE64K ([\d.]+) MB/s`), num(`SEND8 ([\d.]+) usec`), num(`SEND8EV ([\d.]+) usec`)
	rw, rs := num(`BenchmarkRelayWrite64K(?:-\d+)?\s+\d+\s+.*?\s([\d.]+) MB/s`), num(`BenchmarkRelaySend8(?:-\d+)?\s+\d+\s+.*?\s([\d.]+) usec/send`)
	rwb, rsb := num(`BenchmarkRelayWrite64KBusyPoll(?:-\d+)?\s+\d+\s+.*?\s([\d.]+) MB/s`), num(`BenchmarkRelaySend8BusyPoll(?:-\d+)?\s+\d+\s+.*?\s([\d.]+) usec/send`)
	one := num(`BenchmarkRelaySend8OneDevice(?:-\d+)?\s+\d+\s+.*?\s([\d.]+) usec/send`)
	med := func(v []float64) float64 { s := append([]float64(nil), v...); sort.Float64s(s); return s[len(s)/2] }
	b.Logf("plain libibverbs: WRITE 64K %v MB/s, SEND 8B %v usec (receive CQ armed once: %v); relay: WRITE 64K %v MB/s, SEND 8B %v usec",
		pw, ps, pse, rw, rs)
	b.Logf("RATIO relay/plain (medians of 3): WRITE 64K throughput %.2fx (goal >= 0.9), SEND 8B post-to-completion %.2fx (goal <= 1.2)",
		med(rw)/med(pw), med(rs)/med(ps))
	b.Logf("RATIO relay with busy polling (%v)/plain: WRITE 64K throughput %.2fx (%v MB/s), SEND 8B post-to-completion %.2fx (%v usec)",
		benchBusyPoll, med(rwb)/med(pw), rwb, med(rsb)/med(ps), rsb)
	b.ReportMetric(med(rwb)/med(pw), "x_write64k_throughput_busypoll")
	b.ReportMetric(med(rsb)/med(ps), "x_send8_latency_busypoll")
	b.ReportMetric(med(rw)/med(pw), "x_write64k_throughput")
	b.ReportMetric(med(rs)/med(ps), "x_send8_latency")
	b.Logf("relay SEND 8B with both QPs on one device (one completion goroutine): %v usec, %.2fx plain", one, med(one)/med(ps))
	// What the relay's shape (a completion thread woken by events beside the
	// posting thread) costs without Go: the WRITE reference in that shape.
	pt := num(`WRITE64KTHREAD ([\d.]+) MB/s`)
	b.Logf("RATIO plain in the relay's thread shape/plain: WRITE 64K %.2fx (%v MB/s); relay/that: %.2fx",
		med(pt)/med(pw), pt, med(rw)/med(pt))
	b.ReportMetric(med(rw)/med(pt), "x_write64k_throughput_vs_plain_thread")
	armed := num(`SEND8ARMED ([\d.]+) usec`)
	b.Logf("RATIO relay default (event-driven: CQs armed)/plain with both CQs armed at every post: SEND 8B %.2fx (plain armed %v usec)", med(rs)/med(armed), armed)
	b.ReportMetric(med(rs)/med(armed), "x_send8_latency_vs_plain_armed")
	b.ReportMetric(med(one)/med(ps), "x_send8_latency_one_device")
}
