//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// watchControl keeps the latest counters of each VM while its QEMU is
// connected, as watchCounters does for a daemon in this process, until
// stop is called.
func watchControl(ctl *backend.ControlClient) (latest func(string) map[string]uint64, stop func()) {
	return watchStatus(func() (backend.Status, error) { return ctl.Status(context.Background()) })
}

// sumCounter sums a counter over the VMs the daemon behind ctl serves.
func sumCounter(ctl *backend.ControlClient, name string) uint64 {
	var n uint64
	if st, err := ctl.Status(context.Background()); err == nil {
		for _, v := range st.VMs {
			n += v.Counters[name]
		}
	}
	return n
}

// TestUpgradeKeepsVMsMemoryDoorbells: two stock guests with their doorbells
// in memory (doorbells=memory) run a data-checked ibv_rc_pingpong -c and
// then ib_write_bw through a `serve` process, which is upgraded live (a
// hand-over to its own binary, exec'd in its process) during each. It
// proves that the UAR memory survives a live upgrade as guest memory does:
// every hand-over errors nothing and keeps the RC connections, the
// guests' doorbells are seen in memory after each hand-over
// (memory_qp_doorbells rises: the successor watches the memory the
// guests' mappings name, not a memory of its own, where their stores
// would go unseen and the applications hang), both applications complete
// with rc 0 on both sides, the user contexts' doorbells are not trapped
// (the trapped ones are the kernel's, page 0: few against those seen in
// memory), and the worker never died (no restart, no panic in the log).
// The hand-over during ib_write_bw, whose client stores doorbells without
// pause, is the one that needs the poller held with the connections
// (vdev Device.HoldDoorbells): without it an RC QP came back in ERR and
// ib_write_bw failed.
func TestUpgradeKeepsVMsMemoryDoorbells(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	sd := serveProcess(t, "mu1,doorbells=memory", "mu2,doorbells=memory")
	dir, ctl, log := sd.dir, sd.ctl, sd.log
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	steps := []step{
		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 6000 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 6000 -s 4096 -c $peer"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -D 20 -s 65536", "ib_write_bw -d $dev -x $g -F -D 20 -s 65536 $peer"},
	}
	a := pvrdmaGuestIn(dir, "mu1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps))
	b := pvrdmaGuestIn(dir, "mu2", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, steps))
	a.NoErrExit, b.NoErrExit = true, true
	a.Timeout, b.Timeout = 10*time.Minute, 10*time.Minute
	latest, stop := watchControl(ctl)
	defer stop()
	vms, err := vm.StartAll(ctx, t, img, nw, a, b)
	require.NoError(t, err)
	// Progress, for the log: a stall after a hand-over shows as flat sends.
	progress := make(chan struct{})
	var pwg sync.WaitGroup
	defer func() { close(progress); pwg.Wait() }()
	pwg.Add(1)
	go func() {
		defer pwg.Done()
		for {
			select {
			case <-progress:
				return
			case <-time.After(10 * time.Second):
			}
			var b strings.Builder
			for _, n := range []string{"mu1", "mu2"} {
				c := latest(n)
				fmt.Fprintf(&b, "%s: send_wqes=%d completions=%d memory_qp_doorbells=%d  ", n, c["send_wqes"], c["completions"], c["memory_qp_doorbells"])
			}
			t.Logf("progress: %s", b.String())
		}
	}()

	for gen, mark := range []string{"=== rc_pingpong", "=== ib_write_bw"} {
		gen++
		require.NoError(t, vm.WaitMarked(5*time.Minute, mark, vms...))
		// The RC QPs are in RTS and the guests' posts are seen in memory.
		require.NoError(t, vm.WaitRising(2*time.Minute, 200*time.Millisecond, func() uint64 { return sumCounter(ctl, "send_wqes") }), "sends during %s", mark)
		require.NoError(t, vm.WaitRising(time.Minute, 200*time.Millisecond, func() uint64 { return sumCounter(ctl, "memory_qp_doorbells") }), "memory doorbells during %s", mark)
		uctx, cancel := context.WithTimeout(ctx, time.Minute)
		require.NoError(t, ctl.Upgrade(uctx, ""))
		var st backend.Status
		require.Eventually(t, func() bool {
			var err error
			st, err = ctl.Status(uctx)
			return err == nil && st.Handover != nil && st.Handover.Generation >= gen && st.Handover.PauseMS > 0
		}, time.Minute, 20*time.Millisecond, "hand-over %d did not complete", gen)
		cancel()
		h := st.Handover
		t.Logf("hand-over %d during %q: pause %.1f ms (saving %.1f, starting %.1f, resuming %.1f), RC QPs kept %d, errored %d",
			gen, strings.TrimPrefix(mark, "=== "), h.PauseMS, h.SaveMS, h.StartMS, h.ResumeMS, h.Continued, h.Errored)
		assert.GreaterOrEqual(t, h.Continued, 1, "hand-over %d: the RC QPs kept their connection: %+v", gen, h)
		assert.Zero(t, h.Errored, "hand-over %d: %+v", gen, h)
		for _, v := range st.VMs {
			assert.Equal(t, "memory", v.Doorbells, "%s after hand-over %d", v.Name, gen)
			assert.True(t, v.Connected, "%s after hand-over %d", v.Name, gen)
		}
		// The successor sees the guests' stores: they land in the memory
		// it watches.
		require.NoError(t, vm.WaitRising(time.Minute, 200*time.Millisecond, func() uint64 { return sumCounter(ctl, "memory_qp_doorbells") }),
			"hand-over %d: no doorbell seen in memory by the successor", gen)
		for _, v := range st.VMs {
			t.Logf("after hand-over %d: %s: %s", gen, v.Name, nonzero(v.Counters))
		}
	}
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	stop()
	checkSteps(t, res, steps)
	for _, r := range res {
		assert.NotRegexp(t, `Assertion|aborted|core dumped|BUG:|Oops`, r.Console, "%s: QEMU and the guest kernel", r.VM)
	}
	for _, name := range []string{"mu1", "mu2"} {
		c := latest(name)
		require.NotNil(t, c, "%s: no counters seen while connected", name)
		t.Logf("%s at the end: %s", name, nonzero(c))
		mem := c["memory_qp_doorbells"] + c["memory_cq_poll_doorbells"]
		trapped := c["trapped_qp_doorbells"] + c["trapped_cq_poll_doorbells"] + c["trapped_srq_doorbells"]
		assert.NotZero(t, c["memory_qp_doorbells"], "%s: posts seen in memory", name)
		assert.Less(t, trapped*10, mem, "%s: the user contexts' doorbells are not trapped (only the kernel's, page 0)", name)
		assert.Zero(t, c["memory_bad_doorbells"], "%s: stock guests write no garbage", name)
	}
	st, err := ctl.Status(ctx)
	require.NoError(t, err)
	require.NotNil(t, st.Supervisor)
	assert.Zero(t, st.Supervisor.Restarts, "no crash")
	assert.NotRegexp(t, panicRE, log.String(), "the daemon's log")
}

