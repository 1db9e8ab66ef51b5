//go:build vm

package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/proc"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// linkNetworks joins two test networks (each a netns with a bridge) with a
// veth pair whose ends are enslaved to the bridges: one L2 across "hosts".
func linkNetworks(t *testing.T, a, b *vm.Network, nameA, nameB string) {
	t.Helper()
	require.NoError(t, a.Do(func() error {
		nsB, err := netns.GetFromPath(b.NSPath())
		if err != nil {
			return err
		}
		defer nsB.Close()
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: nameA}, PeerName: nameB, PeerNamespace: netlink.NsFd(nsB)}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("veth %s/%s: %w", nameA, nameB, err)
		}
		br, err := netlink.LinkByName(a.Bridge())
		if err != nil {
			return err
		}
		l, err := netlink.LinkByName(nameA)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetMaster(l, br); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	}))
	require.NoError(t, b.Do(func() error {
		br, err := netlink.LinkByName(b.Bridge())
		if err != nil {
			return err
		}
		l, err := netlink.LinkByName(nameB)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetMaster(l, br); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	}))
}

// fabricLink makes a routed RDMA fabric between two hosts: a veth pair
// fabA/fabB with a route for the guests' subnet through it on each side.
// The daemons add their VMs' GIDs to these netdevs as host addresses.
func fabricLink(t *testing.T, a, b *vm.Network, subnet string) {
	t.Helper()
	_, dst, err := net.ParseCIDR(subnet)
	require.NoError(t, err)
	require.NoError(t, a.Do(func() error {
		nsB, err := netns.GetFromPath(b.NSPath())
		if err != nil {
			return err
		}
		defer nsB.Close()
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fabA"}, PeerName: "fabB", PeerNamespace: netlink.NsFd(nsB)})
	}))
	for _, side := range []struct {
		nw   *vm.Network
		name string
	}{{a, "fabA"}, {b, "fabB"}} {
		require.NoError(t, side.nw.Do(func() error {
			l, err := netlink.LinkByName(side.name)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK})
		}))
	}
}

// daemonIn starts a daemon inside a network namespace, so its sockets and
// netlink handles live there.
func daemonIn(t *testing.T, nw *vm.Network, fab backend.FabricConfig, names ...string) *backend.Daemon {
	t.Helper()
	var d *backend.Daemon
	require.NoError(t, nw.Do(func() error {
		d = daemon(t, backend.Config{Fabric: fab}, names...)
		if d == nil {
			return errors.New("no daemon")
		}
		return nil
	}))
	return d
}

// daemonProcessIn runs `pvrdma-backend serve --keep-state` (bin) in a
// network namespace, serving the named VMs in IP mode on netdev, as a
// process of its own: a live upgrade execs it. It returns the socket
// directory; the daemon stops at cleanup.
func daemonProcessIn(t *testing.T, nw *vm.Network, bin, netdev string, names ...string) string {
	t.Helper()
	dir := t.TempDir()
	args := []string{"--net=" + nw.NSPath(), bin, "serve", "--socket-dir", dir, "--keep-state", "--fabric-netdev", netdev,
		"--gid-allow", "10.77.0.0/24"} // the fabric's pool (IP mode assigns none by default)
	for _, n := range names {
		args = append(args, "--vm", n)
	}
	// nsenter execs the daemon: the PID, and with it the signals below
	// and the death signal, are the daemon's.
	cmd := exec.Command("nsenter", args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stdout, cmd.Stderr = testWriter{t}, testWriter{t}
	done, err := proc.Start(cmd)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(dir, "control.sock"))
		return err == nil
	}, 30*time.Second, 20*time.Millisecond, "the daemon in %s did not start", nw.NSPath())
	return dir
}

// upgradeDuring waits until every guest has printed mark (a step under
// way; the tools' own output is buffered until they exit) and the daemons
// (all) see the VMs' sends flowing (the RC QPs are in RTS: a WRITE test's
// server sends nothing), then hands the daemon behind ctl over to its own
// binary and waits for generation gen to serve: the guests' RC connections
// must carry on (every RC QP kept) and the fabric's sockets go with it.
func upgradeDuring(t *testing.T, vms []*vm.VM, mark string, all []*backend.ControlClient, ctl *backend.ControlClient, gen int, who string) {
	t.Helper()
	require.NoError(t, vm.WaitMarked(5*time.Minute, mark, vms...))
	sends := func() uint64 {
		var n uint64
		for _, c := range all {
			if st, err := c.Status(context.Background()); err == nil {
				for _, v := range st.VMs {
					n += v.Counters["send_wqes"]
				}
			}
		}
		return n
	}
	require.NoError(t, vm.WaitRising(2*time.Minute, 200*time.Millisecond, sends), "sends during %s", mark)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, ctl.Upgrade(ctx, ""))
	var st backend.Status
	require.Eventually(t, func() bool {
		var err error
		st, err = ctl.Status(ctx)
		return err == nil && st.Handover != nil && st.Handover.Generation >= gen && (st.Handover.PauseMS > 0 || st.Handover.VMs == 0)
	}, time.Minute, 20*time.Millisecond, "daemon %s: hand-over %d did not complete", who, gen)
	h := st.Handover
	t.Logf("daemon %s hand-over %d during %q: pause %.1f ms (saving %.1f, starting %.1f, resuming %.1f), RC QPs kept %d, errored %d",
		who, gen, strings.TrimPrefix(mark, "=== "), h.PauseMS, h.SaveMS, h.StartMS, h.ResumeMS, h.Continued, h.Errored)
	require.GreaterOrEqual(t, h.Continued, 1, "daemon %s: the guest's RC QP kept its connection: %+v", who, h)
	require.Zero(t, h.Errored, "daemon %s: %+v", who, h)
	require.Equal(t, uint64(2), st.Counters["wire_rx_sockets_inherited"], "daemon %s: the fabric's sockets were handed over", who)
}

