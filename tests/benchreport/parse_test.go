package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The testdata files are real outputs of the sections' commands (short benchtimes, a
// busy machine: their figures mean nothing, their format is go test's and ours).

func parseFile(t *testing.T, name string) *Output {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	require.NoError(t, err)
	defer f.Close()
	out, err := Parse(f)
	require.NoError(t, err)
	return out
}

func result(t *testing.T, out *Output, name string) Result {
	t.Helper()
	for _, p := range out.Packages {
		for _, r := range p.Results {
			if r.Name == name {
				return r
			}
		}
	}
	t.Fatalf("no result %s", name)
	return Result{}
}

func metric(r Result, unit string) string {
	for _, m := range r.Metrics {
		if m.Unit == unit {
			return m.Value
		}
	}
	return ""
}

func TestParseTwoPackages(t *testing.T) {
	out := parseFile(t, "device.txt")
	require.False(t, out.Failed)
	require.Len(t, out.Packages, 2)
	assert.Equal(t, modulePath+"/vfiouser", out.Packages[0].Path)
	assert.Equal(t, modulePath+"/vdev", out.Packages[1].Path)
	assert.Equal(t, "AMD EPYC", out.Packages[0].CPU)
	assert.Len(t, out.Packages[0].Results, 1)
	assert.Len(t, out.Packages[1].Results, 6)
	r := result(t, out, "BenchmarkRegionWriteRoundTrip")
	assert.Equal(t, "2", r.Procs)
	assert.Equal(t, "1503", r.N)
	// Values exactly as printed, in the order printed.
	assert.Equal(t, []Metric{{"33503", "ns/op"}, {"14091", "baseline-ns/op"}, {"0.9609", "ratio"}, {"67", "B/op"}, {"0", "allocs/op"}}, r.Metrics)
	assert.Equal(t, "0.0007260", metric(result(t, out, "BenchmarkPollDoorbell"), "x_socket_rtt"))
	for _, p := range out.Packages {
		assert.Empty(t, p.Printed, "go test's own lines are not the benchmarks' output")
	}
}

func TestParseCustomMetrics(t *testing.T) {
	out := parseFile(t, "wire.txt")
	require.Len(t, out.Packages, 2)
	w := result(t, out, "BenchmarkWrite1MiBLoopback")
	assert.Equal(t, "506.47", metric(w, "MB/s"))
	assert.NotEmpty(t, metric(w, "x_gso_blast"))
	assert.NotEmpty(t, metric(w, "pkts/tx_msg"))
	assert.NotEmpty(t, metric(w, "udp_blast_delivered_%"))
	assert.Equal(t, "3390.62", metric(result(t, out, "BenchmarkRecoverIPv4ID"), "MB/s"))
}

func TestParseSubBenchmarksAndPrintedLines(t *testing.T) {
	out := parseFile(t, "scale.txt")
	require.Len(t, out.Packages, 1)
	p := out.Packages[0]
	assert.Equal(t, modulePath+"/tests/hostile", p.Path)
	s2 := result(t, out, "BenchmarkScale/vms=2")
	assert.Equal(t, "BenchmarkScale", s2.Group())
	assert.Equal(t, "vms=2", s2.Sub())
	assert.Equal(t, "-2.716", metric(s2, "busy_rss_anon_MiB/vm"), "negative values are values")
	assert.Equal(t, "0.7263", metric(result(t, out, "BenchmarkObjects"), "cq_x_last_first"))
	printed := strings.Join(p.Printed, "\n")
	// Printed before go test's package header: still this package's.
	assert.True(t, strings.HasPrefix(p.Printed[0], "OBJECTS device caps:"), p.Printed[0])
	assert.Contains(t, printed, "--- BENCH: BenchmarkScale/vms=8-2")
	assert.Contains(t, printed, "scale_test.go:63: vms=2:")
	assert.Contains(t, printed, "SCALE aggregate against vms=8 (same run)")
	assert.NotContains(t, printed, "goos:")
	assert.NotContains(t, printed, "PASS")
}

func TestParseNamesWithPunctuation(t *testing.T) {
	out := parseFile(t, "incast.txt")
	r := result(t, out, "BenchmarkIncast/DCQCN,_timer_1_ms,_alpha_period_200_us")
	assert.Equal(t, "2", r.Procs)
	assert.NotEmpty(t, metric(r, "x_mark_threshold"))
	out = parseFile(t, "hosts.txt")
	assert.Equal(t, "0.9992", metric(result(t, out, "BenchmarkManyHosts/vxlan"), "jain_streams"))
	assert.Len(t, out.Packages[0].Printed, 13)
}

