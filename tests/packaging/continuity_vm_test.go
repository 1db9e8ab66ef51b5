//go:build vm

package packaging

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// installer is a oneshot unit that installs the package at boot; the
// container then runs until the test stops it.
const installer = `[Unit]
Description=install pvrdma-backend
After=multi-user.target
[Service]
Type=oneshot
StandardOutput=append:/root/install.out
StandardError=inherit
ExecStart=/usr/bin/dpkg -i /root/pvrdma-backend.deb
[Install]
WantedBy=multi-user.target
`

// container is a bookworm root booted under systemd-nspawn in the
// background, its /run/pvrdma bound to a host directory.
type container struct {
	cmd     *exec.Cmd
	out     *bytes.Buffer
	sockDir string
	done    chan error
}

// bootPackaged builds the package, installs it at boot in a clean root and
// waits until its daemon serves on the bound socket directory.
func bootPackaged(t *testing.T, extra map[string][]byte) *container {
	t.Helper()
	root := cleanRoot(t)
	for path, b := range extra {
		require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(root, path)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, path), b, 0o755))
	}
	deb := builtDeb(t)
	require.NoError(t, os.WriteFile(filepath.Join(root, "root/pvrdma-backend.deb"), deb, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(root, "etc/systemd/system/pkginstall.service"), []byte(installer), 0o644))
	require.NoError(t, os.Symlink("/etc/systemd/system/pkginstall.service",
		filepath.Join(root, "etc/systemd/system/multi-user.target.wants/pkginstall.service")))

	c := &container{out: &bytes.Buffer{}, sockDir: filepath.Join(t.TempDir(), "pvrdma"), done: make(chan error, 1)}
	require.NoError(t, os.Mkdir(c.sockDir, 0o750))
	c.cmd = exec.Command("systemd-nspawn", "--quiet", "-D", root, "--boot", "--register=no", "--keep-unit",
		"--private-network", "--console=read-only", "--capability=CAP_IPC_LOCK", "--bind="+c.sockDir+":/run/pvrdma")
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	require.NoError(t, c.cmd.Start())
	go func() { c.done <- c.cmd.Wait() }()
	t.Cleanup(func() {
		_ = c.cmd.Process.Signal(syscall.SIGTERM) // nspawn: an orderly shutdown of the container
		select {
		case <-c.done:
		case <-time.After(30 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
		if t.Failed() {
			t.Logf("container console:\n%s", tail(c.out.String(), 6000))
			if b, err := os.ReadFile(filepath.Join(root, "root/install.out")); err == nil {
				t.Logf("install:\n%s", b)
			}
		}
	})
	ctl := backend.NewControlClient(filepath.Join(c.sockDir, "control.sock"))
	require.Eventually(t, func() bool {
		_, err := ctl.Status(context.Background())
		return err == nil
	}, 3*time.Minute, 100*time.Millisecond, "the packaged daemon never served; console:\n%s", tail(c.out.String(), 4000))
	return c
}

// register registers the VMs, each given as NAME=ADDRESS, with the
// container's daemon (512 MiB each, and the address assigned to the VM:
// the packaged daemon declares no pool, so a VM binds only the addresses
// it is assigned) and returns its control client.
func (c *container) register(t *testing.T, vms ...string) *backend.ControlClient {
	t.Helper()
	ctl := backend.NewControlClient(filepath.Join(c.sockDir, "control.sock"))
	for _, v := range vms {
		name, addr, ok := strings.Cut(v, "=")
		require.True(t, ok, "register %q: NAME=ADDRESS", v)
		_, err := ctl.AddVM(context.Background(), backend.VMRequest{Name: name, MemBytes: 512 << 20, GIDAllow: []string{addr + "/32"}})
		require.NoError(t, err)
	}
	return ctl
}

// guest is a stock guest whose QEMU, on the host, uses the container's
// daemon: vmxnet3 at 05.0, the device at 05.1 and the daemon's QMP
// monitor, as qemu-args gives them; modules nil loads the PVRDMA stack.
func (c *container) guest(name, ip, scenario string, modules []string) vm.Config {
	dev, _ := json.Marshal(map[string]any{
		"driver": "vfio-user-pci", "addr": "05.1", "x-no-posted-writes": true,
		"socket": map[string]any{"type": "unix", "path": filepath.Join(c.sockDir, name+".sock")},
	})
	return vm.Config{
		Name:      name,
		NICs:      []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: backend.DefaultMAC(name).String(), IP: ip}},
		ExtraArgs: append([]string{"-device", string(dev)}, backend.VMSpec{QMPSocket: filepath.Join(c.sockDir, name+".qmp")}.QMPArgs()...),
		Modules:   modules,
		Scenario:  scenario,
		NoErrExit: true,
		Timeout:   15 * time.Minute,
	}
}

