//go:build linux

package soft

import (
	"bytes"
	"encoding/binary"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// connectL2 connects an RC pair whose address vectors carry the peers'
// MACs, as a guest's do (it resolves them with ARP).
// The harness gives a device named n the MAC 52:54:00:00:00:len(n).
func harnessMAC(name string) [6]byte { return [6]byte{0x52, 0x54, 0, 0, 0, byte(len(name))} }

func connectL2(t *testing.T, a, b *endpoint, macA, macB [6]byte, o rcOpts) (qa, qb hostverbs.QP) {
	t.Helper()
	qa, qb = createRC(t, a, o), createRC(t, b, o)
	for _, s := range []struct {
		q, peer hostverbs.QP
		remote  *endpoint
		mac     [6]byte
		rq, sq  uint32
	}{{qa, qb, b, macB, o.psnB, o.psnA}, {qb, qa, a, macA, o.psnA, o.psnB}} {
		require.NoError(t, s.q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: o.mtu, DestQPN: s.peer.QPN(),
			RQPSN: s.rq, MaxDestRdAtomic: o.rdAtomic, MinRNRTimer: o.minRNR,
			AV: hostverbs.AddressVector{DGID: s.remote.gid, HopLimit: 64, Port: 1, DMAC: s.mac, TrafficClass: o.tclass}},
			hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|
				hostverbs.AttrRQPSN|hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
		require.NoError(t, s.q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: o.timeout,
			RetryCnt: o.retry, RNRRetry: o.rnr, SQPSN: s.sq, MaxRdAtomic: o.rdAtomic},
			hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|hostverbs.AttrRNRRetry|
				hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic))
	}
	return qa, qb
}

// TestPacketWireBridgedHosts: two hosts (network namespaces), each with a
// bridge, the bridges joined by a veth: one L2 segment. A fabric on each
// bridge reaches the other through PacketWire alone (no host IP address
// anywhere), with frames carrying the devices' own MACs, and neither bridge
// learns its own fabric's source MAC on the uplink.
func TestPacketWireBridgedHosts(t *testing.T) {
	x, _, fx, fy := bridgedFabrics(t)
	a := newEndpoint(t, fx, "a", "10.9.0.1", 1<<20)
	b := newEndpoint(t, fy, "bb", "10.9.0.2", 1<<20)
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	qa, qb := connectL2(t, a, b, harnessMAC("a"), harnessMAC("bb"), o)

	writeThenSend(t, a, b, qa, qb, 256<<10, fx, fy)

	// The uplink carried the fabrics' frames, and each bridge learned the
	// remote device's MAC on the uplink but not its own device's.
	fdb := run(t, "ip", "netns", "exec", x.name, "bridge", "fdb", "show", "br", "brx")
	macA, macB := harnessMAC("a"), harnessMAC("bb")
	assert.NotContains(t, lines(fdb, net.HardwareAddr(macA[:]).String()), "dev vx",
		"brx learned its own device's MAC on the uplink:\n%s", fdb)
	assert.Contains(t, lines(fdb, net.HardwareAddr(macB[:]).String()), "dev vx",
		"brx did not learn the remote device's MAC:\n%s", fdb)
	assert.Zero(t, fx.Counters()["drop_bad_icrc"])
	assert.Positive(t, fy.Counters()["rx_packets"])
}

// bridgedFabrics builds two hosts (network namespaces x and y), each with
// a bridge (brx, bry), the bridges joined by a veth, and a fabric on
// each bridge through PacketWire.
func bridgedFabrics(t *testing.T) (x, y *netns, fx, fy *Fabric) {
	return bridgedFabricsWith(t, wire.PacketWireConfig{}, wire.PacketWireConfig{})
}

