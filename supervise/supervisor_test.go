package supervise

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// The test binary is also the worker: run with envTestWorker set, it
// plays a daemon that speaks the notify protocol with the daemon's own
// senders (backend.FDStore for FDSTORE/FDSTOREREMOVE/BARRIER, go-systemd
// for READY) and takes descriptors back with go-systemd's activation, as
// cmd/pvrdma-backend's serve does.
const (
	envTestWorker = "SUPERVISE_TEST_WORKER" // the mode
	envTestReport = "SUPERVISE_TEST_REPORT" // a file the worker appends a JSON line to
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(envTestWorker); mode != "" {
		os.Exit(testWorker(mode))
	}
	os.Exit(m.Run())
}

// workerReport is what a test worker saw at its start.
type workerReport struct {
	PID       int               `json:"pid"`
	Worker    bool              `json:"worker"` // Worker() said so
	Restarts  int               `json:"restarts"`
	LastExit  string            `json:"last_exit"`
	Notify    string            `json:"notify"`
	Names     []string          `json:"names"` // inherited, sorted, once per descriptor
	Contents  map[string]string `json:"contents,omitempty"`
	BarrierOK bool              `json:"barrier_ok"`
	Err       string            `json:"err,omitempty"`
}

func testWorker(mode string) int {
	if mode == "fail" {
		return 2 // before READY: a start that fails
	}
	info, ok := Worker()
	rep := workerReport{PID: os.Getpid(), Worker: ok, Restarts: info.Restarts, LastExit: info.LastExit,
		Notify: os.Getenv("NOTIFY_SOCKET"), Contents: map[string]string{}}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM)
	inherited := activation.FilesWithNames()
	store, err := backend.OpenFDStore(rep.Notify)
	if err != nil {
		rep.Err = err.Error()
	}
	for name, files := range inherited {
		for _, f := range files {
			rep.Names = append(rep.Names, name)
			b := make([]byte, 64)
			if n, err := f.ReadAt(b, 0); n > 0 || errors.Is(err, io.EOF) {
				rep.Contents[name] = string(b[:n])
			}
			// A restarted daemon stores again what it got back.
			if store != nil {
				if err := store.Store(name, int(f.Fd())); err != nil {
					rep.Err = err.Error()
				}
			}
		}
	}
	sort.Strings(rep.Names)
	if store != nil && len(inherited) == 0 {
		// First start: a guest memory file with data, a pipe's read end,
		// and an eventfd stored and removed again.
		mfd, _ := unix.MemfdCreate("guest", unix.MFD_CLOEXEC)
		_, _ = unix.Write(mfd, []byte("generation 1"))
		var p [2]int
		_ = unix.Pipe2(p[:], unix.O_CLOEXEC)
		efd, _ := unix.Eventfd(0, unix.EFD_CLOEXEC)
		for _, s := range []struct {
			name string
			fd   int
		}{{"vm1.m1", mfd}, {"vm1.conn", p[0]}, {"vm1.i2-0", efd}} {
			if err := store.Store(s.name, s.fd); err != nil {
				rep.Err = err.Error()
			}
		}
		if err := store.Remove("vm1.i2-0"); err != nil {
			rep.Err = err.Error()
		}
	}
	if store != nil {
		rep.BarrierOK = store.Barrier(10*time.Second) == nil
	}
	if _, err := daemon.SdNotify(false, daemon.SdNotifyReady); err != nil {
		rep.Err = err.Error()
	}
	if path := os.Getenv(envTestReport); path != "" {
		b, _ := json.Marshal(rep)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err == nil {
			_, _ = f.Write(append(b, '\n'))
			_ = f.Close()
		}
	}
	switch mode {
	case "die":
		time.Sleep(20 * time.Millisecond)
		return 1
	case "exit0":
		return 0
	}
	<-sigs // serve until an orderly stop
	_, _ = daemon.SdNotify(false, daemon.SdNotifyStopping)
	return 0
}

// harness runs Run over the test binary as the worker.
type harness struct {
	t      *testing.T
	report string
	cancel context.CancelFunc
	done   chan error
	log    *syncBuffer
}

