package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// envAsMain makes the test binary the program: run with it set, it runs
// main() on its arguments, so that the tests below run `serve` as the
// processes a user starts (the supervisor, and its worker: the same
// binary, which inherits the variable).
const envAsMain = "PVRDMA_TEST_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(envAsMain) == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

// served is a `serve` process of the test binary.
type served struct {
	t    *testing.T
	cmd  *exec.Cmd
	dir  string
	ctl  *backend.ControlClient
	out  *lockedBuffer
	done chan struct{}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// startServe runs `serve --socket-dir DIR args...` (DIR made with mode
// dirMode) and returns without waiting for it to serve.
func startServe(t *testing.T, dirMode os.FileMode, args ...string) *served {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "sock")
	require.NoError(t, os.Mkdir(dir, dirMode))
	require.NoError(t, os.Chmod(dir, dirMode))
	s := &served{t: t, dir: dir, ctl: backend.NewControlClient(controlPath(dir)), out: &lockedBuffer{}, done: make(chan struct{})}
	s.cmd = exec.Command(exe, append([]string{"serve", "--socket-dir", dir, "--log-level", "info"}, args...)...)
	s.cmd.Env = append(os.Environ(), envAsMain+"=1")
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	// A test that dies takes the supervisor with it (and it its worker).
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, s.cmd.Start())
	go func() { _ = s.cmd.Wait(); close(s.done) }()
	t.Cleanup(func() {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(time.Minute):
			_ = s.cmd.Process.Kill()
			<-s.done
		}
		if t.Failed() {
			t.Logf("serve's output:\n%s", s.out.String())
		}
	})
	return s
}

// status waits until the daemon answers with a worker other than not
// (0: any) and returns its status.
func (s *served) status(not int) backend.Status {
	s.t.Helper()
	var st backend.Status
	require.Eventually(s.t, func() bool {
		var err error
		st, err = s.ctl.Status(context.Background())
		return err == nil && st.PID != not
	}, time.Minute, 10*time.Millisecond, "the daemon did not serve:\n%s", s.out.String())
	return st
}

// exit waits for the supervisor to end and returns its exit code.
func (s *served) exit() int {
	s.t.Helper()
	select {
	case <-s.done:
	case <-time.After(time.Minute):
		s.t.Fatalf("serve did not end:\n%s", s.out.String())
	}
	return s.cmd.ProcessState.ExitCode()
}

func alive(pid int) bool { return syscall.Kill(pid, 0) == nil }

// processesIn lists the processes whose command line names dir (the
// test's socket directory is in no other).
func processesIn(dir string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cl, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cl), dir) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestServeSupervised: `serve` not run by systemd runs the daemon as the
// worker of its supervisor: status names both, a kill -9 of the worker
// costs a restart (counted in status and the metrics), and an orderly
// stop of the supervisor (SIGTERM) ends the worker, leaves no process
// behind, removes the kept state and exits 0.
func TestServeSupervised(t *testing.T) {
	s := startServe(t, 0o700, "--vm", "v1", "--restart-delay", "10ms")
	st := s.status(0)
	require.NotNil(t, st.Supervisor, "supervised")
	assert.Equal(t, s.cmd.Process.Pid, st.Supervisor.PID)
	assert.NotEqual(t, s.cmd.Process.Pid, st.PID, "the daemon is the supervisor's worker")
	assert.Zero(t, st.Supervisor.Restarts)
	assert.True(t, st.KeepsState)
	first := st.PID

	require.NoError(t, syscall.Kill(first, syscall.SIGKILL))
	st = s.status(first)
	require.NotNil(t, st.Supervisor)
	assert.Equal(t, 1, st.Supervisor.Restarts)
	assert.Equal(t, "killed by signal SIGKILL", st.Supervisor.LastExit)
	require.Len(t, st.VMs, 1, "the VM's registration was kept")
	m, err := s.ctl.Metrics(context.Background())
	require.NoError(t, err)
	assert.Contains(t, m, "pvrdma_supervisor_worker_restarts_total 1\n")
	var out bytes.Buffer
	require.Zero(t, run(context.Background(), []string{"status", "--socket-dir", s.dir}, &out, &out), out.String())
	assert.Contains(t, out.String(), "under its supervisor (pid "+strconv.Itoa(s.cmd.Process.Pid)+")")
	assert.Contains(t, out.String(), "restarts: 1 (the previous process: killed by signal SIGKILL)")

	second := st.PID
	require.NoError(t, s.cmd.Process.Signal(syscall.SIGTERM))
	assert.Zero(t, s.exit(), s.out.String())
	assert.False(t, alive(second), "the worker ended")
	assert.Empty(t, processesIn(s.dir), "no process left behind")
	_, err = os.Stat(filepath.Join(s.dir, "state"))
	assert.True(t, errors.Is(err, os.ErrNotExist), "an orderly stop ends the VMs: no state kept (%v)", err)
	log := s.out.String()
	assert.Equal(t, 1, strings.Count(log, `msg="worker restarted"`))
	assert.Contains(t, log, `msg="worker stopped"`)
}