// A name printed before its benchmark ran, the benchmark's own output, then the results
// on a line of their own (go test's non-verbose layout when a benchmark prints).
func TestParseResultsAfterPrintedOutput(t *testing.T) {
	in := "goos: linux\ngoarch: amd64\npkg: " + modulePath + "/tests/e2e\ncpu: AMD EPYC\n" +
		"BenchmarkVMvsRxe-2   \t\n" +
		"workload (client side, TCG guests)   rxe in guest   pvrdma   ratio\n" +
		"ib_write_bw 64 KiB      15.00 MB/s    900.00 MB/s     60.0x   >=30x\n" +
		"       1\t123456789 ns/op\t        60.00 x_ib_write_bw\n" +
		"PASS\nok  \t" + modulePath + "/tests/e2e\t99.9s\n"
	out, err := Parse(strings.NewReader(in))
	require.NoError(t, err)
	r := result(t, out, "BenchmarkVMvsRxe")
	assert.Equal(t, "1", r.N)
	assert.Equal(t, "60.00", metric(r, "x_ib_write_bw"))
	assert.Len(t, out.Packages[0].Printed, 2)
	assert.Contains(t, out.Packages[0].Printed[1], "900.00 MB/s", "a printed table row is not a result")
}

func TestParseFailure(t *testing.T) {
	in := "goos: linux\npkg: " + modulePath + "/vdev\nBenchmarkX-2 \t 10\t 5 ns/op\n--- FAIL: BenchmarkY-2\n" +
		"    y_test.go:9: boom\nFAIL\nexit status 1\nFAIL\t" + modulePath + "/vdev\t1.0s\n"
	out, err := Parse(strings.NewReader(in))
	require.NoError(t, err)
	assert.True(t, out.Failed)
	assert.True(t, out.Packages[0].Failed)
}

// BenchmarkVMvsRxe prints its table while it runs, before go test's package header, and
// the test bed's log follows the result line.
func TestParseVMSection(t *testing.T) {
	out := parseFile(t, "vm.txt")
	require.False(t, out.Failed)
	require.Len(t, out.Packages, 1)
	p := out.Packages[0]
	assert.Equal(t, modulePath+"/tests/e2e", p.Path)
	assert.Equal(t, "102.8", metric(result(t, out, "BenchmarkVMvsRxe"), "x_ib_write_bw"))
	assert.Equal(t, "679.5", metric(result(t, out, "BenchmarkGuestPerf"), "pingpong_us"))
	assert.True(t, strings.HasPrefix(p.Printed[0], "workload (client side, TCG guests)"), p.Printed[0])
	assert.Contains(t, p.Printed[1], "ib_write_bw 64 KiB")
}

func TestClipLongLines(t *testing.T) {
	short := strings.Repeat("x", maxLine)
	assert.Equal(t, short, clip(short))
	long := strings.Repeat("é", maxLine+5)
	assert.Equal(t, strings.Repeat("é", maxLine)+" … (5 more characters in the raw output)", clip(long))
}

// go test -v (the relay section) prints each benchmark's name alone before it runs, its
// log untruncated, then the whole result line.
func TestParseVerbose(t *testing.T) {
	in := "goos: linux\ngoarch: amd64\npkg: " + modulePath + "/hostverbs/ibverbs\ncpu: AMD EPYC\n" +
		"BenchmarkRelayVsPlainLibibverbs\n" +
		"    rxe_vm_test.go:142: RATIO relay/plain (medians of 3): WRITE 64K throughput 0.80x (goal >= 0.9)\n" +
		"BenchmarkRelayVsPlainLibibverbs-2   \t       1\t233768502323 ns/op\t         0.8000 x_write64k_throughput\n" +
		"BenchmarkS\nBenchmarkS/n=1\n    x_test.go:13: sub 1\nBenchmarkS/n=1-2         \t       1\t    163927 ns/op\t         1.000 v\n" +
		"PASS\nok  \t" + modulePath + "/hostverbs/ibverbs\t233.864s\n"
	out, err := Parse(strings.NewReader(in))
	require.NoError(t, err)
	assert.Equal(t, "0.8000", metric(result(t, out, "BenchmarkRelayVsPlainLibibverbs"), "x_write64k_throughput"))
	assert.Equal(t, "1.000", metric(result(t, out, "BenchmarkS/n=1"), "v"))
	assert.Equal(t, []string{"BenchmarkRelayVsPlainLibibverbs",
		"    rxe_vm_test.go:142: RATIO relay/plain (medians of 3): WRITE 64K throughput 0.80x (goal >= 0.9)",
		"BenchmarkS", "BenchmarkS/n=1", "    x_test.go:13: sub 1"}, out.Packages[0].Printed)
}

// The relay section's real -v output: the RATIO lines it logs after the guest's output
// are kept.
func TestParseRelayVerbose(t *testing.T) {
	out := parseFile(t, "relay.txt")
	require.False(t, out.Failed)
	require.Len(t, out.Packages, 1)
	assert.Equal(t, "0.8084", metric(result(t, out, "BenchmarkRelayVsPlainLibibverbs"), "x_write64k_throughput"))
	printed := strings.Join(out.Packages[0].Printed, "\n")
	assert.Equal(t, "BenchmarkRelayVsPlainLibibverbs", out.Packages[0].Printed[0])
	assert.Contains(t, printed, "RATIO relay/plain (medians of 3)")
	assert.Contains(t, printed, "RATIO relay default (event-driven: CQs armed)")
}