func startHarness(t *testing.T, mode string, cfg Config) *harness {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	h := &harness{t: t, report: filepath.Join(t.TempDir(), "report"), done: make(chan error, 1), log: &syncBuffer{}}
	cfg.Path, cfg.Args = exe, []string{exe, "worker"}
	cfg.Env = append(os.Environ(), envTestWorker+"="+mode, envTestReport+"="+h.report)
	cfg.Logger = slog.New(slog.NewTextHandler(h.log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- Run(ctx, cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-h.done:
		case <-time.After(time.Minute):
			t.Error("Run did not return")
		}
		if t.Failed() || testing.Verbose() {
			t.Logf("supervisor log:\n%s", h.log.String())
		}
	})
	return h
}

// reports returns the reports the workers wrote so far.
func (h *harness) reports() []workerReport {
	f, err := os.Open(h.report)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []workerReport
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r workerReport
		require.NoError(h.t, json.Unmarshal(sc.Bytes(), &r))
		out = append(out, r)
	}
	return out
}

// waitReports waits until n workers reported.
func (h *harness) waitReports(n int) []workerReport {
	h.t.Helper()
	var reps []workerReport
	require.Eventually(h.t, func() bool {
		reps = h.reports()
		return len(reps) >= n
	}, time.Minute, 5*time.Millisecond, "%d workers reported, want %d; log:\n%s", len(reps), n, h.log.String())
	return reps
}

// waitLog waits until the supervisor logged substr count times.
func (h *harness) waitLog(substr string, count int) {
	h.t.Helper()
	require.Eventually(h.t, func() bool { return strings.Count(h.log.String(), substr) >= count },
		time.Minute, 5*time.Millisecond, "%q x%d not logged:\n%s", substr, count, h.log.String())
}

func (h *harness) result() error {
	h.t.Helper()
	select {
	case err := <-h.done:
		h.done <- err
		return err
	case <-time.After(time.Minute):
		h.t.Fatal("Run did not return")
		return nil
	}
}

func gone(pid int) bool { return unix.Kill(pid, 0) == unix.ESRCH }

// TestRunRestartsWithDescriptors: a worker killed with SIGKILL is started
// again and gets back what it stored (not what it removed, nor what
// another process sent), named; stored again by the new worker, each file
// is held once; an orderly stop ends the worker and Run returns nil.
func TestRunRestartsWithDescriptors(t *testing.T) {
	h := startHarness(t, "serve", Config{RestartDelay: 10 * time.Millisecond})
	r1 := h.waitReports(1)[0]
	require.Empty(t, r1.Err)
	assert.True(t, r1.Worker)
	assert.Zero(t, r1.Restarts)
	assert.Empty(t, r1.Names)
	assert.True(t, r1.BarrierOK, "BARRIER=1 answered")
	assert.Equal(t, "notify", filepath.Base(r1.Notify))
	fi, err := os.Stat(filepath.Dir(r1.Notify))
	require.NoError(t, err)
	assert.Equal(t, os.ModeDir|0o700, fi.Mode(), "only its user reaches the notify socket")
	h.waitLog("the worker serves", 1)

	// Another process's FDSTORE is refused (the test sends as itself).
	fr, fw := pipe(t)
	foreign, err := backend.OpenFDStore(r1.Notify)
	require.NoError(t, err)
	require.NoError(t, foreign.Store("foreign", fr))
	require.NoError(t, foreign.Close())
	require.NoError(t, unix.Close(fr))
	h.waitLog("another process than the worker", 1)
	assert.False(t, readerOpen(t, fw), "the supervisor closed the foreign descriptor")

	for round := 1; round <= 2; round++ {
		prev := h.reports()[round-1]
		require.NoError(t, unix.Kill(prev.PID, unix.SIGKILL))
		r := h.waitReports(round + 1)[round]
		require.Empty(t, r.Err)
		assert.True(t, r.Worker)
		assert.NotEqual(t, prev.PID, r.PID)
		assert.Equal(t, round, r.Restarts)
		assert.Equal(t, "killed by signal SIGKILL", r.LastExit)
		assert.Equal(t, r1.Notify, r.Notify)
		// Once each, though the previous worker stored them again.
		assert.Equal(t, []string{"vm1.conn", "vm1.m1"}, r.Names, "round %d", round)
		assert.Equal(t, "generation 1", r.Contents["vm1.m1"], "the same guest memory file")
		h.waitLog("the restarted worker serves", round)
	}
	assert.Equal(t, 2, strings.Count(h.log.String(), "worker restarted"))

	last := h.reports()[2]
	h.cancel()
	require.NoError(t, h.result())
	assert.True(t, gone(last.PID), "the worker ended with the supervisor")
	_, err = os.Stat(filepath.Dir(r1.Notify))
	assert.ErrorIs(t, err, os.ErrNotExist, "the notify socket's directory is removed")
	assert.Contains(t, h.log.String(), "worker stopped")
}

