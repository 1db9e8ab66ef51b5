//go:build vm

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// syncBuf collects a process's output while the test reads it.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// supervisedCrashScenario: per round, a long ib_write_bw the daemon's
// worker is killed under (it must end, with or without an error, never
// hang), then a fresh data-checked ibv_rc_pingpong and an ib_write_bw on
// the same device, which must pass.
func supervisedCrashScenario(self, peer string, server bool, rounds int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "dev=vmw_pvrdma0\nself=%s\npeer=%s\ng=$(pvt_gid_index $dev $self)\n", self, peer)
	run := func(name, srv, cli string) {
		cmd := "timeout 120 " + perftestQPTimeout(srv)
		if !server {
			cmd = "pvt_retry 60 timeout 120 " + perftestQPTimeout(cli)
		}
		fmt.Fprintf(&b, "echo '=== %s'\nif %s; then echo rc=0; else echo rc=$?; fi\n", name, cmd)
	}
	for r := 1; r <= rounds; r++ {
		run(fmt.Sprintf("during%d", r), "ib_write_bw -d $dev -x $g -F -n 1000000 -s 65536",
			"ib_write_bw -d $dev -x $g -F -n 1000000 -s 65536 $peer")
		// Both sides wait for the daemon to be back, and the server for
		// its client's previous run to end.
		b.WriteString("sleep 3\n")
		run(fmt.Sprintf("after%d", r), "ibv_rc_pingpong -d $dev -g $g -n 300 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 300 -s 4096 -c $peer")
		run(fmt.Sprintf("bw%d", r), "ib_write_bw -d $dev -x $g -F -n 200 -s 65536", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536 $peer")
	}
	b.WriteString("echo '=== end'\n")
	return b.String()
}

// TestSupervisedCrashKeepsVMs: `pvrdma-backend serve` run as a plain
// process (no systemd, no container: a shell, a CI job) supervises its
// own worker. Two stock guests run ib_write_bw through it; the worker is
// killed with SIGKILL three times during the traffic. The supervisor,
// which holds the VMs' connections, guest memory files and interrupt
// eventfds, starts the worker again with them: no QEMU aborts or sees its
// device's socket close, the ib_write_bw running ends (an error, not a
// hang), and a fresh ibv_rc_pingpong and ib_write_bw pass in the same
// guests after each kill. status counts the restarts, and the supervisor's
// log names each. At the end an orderly stop of the supervisor ends the
// worker and leaves no process behind.
func TestSupervisedCrashKeepsVMs(t *testing.T) { supervisedCrash(t, "") }

// TestSupervisedCrashKeepsVMsMemoryDoorbells is TestSupervisedCrashKeepsVMs
// with the VMs' doorbells in memory (doorbells=memory): the UAR memory the
// guests' mappings name is kept (<vm>.uar) and the restarted worker watches
// it, so the guests' posts after each kill are seen.
func TestSupervisedCrashKeepsVMsMemoryDoorbells(t *testing.T) {
	supervisedCrash(t, ",doorbells=memory")
}

