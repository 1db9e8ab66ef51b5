package hostile

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// daemonBinary builds the daemon into a temporary directory of tb.
func daemonBinary(tb testing.TB) string {
	tb.Helper()
	bin := filepath.Join(tb.TempDir(), "pvrdma-backend")
	root, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	require.NoError(tb, err)
	build := exec.Command("go", "build", "-o", bin, "./cmd/pvrdma-backend")
	build.Dir = strings.TrimSpace(string(root))
	out, err := build.CombinedOutput()
	require.NoError(tb, err, "go build:\n%s", out)
	return bin
}

// daemonOpts are how serveProcess runs its daemon; the zero value is a
// daemon of its own build without a fabric, in this network namespace.
type daemonOpts struct {
	bin   string   // the binary (daemonBinary); built if empty
	netns string   // a named network namespace (ip netns) to run in
	args  []string // more serve flags, e.g. --fabric-netdev
}

// serveProcess runs `pvrdma-backend serve --keep-state` with the given
// --vm values (NAME[,gid-allow=...]) in a socket directory of its own and
// returns the directory: a live upgrade execs the binary, which the daemon
// inside a test process cannot do. The daemon is stopped at cleanup and
// its log shown if tb failed. HOSTILE_LOG set: the log is at level info;
// set to a path, it is written there.
func serveProcess(tb testing.TB, vms []string, o daemonOpts) string {
	tb.Helper()
	if o.bin == "" {
		o.bin = daemonBinary(tb)
	}
	dir := filepath.Join(tb.TempDir(), "sock")
	level := "warn"
	if os.Getenv("HOSTILE_LOG") != "" {
		level = "info"
	}
	args := []string{o.bin, "serve", "--socket-dir", dir, "--keep-state", "--log-level", level}
	for _, v := range vms {
		args = append(args, "--vm", v)
	}
	args = append(args, o.args...)
	if !slices.Contains(o.args, "--gid-allow") {
		// The fabric's declared pool (without one a VM binds only its
		// link-local GID): the private ranges the tests' VMs bind in.
		args = append(args, "--gid-allow", backend.PrivateGIDAllow)
	}
	if o.netns != "" {
		// ip execs the daemon in the namespace: the PID, and with it the
		// signals below and the death signal, are the daemon's.
		args = append([]string{"ip", "netns", "exec", o.netns}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	// A benchmark killed before its cleanup takes its daemon with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if path := os.Getenv("HOSTILE_LOG"); strings.HasPrefix(path, "/") {
		// HOSTILE_LOG=/path: the daemons' logs go to that file whole
		// (test output truncates long logs).
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		require.NoError(tb, err)
		tb.Cleanup(func() { f.Close() })
		cmd.Stdout, cmd.Stderr = f, f
	}
	require.NoError(tb, cmd.Start())
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if tb.Failed() {
			tb.Logf("log of the daemon of %s:\n%s", dir, logs.String())
		}
	})
	return dir
}

// upgradeDaemon hands the daemon behind ctl over to its own binary and
// waits (up to a minute) until the new image serves: its hand-over
// generation is gen and, if it took VMs, its pause is known. It returns
// the new image's hand-over status.
func upgradeDaemon(tb testing.TB, ctl *backend.ControlClient, gen int) backend.HandoverStatus {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(tb, ctl.Upgrade(ctx, ""))
	var h *backend.HandoverStatus
	for h == nil || h.Generation < gen || (h.PauseMS == 0 && h.VMs > 0) {
		time.Sleep(20 * time.Millisecond)
		if st, err := ctl.Status(ctx); err == nil {
			h = st.Handover
		}
		require.NoError(tb, ctx.Err(), "the new daemon did not serve: last hand-over status %+v", h)
	}
	return *h
}

