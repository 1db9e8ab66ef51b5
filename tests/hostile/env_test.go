package hostile

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// The VMs every environment registers: two the hostile cases use and two
// that prove afterwards that the daemon still serves fresh guests.
const (
	vmEvil  = "evil"
	vmPeer  = "peer"
	vmFresh = "fresh"
	vmOther = "other"
)

// resources is what a leak would show: goroutines (all of them, and
// those running the daemon's code), open descriptors and locked memory
// of this process (the daemon runs in it).
type resources struct {
	goroutines int
	daemon     int
	fds        int
	lockedKiB  int64
}

func (r resources) String() string {
	return fmt.Sprintf("%d goroutines (%d of the daemon), %d fds, VmLck %d kB", r.goroutines, r.daemon, r.fds, r.lockedKiB)
}

func measure(tb testing.TB) resources {
	tb.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(tb, err)
	return resources{goroutines: runtime.NumGoroutine(), daemon: daemonGoroutines(), fds: len(ents), lockedKiB: vmLck(tb)}
}

// daemonGoroutines counts the goroutines with a frame of the project's
// code other than this harness and the test client: the daemon's. Unlike
// the total, it does not move with the test framework's or the fuzzing
// engine's own goroutines.
func daemonGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	const mod = "github.com/pvrdma-backend/pvrdma-backend/"
	count := 0
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		for _, line := range bytes.Split(g, []byte("\n")) {
			i := bytes.Index(line, []byte(mod))
			if i < 0 || bytes.HasPrefix(line, []byte("created by")) {
				continue
			}
			rest := line[i+len(mod):]
			if !bytes.HasPrefix(rest, []byte("tests/hostile")) && !bytes.HasPrefix(rest, []byte("vfiouser/vfiousertest")) {
				count++
				break
			}
		}
	}
	return count
}

// vmLck reads VmLck (kB of mlocked memory) from /proc/self/status.
func vmLck(tb testing.TB) int64 {
	tb.Helper()
	return procStatusKB(tb, "VmLck")
}

// procStatusKB reads a kB field of /proc/self/status.
func procStatusKB(tb testing.TB, field string) int64 {
	tb.Helper()
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(tb, err)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			require.NoError(tb, err)
			return n
		}
	}
	tb.Fatalf("no %s in /proc/self/status", field)
	return 0
}

// settle waits (up to 10 s) until the process is back to base: no more
// goroutines and descriptors than then, and exactly as much locked memory.
// Goroutines of the runtime and the test framework come and go, so the
// count may end below the baseline, never above.
func settle(tb testing.TB, base resources, what string) {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	var now resources
	for {
		now = measure(tb)
		if (now.goroutines <= base.goroutines || fuzzing()) && now.daemon <= base.daemon &&
			now.fds <= base.fds && now.lockedKiB == base.lockedKiB {
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	tb.Fatalf("%s: resources not back to baseline: now %v, baseline %v\n%s\nopen fds:\n%s", what, now, base, buf, listFDs())
}

func listFDs() string {
	ents, _ := os.ReadDir("/proc/self/fd")
	var sb strings.Builder
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		fmt.Fprintf(&sb, "  %s -> %s\n", e.Name(), target)
	}
	return sb.String()
}

// env is a daemon running in this process with the test's VMs registered.
type env struct {
	t    testing.TB
	d    *backend.Daemon
	base resources // with the daemon idle: no VM connected

	// An external daemon (a `pvrdma-backend serve` process) instead of d:
	// its socket directory and control socket.
	socketDir string
	ctl       *backend.ControlClient

	mu  sync.Mutex
	vms map[*vm]struct{} // open VMs, closed at cleanup

	// shutdown stops the daemon (once) and returns what Run returned;
	// down records that a test did so on purpose.
	shutdown func() error
	down     bool
}

// status is the daemon's status, in process or through the control socket.
func (e *env) status() backend.Status {
	if e.d != nil {
		return e.d.Status()
	}
	st, err := e.ctl.Status(context.Background())
	require.NoError(e.t, err, "status of the daemon at %s", e.socketDir)
	return st
}

// externalEnv is an environment whose VMs connect to a daemon already
// serving in socketDir (a `pvrdma-backend serve` process). The leak checks
// of newEnvConfig need the daemon in this process and are not made.
func externalEnv(t testing.TB, socketDir string) *env {
	t.Helper()
	waitControl(t, socketDir+"/control.sock")
	e := &env{t: t, socketDir: socketDir, ctl: backend.NewControlClient(socketDir + "/control.sock"), vms: map[*vm]struct{}{}}
	t.Cleanup(e.closeAll)
	return e
}

// newEnv starts a daemon with the default limits.
func newEnv(t testing.TB) *env { return newEnvLimits(t, vdev.Limits{}) }

// newEnvLimits starts a daemon whose devices have the given limits. At
// cleanup every VM still open is closed, the resources must return to
// the idle baseline, the daemon stops and they must return to what they
// were before it started.
func newEnvLimits(t testing.TB, limits vdev.Limits) *env {
	t.Helper()
	return newEnvLog(t, limits, testLogger(t))
}

// newEnvLog is newEnvLimits with the daemon's logger.
func newEnvLog(t testing.TB, limits vdev.Limits, logger *slog.Logger) *env {
	t.Helper()
	return newEnvConfig(t, limits, logger, nil)
}

// newEnvConfig is newEnvLog with a last word on the daemon's configuration.
func newEnvConfig(t testing.TB, limits vdev.Limits, logger *slog.Logger, tweak func(*backend.Config)) *env {
	t.Helper()
	warmUp.Do(func() { warm(t) })
	runtime.GC()
	before := measure(t)
	dir := t.TempDir()
	// The fabric's declared pool: the private ranges the tests' guests bind in.
	pool, err := backend.ParseGIDAllow(backend.PrivateGIDAllow)
	require.NoError(t, err)
	cfg := backend.Config{SocketDir: dir, Limits: limits, Logger: logger, GIDAllow: pool}
	for _, n := range []string{vmEvil, vmPeer, vmFresh, vmOther} {
		cfg.VMs = append(cfg.VMs, backend.VMRequest{Name: n})
	}
	if tweak != nil {
		tweak(&cfg)
	}
	d, err := backend.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	e := &env{t: t, d: d, vms: map[*vm]struct{}{}}
	var once sync.Once
	var runErr error
	e.shutdown = func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := e.shutdown(); err != nil {
			t.Errorf("daemon: %v", err)
		}
		if !fuzzing() {
			settle(t, before, "after the daemon stopped")
		}
	})
	waitControl(t, dir+"/control.sock")
	e.base = steady(t)
	t.Cleanup(func() {
		e.closeAll()
		if !fuzzing() && !e.down {
			e.idle()
		}
	})
	return e
}