// bridgedFabricsWith is bridgedFabrics with the two wires' settings
// (their Interface is filled in).
func bridgedFabricsWith(t *testing.T, cx, cy wire.PacketWireConfig) (x, y *netns, fx, fy *Fabric) {
	needRoot(t)
	x, y = newNetns(t, "x"), newNetns(t, "y")
	x.ip(t, "link", "add", "brx", "type", "bridge")
	y.ip(t, "link", "add", "bry", "type", "bridge")
	run(t, "ip", "link", "add", "vx", "netns", x.name, "type", "veth", "peer", "name", "vy", "netns", y.name)
	x.ip(t, "link", "set", "vx", "master", "brx", "up")
	y.ip(t, "link", "set", "vy", "master", "bry", "up")
	x.ip(t, "link", "set", "brx", "up")
	y.ip(t, "link", "set", "bry", "up")
	// Carrier reaches the bridges through linkwatch (up to a second).
	require.Eventually(t, func() bool {
		return strings.Contains(x.ip(t, "link", "show", "brx"), "state UP") &&
			strings.Contains(y.ip(t, "link", "show", "bry"), "state UP")
	}, 10*time.Second, 50*time.Millisecond)

	fabric := func(ns *netns, dev string, c wire.PacketWireConfig) *Fabric {
		var f *Fabric
		ns.do(t, func() {
			c.Interface = dev
			w, err := wire.NewPacketWire(c)
			require.NoError(t, err)
			f, err = New(Config{Wire: w, LinkMTU: 1500})
			require.NoError(t, err)
		})
		t.Cleanup(func() { f.Close() })
		return f
	}
	return x, y, fabric(x, "brx", cx), fabric(y, "bry", cy)
}

// TestPacketWireWrongMAC: in L2 mode every RoCE frame on the bridge is
// captured, whoever it is addressed to. A frame carrying a VM's GID but
// addressed to another MAC (a peer that resolved the GID to a different
// NIC, or a VM that claims an address on the wire while its owner's
// device holds the GID) must not reach the device: it is dropped and
// counted, and the device's receive queue stays untouched.
func TestPacketWireWrongMAC(t *testing.T) {
	_, _, fx, fy := bridgedFabrics(t)
	a := newEndpoint(t, fx, "a", "10.9.0.1", 1<<20)
	b := newEndpoint(t, fy, "bb", "10.9.0.2", 1<<20)
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	other := [6]byte{0x52, 0x54, 0, 0, 0, 0x99}
	qa, qb := connectL2(t, a, b, other, harnessMAC("bb"), o) // b aims at a's GID with another MAC
	require.NoError(t, qa.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: sge(a, 0, 4096)}))
	msg := []byte("for a's GID, to someone else's MAC")
	b.write(t, b.iova, msg)
	require.NoError(t, qb.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(b, 0, len(msg))}))
	require.Eventually(t, func() bool { return fx.Counters()["drop_wrong_mac"] > 0 }, 10*time.Second, 10*time.Millisecond)
	a.ccq.none(t, 200*time.Millisecond)
	assert.Equal(t, make([]byte, len(msg)), a.read(t, a.iova, len(msg)), "the receive buffer was written")
	assert.Zero(t, fx.Counters()["completions"], "x: %v y: %v", nonzero(fx.Counters()), nonzero(fy.Counters()))
}

// writeThenSend runs an RDMA WRITE of size bytes a -> b and a SEND b -> a
// over a connected pair, byte-compared.
func writeThenSend(t *testing.T, a, b *endpoint, qa, qb hostverbs.QP, size int, fx, fy *Fabric) {
	t.Helper()
	src := make([]byte, size)
	fill(src, uint64(size))
	a.write(t, a.iova, src)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 0, len(src)), RemoteAddr: b.iova + 4096, RKey: b.mr.RKey()}))
	wc := a.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v\nx: %v\ny: %v", wc, nonzero(fx.Counters()), nonzero(fy.Counters()))
	assert.True(t, bytes.Equal(src, b.read(t, b.iova+4096, len(src))), "written bytes differ")
	require.NoError(t, qa.PostRecv(&hostverbs.RecvWR{WRID: 2, SGL: sge(a, 512<<10, 4096)}))
	msg := []byte("hello over the bridge")
	b.write(t, b.iova+900<<10, msg)
	require.NoError(t, qb.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(b, 900<<10, len(msg))}))
	require.Equal(t, hostverbs.WCSuccess, b.ccq.wait(t, 10*time.Second).Status)
	rwc := a.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, rwc.Status)
	require.Equal(t, hostverbs.WCRecv, rwc.Opcode)
	assert.Equal(t, msg, a.read(t, a.iova+512<<10, len(msg)))
}

