//go:build linux

package soft

import (
	"encoding/binary"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"net"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// 802.1Q, as the tests read it.
const (
	etherType8021Q = 0x8100
	vlanIDMask     = 0x0fff
	pcpShift       = 13
)

// frameTag is one captured frame's Ethertype and 802.1Q tag (tagged is
// false for an untagged frame).
type frameTag struct {
	etherType uint16
	tagged    bool
	vid, pcp  uint16
	roce      bool // the frame holds a RoCE v2 datagram
}

// tagCapture captures every frame crossing ifname (in ns), received or
// sent, with its tag: inline in the data, or (as the kernel delivers
// received tagged frames) in the packet's auxiliary data.
func tagCapture(t *testing.T, ns *netns, ifname string) func() []frameTag {
	var fd int
	ns.do(t, func() {
		var err error
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK, int(htons(unix.ETH_P_ALL)))
		require.NoError(t, err)
		require.NoError(t, unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 16<<20))
		require.NoError(t, unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_AUXDATA, 1))
		ifi, err := net.InterfaceByName(ifname)
		require.NoError(t, err)
		require.NoError(t, unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}))
	})
	t.Cleanup(func() { unix.Close(fd) })
	return func() []frameTag {
		var out []frameTag
		buf := make([]byte, 9000)
		oob := make([]byte, 256)
		for {
			n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, 0)
			if err != nil {
				return out
			}
			if n < 14 {
				continue
			}
			f := frameTag{etherType: binary.BigEndian.Uint16(buf[12:])}
			l3 := 14
			if f.etherType == etherType8021Q && n >= 18 {
				tci := binary.BigEndian.Uint16(buf[14:])
				f = frameTag{etherType: binary.BigEndian.Uint16(buf[16:]), tagged: true, vid: tci & vlanIDMask, pcp: tci >> pcpShift}
				l3 = 18
			}
			var rp roce.Packet
			f.roce = rp.Parse(buf[l3:n]) == nil
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				if m.Header.Level != unix.SOL_PACKET || m.Header.Type != unix.PACKET_AUXDATA || len(m.Data) < int(unsafe.Sizeof(unix.TpacketAuxdata{})) {
					continue
				}
				aux := (*unix.TpacketAuxdata)(unsafe.Pointer(&m.Data[0]))
				if aux.Status&unix.TP_STATUS_VLAN_VALID != 0 {
					f.tagged, f.vid, f.pcp = true, aux.Vlan_tci&vlanIDMask, aux.Vlan_tci>>pcpShift
				}
			}
			out = append(out, f)
		}
	}
}

// TestPacketWireVLAN: two fabrics on VLAN 100 reach each other with every
// frame tagged: the priority follows each packet's traffic class
// (PCPFromTrafficClass: TOS 0x68, DSCP 26, gives 3) on one side and is
// fixed (5) on the other; the uplink carries no untagged RoCE frame.
func TestPacketWireVLAN(t *testing.T) {
	x, _, fx, fy := bridgedFabricsWith(t, wire.PacketWireConfig{VLAN: 100, PCP: wire.PCPFromTrafficClass}, wire.PacketWireConfig{VLAN: 100, PCP: 5})
	capX := tagCapture(t, x, "vx")
	a := newEndpoint(t, fx, "a", "10.9.0.1", 1<<20)
	b := newEndpoint(t, fy, "bb", "10.9.0.2", 1<<20)
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	o.tclass = 0x68
	qa, _ := connectL2(t, a, b, harnessMAC("a"), harnessMAC("bb"), o)
	src := make([]byte, 128<<10)
	fill(src, 5)
	a.write(t, a.iova, src)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 0, len(src)), RemoteAddr: b.iova + 4096, RKey: b.mr.RKey()}))
	wc := a.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v\nx: %v\ny: %v", wc, nonzero(fx.Counters()), nonzero(fy.Counters()))
	assert.Equal(t, src, b.read(t, b.iova+4096, len(src)))

	byPCP := map[[2]uint16]int{}
	for _, f := range capX() {
		switch {
		case f.roce && !f.tagged:
			t.Errorf("an untagged RoCE frame on the uplink")
		case f.roce:
			assert.EqualValues(t, 100, f.vid)
			byPCP[[2]uint16{f.etherType, f.pcp}]++
		}
	}
	t.Logf("tagged frames on the uplink by (ethertype, PCP): %v", byPCP)
	assert.Greater(t, byPCP[[2]uint16{unix.ETH_P_IP, 3}], 100, "x's WRITEs: PCP 3 from DSCP 26")
	assert.Positive(t, byPCP[[2]uint16{unix.ETH_P_IP, 5}], "y's ACKs: the fixed PCP 5")
	assert.Zero(t, fx.Counters()["drop_bad_icrc"]+fy.Counters()["drop_bad_icrc"])
}

// TestPacketWireOtherVLAN: a fabric takes in only frames of its own VLAN:
// y (untagged) ignores x's VLAN 100 frames, so b never sees a's datagram.
func TestPacketWireOtherVLAN(t *testing.T) {
	_, _, fx, fy := bridgedFabricsWith(t, wire.PacketWireConfig{VLAN: 100}, wire.PacketWireConfig{})
	a := newEndpoint(t, fx, "a", "10.9.0.1", 1<<20)
	b := newEndpoint(t, fy, "bb", "10.9.0.2", 1<<20)
	qa, qb := udQP(t, a, hostverbs.QPTypeUD, 7), udQP(t, b, hostverbs.QPTypeUD, 7)
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: sge(b, 0, 4096)}))
	for i := range 5 {
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, 64), AV: hostverbs.AddressVector{DGID: b.gid, DMAC: harnessMAC("bb")}, RemoteQPN: qb.QPN(), RemoteQKey: 7}))
		require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)
	}
	assert.Positive(t, fx.Counters()["tx_packets"])
	b.ccq.none(t, 300*time.Millisecond)
	assert.Zero(t, fy.Counters()["rx_packets"], "y took in frames of another VLAN")
}

func TestPacketWireVLANConfig(t *testing.T) {
	needRoot(t)
	_, err := wire.NewPacketWire(wire.PacketWireConfig{Interface: "lo", VLAN: 4095})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
	_, err = wire.NewPacketWire(wire.PacketWireConfig{Interface: "lo", VLAN: 10, PCP: 8})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
}