// BenchmarkHandover (make bench-handover) measures the guest-visible pause
// of a live upgrade with N VMs of the fake driver: N/2 pairs stream RDMA
// WRITEs (as BenchmarkScale) and a probe pair times single WRITEs while
// the daemon hands itself over (pvrdma-backend upgrade, exec of its own
// binary). It reports the daemon's pause (hold to the last device
// rebuilt) and its parts with the CPU time each took (HandoverStatus),
// the probe's longest doorbell-to-CQE time across the hand-over against
// its median over the run (the reference, same run), and that every
// stream carried on without an error completion.
func BenchmarkHandover(b *testing.B) {
	for _, n := range handoverVMs(b) {
		b.Run(fmt.Sprintf("vms=%d", n), func(b *testing.B) {
			for range b.N {
				h, probeMax, probeMed := runHandover(b, n)
				pause, continued := h.PauseMS, h.Continued
				b.ReportMetric(pause, "pause_ms")
				b.ReportMetric(probeMax.Seconds()*1e3, "probe_max_ms")
				b.ReportMetric(probeMed.Seconds()*1e3, "probe_p50_ms")
				b.ReportMetric(float64(continued), "qps_continued")
				b.ReportMetric(h.SaveMS, "save_ms")
				b.ReportMetric(h.StartMS, "start_ms")
				b.ReportMetric(h.ResumeMS, "resume_ms")
				b.Logf("vms=%d: hand-over pause %.1f ms (daemon); probe WRITE longest %.1f ms across it, median %.3f ms (%.0fx); RC QPs kept %d",
					n, pause, probeMax.Seconds()*1e3, probeMed.Seconds()*1e3, probeMax.Seconds()/probeMed.Seconds(), continued)
				b.Logf("vms=%d: the pause's parts: saving %.1f ms (holding %.1f, draining %.1f; CPU %.1f ms), "+
					"the new binary starting %.1f ms (exec and runtime start %.1f; CPU %.1f ms), devices rebuilt %.1f ms (CPU %.1f ms)",
					n, h.SaveMS, h.HoldMS, h.DrainMS, h.SaveCPUMS, h.StartMS, h.ExecMS, h.StartCPUMS, h.ResumeMS, h.ResumeCPUMS)
			}
		})
	}
}

func runHandover(b *testing.B, n int) (h backend.HandoverStatus, probeMax, probeMed time.Duration) {
	names := make([]string, n+2)
	for i := range names {
		names[i] = fmt.Sprintf("h%03d", i)
	}
	dir := serveProcess(b, names, daemonOpts{})
	e := externalEnv(b, dir)
	eps := make([]*endpoint, len(names))
	for i := 0; i < len(names); i += 2 {
		eps[i], eps[i+1] = e.pairGIDs(names[i], names[i+1], byte(i+1), byte(i+2), 12, 7)
	}
	var stop atomic.Bool
	bytes := make([]atomic.Int64, n)
	errs := make(chan error, n+1)
	var wg sync.WaitGroup
	for i := range n {
		src, dst := eps[i], eps[i^1]
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := streamWrites(src, dst, &stop, &bytes[i]); err != nil {
				errs <- fmt.Errorf("VM %s: %w", src.v.name, err)
			}
		}()
	}
	var lat []time.Duration
	wg.Add(1)
	go func() {
		defer wg.Done()
		var err error
		lat, err = probeWrites(eps[n], eps[n+1], &stop)
		if err != nil {
			errs <- fmt.Errorf("probe: %w", err)
		}
	}()
	stopped := false
	defer func() { // a failure below must not unmap guest RAM under the drivers
		if !stopped {
			stop.Store(true)
			wg.Wait()
		}
	}()
	time.Sleep(time.Second)
	h = upgradeDaemon(b, e.ctl, 1)
	time.Sleep(time.Second)
	stop.Store(true)
	wg.Wait()
	stopped = true
	close(errs)
	for err := range errs {
		b.Error(err)
	}
	require.NotEmpty(b, lat)
	probeMed = median(lat) // the hand-over's few probes do not move it
	for _, d := range lat {
		probeMax = max(probeMax, d)
	}
	return h, probeMax, probeMed
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// handoverVMs are the VM counts of BenchmarkHandover (PVRDMA_HANDOVER_N,
// e.g. 8, to run one).
func handoverVMs(b *testing.B) []int {
	s := os.Getenv("PVRDMA_HANDOVER_N")
	if s == "" {
		return []int{2, 8, 32}
	}
	var ns []int
	for _, f := range strings.Split(s, ",") {
		var n int
		if _, err := fmt.Sscan(f, &n); err != nil || n < 2 || n%2 != 0 || n > 64 {
			b.Fatalf("PVRDMA_HANDOVER_N: %q: want even VM counts of 2..64", f)
		}
		ns = append(ns, n)
	}
	return ns
}

// daemonCounter returns one device counter of VM vm, as the daemon behind
// ctl reports it.
func daemonCounter(t *testing.T, ctl *backend.ControlClient, vm, counter string) uint64 {
	t.Helper()
	st, err := ctl.Status(context.Background())
	require.NoError(t, err)
	for _, v := range st.VMs {
		if v.Name == vm {
			return v.Counters[counter]
		}
	}
	t.Fatalf("no VM %s", vm)
	return 0
}