// lines returns the lines of s that contain sub.
func lines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func nonzero(m map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

// TestPacketWireRoCEv1: RoCE v1 devices on two bridged hosts reach each
// other through PacketWire in Ethertype 0x8915 frames (captured on the
// uplink: every RoCE frame there is v1), and a v2 device's UD datagram
// to a v1 device's GID crosses the wire but is dropped on arrival as a
// version mismatch.
func TestPacketWireRoCEv1(t *testing.T) {
	_, y, fx, fy := bridgedFabrics(t)
	var capFD int
	y.do(t, func() {
		var err error
		capFD, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK, int(htons(unix.ETH_P_ALL)))
		require.NoError(t, err)
		require.NoError(t, unix.SetsockoptInt(capFD, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 16<<20))
		ifi, err := net.InterfaceByName("vy")
		require.NoError(t, err)
		require.NoError(t, unix.Bind(capFD, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}))
	})
	t.Cleanup(func() { unix.Close(capFD) })
	a := newEndpointMode(t, fx, "a", "10.9.0.1", 1<<20, false, hostverbs.GIDTypeRoCEv1)
	b := newEndpointMode(t, fy, "bb", "10.9.0.2", 1<<20, false, hostverbs.GIDTypeRoCEv1)
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	qa, qb := connectL2(t, a, b, harnessMAC("a"), harnessMAC("bb"), o)
	writeThenSend(t, a, b, qa, qb, 256<<10, fx, fy)

	types := map[uint16]int{}
	buf := make([]byte, 9000)
	for {
		n, _, err := unix.Recvfrom(capFD, buf, 0)
		if err != nil {
			break
		}
		if n < 14 {
			continue
		}
		et := binary.BigEndian.Uint16(buf[12:])
		var rp roce.Packet
		if et == roce.EtherTypeRoCEv1 || rp.Parse(buf[14:n]) == nil { // RoCE v1, or a RoCE v2 datagram
			types[et]++
		}
	}
	assert.Greater(t, types[roce.EtherTypeRoCEv1], 256, "v1 frames on the uplink: %v", types)
	assert.Zero(t, types[unix.ETH_P_IP]+types[unix.ETH_P_IPV6], "RoCE v2 frames on the uplink: %v", types)

	// A v2 device on x aims a UD datagram at b's GID and MAC.
	c := newEndpoint(t, fx, "ccc", "10.9.0.3", 1<<20)
	qc, qbu := udQP(t, c, hostverbs.QPTypeUD, 7), udQP(t, b, hostverbs.QPTypeUD, 7)
	require.NoError(t, qbu.PostRecv(&hostverbs.RecvWR{WRID: 4, SGL: sge(b, 0, 4096)}))
	require.NoError(t, qc.PostSend(&hostverbs.SendWR{WRID: 5, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(c, 0, 64), AV: hostverbs.AddressVector{DGID: b.gid, DMAC: harnessMAC("bb")}, RemoteQPN: qbu.QPN(), RemoteQKey: 7}))
	require.Equal(t, hostverbs.WCSuccess, c.ccq.wait(t, 5*time.Second).Status)
	require.Eventually(t, func() bool { return fy.Counters()["drop_roce_version_mismatch"] == 1 }, 10*time.Second, 10*time.Millisecond,
		"y: %v", nonzero(fy.Counters()))
	b.ccq.none(t, 100*time.Millisecond)
	assert.Zero(t, fy.Counters()["drop_bad_icrc"])
}