// supervisedCrash runs TestSupervisedCrashKeepsVMs with vmOpts appended to
// each --vm.
func supervisedCrash(t *testing.T, vmOpts string) {
	img := image(t)
	ctx := context.Background()
	sd := serveProcess(t, "sk1"+vmOpts, "sk2"+vmOpts)
	dir, ctl, log, serve, exited := sd.dir, sd.ctl, sd.log, sd.cmd, sd.exited
	st, err := ctl.Status(ctx)
	require.NoError(t, err)
	require.NotNil(t, st.Supervisor, "serve in a shell runs under its supervisor")
	require.Equal(t, serve.Process.Pid, st.Supervisor.PID)
	require.NotEqual(t, serve.Process.Pid, st.PID)

	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	const rounds = 3
	cfgs := []vm.Config{
		pvrdmaGuestIn(dir, "sk1", "10.77.0.1/24", supervisedCrashScenario("10.77.0.1", "", true, rounds)),
		pvrdmaGuestIn(dir, "sk2", "10.77.0.2/24", supervisedCrashScenario("10.77.0.2", "10.77.0.1", false, rounds)),
	}
	for i := range cfgs {
		cfgs[i].NoErrExit, cfgs[i].Timeout = true, 15*time.Minute
	}
	vms, err := vm.StartAll(ctx, t, img, nw, cfgs...)
	require.NoError(t, err)

	sends := func() uint64 {
		var n uint64
		if st, err := ctl.Status(ctx); err == nil {
			for _, v := range st.VMs {
				n += v.Counters["send_wqes"]
			}
		}
		return n
	}
	for r := 1; r <= rounds; r++ {
		require.NoError(t, vm.WaitMarked(5*time.Minute, fmt.Sprintf("=== during%d", r), vms...), "round %d", r)
		// ib_write_bw is under way: the client's WRITEs flow.
		require.NoError(t, vm.WaitRising(2*time.Minute, 300*time.Millisecond, sends), "round %d: traffic", r)
		st, err := ctl.Status(ctx)
		require.NoError(t, err)
		worker := st.PID
		killed := time.Now()
		require.NoError(t, syscall.Kill(worker, syscall.SIGKILL), "kill -9 the worker")
		var back time.Duration
		require.Eventually(t, func() bool {
			st, err = ctl.Status(ctx)
			if err != nil || st.PID == worker || len(st.VMs) != 2 {
				return false
			}
			for _, v := range st.VMs {
				if !v.Connected {
					return false
				}
			}
			back = time.Since(killed)
			return true
		}, time.Minute, 10*time.Millisecond, "round %d: the restarted worker did not resume both VMs", r)
		require.NotNil(t, st.Supervisor)
		assert.Equal(t, r, st.Supervisor.Restarts, "round %d: the supervisor's restarts", r)
		assert.Equal(t, "killed by signal SIGKILL", st.Supervisor.LastExit)
		t.Logf("round %d: kill -9 of the worker to both devices resumed: %v", r, back.Round(time.Millisecond))
		if vmOpts != "" {
			for _, v := range st.VMs {
				t.Logf("round %d: %s doorbells=%s: %s", r, v.Name, v.Doorbells, nonzero(v.Counters))
				assert.Equal(t, "memory", v.Doorbells, "%s", v.Name)
			}
		}
		for _, v := range vms {
			require.NoError(t, syscall.Kill(v.PID(), 0), "%s: its QEMU is alive", v.Name())
		}
	}

	if vmOpts != "" {
		// The guests' posts after the last restart were seen in memory.
		var seen uint64
		if st, err := ctl.Status(ctx); err == nil {
			for _, v := range st.VMs {
				seen += v.Counters["memory_qp_doorbells"]
				t.Logf("after the last restart: %s: %s", v.Name, nonzero(v.Counters))
			}
		}
		assert.NotZero(t, seen, "posts seen in memory")
	}
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	rcRE := regexp.MustCompile(`(?m)^rc=(\d+)$`)
	for _, r := range res {
		require.Contains(t, r.Output, "=== end", "%s did not finish:\n%s", r.VM, r.Output)
		assert.NotRegexp(t, `Assertion|aborted|core dumped|BUG:|Oops`, r.Console, "%s: QEMU and the guest kernel", r.VM)
		for i := 1; i <= rounds; i++ {
			sec := vm.Section(r.Output, fmt.Sprintf("during%d", i))
			m := rcRE.FindStringSubmatch(sec)
			if assert.NotNil(t, m, "%s during%d: no status", r.VM, i) {
				assert.NotEqual(t, "124", m[1], "%s during%d: the application hung:\n%s", r.VM, i, sec)
			}
			for _, step := range []string{"after", "bw"} {
				sec := vm.Section(r.Output, fmt.Sprintf("%s%d", step, i))
				m := rcRE.FindStringSubmatch(sec)
				if assert.NotNil(t, m, "%s %s%d: no status", r.VM, step, i) {
					assert.Equal(t, "0", m[1], "%s %s%d after the worker was killed:\n%s", r.VM, step, i, sec)
				}
			}
		}
	}
	assert.Equal(t, rounds, strings.Count(log.String(), `msg="worker restarted"`), "the supervisor's log names each restart")

	// An orderly stop ends the worker, and nothing is left.
	st, err = ctl.Status(ctx)
	require.NoError(t, err)
	worker := st.PID
	require.NoError(t, serve.Process.Signal(syscall.SIGTERM))
	select {
	case <-exited:
	case <-time.After(time.Minute):
		t.Fatal("the supervisor did not stop")
	}
	assert.Zero(t, serve.ProcessState.ExitCode(), "an orderly stop")
	assert.ErrorIs(t, syscall.Kill(worker, 0), syscall.ESRCH, "the worker ended")
	for _, pid := range processesNaming(dir) {
		cl, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		t.Errorf("left behind: pid %d %q", pid, cl)
	}
}

// processesNaming lists the processes whose command line holds s.
func processesNaming(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cl, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cl), s) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// tail is the last n bytes of s.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