// TestUpgradeRefusedServesOn: a binary that cannot take the daemon's state
// (here one that answers check-state with a refusal) is not exec'd: the
// daemon holds nothing, says why in status, and its VMs' RDMA carries on;
// a real hand-over after it works, and the QPs keep their connection.
func TestUpgradeRefusedServesOn(t *testing.T) {
	dir := serveProcess(t, []string{"r0", "r1"}, daemonOpts{})
	e := externalEnv(t, dir)
	a, b := e.pairGIDs("r0", "r1", 1, 2, 12, 7)
	write := func(n int) {
		t.Helper()
		var stop atomic.Bool
		var done atomic.Int64
		go func() {
			for done.Load() < int64(n)*scaleMsg {
				time.Sleep(time.Millisecond)
			}
			stop.Store(true)
		}()
		require.NoError(t, streamWrites(a, b, &stop, &done))
	}
	write(20)
	bad := filepath.Join(t.TempDir(), "old-daemon")
	require.NoError(t, os.WriteFile(bad, []byte("#!/bin/sh\necho 'journal version 2, this daemon reads 1' >&2\nexit 1\n"), 0o755))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ctl := backend.NewControlClient(filepath.Join(dir, "control.sock"))
	require.NoError(t, ctl.Upgrade(ctx, bad))
	var st backend.Status
	require.Eventually(t, func() bool {
		var err error
		st, err = ctl.Status(ctx)
		return err == nil && st.Handover != nil && st.Handover.Error != ""
	}, 30*time.Second, 20*time.Millisecond)
	require.Contains(t, st.Handover.Error, "cannot take this daemon's state")
	require.Contains(t, st.Handover.Error, "journal version 2")
	require.Zero(t, st.Handover.Generation, "no hand-over happened")
	write(20) // the VMs were never held

	doorbells := daemonCounter(t, ctl, "r0", "doorbells")
	require.NotZero(t, doorbells)
	h := upgradeDaemon(t, ctl, 1)
	require.Equal(t, 2, h.Continued, "both RC QPs kept their connection")
	require.GreaterOrEqual(t, daemonCounter(t, ctl, "r0", "doorbells"), doorbells, "the counters carried over")
	write(20)
}

// TestUpgradeExecFailsServesOn: a hand-over whose exec fails after the VMs
// were held, drained and their RC QPs' transport state saved (here a
// binary that passes check-state and then makes itself unexecutable)
// undoes its stages: the daemon releases its VMs, the frozen QPs take
// packets again, their RDMA carries on, and a real hand-over after it
// keeps the QPs' connection.
func TestUpgradeExecFailsServesOn(t *testing.T) {
	dir := serveProcess(t, []string{"x0", "x1"}, daemonOpts{})
	e := externalEnv(t, dir)
	a, b := e.pairGIDs("x0", "x1", 1, 2, 12, 7)
	write := func(n int) {
		t.Helper()
		var stop atomic.Bool
		var done atomic.Int64
		go func() {
			for done.Load() < int64(n)*scaleMsg {
				time.Sleep(time.Millisecond)
			}
			stop.Store(true)
		}()
		require.NoError(t, streamWrites(a, b, &stop, &done))
	}
	write(20)
	vanishing := filepath.Join(t.TempDir(), "vanishing-daemon")
	require.NoError(t, os.WriteFile(vanishing, []byte("#!/bin/sh\nchmod a-x \"$0\"\necho '"+backend.FeaturesLine()+"'\n"), 0o755))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ctl := backend.NewControlClient(filepath.Join(dir, "control.sock"))
	require.NoError(t, ctl.Upgrade(ctx, vanishing))
	var st backend.Status
	require.Eventually(t, func() bool {
		var err error
		st, err = ctl.Status(ctx)
		return err == nil && st.Handover != nil && st.Handover.Error != ""
	}, 30*time.Second, 20*time.Millisecond)
	require.Contains(t, st.Handover.Error, "exec "+vanishing)
	require.Zero(t, st.Handover.Generation, "no hand-over happened")
	write(20) // released, and the QPs frozen for the successor took packets again

	doorbells := daemonCounter(t, ctl, "x0", "doorbells")
	h := upgradeDaemon(t, ctl, 1)
	require.GreaterOrEqual(t, daemonCounter(t, ctl, "x0", "doorbells"), doorbells, "the counters carried over")
	require.Equal(t, 2, h.Continued, "both RC QPs kept their connection")
	write(20)
}

