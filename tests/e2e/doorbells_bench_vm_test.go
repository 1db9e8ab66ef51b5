//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/proc"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// doorbellStep is one workload of BenchmarkDoorbells: ops is how many
// operations (iterations, messages) its client makes, the divisor of the
// doorbells counted over it.
type doorbellStep struct {
	name, server, client string
	ops                  int
}

// doorbellSteps are the workloads the issue names, latency and message
// rate first. UCX runs over rc_verbs with its defaults (busy polling).
var doorbellSteps = []doorbellStep{
	{"ib_write_lat", "ib_write_lat -d $dev -x $g -F -n 2000 -s 2", "ib_write_lat -d $dev -x $g -F -n 2000 -s 2 $peer", 2000},
	{"ib_send_bw", "ib_send_bw -d $dev -x $g -F -n 20000 -s 64", "ib_send_bw -d $dev -x $g -F -n 20000 -s 64 $peer", 20000},
	{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 2000 -s 64", "ibv_rc_pingpong -d $dev -g $g -n 2000 -s 64 $peer", 2000},
	{"rc_pingpong_events", "ibv_rc_pingpong -d $dev -g $g -n 1000 -s 64 -e", "ibv_rc_pingpong -d $dev -g $g -n 1000 -s 64 -e $peer", 1000},
	{"ucx_am_lat", "ucx_perftest -d $dev:1 -p 13700", "ucx_perftest -d $dev:1 -p 13700 -x rc_verbs -t am_lat -s 8 -n 2000 -w 100 -D bcopy $peer", 2100},
}

// doorbellIdle is how long both guests hold an idle user context (an
// ibv_rc_pingpong server waiting for its client) while the daemon's CPU
// time is read.
const doorbellIdle = 10 * time.Second

// doorbellScenario is one side's scenario: the idle window ("=== idle",
// "=== idle-end"), each doorbellStep ("=== NAME", then "rc=N"), then
// NVMe-oF at queue depth 1 (vm.StorageScenario), then "=== end".
func doorbellScenario(dev, self, peer string, server bool) (string, error) {
	var b strings.Builder
	if dev == "rxe0" {
		b.WriteString("pvt_rxe eth0\n")
	}
	fmt.Fprintf(&b, "dev=%s\nself=%s\npeer=%s\ng=$(pvt_gid_index $dev $self)\n", dev, self, peer)
	idle := int(doorbellIdle / time.Second)
	fmt.Fprintf(&b, "timeout %d ibv_rc_pingpong -d $dev -g $g -p 18700 >/dev/null 2>&1 &\nsleep 2\n", idle+6)
	fmt.Fprintf(&b, "echo '=== idle'\nsleep %d\necho '=== idle-end'\nwait\n", idle)
	for _, s := range doorbellSteps {
		cmd := "timeout 300 " + perftestQPTimeout(s.server)
		if !server {
			cmd = "pvt_retry 60 timeout 300 " + perftestQPTimeout(s.client)
		}
		if strings.HasPrefix(s.name, "ucx") {
			if env := ucxDevEnv[dev]; env != "" {
				cmd = strings.Replace(cmd, "ucx_perftest", "env "+env+" ucx_perftest", 1)
			}
		}
		fmt.Fprintf(&b, "echo '=== %s'\nif %s; then echo rc=0; else echo rc=$?; fi\nsleep 1\n", s.name, cmd)
	}
	st, err := vm.StorageScenario(server, dev, self, peer, 16, vm.StorageRun{Kind: vm.StorageNVMe, Secs: 10, Bench: true})
	if err != nil {
		return "", err
	}
	b.WriteString(strings.TrimPrefix(st, "pvt_rxe eth0\n"))
	return b.String(), nil
}

// doorbellFigures is what one pair of guests measured.
type doorbellFigures struct {
	// figures by step: latency (us), message rate (kpps), time per
	// iteration (us), NVMe QD1 IOPS.
	fig map[string]float64
	// per step, over both VMs: trapped and memory doorbells per operation.
	trapped, memory map[string]float64
	// the daemon's CPU per VM, in cores (1 = one core busy), idle and
	// over the workloads.
	idleCPU, busyCPU float64
}

// ucxFinalRE is ucx_perftest's last line: iterations, then latency p50,
// average and overall (us), bandwidth and message rate.
var ucxFinalRE = regexp.MustCompile(`(?m)^Final:\s+\d+\s+([\d.]+)\s+([\d.]+)`)

// doorbellPair runs doorbellScenario on two guests over dev: "rxe" (kernel
// rxe in the guests) or our device in the doorbell mode mode (a daemon
// process of its own, whose CPU time and counters are read at the
// scenario's marks).
func doorbellPair(b *testing.B, img *vm.Image, bin, mode string) doorbellFigures {
	ctx := context.Background()
	nw, err := vm.NewNetwork(b, vm.NetworkConfig{})
	require.NoError(b, err)
	names := [2]string{"d" + mode[:1] + "1", "d" + mode[:1] + "2"}
	ips := [2]string{"10.77.0.1", "10.77.0.2"}
	dev := "vmw_pvrdma0"
	if mode == "rxe" {
		dev = "rxe0"
	}
	var dir string
	pid := 0
	if mode != "rxe" {
		dir, pid = daemonProcess(b, bin, names[0]+",doorbells="+mode, names[1]+",doorbells="+mode)
	}
	var cfgs [2]vm.Config
	for i := range cfgs {
		sc, err := doorbellScenario(dev, ips[i], ips[1-i], i == 0)
		require.NoError(b, err)
		if mode == "rxe" {
			cfgs[i] = vm.Config{Name: names[i], NICs: []vm.NIC{{Addr: "05.0", MAC: backend.DefaultMAC(names[i]).String(), IP: ips[i] + "/24"}}, Scenario: sc}
		} else {
			cfgs[i] = pvrdmaGuestIn(dir, names[i], ips[i]+"/24", sc)
			cfgs[i].KnownWarnings = vm.CrashWarnings()
		}
		cfgs[i].Modules = slices.Concat(rdmaCMModules, []string{"crc32_generic", "udp_tunnel", "ip6_udp_tunnel", "rdma_rxe"})
		cfgs[i].Layers = []vm.Layer{vm.LayerStorage, vm.LayerUCX}
		cfgs[i].NoErrExit, cfgs[i].Timeout, cfgs[i].QuietConsole = true, 20*time.Minute, true
		cfgs[i].MemLock = true // as production runs them
	}
	vms, err := vm.StartAll(ctx, b, img, nw, cfgs[0], cfgs[1])
	require.NoError(b, err)

	f := doorbellFigures{fig: map[string]float64{}, trapped: map[string]float64{}, memory: map[string]float64{}}
	var ctl *backend.ControlClient
	if dir != "" {
		ctl = backend.NewControlClient(filepath.Join(dir, "control.sock"))
	}
	type mark struct {
		at       time.Time
		cpu      time.Duration
		tr, mem  uint64
		hasCount bool
	}
	// at waits for the client's mark and reads the daemon's CPU time and
	// doorbell counters (both VMs).
	at := func(name string) mark {
		require.NoError(b, vm.WaitMarked(15*time.Minute, "=== "+name+"\n", vms[1]), "mark %s", name)
		m := mark{at: time.Now()}
		if pid == 0 {
			return m
		}
		c, err := proc.TreeCPU(pid)
		require.NoError(b, err)
		m.cpu = c
		st, err := ctl.Status(ctx)
		require.NoError(b, err)
		for _, v := range st.VMs {
			for k, n := range v.Counters {
				switch {
				case strings.HasPrefix(k, "trapped_") && strings.HasSuffix(k, "_doorbells"):
					m.tr += n
				case strings.HasPrefix(k, "memory_") && strings.HasSuffix(k, "_doorbells") && k != "memory_bad_doorbells":
					m.mem += n
				}
			}
		}
		m.hasCount = true
		return m
	}
	perCore := func(a, z mark) float64 {
		return float64(z.cpu-a.cpu) / float64(z.at.Sub(a.at)) / 2 // two VMs
	}
	idle := at("idle")
	idleEnd := at("idle-end")
	f.idleCPU = perCore(idle, idleEnd)
	prev := at(doorbellSteps[0].name)
	first := prev
	for i, s := range doorbellSteps {
		next := vm.StorageNVMe
		if i+1 < len(doorbellSteps) {
			next = doorbellSteps[i+1].name
		}
		m := at(next)
		if m.hasCount {
			f.trapped[s.name] = float64(m.tr-prev.tr) / float64(s.ops)
			f.memory[s.name] = float64(m.mem-prev.mem) / float64(s.ops)
		}
		prev = m
	}
	f.busyCPU = perCore(first, prev)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(b, err)

	out := res[1].Output // the client's view
	for _, s := range doorbellSteps {
		sec := vm.Section(out, s.name)
		require.Contains(b, sec, "rc=0", "%s over %s:\n%s\nserver:\n%s", s.name, mode, sec, vm.Section(res[0].Output, s.name))
		switch s.name {
		case "ib_write_lat":
			lat, err := vm.ParsePerftestLat(sec)
			require.NoError(b, err, "%s", sec)
			f.fig[s.name] = lat[0].Typical
		case "ib_send_bw":
			bw, err := vm.ParsePerftestBW(sec)
			require.NoError(b, err, "%s", sec)
			f.fig[s.name] = bw[0].MsgRateMpps * 1000 // kpps: TCG's rates are far below 1 Mpps
		case "rc_pingpong", "rc_pingpong_events":
			pp, err := vm.ParsePingPong(sec)
			require.NoError(b, err, "%s", sec)
			f.fig[s.name] = pp.UsecPerIter
		case "ucx_am_lat":
			m := ucxFinalRE.FindStringSubmatch(sec)
			require.NotNil(b, m, "ucx_perftest's Final line:\n%s", sec)
			f.fig[s.name], _ = strconv.ParseFloat(m[1], 64)
		}
	}
	st, err := vm.ParseStorageBench(vm.Section(out, vm.StorageNVMe))
	require.NoError(b, err, "%s", vm.Section(out, vm.StorageNVMe))
	f.fig["nvme_qd1_read"], f.fig["nvme_qd1_write"] = st.RandReadIOPS, st.RandWriteIOPS
	return f
}

// BenchmarkDoorbells compares the two doorbell modes in stock guests,
// with kernel rxe in the same kind of guests as the reference, in one run:
// each pair of guests (rxe; our device with doorbells trapped; our device
// with doorbells in memory) runs ib_write_lat 2 B, ib_send_bw 64 B (its
// message rate), ibv_rc_pingpong 64 B busy-polling and event-driven (-e),
// UCX's am_lat over rc_verbs, and NVMe-oF 4 KiB random reads and writes at
// queue depth 1. It prints each figure, the ratio of each mode to rxe, the
// doorbells the daemon trapped (each a VM exit plus a vfio-user round trip)
// and saw in memory per operation, and the daemon's CPU per VM while the
// guests hold an idle context and over the workloads:
//
//	go test -tags vm -run '^$' -bench Doorbells -benchtime 1x -timeout 60m ./tests/e2e
//
// The kernel's consumers (NVMe-oF) ring on UAR page 0, which stays
// trapped in both modes.
func BenchmarkDoorbells(b *testing.B) {
	img := image(b)
	bin := buildDaemon(b)
	for i := 0; i < b.N; i++ {
		figs := map[string]doorbellFigures{}
		for _, mode := range []string{"rxe", "trapped", "memory"} {
			figs[mode] = doorbellPair(b, img, bin, mode)
		}
		printDoorbells(b, figs)
	}
}

// printDoorbells prints BenchmarkDoorbells' tables and reports the memory
// mode's gains over the trapped one as metrics.
func printDoorbells(b *testing.B, figs map[string]doorbellFigures) {
	w := os.Stdout
	rows := []struct {
		key, label, unit string
		higherBetter     bool
	}{
		{"ib_write_lat", "ib_write_lat 2 B, typical", "us", false},
		{"ib_send_bw", "ib_send_bw 64 B, message rate", "kpps", true},
		{"rc_pingpong", "ibv_rc_pingpong 64 B, per iteration", "us", false},
		{"rc_pingpong_events", "ibv_rc_pingpong -e 64 B, per iteration", "us", false},
		{"ucx_am_lat", "ucx_perftest am_lat rc_verbs 8 B, p50", "us", false},
		{"nvme_qd1_read", "NVMe-oF 4 KiB random read QD1", "IOPS", true},
		{"nvme_qd1_write", "NVMe-oF 4 KiB random write QD1", "IOPS", true},
	}
	// x is how many times better than rxe (above 1: better).
	x := func(key string, higherBetter bool, mode string) float64 {
		r, o := figs["rxe"].fig[key], figs[mode].fig[key]
		if r == 0 || o == 0 {
			return 0
		}
		if higherBetter {
			return o / r
		}
		return r / o
	}
	fmt.Fprintf(w, "\n%-40s %12s %12s %12s %9s %9s %10s\n", "workload (client side, TCG guests)", "rxe", "trapped", "memory",
		"trap/rxe", "mem/rxe", "mem/trap")
	for _, r := range rows {
		t, m := x(r.key, r.higherBetter, "trapped"), x(r.key, r.higherBetter, "memory")
		gain := 0.0
		if t > 0 {
			gain = m / t
		}
		fmt.Fprintf(w, "%-40s %7.4g %-4s %7.4g %-4s %7.4g %-4s %8.2fx %8.2fx %9.2fx\n", r.label,
			figs["rxe"].fig[r.key], r.unit, figs["trapped"].fig[r.key], r.unit, figs["memory"].fig[r.key], r.unit, t, m, gain)
		b.ReportMetric(gain, "x_mem_vs_trap_"+r.key)
	}
	fmt.Fprintf(w, "(ratios: how many times better than rxe in the same run, above 1 better; mem/trap: the memory mode's gain)\n")
	fmt.Fprintf(w, "\n%-40s %12s %12s %12s %12s\n", "doorbells per operation (both VMs)", "trapped: trap", "trapped: mem", "memory: trap", "memory: mem")
	for _, s := range doorbellSteps {
		fmt.Fprintf(w, "%-40s %12.2f %12.2f %12.2f %12.2f\n", s.name, figs["trapped"].trapped[s.name], figs["trapped"].memory[s.name],
			figs["memory"].trapped[s.name], figs["memory"].memory[s.name])
	}
	fmt.Fprintf(w, "(trap: doorbells the daemon trapped, each a VM exit and a vfio-user round trip; mem: seen in memory)\n")
	fmt.Fprintf(w, "\n%-40s %12s %12s\n", "daemon CPU per VM (cores)", "trapped", "memory")
	fmt.Fprintf(w, "%-40s %12.3f %12.3f\n", fmt.Sprintf("idle context (%s)", doorbellIdle), figs["trapped"].idleCPU, figs["memory"].idleCPU)
	fmt.Fprintf(w, "%-40s %12.3f %12.3f\n", "over the workloads", figs["trapped"].busyCPU, figs["memory"].busyCPU)
	b.ReportMetric(figs["memory"].idleCPU, "mem_idle_cores/vm")
	b.ReportMetric(figs["memory"].busyCPU, "mem_busy_cores/vm")
}