// TestServeSupervisorCrashLoop: a worker killed each time it serves is
// restarted until the start limit, then the supervisor exits 1 with a
// clear error; no process is left.
func TestServeSupervisorCrashLoop(t *testing.T) {
	// An interval no machine is slow enough to leave.
	s := startServe(t, 0o700, "--restart-delay", "10ms", "--restart-burst", "3", "--restart-interval", "1h")
	var killed []int
	last := 0
	for {
		select {
		case <-s.done:
		default:
			st, err := s.ctl.Status(context.Background())
			if err == nil && st.PID != last {
				last = st.PID
				killed = append(killed, last)
				require.NoError(t, syscall.Kill(last, syscall.SIGKILL))
			}
			time.Sleep(5 * time.Millisecond)
			continue
		}
		break
	}
	assert.Equal(t, 1, s.exit())
	assert.Len(t, killed, 3, "started three times")
	log := s.out.String()
	assert.Contains(t, log, "pvrdma-backend serve: the worker crashes in a loop: it was started 3 times within 1h0m0s and died each time (the last killed by signal SIGKILL); giving up")
	for _, pid := range killed {
		assert.False(t, alive(pid))
	}
	assert.Empty(t, processesIn(s.dir))
}

// TestServeSupervisorStartFails: a daemon that cannot start (here: a
// socket directory others may write to) is not restarted: its own error,
// then the supervisor's, exit 1.
func TestServeSupervisorStartFails(t *testing.T) {
	s := startServe(t, 0o777, "--restart-delay", "10ms")
	assert.Equal(t, 1, s.exit())
	log := s.out.String()
	assert.Equal(t, 1, strings.Count(log, `msg="worker started"`))
	assert.Contains(t, log, "pvrdma-backend serve: the worker did not start (exit status 1 before it served): not restarted")
	assert.Empty(t, processesIn(s.dir))
}

// TestServeNoSupervisor: with --no-supervisor the daemon serves in the
// process started, without a descriptor store.
func TestServeNoSupervisor(t *testing.T) {
	s := startServe(t, 0o700, "--no-supervisor")
	st := s.status(0)
	assert.Nil(t, st.Supervisor)
	assert.Equal(t, s.cmd.Process.Pid, st.PID)
	assert.False(t, st.KeepsState)
	require.NoError(t, s.cmd.Process.Signal(syscall.SIGTERM))
	assert.Zero(t, s.exit())
}

// TestServeSupervisorKilled: a supervisor killed with SIGKILL takes its
// worker with it (an orderly stop on its parent-death signal), and the
// worker removes the notify socket's directory the supervisor left.
func TestServeSupervisorKilled(t *testing.T) {
	s := startServe(t, 0o700, "--vm", "v1")
	st := s.status(0)
	worker := st.PID
	env, err := os.ReadFile("/proc/" + strconv.Itoa(worker) + "/environ")
	require.NoError(t, err)
	var notify string
	for _, kv := range strings.Split(string(env), "\x00") {
		if v, ok := strings.CutPrefix(kv, "NOTIFY_SOCKET="); ok {
			notify = v
		}
	}
	require.NotEmpty(t, notify)
	require.FileExists(t, notify)

	require.NoError(t, s.cmd.Process.Kill())
	s.exit()
	ended := func() bool { // gone, or a zombie nobody reaps here
		b, err := os.ReadFile("/proc/" + strconv.Itoa(worker) + "/stat")
		if err != nil {
			return true
		}
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		return len(f) > 0 && f[0] == "Z"
	}
	require.Eventually(t, ended, time.Minute, 10*time.Millisecond, "the worker outlived its supervisor:\n%s", s.out.String())
	assert.Contains(t, s.out.String(), `msg=stopped`, "it stopped in order")
	_, err = os.Stat(filepath.Dir(notify))
	assert.ErrorIs(t, err, os.ErrNotExist, "the notify socket's directory is removed")
}
