//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// doorbellPolls is how many empty polls each measurement makes, doorbellRuns
// how many measurements per device.
const (
	doorbellPolls = 20000
	doorbellRuns  = 3
	pingpongIters = 1000
)

// buildDoorbells compiles testdata/doorbells.c for the guests.
func buildDoorbells(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "doorbells")
	out, err := exec.Command("gcc", "-O2", "-Wall", "-o", bin,
		filepath.Join(repoDir(t), "tests/e2e/testdata/doorbells.c"), "-libverbs").CombinedOutput()
	require.NoError(t, err, "build doorbells (needs gcc and libibverbs-dev: make deps): %s", out)
	return bin
}

// watchCounters keeps the latest counters of each named VM while its QEMU is
// connected (they go with the connection) until stop is called.
func watchCounters(d *backend.Daemon) (latest func(string) map[string]uint64, stop func()) {
	return watchStatus(func() (backend.Status, error) { return d.Status(), nil })
}

// watchStatus polls status every 200 ms and keeps the latest counters of
// each VM while its QEMU is connected until stop is called.
func watchStatus(status func() (backend.Status, error)) (latest func(string) map[string]uint64, stop func()) {
	var mu sync.Mutex
	last := map[string]map[string]uint64{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			if st, err := status(); err == nil {
				for _, v := range st.VMs {
					if v.Connected && v.Counters != nil {
						mu.Lock()
						last[v.Name] = v.Counters
						mu.Unlock()
					}
				}
			}
			select {
			case <-done:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	var once sync.Once
	return func(name string) map[string]uint64 {
			mu.Lock()
			defer mu.Unlock()
			return last[name]
		}, func() {
			once.Do(func() { close(done) })
			wg.Wait()
		}
}

// TestDoorbells: a stock guest polls an empty CQ over our device with
// doorbells trapped (every UAR write a vfio-user round trip) and in memory
// (QEMU maps the user contexts' UAR pages; the daemon polls them), and over
// kernel rxe in the same guest; then 8 loopback RC pairs of one context arm
// their receive CQs back to back and wait for every event (arms overwrite
// each other in memory: each must still be honoured or covered by the
// safety net). A benchmark for the figures (logged, no timed assertion);
// the assertions are that nothing hangs and that, in memory mode, the user
// doorbells were seen in memory, not trapped.
func TestDoorbells(t *testing.T) {
	img := image(t)
	bin := buildDoorbells(t)
	d := daemon(t, backend.Config{VMs: []backend.VMRequest{{Name: "dbtrap"}, {Name: "dbmem", Doorbells: "memory"}}})
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	scen := func(ip string) string {
		var b strings.Builder
		b.WriteString("pvt_rxe eth0\n")
		fmt.Fprintf(&b, "g=$(pvt_gid_index vmw_pvrdma0 %s)\n", ip)
		for i := 0; i < doorbellRuns; i++ {
			fmt.Fprintf(&b, "doorbells -d vmw_pvrdma0 -n %d\ndoorbells -d rxe0 -n %d\n", doorbellPolls, doorbellPolls)
		}
		b.WriteString("echo '=== events'\n")
		b.WriteString("if timeout 600 doorbells -d vmw_pvrdma0 -n 100 -g $g -p 8 -r 40; then echo rc=0; else echo rc=$?; fi\n")
		// Event-driven ping-pong in the guest (loopback): each side arms
		// its CQ, then polls it until empty, which overwrites the arm with
		// a POLL in memory mode (the safety net's case).
		fmt.Fprintf(&b, "gr=$(pvt_gid_index rxe0 %s)\n", ip)
		for i, dev := range []string{"vmw_pvrdma0", "rxe0"} {
			gv := map[string]string{"vmw_pvrdma0": "$g", "rxe0": "$gr"}[dev]
			port := 18800 + i
			fmt.Fprintf(&b, "echo '=== pingpong %s'\n", dev)
			fmt.Fprintf(&b, "timeout 300 ibv_rc_pingpong -d %s -g %s -e -n %d -s 64 -p %d >/tmp/pp.srv 2>&1 &\n", dev, gv, pingpongIters, port)
			fmt.Fprintf(&b, "if pvt_retry 30 timeout 300 ibv_rc_pingpong -d %s -g %s -e -n %d -s 64 -p %d 127.0.0.1; then echo rc=0; else echo rc=$?; fi\n", dev, gv, pingpongIters, port)
			b.WriteString("wait\n")
		}
		return b.String()
	}
	latest, stop := watchCounters(d)
	defer stop()
	res := map[string]string{}
	// One guest at a time: the figures of one are not disturbed by the other.
	// Each its own address: a GID a VM bound stays reserved to it.
	ips := map[string]string{"dbtrap": "10.77.0.1", "dbmem": "10.77.0.2"}
	for _, name := range []string{"dbtrap", "dbmem"} {
		c := pvrdmaGuest(d, name, ips[name]+"/24", scen(ips[name]))
		c.Modules = append(vm.DefaultModules(), "crc32_generic", "udp_tunnel", "ip6_udp_tunnel", "rdma_rxe")
		c.HostFiles = map[string]string{"/usr/bin/doorbells": bin}
		r := runGuests(context.Background(), t, img, nw, 15*time.Minute, c)
		res[name] = r[0].Output
		time.Sleep(500 * time.Millisecond)
	}
	stop()
	lineRE := regexp.MustCompile(`(?m)^doorbells: (\S+) empty_poll n=` + strconv.Itoa(doorbellPolls) + ` ns_per_poll=(\d+)$`)
	cost := map[string][]float64{}
	for _, name := range []string{"dbtrap", "dbmem"} {
		out := res[name]
		for _, m := range lineRE.FindAllStringSubmatch(out, -1) {
			v, _ := strconv.ParseFloat(m[2], 64)
			key := name + "/" + m[1]
			cost[key] = append(cost[key], v)
		}
		ev := vm.Section(out, "events")
		assert.Contains(t, ev, "rc=0", "%s: every event of the back-to-back arms came: %s", name, ev)
		assert.Regexp(t, `events pairs=8 rounds=40 spurious=\d+ us_per_round=\d+ OK`, ev, name)
		t.Logf("DOORBELLS %s events: %s", name, strings.TrimSpace(ev))
		c := latest(name)
		t.Logf("DOORBELLS %s counters: %s", name, nonzero(c))
		require.NotNil(t, c, "%s: no counters seen while connected", name)
	}
	ppRE := regexp.MustCompile(`(?m)^\d+ iters in [\d.]+ seconds = ([\d.]+) usec/iter$`)
	for _, name := range []string{"dbtrap", "dbmem"} {
		for _, dev := range []string{"vmw_pvrdma0", "rxe0"} {
			sec := vm.Section(res[name], "pingpong "+dev)
			assert.Contains(t, sec, "rc=0", "%s: ibv_rc_pingpong -e over %s: %s", name, dev, sec)
			if m := ppRE.FindStringSubmatch(sec); m != nil {
				t.Logf("DOORBELLS ibv_rc_pingpong -e -s 64 -n %d (loopback in one guest) vm=%s dev=%s: %s usec/iter", pingpongIters, name, dev, m[1])
			}
		}
	}
	for _, k := range []string{"dbtrap/vmw_pvrdma0", "dbtrap/rxe0", "dbmem/vmw_pvrdma0", "dbmem/rxe0"} {
		assert.Len(t, cost[k], doorbellRuns, "%s: every measurement printed", k)
	}
	med := func(k string) float64 {
		v := append([]float64(nil), cost[k]...)
		if len(v) == 0 {
			return 0
		}
		for i := range v {
			for j := i + 1; j < len(v); j++ {
				if v[j] < v[i] {
					v[i], v[j] = v[j], v[i]
				}
			}
		}
		return v[len(v)/2]
	}
	for _, name := range []string{"dbtrap", "dbmem"} {
		p, x := med(name+"/vmw_pvrdma0"), med(name+"/rxe0")
		ratio := 0.0
		if x > 0 {
			ratio = p / x
		}
		t.Logf("DOORBELLS empty ibv_poll_cq (median of %d x %d) vm=%s: pvrdma %.0f ns, rxe %.0f ns, ratio %.1fx (all: pvrdma %v rxe %v)",
			doorbellRuns, doorbellPolls, name, p, x, ratio, cost[name+"/vmw_pvrdma0"], cost[name+"/rxe0"])
	}
	if p, q := med("dbtrap/vmw_pvrdma0"), med("dbmem/vmw_pvrdma0"); q > 0 {
		t.Logf("DOORBELLS trapped/memory empty poll: %.1fx", p/q)
	}
	polls := uint64(doorbellRuns * (doorbellPolls + 100))
	m, tr := latest("dbmem"), latest("dbtrap")
	assert.GreaterOrEqual(t, tr["trapped_cq_poll_doorbells"], polls, "trapped: every empty poll is a region write")
	assert.Zero(t, tr["memory_cq_poll_doorbells"]+tr["memory_qp_doorbells"], "trapped: nothing in memory")
	assert.NotZero(t, m["memory_cq_poll_doorbells"], "memory: the polls' doorbells were seen in memory")
	assert.NotZero(t, m["memory_qp_doorbells"], "memory: the posts' doorbells were seen in memory")
	assert.Less(t, m["trapped_cq_poll_doorbells"], polls/10, "memory: the user contexts' doorbells are not trapped (QEMU mapped the pages)")
	assert.Zero(t, m["memory_bad_doorbells"])
}