// daemonPID returns the PID of the packaged daemon that runs in c's container (a
// descendant of its systemd-nspawn), or 0. Only c's: a container another test left
// running (one whose test binary was killed) runs the same command line.
func (c *container) daemonPID(t *testing.T) int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	var daemons []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil {
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); len(f) > 1 {
				parent[pid], _ = strconv.Atoi(f[1])
			}
		}
		cl, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(cl), "\x00")
		if len(args) > 2 && args[0] == "/usr/bin/pvrdma-backend" && args[1] == "serve" {
			daemons = append(daemons, pid)
		}
	}
	for _, pid := range daemons {
		for p, hops := pid, 0; p > 1 && hops < 64; p, hops = parent[p], hops+1 {
			if p == c.cmd.Process.Pid {
				return pid
			}
		}
	}
	return 0
}

// doorbells are the VMs' doorbell counters in a status.
func doorbells(st backend.Status) map[string]uint64 {
	m := map[string]uint64{}
	for _, v := range st.VMs {
		m[v.Name] = v.Counters["doorbells"]
	}
	return m
}

// crashScenario: for each round, a long ping-pong the daemon is killed
// under (it must end, with or without an error, never hang), then a fresh
// ping-pong and ib_write_bw on the same device (they must pass).
func crashScenario(self, peer string, server bool, rounds int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "dev=vmw_pvrdma0\nself=%s\npeer=%s\ng=$(pvt_gid_index $dev $self)\n", self, peer)
	run := func(name, srv, cli string) {
		cmd := "timeout 100 " + srv
		if !server {
			cmd = "pvt_retry 60 timeout 100 " + cli
		}
		fmt.Fprintf(&b, "echo '=== %s'\nif %s; then echo rc=0; else echo rc=$?; fi\n", name, cmd)
	}
	for r := 1; r <= rounds; r++ {
		run(fmt.Sprintf("during%d", r), "ibv_rc_pingpong -d $dev -g $g -n 1000000 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 1000000 -s 4096 $peer")
		// Both sides wait for the daemon to be back (a fresh ping-pong
		// needs it), and the server for its client's previous run to end.
		b.WriteString("sleep 3\n")
		run(fmt.Sprintf("after%d", r), "ibv_rc_pingpong -d $dev -g $g -n 300 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 300 -s 4096 -c $peer")
		run(fmt.Sprintf("bw%d", r), "ib_write_bw -d $dev -x $g -F -n 200 -s 65536", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536 $peer")
	}
	b.WriteString("echo '=== end'\n")
	return b.String()
}

// TestCrashKeepsVMs: the packaged daemon, under systemd in a container,
// serves two stock guests whose QEMUs run on the host; it is killed with
// SIGKILL three times while the guests run ibv_rc_pingpong. systemd
// restarts it, hands it back the connections from its file descriptor
// store, and it resumes them: no QEMU aborts or sees its device's socket
// close, the ping-pong that was running ends (an error, not a hang), and a
// fresh ibv_rc_pingpong and ib_write_bw pass in the same guests after each
// kill. The test prints each kill's time until both devices are resumed.
func TestCrashKeepsVMs(t *testing.T) {
	img, err := vm.EnsureImage(context.Background(), t.Logf)
	require.NoError(t, err)
	c := bootPackaged(t, nil)
	ctx := context.Background()
	ctl := c.register(t, "ck1=10.78.0.1", "ck2=10.78.0.2")
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	const rounds = 3
	guest := func(name, ip, scenario string) vm.Config { return c.guest(name, ip, scenario, nil) }
	vms, err := vm.StartAll(ctx, t, img, nw,
		guest("ck1", "10.78.0.1/24", crashScenario("10.78.0.1", "", true, rounds)),
		guest("ck2", "10.78.0.2/24", crashScenario("10.78.0.2", "10.78.0.1", false, rounds)))
	require.NoError(t, err)

	for r := 1; r <= rounds; r++ {
		mark := fmt.Sprintf("=== during%d", r)
		require.NoError(t, vm.WaitMarked(5*time.Minute, mark, vms...), "round %d", r)
		time.Sleep(2 * time.Second) // into the ping-pong
		pid := c.daemonPID(t)
		require.NotZero(t, pid, "the daemon runs")
		killed := time.Now()
		require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
		var back time.Duration
		require.Eventually(t, func() bool {
			np := c.daemonPID(t)
			if np == 0 || np == pid {
				return false
			}
			st, err := ctl.Status(ctx)
			if err != nil || len(st.VMs) != 2 {
				return false
			}
			for _, v := range st.VMs {
				if !v.Connected {
					return false
				}
			}
			back = time.Since(killed)
			return true
		}, 30*time.Second, 10*time.Millisecond, "round %d: the restarted daemon did not resume both VMs", r)
		t.Logf("round %d: kill -9 to both devices resumed: %v", r, back.Round(time.Millisecond))
		for _, v := range vms {
			require.NoError(t, syscall.Kill(v.PID(), 0), "%s: its QEMU is alive", v.Name())
		}
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
					assert.Equal(t, "0", m[1], "%s %s%d after the daemon was killed:\n%s", r.VM, step, i, sec)
				}
			}
		}
	}
}