// warmUp runs once per process: the first daemon of a process
// initialises the runtime's network poller and other lazily created
// state, which must not count as a leak of the first test.
var warmUp sync.Once

func warm(t testing.TB) {
	dir := t.TempDir()
	d, err := backend.New(backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "warm"}},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	waitControl(t, dir+"/control.sock")
	e := &env{t: t, d: d, vms: map[*vm]struct{}{}}
	v := e.boot("warm")
	v.Close()
	cancel()
	require.NoError(t, <-done)
}

// waitControl waits until the daemon answers on its control socket, so
// that all its serving goroutines exist. The request does not keep its
// connection alive (its server goroutine would count as the baseline's).
func waitControl(t testing.TB, path string) {
	t.Helper()
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}}
	require.Eventually(t, func() bool {
		resp, err := hc.Get("http://pvrdma/v1/status")
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 5*time.Second, 5*time.Millisecond, "daemon control socket")
	hc.CloseIdleConnections()
}

// steady measures once goroutines and descriptors stop changing (the
// control request's server goroutine ends shortly after its reply).
func steady(t testing.TB) resources {
	t.Helper()
	prev := measure(t)
	for i := 0; i < 200; i++ {
		time.Sleep(10 * time.Millisecond)
		now := measure(t)
		if now == prev {
			return now
		}
		prev = now
	}
	t.Fatalf("resources never settled: %v", prev)
	return prev
}

// fuzzing reports whether this process is a fuzzing coordinator or
// worker (go test -fuzz): the fuzzing engine's own goroutines and pipes
// come and go outside any input, so only each input's leaks are checked.
func fuzzing() bool {
	f := flag.Lookup("test.fuzz")
	return f != nil && f.Value.String() != ""
}

// testLogger logs the daemon's warnings and errors into the test log
// (HOSTILE_LOG=debug for the device's command trace).
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tbWriter{t}, &slog.HandlerOptions{Level: logLevel()}))
}

func logLevel() slog.Level {
	level := slog.LevelWarn
	_ = level.UnmarshalText([]byte(os.Getenv("HOSTILE_LOG")))
	return level
}

// stderrLogger is for fuzzing, where the daemon outlives every input's
// test log: nothing unless HOSTILE_LOG is set.
func stderrLogger() *slog.Logger {
	if os.Getenv("HOSTILE_LOG") == "" {
		return slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel()}))
}

type tbWriter struct{ t testing.TB }

func (w tbWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", bytes.TrimRight(p, "\n"))
	return len(p), nil
}

var _ io.Writer = tbWriter{}

// idle checks that no VM is connected any more and that goroutines,
// descriptors and locked memory are back to the daemon's idle baseline.
func (e *env) idle() {
	e.t.Helper()
	require.Eventually(e.t, func() bool {
		for _, v := range e.d.Status().VMs {
			if v.Connected {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "every VM disconnected")
	for _, v := range e.d.Status().VMs {
		require.Zero(e.t, v.LockedBytes, "VM %s", v.Name)
	}
	settle(e.t, e.base, "with every VM gone")
}

// vmStatus returns the daemon's view of VM name.
func (e *env) vmStatus(name string) backend.VMStatus {
	e.t.Helper()
	for _, v := range e.d.Status().VMs {
		if v.Name == name {
			return v
		}
	}
	e.t.Fatalf("no VM %s", name)
	return backend.VMStatus{}
}

// counter returns one device counter of VM name (0 when disconnected).
func (e *env) counter(name, counter string) uint64 {
	e.t.Helper()
	return e.vmStatus(name).Counters[counter]
}

// healthy is the epilogue of every hostile test: every VM the test opened
// is closed, the daemon is back to idle, a fresh pair of VMs exchanges an
// RC SEND and an RDMA WRITE through it, and after they leave the
// resources are back to the baseline again.
func (e *env) healthy() {
	e.t.Helper()
	e.closeAll()
	e.idle()
	a, b := e.pairGIDs(vmFresh, vmOther, 201, 202, 12, 7)
	exchange(e.t, a, b)
	a.Close()
	b.Close()
	e.idle()
}

// closeAll closes every VM still open.
func (e *env) closeAll() {
	e.mu.Lock()
	open := make([]*vm, 0, len(e.vms))
	for v := range e.vms {
		open = append(open, v)
	}
	e.mu.Unlock()
	for _, v := range open {
		v.Close()
	}
}

// connected reports whether VM name has a connected device.
func (e *env) connected(name string) bool {
	for _, v := range e.status().VMs {
		if v.Name == name {
			return v.Connected
		}
	}
	return false
}
