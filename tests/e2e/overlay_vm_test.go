//go:build vm

package e2e

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// overlayNetworks joins the bridges of two test networks ("hosts") into
// one L2 segment with the kernel's VXLAN, as Linux bridges build a
// distributed switch: an underlay veth pair (the hosts' physical link,
// underlayMTU) carries VNI 4242 between a VXLAN port on each bridge. The
// encapsulation takes 50 bytes, so each bridge's MTU is set to
// underlayMTU-50, the largest frame the overlay carries.
func overlayNetworks(t *testing.T, a, b *vm.Network, underlayMTU int) {
	t.Helper()
	require.NoError(t, a.Do(func() error {
		nsB, err := netns.GetFromPath(b.NSPath())
		if err != nil {
			return err
		}
		defer nsB.Close()
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ulA", MTU: underlayMTU}, PeerName: "ulB",
			PeerMTU: uint32(underlayMTU), PeerNamespace: netlink.NsFd(nsB)})
	}))
	for i, side := range []struct {
		nw           *vm.Network
		ul, vx       string
		local, other string
	}{{a, "ulA", "vxA", "192.168.240.1", "192.168.240.2"}, {b, "ulB", "vxB", "192.168.240.2", "192.168.240.1"}} {
		require.NoError(t, side.nw.Do(func() error {
			ul, err := netlink.LinkByName(side.ul)
			if err != nil {
				return err
			}
			addr, _ := netlink.ParseAddr(side.local + "/30")
			if err := netlink.AddrAdd(ul, addr); err != nil {
				return err
			}
			if err := netlink.LinkSetMTU(ul, underlayMTU); err != nil {
				return err
			}
			if err := netlink.LinkSetUp(ul); err != nil {
				return err
			}
			vx := &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: side.vx, MTU: underlayMTU - 50}, VxlanId: 4242,
				VtepDevIndex: ul.Attrs().Index, SrcAddr: net.ParseIP(side.local), Group: net.ParseIP(side.other),
				Port: 4789, Learning: true}
			if err := netlink.LinkAdd(vx); err != nil {
				return fmt.Errorf("vxlan on side %d: %w", i, err)
			}
			br, err := netlink.LinkByName(side.nw.Bridge())
			if err != nil {
				return err
			}
			if err := netlink.LinkSetMaster(vx, br); err != nil {
				return err
			}
			if err := netlink.LinkSetUp(vx); err != nil {
				return err
			}
			return netlink.LinkSetMTU(br, underlayMTU-50)
		}))
	}
}

// TestOverlayHosts: two hosts (network namespaces), one daemon each in L2
// mode on its host's bridge, the bridges joined by a VXLAN overlay whose
// MTU (4150: a 4200-byte underlay less VXLAN's 50) is smaller than the
// underlay's. Each host's stock guest sees the port's active MTU follow
// the overlay (2048; the underlay's would give 4096, a plain 1500-byte
// bridge 1024), and perftest and the verbs ping-pong run across it at
// that MTU.
func TestOverlayHosts(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	// Bridge and taps at the overlay's MTU (a bridge keeps the smallest of
	// its ports' otherwise; the guests' NICs stay at 1500).
	const underlay = 4200
	nwA, err := vm.NewNetwork(t, vm.NetworkConfig{MTU: underlay - 50})
	require.NoError(t, err)
	nwB, err := vm.NewNetwork(t, vm.NetworkConfig{MTU: underlay - 50})
	require.NoError(t, err)
	overlayNetworks(t, nwA, nwB, underlay)
	dA := daemonIn(t, nwA, backend.FabricConfig{Bridge: nwA.Bridge()}, "ov1")
	dB := daemonIn(t, nwB, backend.FabricConfig{Bridge: nwB.Bridge()}, "ov2")

	steps := []step{
		{"devinfo", "ibv_devinfo -d $dev -v", "ibv_devinfo -d $dev -v"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 300 -s 65536", "ib_write_bw -d $dev -x $g -F -n 300 -s 65536 $peer"},
		{"ib_send_bw", "ib_send_bw -d $dev -x $g -F -n 300 -s 65536", "ib_send_bw -d $dev -x $g -F -n 300 -s 65536 $peer"},

		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096 -m 2048 -c", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096 -m 2048 -c $peer"},
	}
	a := pvrdmaGuest(dA, "ov1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps))
	b := pvrdmaGuest(dB, "ov2", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, steps))
	for _, c := range []*vm.Config{&a, &b} {
		c.NoErrExit, c.Timeout = true, 6*time.Minute
	}
	va, err := vm.Start(ctx, t, img, nwA, a)
	require.NoError(t, err)
	vb, err := vm.Start(ctx, t, img, nwB, b)
	require.NoError(t, err)
	for _, nw := range []*vm.Network{nwA, nwB} {
		require.NoError(t, nw.Do(func() error {
			br, err := netlink.LinkByName(nw.Bridge())
			if err == nil && br.Attrs().MTU != underlay-50 {
				err = fmt.Errorf("bridge MTU %d, want the overlay's %d", br.Attrs().MTU, underlay-50)
			}
			return err
		}), "the guests' taps keep the bridge at the overlay's MTU")
	}
	res, err := vm.WaitAll(ctx, va, vb)
	require.NoError(t, err)
	checkSteps(t, res, steps)
	activeRE := regexp.MustCompile(`active_mtu:\s*(\d+)`)
	perftestRE := regexp.MustCompile(`Mtu\s*:\s*(\d+)\[B\]`)
	for i, r := range res {
		m := activeRE.FindStringSubmatch(vm.Section(r.Output, "devinfo"))
		if assert.NotNil(t, m, "%s: no active_mtu", r.VM) {
			assert.Equal(t, "2048", m[1], "%s: the port's active MTU follows the overlay's", r.VM)
		}
		for _, tool := range []string{"ib_write_bw", "ib_send_bw"} {
			sec := vm.Section(r.Output, tool)
			if m := perftestRE.FindStringSubmatch(sec); assert.NotNil(t, m, "%s %s: no MTU line", r.VM, tool) {
				assert.Equal(t, "2048", m[1], "%s %s ran at the overlay's MTU", r.VM, tool)
			}
			if bw, err := vm.ParsePerftestBW(sec); err == nil && len(bw) == 1 {
				t.Logf("PVRDMA-OVERLAY %s 65536B vm=%s side=%s avg_MBps=%.2f", tool, r.VM, side(i), bw[0].AvgMBps)
			}
		}
	}
	for _, d := range []*backend.Daemon{dA, dB} {
		st := d.Status()
		t.Logf("fabric %s (MTU of the overlay) counters: %s", st.Fabric.Netdev, nonzero(st.Counters))
		assert.Zero(t, st.Counters["drop_oversize"], "no frame larger than the overlay carries")
	}
}