// inContainer runs a command in the booted container (as its root, in all
// its namespaces) and returns its output.
func (c *container) inContainer(t *testing.T, args ...string) (string, error) {
	t.Helper()
	kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", c.cmd.Process.Pid, c.cmd.Process.Pid))
	require.NoError(t, err)
	f := strings.Fields(string(kids))
	require.NotEmpty(t, f, "the container's init")
	out, err := exec.Command("nsenter", append([]string{"-t", f[0], "-a"}, args...)...).CombinedOutput()
	return string(out), err
}

// upgradeScenario: each step runs one long application through the
// hand-overs the host does meanwhile; each must complete, with its data
// checked, rc 0.
func upgradeScenario(self, peer string, server bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "dev=vmw_pvrdma0\nself=%s\npeer=%s\ng=$(pvt_gid_index $dev $self)\n", self, peer)
	run := func(name, srv, cli string) {
		cmd := "timeout 200 " + srv
		if !server {
			cmd = "pvt_retry 60 timeout 200 " + cli
		}
		fmt.Fprintf(&b, "echo '=== %s'\nif %s; then echo rc=0; else echo rc=$?; fi\nsleep 2\n", name, cmd)
	}
	run("pingpong", "ibv_rc_pingpong -d $dev -g $g -n 30000 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 30000 -s 4096 -c $peer")
	run("write_bw", "ib_write_bw -d $dev -x $g -F -D 20 -s 65536", "ib_write_bw -d $dev -x $g -F -D 20 -s 65536 $peer")
	// 16 RC QPs on one SRQ a side: the SRQ's receives cross the hand-over.
	run("srq", "ibv_srq_pingpong -d $dev -g $g -n 10000 -s 4096", "ibv_srq_pingpong -d $dev -g $g -n 10000 -s 4096 $peer")
	run("rping", "rping -s -a $self -C 3000 -v", "rping -c -a $peer -C 3000 -v")
	b.WriteString("echo '=== end'\n")
	return b.String()
}

// previousBinary builds the daemon from the commit before HEAD (a
// downgrade is an upgrade to an older binary, and the format of the state
// must be readable both ways).
func previousBinary(t *testing.T) []byte {
	t.Helper()
	src := filepath.Join(t.TempDir(), "prev")
	require.NoError(t, os.Mkdir(src, 0o755))
	arch := exec.Command("sh", "-c", "git archive HEAD~1 | tar -x -C "+src)
	arch.Dir = repoRoot(t)
	out, err := arch.CombinedOutput()
	require.NoError(t, err, "git archive HEAD~1:\n%s", out)
	bin := filepath.Join(t.TempDir(), "pvrdma-backend")
	// Built as `make deb` builds the package's binary (cgo, -trimpath): the
	// source tree's path (a new temporary directory each run) stays out of the
	// build cache's keys, and the packages that did not change since HEAD~1
	// come from the cache that `make deb` filled.
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "./cmd/pvrdma-backend")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_ENABLED=1")
	out, err = build.CombinedOutput()
	require.NoError(t, err, "build the previous commit:\n%s", out)
	b, err := os.ReadFile(bin)
	require.NoError(t, err)
	return b
}

