//go:build vm

package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// vlanTag is a RoCE v2 frame's 802.1Q tag as captured (tagged false: none).
type vlanTag struct {
	tagged   bool
	vid, pcp uint16
}

// tagCount counts the tags of the IPv4 UDP 4791 frames of each source MAC.
type tagCount struct {
	mu   sync.Mutex
	tags map[string]map[vlanTag]int
}

func (c *tagCount) of(mac net.HardwareAddr) map[vlanTag]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[vlanTag]int{}
	for k, v := range c.tags[mac.String()] {
		out[k] = v
	}
	return out
}

// captureRoCE calls fn, until the test ends, for every IPv4 RoCE v2 frame
// (UDP 4791) crossing the network's bridge, with its source MAC, its
// 802.1Q tag and its IPv4 TOS. Frames the daemon injects carry their tag
// in the data; received ones have it taken out by the kernel and reported
// in the packet's auxiliary data. fn runs on the capture's goroutine.
func captureRoCE(t *testing.T, nw *vm.Network, fn func(src net.HardwareAddr, tag vlanTag, tos byte)) {
	t.Helper()
	var fd int
	require.NoError(t, nw.Do(func() error {
		ifi, err := net.InterfaceByName(nw.Bridge())
		if err != nil {
			return err
		}
		// ETH_P_ALL: frames the daemon injects are outgoing on the bridge,
		// which only ETH_P_ALL taps see.
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_AUXDATA, 1); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index})
	}))
	done := make(chan struct{})
	t.Cleanup(func() { unix.Close(fd); <-done })
	require.NoError(t, unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1}))
	go func() {
		defer close(done)
		buf := make([]byte, 9000)
		oob := make([]byte, 256)
		for {
			n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, 0)
			if err != nil {
				if err == unix.EAGAIN || err == unix.EINTR {
					continue
				}
				return
			}
			f := buf[:n]
			if n < 18 {
				continue
			}
			var tag vlanTag
			l3 := 14
			if binary.BigEndian.Uint16(f[12:]) == 0x8100 {
				tci := binary.BigEndian.Uint16(f[14:])
				tag, l3 = vlanTag{true, tci & 0xfff, tci >> 13}, 18
			}
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				if m.Header.Level == unix.SOL_PACKET && m.Header.Type == unix.PACKET_AUXDATA && len(m.Data) >= int(unsafe.Sizeof(unix.TpacketAuxdata{})) {
					aux := (*unix.TpacketAuxdata)(unsafe.Pointer(&m.Data[0]))
					if aux.Status&unix.TP_STATUS_VLAN_VALID != 0 {
						tag = vlanTag{true, aux.Vlan_tci & 0xfff, aux.Vlan_tci >> 13}
					}
				}
			}
			if n < l3+28 || binary.BigEndian.Uint16(f[l3-2:]) != unix.ETH_P_IP || f[l3+9] != unix.IPPROTO_UDP {
				continue
			}
			ihl := int(f[l3]&0xf) * 4
			if n < l3+ihl+8 || binary.BigEndian.Uint16(f[l3+ihl+2:]) != 4791 {
				continue
			}
			fn(net.HardwareAddr(bytes.Clone(f[6:12])), tag, f[l3+1])
		}
	}()
}

// captureTags counts the tags of the RoCE v2 frames on the bridge.
func captureTags(t *testing.T, nw *vm.Network) *tagCount {
	c := &tagCount{tags: map[string]map[vlanTag]int{}}
	captureRoCE(t, nw, func(src net.HardwareAddr, tag vlanTag, _ byte) {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.tags[src.String()] == nil {
			c.tags[src.String()] = map[vlanTag]int{}
		}
		c.tags[src.String()][tag]++
	})
	return c
}

// vlanSetup adds VLAN 100 on the guest's NIC (the one holding nicIP) with
// addr, and an egress priority map if qos is set.
func vlanSetup(nicIP, addr, qos string) string {
	return fmt.Sprintf(`nic=$(ip -o -4 addr show | awk -v a=%q 'index($4, a"/") == 1 {print $2}')
ip link add link $nic name vlan100 type vlan id 100 %s
ip addr add %s dev vlan100
ip link set vlan100 up
`, nicIP, qos, addr)
}

// TestVLANPriority: in L2 mode with --fabric-vlan 100 and the priority
// derived from the traffic class, our VM talks to kernel rxe using a VLAN
// 100 interface (with an egress priority map: every priority to PCP 4) in
// another guest: rxe runs over eth0 (it refuses VLAN devices) and uses
// the GID of the VLAN interface's address, so its frames leave through
// the VLAN device. Both guests address each other on the VLAN.
// On the bridge, every RoCE frame of our VM carries VLAN 100 with PCP 3
// (perftest --tclass 104: DSCP 26, class 3), every frame of rxe VLAN 100
// with PCP 4; and the daemon takes rxe's tagged frames in.
func TestVLANPriority(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	d := daemonIn(t, nw, backend.FabricConfig{Bridge: nw.Bridge(), VLAN: 100}, "vl1")
	tags := captureTags(t, nw)
	steps := []step{
		{"rc_pingpong", "ibv_rc_pingpong -d $dev -g $g -n 200 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 200 -s 4096 $peer"},
		{"ib_write_bw", "ib_write_bw -d $dev -x $g -F -n 100 -s 65536", "ib_write_bw -d $dev -x $g -F -n 100 -s 65536 --tclass=104 $peer"},
	}
	const rxeMAC = "52:54:00:77:00:14"
	a := pvrdmaGuest(d, "vl1", "10.77.0.1/24",
		vlanSetup("10.77.0.1", "10.80.0.1/24", "")+matrixScenario("vmw_pvrdma0", "10.80.0.1", "10.80.0.2", false, steps))
	a.Modules = []string{"ib_core", "ib_uverbs", "vmw_pvrdma", "8021q"}
	r := vm.Config{Name: "vlrxe", Modules: []string{"ib_core", "ib_uverbs", "8021q"},
		NICs: []vm.NIC{{Addr: "05.0", MAC: rxeMAC, IP: "10.77.0.2/24"}},
		Scenario: vlanSetup("10.77.0.2", "10.80.0.2/24", "egress-qos-map 0:4 1:4 2:4 3:4 4:4 5:4 6:4 7:4") +
			"pvt_rxe eth0\n" + matrixScenario("rxe0", "10.80.0.2", "", true, steps)}
	res := runGuests(ctx, t, img, nw, 6*time.Minute, a, r)
	checkSteps(t, res, steps)

	ours, theirs := tags.of(backend.DefaultMAC("vl1")), tags.of(net.HardwareAddr{0x52, 0x54, 0, 0x77, 0, 0x14})
	t.Logf("RoCE v2 frames by tag: ours %v, rxe's %v", ours, theirs)
	for tag, c := range ours {
		assert.Equal(t, vlanTag{true, 100, tag.pcp}, tag, "%d frames of ours", c)
	}
	assert.Greater(t, ours[vlanTag{true, 100, 3}], 100, "the WRITEs: PCP 3 from the traffic class")
	assert.Positive(t, ours[vlanTag{true, 100, 0}], "the ping-pong (traffic class 0): PCP 0")
	for tag, c := range theirs {
		assert.Equal(t, vlanTag{true, 100, 4}, tag, "%d frames of rxe's", c)
	}
	assert.Positive(t, len(theirs), "rxe's frames crossed the bridge")
}
