//go:build vm

package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
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

// TestTwoHosts: two VMs on two backends in two network namespaces (two
// hosts) reach each other over the kernel UDP 4791 path: each daemon adds
// its VM's GIDs to its fabric netdev (netlink).
func TestTwoHosts(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	nwA, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	nwB, err := vm.NewNetwork(t, vm.NetworkConfig{})
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
	dA := daemonIn(t, nwA, backend.FabricConfig{Netdev: "fabA"}, "ha1")
	dB := daemonIn(t, nwB, backend.FabricConfig{Netdev: "fabB"}, "hb1")

	steps := []step{
		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096 $peer"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536", "ib_write_bw -d $dev -x $g -F -n 200 -s 65536 $peer"},
	}
	a := pvrdmaGuest(dA, "ha1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps))
	b := pvrdmaGuest(dB, "hb1", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, steps))
	a.NoErrExit, b.NoErrExit = true, true
	a.Timeout, b.Timeout = 6*time.Minute, 6*time.Minute
	va, err := vm.Start(ctx, t, img, nwA, a)
	require.NoError(t, err)
	vb, err := vm.Start(ctx, t, img, nwB, b)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, va, vb)
	require.NoError(t, err)
	checkSteps(t, res, steps)
	for _, d := range []*backend.Daemon{dA, dB} {
		st := d.Status()
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