// TestRunCrashLoop: a worker that dies each time after it served is
// started Burst times, then Run gives up with ErrCrashLoop.
func TestRunCrashLoop(t *testing.T) {
	h := startHarness(t, "die", Config{RestartDelay: time.Millisecond, Burst: 3, Interval: time.Hour})
	err := h.result()
	require.ErrorIs(t, err, ErrCrashLoop)
	assert.Contains(t, err.Error(), "started 3 times within 1h0m0s")
	assert.Contains(t, err.Error(), "exit status 1")
	reps := h.reports()
	assert.Len(t, reps, 3)
	for _, r := range reps {
		assert.True(t, gone(r.PID))
	}
}

// TestRunFirstStartFails: a worker that fails before it served is not
// restarted.
func TestRunFirstStartFails(t *testing.T) {
	h := startHarness(t, "fail", Config{RestartDelay: time.Millisecond})
	err := h.result()
	require.ErrorIs(t, err, ErrNotStarted)
	assert.Contains(t, err.Error(), "exit status 2")
	assert.Equal(t, 1, strings.Count(h.log.String(), "worker started"))
}

// TestRunWorkerStopsCleanly: a worker that exits 0 by itself is not
// restarted, and Run returns nil.
func TestRunWorkerStopsCleanly(t *testing.T) {
	h := startHarness(t, "exit0", Config{RestartDelay: time.Millisecond})
	require.NoError(t, h.result())
	assert.Len(t, h.reports(), 1)
	assert.Contains(t, h.log.String(), "stopped by itself")
}

// TestRunSIGHUPStops: SIGHUP to the supervisor is an orderly stop.
func TestRunSIGHUPStops(t *testing.T) {
	h := startHarness(t, "serve", Config{})
	r := h.waitReports(1)[0]
	h.waitLog("the worker serves", 1)
	require.NoError(t, unix.Kill(os.Getpid(), unix.SIGHUP))
	require.NoError(t, h.result())
	assert.True(t, gone(r.PID))
}

func TestWorkerEnv(t *testing.T) {
	env := workerEnv([]string{"PATH=/bin", "NOTIFY_SOCKET=/run/x", "LISTEN_FDS=2", "LISTEN_PID=1", "LISTEN_FDNAMES=a:b",
		EnvSupervisor + "=9", EnvRestarts + "=1", EnvLastExit + "=x", "PVRDMA_OTHER=1"})
	assert.Equal(t, []string{"PATH=/bin", "PVRDMA_OTHER=1"}, env)

	// Worker() believes only its parent.
	t.Setenv("LISTEN_FDS", "1")
	t.Setenv(EnvSupervisor, "1")
	if os.Getppid() != 1 {
		_, ok := Worker()
		assert.False(t, ok)
		_, set := os.LookupEnv("LISTEN_PID")
		assert.False(t, set, "LISTEN_PID left alone")
	}
	t.Setenv(EnvSupervisor, itoa(os.Getppid()))
	t.Setenv(EnvRestarts, "3")
	t.Setenv(EnvLastExit, "killed by signal SIGKILL")
	os.Unsetenv("LISTEN_PID")
	info, ok := Worker()
	require.True(t, ok)
	assert.Equal(t, WorkerInfo{SupervisorPID: os.Getppid(), Restarts: 3, LastExit: "killed by signal SIGKILL"}, info)
	assert.Equal(t, itoa(os.Getpid()), os.Getenv("LISTEN_PID"))
	os.Unsetenv("LISTEN_PID")
}

func TestExitString(t *testing.T) {
	assert.Equal(t, "exit status 3", ExitString(unix.WaitStatus(3<<8)))
	assert.Equal(t, "killed by signal SIGKILL", ExitString(unix.WaitStatus(9)))
	assert.Equal(t, "killed by signal SIGSEGV (core dumped)", ExitString(unix.WaitStatus(11|0x80)))
	assert.True(t, cleanExit(unix.WaitStatus(0)))
	assert.True(t, cleanExit(unix.WaitStatus(15)))
	assert.False(t, cleanExit(unix.WaitStatus(9)))
	assert.False(t, cleanExit(unix.WaitStatus(1<<8)))
}

// syncBuffer is a log destination the test reads while Run writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func itoa(n int) string { return strconv.Itoa(n) }