// panicRE matches a Go panic or fatal error in a daemon's log.
var panicRE = regexp.MustCompile(`panic:|fatal error:|goroutine \d+ \[`)

// garbageProgram compiles testdata/bar2garbage.c (static) for the guests.
func garbageProgram(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "bar2garbage")
	out, err := exec.Command("gcc", "-O2", "-Wall", "-static", "-o", bin,
		filepath.Join(repoDir(t), "tests/e2e/testdata/bar2garbage.c")).CombinedOutput()
	require.NoError(t, err, "build bar2garbage (needs gcc and libc6-dev): %s", out)
	return bin
}

// uarResource is the sysfs resource file of our device's BAR2 (the UAR
// BAR) in a guest: pvrdmaGuest puts the device at 00:05.1.
const uarResource = "/sys/bus/pci/devices/0000:00:05.1/resource2"

// TestMemoryDoorbellsGarbage: a hostile root process in a stock guest whose
// doorbells are in memory maps the device's UAR BAR through sysfs
// (bar2garbage: resource2, mmap; the guest kernel refuses that mapping
// while vmw_pvrdma holds the region unless booted with iomem=relaxed, which
// this guest is: the probe in the other guest, booted without it, shows the
// refusal) and writes nonzero garbage (random words, small handles with
// every combination of the kind bits, every top byte, the extremes) to the
// QP, CQ and SRQ words and elsewhere on pages 1 to 511 in a loop, while a
// data-checked ibv_rc_pingpong -c runs in the same guest (loopback: two
// contexts, so the garbage names objects of the other context and lands
// on both pages), and two other guests, one with trapped doorbells and
// one with doorbells in memory, run a data-checked ibv_rc_pingpong -c and
// ib_write_bw. It proves that garbage in the doorbell memory gets a
// counter (memory_bad_doorbells > 0 for the hostile VM only), never a
// crash (the daemon's worker was never restarted, no panic in its log)
// nor another VM's work: every application of every guest, the hostile
// guest's own ping-pong included, completes with rc 0.
func TestMemoryDoorbellsGarbage(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	garbage := garbageProgram(t)
	sd := serveProcess(t, "gh1,doorbells=memory", "gt2", "gm3,doorbells=memory")
	dir, ctl, log := sd.dir, sd.ctl, sd.log
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)

	// The hostile guest: the garbage flows first, then the victim runs under
	// it (its contexts are created under it too), then the garbage stops.
	var hs strings.Builder
	hs.WriteString("dev=vmw_pvrdma0\ng=$(pvt_gid_index $dev 10.77.0.1)\n")
	fmt.Fprintf(&hs, "bar2garbage -r %s -t 900 >/tmp/garbage.out 2>&1 &\ngp=$!\n", uarResource)
	hs.WriteString("sleep 3\necho '=== garbage'\ncat /tmp/garbage.out\n")
	hs.WriteString("echo '=== victim'\n")
	hs.WriteString("timeout 600 ibv_rc_pingpong -d $dev -g $g -n 3000 -s 4096 -c -p 18600 >/tmp/pp.srv 2>&1 &\nsp=$!\n")
	hs.WriteString("if pvt_retry 30 timeout 600 ibv_rc_pingpong -d $dev -g $g -n 3000 -s 4096 -c -p 18600 127.0.0.1; then echo rc=0; else echo rc=$?; fi\n")
	hs.WriteString("echo '=== victim server'\nwait $sp\nsrc=$?\ncat /tmp/pp.srv\necho rc=$src\n")
	hs.WriteString("echo '=== garbage end'\nif kill -0 $gp; then echo running; fi\nkill $gp\nwait $gp\necho rc=$?\ncat /tmp/garbage.out\n")
	hs.WriteString("echo '=== end'\n")
	h := pvrdmaGuestIn(dir, "gh1", "10.77.0.1/24", hs.String())
	h.KernelArgs = "iomem=relaxed"
	h.HostFiles = map[string]string{"/usr/bin/bar2garbage": garbage}

	steps := []step{
		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 5000 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 5000 -s 4096 -c $peer"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 5000 -s 65536", "ib_write_bw -d $dev -x $g -F -n 5000 -s 65536 $peer"},
	}
	// The trapped guest probes first whether a stock kernel lets root map
	// the BAR while the driver holds it (no write).
	probe := fmt.Sprintf("echo '=== probe'\nif bar2garbage -p -r %s; then echo rc=0; else echo rc=$?; fi\n", uarResource)
	o := pvrdmaGuestIn(dir, "gt2", "10.77.0.2/24", probe+matrixScenario("vmw_pvrdma0", "10.77.0.2", "", true, steps))
	o.HostFiles = map[string]string{"/usr/bin/bar2garbage": garbage}
	m := pvrdmaGuestIn(dir, "gm3", "10.77.0.3/24", matrixScenario("vmw_pvrdma0", "10.77.0.3", "10.77.0.2", false, steps))
	for _, c := range []*vm.Config{&h, &o, &m} {
		c.NoErrExit, c.Timeout = true, 15*time.Minute
	}
	latest, stop := watchControl(ctl)
	defer stop()
	vms, err := vm.StartAll(ctx, t, img, nw, h, o, m)
	require.NoError(t, err)
	// The garbage lands on the victim's pages: counted while it runs.
	require.NoError(t, vm.WaitMarked(10*time.Minute, "=== victim", vms[0]))
	require.Eventually(t, func() bool {
		st, err := ctl.Status(ctx)
		if err != nil {
			return false
		}
		for _, v := range st.VMs {
			if v.Name == "gh1" && v.Counters["memory_bad_doorbells"] > 0 {
				return true
			}
		}
		return false
	}, 5*time.Minute, 200*time.Millisecond, "no bad doorbell counted")
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	stop()

	rcRE := regexp.MustCompile(`(?m)^rc=(\d+)$`)
	out := res[0].Output
	assert.Contains(t, vm.Section(out, "garbage"), "bar2garbage: mapped", "the hostile process mapped BAR2:\n%s", out)
	for _, sec := range []string{"victim", "victim server", "garbage end"} {
		s := vm.Section(out, sec)
		m := rcRE.FindAllStringSubmatch(s, -1)
		if assert.NotEmpty(t, m, "gh1 %s: no status:\n%s", sec, out) {
			assert.Equal(t, "0", m[len(m)-1][1], "gh1 %s:\n%s", sec, s)
		}
	}
	assert.Contains(t, vm.Section(out, "garbage end"), "running", "the garbage ran through the victim's run")
	t.Logf("gh1: %s", strings.TrimSpace(vm.Section(out, "garbage end")))
	t.Logf("stock kernel, no iomem=relaxed, BAR2 mapped while the driver holds it: %s", strings.TrimSpace(vm.Section(res[1].Output, "probe")))
	checkSteps(t, res[1:], steps)
	for _, r := range res {
		assert.NotRegexp(t, `Assertion|aborted|core dumped|BUG:|Oops`, r.Console, "%s: QEMU and the guest kernel", r.VM)
	}
	for _, name := range []string{"gh1", "gt2", "gm3"} {
		c := latest(name)
		require.NotNil(t, c, "%s: no counters seen while connected", name)
		t.Logf("%s at the end: %s", name, nonzero(c))
		if name == "gh1" {
			assert.NotZero(t, c["memory_bad_doorbells"], "%s: the garbage is counted", name)
		} else {
			assert.Zero(t, c["memory_bad_doorbells"]+c["bad_doorbells"], "%s: nothing of another VM's garbage", name)
		}
	}
	assert.NotZero(t, latest("gm3")["memory_qp_doorbells"], "gm3: its posts seen in memory")
	st, err := ctl.Status(ctx)
	require.NoError(t, err)
	require.NotNil(t, st.Supervisor)
	assert.Zero(t, st.Supervisor.Restarts, "the daemon's worker never died")
	assert.NotRegexp(t, panicRE, log.String(), "the daemon's log")
}