// TestUpgradeKeepsVMs: the packaged daemon, under systemd in a container,
// serves two stock guests (QEMUs on the host) that run a data-checked
// ibv_rc_pingpong, ib_write_bw, ibv_srq_pingpong (16 RC QPs on an SRQ)
// and rping; during each, the daemon is
// upgraded in place: `systemctl reload` (the unit's ExecReload runs
// `pvrdma-backend upgrade`), once to a binary built from the previous
// commit (`pvrdma-backend upgrade --binary`), and once `dpkg -i` of the
// package (its postinst reloads, back to the current binary). Each hand-over execs the binary in the same process;
// every application completes with rc 0 and the QEMUs never see their
// device's socket close. The test prints each hand-over's pause.
func TestUpgradeKeepsVMs(t *testing.T) {
	img, err := vm.EnsureImage(context.Background(), t.Logf)
	require.NoError(t, err)
	prev := previousBinary(t)
	c := bootPackaged(t, map[string][]byte{"usr/local/bin/pvrdma-backend-prev": prev})
	ctx := context.Background()
	ctl := c.register(t, "uk1=10.79.0.1", "uk2=10.79.0.2")
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	rdmaCM := []string{"ib_core", "ib_uverbs", "vmw_pvrdma", "configfs", "iw_cm", "ib_cm", "rdma_cm", "rdma_ucm"}
	guest := func(name, ip, scenario string) vm.Config { return c.guest(name, ip, scenario, rdmaCM) }
	vms, err := vm.StartAll(ctx, t, img, nw,
		guest("uk1", "10.79.0.1/24", upgradeScenario("10.79.0.1", "", true)),
		guest("uk2", "10.79.0.2/24", upgradeScenario("10.79.0.2", "10.79.0.1", false)))
	require.NoError(t, err)

	st0, err := ctl.Status(ctx)
	require.NoError(t, err)
	pid := st0.PID // in the container's PID namespace
	upgrades := 0
	upgrade := func(how string, args ...string) backend.HandoverStatus {
		t.Helper()
		pre, err := ctl.Status(ctx)
		require.NoError(t, err)
		out, err := c.inContainer(t, args...)
		require.NoError(t, err, "%s:\n%s", how, out)
		st, err := ctl.Status(ctx)
		require.NoError(t, err)
		require.NotNil(t, st.Handover, "%s: no hand-over recorded:\n%s", how, out)
		upgrades++
		require.Equal(t, upgrades, st.Handover.Generation, "%s:\n%s", how, out)
		assert.Equal(t, pid, st.PID, "the daemon keeps its process (exec)")
		for vm, n := range doorbells(pre) {
			assert.GreaterOrEqual(t, doorbells(st)[vm], n, "%s: the counters carry over", vm)
		}
		t.Logf("hand-over %d (%s): pause %.1f ms (saving %.1f, starting %.1f, resuming %.1f), %d VMs, RC QPs kept %d, errored %d, objects lost %d",
			upgrades, how, st.Handover.PauseMS, st.Handover.SaveMS, st.Handover.StartMS, st.Handover.ResumeMS,
			st.Handover.VMs, st.Handover.Continued, st.Handover.Errored, st.Handover.Lost)
		assert.Zero(t, st.Handover.Errored, "no RC QP errored by a planned hand-over")
		return *st.Handover
	}
	during := func(step string) {
		mark := "=== " + step
		require.NoError(t, vm.WaitMarked(5*time.Minute, mark, vms...))
		// Connected and running: the guests' sends flow (the tools'
		// own output is buffered until they exit).
		sends := func() uint64 {
			var n uint64
			if st, err := ctl.Status(ctx); err == nil {
				for _, v := range st.VMs {
					n += v.Counters["send_wqes"]
				}
			}
			return n
		}
		require.NoError(t, vm.WaitRising(2*time.Minute, 300*time.Millisecond, sends), "%s: sends", step)
	}
	during("pingpong")
	upgrade("systemctl reload", "systemctl", "reload", "pvrdma-backend.service")
	time.Sleep(time.Second)
	upgrade("to the previous commit's binary", "pvrdma-backend", "upgrade", "--binary", "/usr/local/bin/pvrdma-backend-prev")
	time.Sleep(time.Second)
	upgrade("package upgrade", "dpkg", "-i", "/root/pvrdma-backend.deb")
	during("write_bw")
	upgrade("systemctl reload", "systemctl", "reload", "pvrdma-backend.service")
	during("srq")
	h := upgrade("systemctl reload", "systemctl", "reload", "pvrdma-backend.service")
	assert.GreaterOrEqual(t, h.Continued, 32, "both guests' 16 RC QPs on their SRQ kept their connections")
	during("rping")
	upgrade("systemctl reload", "systemctl", "reload", "pvrdma-backend.service")

	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	rcRE := regexp.MustCompile(`(?m)^rc=(\d+)$`)
	for _, r := range res {
		require.Contains(t, r.Output, "=== end", "%s did not finish:\n%s", r.VM, r.Output)
		assert.NotRegexp(t, `Assertion|aborted|core dumped|BUG:|Oops`, r.Console, "%s", r.VM)
		for _, step := range []string{"pingpong", "write_bw", "srq", "rping"} {
			sec := vm.Section(r.Output, step)
			m := rcRE.FindStringSubmatch(sec)
			if assert.NotNil(t, m, "%s %s: no status", r.VM, step) {
				assert.Equal(t, "0", m[1], "%s %s through the upgrades:\n%s", r.VM, step, sec)
			}
		}
	}
}