// twoHosts builds the daemon binary and makes two hosts (network namespaces, each with
// a bridge for its VMs) joined by one L2 for the guests' NICs and a routed fabric
// (fabA/fabB) for 10.77.0.0/24, as TestTwoHosts runs them.
func twoHosts(t *testing.T) (bin string, nwA, nwB *vm.Network) {
	t.Helper()
	bin = buildDaemon(t)
	nwA, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	nwB, err = vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	linkNetworks(t, nwA, nwB, "vmnetA", "vmnetB")
	fabricLink(t, nwA, nwB, "10.77.0.0/24")
	for _, nw := range []*vm.Network{nwA, nwB} {
		// IP mode's host requirement (docs/ARCHITECTURE.md): answer ARP for the
		// guests' GIDs only on the fabric netdev, not on the VM-facing bridge.
		require.NoError(t, nw.Do(func() error {
			return os.WriteFile("/proc/sys/net/ipv4/conf/all/arp_ignore", []byte("1"), 0o644)
		}))
	}
	return bin, nwA, nwB
}

// TestTwoHosts: two VMs on two backends in two network namespaces (two
// hosts) reach each other over the kernel UDP 4791 path: each daemon adds
// its VM's GIDs to its fabric netdev (netlink). Each daemon is a process of
// its own, and both are upgraded live while the guests' RC traffic runs
// (daemon A during the ping-pong, B and then A again during ib_write_bw):
// the connections carry on and every step passes.
func TestTwoHosts(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	bin, nwA, nwB := twoHosts(t)
	dirA := daemonProcessIn(t, nwA, bin, "fabA", "ha1")
	dirB := daemonProcessIn(t, nwB, bin, "fabB", "hb1")
	ctlA := backend.NewControlClient(filepath.Join(dirA, "control.sock"))
	ctlB := backend.NewControlClient(filepath.Join(dirB, "control.sock"))

	steps := []step{
		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 20000 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 20000 -s 4096 -c $peer"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -D 12 -s 65536", "ib_write_bw -d $dev -x $g -F -D 12 -s 65536 $peer"},
	}
	a := pvrdmaGuestIn(dirA, "ha1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps))
	b := pvrdmaGuestIn(dirB, "hb1", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, steps))
	a.NoErrExit, b.NoErrExit = true, true
	a.Timeout, b.Timeout = 6*time.Minute, 6*time.Minute
	va, err := vm.Start(ctx, t, img, nwA, a)
	require.NoError(t, err)
	vb, err := vm.Start(ctx, t, img, nwB, b)
	require.NoError(t, err)
	vms := []*vm.VM{va, vb}
	both := []*backend.ControlClient{ctlA, ctlB}
	upgradeDuring(t, vms, "=== rc_pingpong", both, ctlA, 1, "A")
	upgradeDuring(t, vms, "=== ib_write_bw", both, ctlB, 1, "B")
	upgradeDuring(t, vms, "=== ib_write_bw", both, ctlA, 2, "A")
	res, err := vm.WaitAll(ctx, va, vb)
	require.NoError(t, err)
	checkSteps(t, res, steps)
	for _, ctl := range []*backend.ControlClient{ctlA, ctlB} {
		st, err := ctl.Status(ctx)
		require.NoError(t, err)
		t.Logf("fabric %s counters: %v", st.Fabric.Netdev, st.Counters)
	}
	for i, r := range res {
		if bw, err := vm.ParsePerftestBW(vm.Section(r.Output, "ib_write_bw")); err == nil && len(bw) == 1 {
			t.Logf("PVRDMA-2HOST ib_write_bw 65536B vm=%s side=%s avg_MBps=%.2f", r.VM, side(i), bw[0].AvgMBps)
		}
		if pp, err := vm.ParsePingPong(vm.Section(r.Output, "rc_pingpong")); err == nil {
			t.Logf("PVRDMA-2HOST ibv_rc_pingpong 4096B vm=%s Mbps=%.2f usec_per_iter=%.2f", r.VM, pp.Mbps, pp.UsecPerIter)
		}
	}
}