// TestUpgradeKeepsListeners: a hand-over passes each VM's listening
// sockets (vfio-user and QMP) to the new image, which serves on them
// without binding new ones (the socket files are the same inodes, so a
// QEMU connecting meanwhile would wait in the backlog, not be refused), and
// a QEMU that connects after it is served.
func TestUpgradeKeepsListeners(t *testing.T) {
	dir := serveProcess(t, []string{"k0", "k1"}, daemonOpts{})
	e := externalEnv(t, dir)
	// A socket file bound again may get the inode number of the one
	// removed; its birth time is new.
	born := func(path string) unix.StatxTimestamp {
		t.Helper()
		var st unix.Statx_t
		require.NoError(t, unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_BTIME|unix.STATX_INO, &st), path)
		if st.Mask&unix.STATX_BTIME == 0 {
			t.Skipf("the file system of %s keeps no birth times", path)
		}
		return st.Btime
	}
	sockets := []string{filepath.Join(dir, "k0.sock"), filepath.Join(dir, "k1.sock"), filepath.Join(dir, "k1.qmp")}
	before := map[string]unix.StatxTimestamp{}
	for _, p := range sockets {
		before[p] = born(p)
	}
	upgradeDaemon(t, e.ctl, 1)
	for _, p := range sockets {
		require.Equal(t, before[p], born(p), "%s was bound again", p)
	}
	c, err := net.Dial("unix", filepath.Join(dir, "k1.qmp"))
	require.NoError(t, err, "the QMP socket listens")
	_ = c.Close()
	a, b := e.pairGIDs("k0", "k1", 1, 2, 12, 7)
	var stop atomic.Bool
	var done atomic.Int64
	go func() {
		for done.Load() < 20*scaleMsg {
			time.Sleep(time.Millisecond)
		}
		stop.Store(true)
	}()
	require.NoError(t, streamWrites(a, b, &stop, &done), "VMs connected after the hand-over")
}

// TestUpgradeToOlderSuccessor: a successor that lists none of the newer
// hand-over features (here the daemon's own binary behind a script that
// strips vm-listeners and handover-state from check-state's answer) gets
// what an older binary takes: the PCI states and counters in the VMs'
// files, no listening sockets. Its RC QPs keep their connection and the
// counters carry over; the next hand-over, to a successor taking
// everything, works as well.
func TestUpgradeToOlderSuccessor(t *testing.T) {
	bin := daemonBinary(t)
	dir := serveProcess(t, []string{"o0", "o1"}, daemonOpts{bin: bin})
	e := externalEnv(t, dir)
	a, b := e.pairGIDs("o0", "o1", 1, 2, 12, 7)
	write := func(n int) {
		t.Helper()
		var stop atomic.Bool
		var done atomic.Int64
		go func() {
			for done.Load() < int64(n)*scaleMsg {
				time.Sleep(time.Millisecond)
			}
			stop.Store(true)
		}()
		require.NoError(t, streamWrites(a, b, &stop, &done))
	}
	write(20)
	older := filepath.Join(t.TempDir(), "older-daemon")
	script := "#!/bin/sh\nif [ \"$1\" = check-state ]; then\n" +
		"\t" + bin + " \"$@\" | sed -e 's/ " + backend.FeatureVMListeners + "//' -e 's/ " + backend.FeatureHandoverState + "//'\n" +
		"\texit 0\nfi\nexec " + bin + " \"$@\"\n"
	require.NoError(t, os.WriteFile(older, []byte(script), 0o755))
	out, err := exec.Command(older, "check-state", "--state-dir", filepath.Join(dir, "state")).Output()
	require.NoError(t, err)
	require.NotContains(t, string(out), backend.FeatureHandoverState)
	require.Contains(t, string(out), backend.FeatureFabricSockets)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ctl := backend.NewControlClient(filepath.Join(dir, "control.sock"))
	doorbells := daemonCounter(t, ctl, "o0", "doorbells")
	require.NoError(t, ctl.Upgrade(ctx, older))
	var h *backend.HandoverStatus
	for h == nil || h.Generation < 1 || h.PauseMS == 0 {
		time.Sleep(20 * time.Millisecond)
		if st, err := ctl.Status(ctx); err == nil {
			h = st.Handover
		}
		require.NoError(t, ctx.Err(), "the new daemon did not serve: last hand-over status %+v", h)
	}
	require.Equal(t, 2, h.Continued, "both RC QPs kept their connection")
	require.GreaterOrEqual(t, daemonCounter(t, ctl, "o0", "doorbells"), doorbells, "the counters carried over")
	write(20)

	h2 := upgradeDaemon(t, ctl, 2)
	require.Equal(t, 2, h2.Continued)
	write(20)
}
