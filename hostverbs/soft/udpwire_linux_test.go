//go:build linux

package soft

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// The UDP wire against a TUN device: a TUN device without offloads makes
// the kernel cut every super-packet routed to it into wire packets
// (software GSO, as for a VM's tap), which the test reads one by one; and
// what the test writes into it arrives as if from a peer on the network,
// one packet at a time (rxe's way: any ID, UDP checksum 0).
//
//	ns: fabric on UDPWire, 10.98.0.1 fd98::1 --- rt0 (TUN) --- the test, as 10.98.0.2 fd98::2

type tunPeer struct {
	ns  *netns
	tun *os.File
}

func newTunPeer(t *testing.T) *tunPeer {
	needRoot(t)
	ns := newNetns(t, "tun")
	var fd int
	var err error
	ns.do(t, func() {
		fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return
		}
		var ifr *unix.Ifreq
		if ifr, err = unix.NewIfreq("rt0"); err != nil {
			return
		}
		ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
		err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
	})
	if err != nil {
		t.Skipf("no TUN device: %v", err)
	}
	tun := os.NewFile(uintptr(fd), "rt0")
	t.Cleanup(func() { tun.Close() })
	ns.ip(t, "link", "set", "rt0", "mtu", "9000", "up")
	ns.ip(t, "addr", "add", "10.98.0.1/24", "dev", "rt0")
	ns.addAddr6(t, "fd98::1/64", "rt0")
	return &tunPeer{ns: ns, tun: tun}
}

// read returns the next RoCE packet routed to the TUN device.
func (p *tunPeer) read(t *testing.T) []byte {
	t.Helper()
	buf := make([]byte, 65536)
	require.NoError(t, p.tun.SetReadDeadline(time.Now().Add(5*time.Second)))
	for {
		n, err := p.tun.Read(buf)
		require.NoError(t, err, "waiting for a packet on the TUN device")
		var rp roce.Packet
		if rp.Parse(buf[:n]) == nil {
			return append([]byte(nil), buf[:n]...)
		}
		// Router solicitations, neighbour discovery: not ours.
	}
}

// buildDatagram builds a sealed RoCE datagram of op with n payload bytes
// for QP 0x77, from UDP port 0xc0de.
func buildDatagram(src, dst string, op roce.Opcode, n int, id uint16, psn uint32) []byte {
	return buildQPDatagram(src, dst, op, n, id, psn, 0x77, 0xc0de)
}

// buildQPDatagram is buildDatagram for destination QP qpn from UDP port
// sport.
func buildQPDatagram(src, dst string, op roce.Opcode, n int, id uint16, psn, qpn uint32, sport uint16) []byte {
	net := roce.NetFields{Src: netip.MustParseAddr(src).As16(), Dst: netip.MustParseAddr(dst).As16(),
		TClass: 0x68, HopLimit: 64, SrcPort: sport, ID: id}
	if netip.MustParseAddr(src).Is4() {
		net.Src = netip.AddrFrom4(netip.MustParseAddr(src).As4()).As16()
		net.Dst = netip.AddrFrom4(netip.MustParseAddr(dst).As4()).As16()
	}
	tf := roce.TransportFields{BTH: roce.BTHFields{Opcode: op, PKey: roce.DefaultPKey, DestQP: qpn, PSN: roce.PSN(psn)},
		VA: 0x1000, RKey: 0x1234, DMALength: 1 << 20}
	buf := make([]byte, wire.MaxDatagram)
	d, off := roce.Build(buf, &net, &tf, n)
	for i := range n {
		d[off+i] = byte(i*13 + int(psn))
	}
	ipLen := roce.IPv4HeaderSize
	if d[0]>>4 == 6 {
		ipLen = roce.IPv6HeaderSize
	}
	roce.SealICRC(d, ipLen)
	return d
}

// TestUDPWireSegmentsOnTheWire sends runs of packets of one flow through
// the UDP wire and reads what the kernel put on the wire: every packet a
// datagram of its own with a valid ICRC over the IP header it really
// carries (IPv4: the ID Linux numbered it with) and a valid UDP checksum,
// in order, with the traffic class and hop limit asked for.
func TestUDPWireSegmentsOnTheWire(t *testing.T) {
	for _, fam := range [][2]string{{"10.98.0.1", "10.98.0.2"}, {"fd98::1", "fd98::2"}} {
		t.Run(fam[0], func(t *testing.T) {
			p := newTunPeer(t)
			var w *wire.UDPWire
			var err error
			p.ns.do(t, func() { w, err = wire.NewUDPWire(wire.UDPWireConfig{}) })
			require.NoError(t, err)
			defer w.Close()
			// 12 full packets and a short one: one message of 13 segments;
			// then a lone packet.
			var dgs []wire.Datagram
			var want [][]byte
			for i := range 14 {
				n := 4096
				op := roce.RCWriteMiddle
				if i == 12 {
					n, op = 1000, roce.RCWriteLast
				} else if i == 13 {
					n, op = 8, roce.RCSendOnly
				}
				d := buildDatagram(fam[0], fam[1], op, n, uint16(1000+i), uint32(i))
				want = append(want, append([]byte(nil), d...))
				dgs = append(dgs, wire.Datagram{Packet: d})
			}
			sent, err := w.Transmit(dgs)
			require.NoError(t, err)
			require.Equal(t, len(dgs), sent)
			m := map[string]uint64{}
			w.Counters(m)
			assert.Equal(t, uint64(2), m["wire_tx_messages"])
			assert.Equal(t, uint64(1), m["wire_tx_segmented"])
			for i := range dgs {
				got := p.read(t)
				var rp roce.Packet
				require.NoError(t, rp.Parse(got))
				require.True(t, rp.ICRCValid(), "packet %d: ICRC over the header on the wire", i)
				assert.Equal(t, roce.PSN(i), rp.BTH.PSN(), "in order")
				assert.Equal(t, uint8(0x68), rp.TClass())
				assert.Equal(t, uint16(0xc0de), rp.UDP.SrcPort())
				hl := roce.IPv4HeaderSize
				if rp.IPv6 {
					hl = roce.IPv6HeaderSize
					assert.Equal(t, uint8(64), got[7], "hop limit")
				} else {
					assert.Equal(t, uint8(64), got[8], "TTL")
					assert.Equal(t, uint16(0x4000), binary.BigEndian.Uint16(got[6:]), "DF")
					id := uint16(i)
					if i == 13 {
						id = 0 // a message of its own
					}
					assert.Equal(t, id, binary.BigEndian.Uint16(got[4:]), "packet %d: IPv4 ID", i)
				}
				assert.True(t, udpChecksumValid(got, hl), "packet %d: UDP checksum", i)
				assert.Equal(t, want[i][hl+roce.UDPHeaderSize+roce.BTHSize:len(want[i])-roce.ICRCSize],
					got[hl+roce.UDPHeaderSize+roce.BTHSize:len(got)-roce.ICRCSize], "packet %d: headers and payload", i)
			}
		})
	}
}

// udpChecksumValid checks the UDP checksum of IP datagram d.
func udpChecksumValid(d []byte, hl int) bool {
	udp := d[hl:]
	var sum uint32
	if hl == roce.IPv6HeaderSize {
		sum = csumAdd(0, d[8:40])
	} else {
		sum = csumAdd(0, d[12:20])
	}
	sum += 17 + uint32(len(udp))
	return csumFold(csumAdd(sum, udp)) == 0xffff
}

// TestUDPWireReceiveIntegrity writes packets into the network as rxe
// sends them (any IPv4 ID, UDP checksum 0) and as corrupted copies of
// them, and checks the fabric behind the UDP wire takes every intact one
// (its header rebuilt, the ID recovered) and drops and counts every
// corrupted one.
func TestUDPWireReceiveIntegrity(t *testing.T) {
	for _, fam := range [][2]string{{"10.98.0.2", "10.98.0.1"}, {"fd98::2", "fd98::1"}} {
		t.Run(fam[0], func(t *testing.T) {
			p := newTunPeer(t)
			f := newKernelFabric(t, p.ns, Config{LinkMTU: 9000})
			newEndpoint(t, f, "a", fam[1], 1<<20) // owns the destination GID; QPN 0x77 does not exist
			rng := rand.New(rand.NewPCG(5, 6))
			const good, bad = 200, 200
			for i := range good + bad {
				n := []int{0, 8, 256, 1024, 4096}[i%5]
				op := roce.RCWriteOnly
				if n == 0 {
					op = roce.RCAcknowledge
				}
				d := buildDatagram(fam[0], fam[1], op, n, uint16(rng.Uint32()), uint32(i))
				hl := roce.IPv4HeaderSize
				if d[0]>>4 == 6 {
					hl = roce.IPv6HeaderSize
				}
				if i >= good {
					// Flip a byte of the payload or of the ICRC itself
					// (what only the ICRC can catch; corrupt headers also
					// fail the parser's checks).
					from := hl + roce.UDPHeaderSize + op.Info().Length
					at := from + rng.IntN(len(d)-from)
					d[at] ^= byte(1 + rng.IntN(255))
				}
				_, err := p.tun.Write(d)
				require.NoError(t, err)
			}
			require.Eventually(t, func() bool {
				c := f.Counters()
				return c["drop_bad_icrc"]+c["drop_unknown_qpn"] == good+bad
			}, 5*time.Second, 10*time.Millisecond, "packets received: %v", f.Counters())
			c := f.Counters()
			t.Logf("fabric: rx %d bad_icrc %d unknown_qpn %d; wire %v", c["rx_packets"], c["drop_bad_icrc"],
				c["drop_unknown_qpn"], wireCounters(c))
			assert.Equal(t, uint64(bad), c["drop_bad_icrc"], "every corrupted packet dropped and counted")
			assert.Equal(t, uint64(good), c["drop_unknown_qpn"], "every intact packet taken (then refused by QPN)")
			if fam[0] == "10.98.0.2" {
				assert.NotZero(t, c["wire_rx_ipid_solved"])
			}
		})
	}
}

// TestUDPWireInheritKeepsQueued: a wire that pauses receiving leaves what
// arrives in the kernel; a successor that inherits its port 4791 sockets
// (a live upgrade, systemd's descriptor store) takes them over, paused
// until its QPs are back, and then receives every datagram that arrived
// in between, in order. A descriptor that is not such a socket is not
// taken.
func TestUDPWireInheritKeepsQueued(t *testing.T) {
	p := newTunPeer(t)
	var w1 *wire.UDPWire
	var err error
	p.ns.do(t, func() { w1, err = wire.NewUDPWire(wire.UDPWireConfig{Interface: "rt0", QueuesPerFamily: 2}) })
	require.NoError(t, err)
	w1.PauseReceive()
	bufs, out := make([][]byte, 64), make([][]byte, 64)
	for i := range bufs {
		bufs[i] = make([]byte, 65536)
	}
	const n = 40
	for i := range n {
		_, err := p.tun.Write(buildDatagram("10.98.0.2", "10.98.0.1", roce.RCWriteOnly, 256, uint16(i), uint32(i)))
		require.NoError(t, err)
	}
	time.Sleep(50 * time.Millisecond)
	got, err := w1.TryReceive(0, bufs, out)
	require.NoError(t, err)
	assert.Zero(t, got, "a paused wire takes nothing from the kernel")

	// The successor's copies, as exec or the descriptor store pass them.
	inherit := inheritCopies(t, w1)
	require.Len(t, inherit, 4)
	// Not a port 4791 socket: left alone.
	other, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	inherit = append([]*os.File{os.NewFile(uintptr(other), "other")}, inherit...)
	require.NoError(t, w1.Close())

	var w2 *wire.UDPWire
	p.ns.do(t, func() {
		w2, err = wire.NewUDPWire(wire.UDPWireConfig{Interface: "rt0", Inherit: inherit, Paused: true, QueuesPerFamily: 2})
	})
	require.NoError(t, err)
	t.Cleanup(func() { w2.Close() })
	for _, f := range inherit {
		require.ErrorIs(t, f.Close(), os.ErrClosed, "the wire closed every inherited file")
	}
	assert.Equal(t, 4, w2.Adopted())
	assert.Equal(t, w2.Adopted(), w2.Queues(), "no socket opened beside those taken over")
	for q := range w2.Queues() {
		got, err = w2.TryReceive(q, bufs, out)
		require.NoError(t, err)
		assert.Zero(t, got, "paused until the successor resumes it")
	}

	w2.ResumeReceive()
	assertQueuedInOrder(t, w2, n)

	// Paused again, a receiver blocked in Receive waits at the gate and
	// returns when the wire closes.
	w2.PauseReceive()
	done := make(chan error, 1)
	go func() {
		_, err := w2.Receive(t.Context(), 0, bufs, out)
		done <- err
	}()
	_, err = p.tun.Write(buildDatagram("10.98.0.2", "10.98.0.1", roce.RCWriteOnly, 256, 0, n))
	require.NoError(t, err)
	select {
	case err := <-done:
		t.Fatalf("a paused wire returned from Receive: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	require.NoError(t, w2.Close())
	select {
	case err := <-done:
		assert.ErrorIs(t, err, hostverbs.ErrClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("Receive did not return after Close")
	}
}

// TestUDPWireSteersByQP: with several receive sockets per family, every
// packet for one QP (destination address and QPN) arrives on the queue
// numbered (the address's last 32 bits + the QPN) mod the family's
// sockets (IPv4's first, then IPv6's), in the order sent; the runs of
// one flow cross loopback as super-packets (UDP_SEGMENT) and are taken
// coalesced (UDP_GRO), which the steering sees by their first segment.
func TestUDPWireSteersByQP(t *testing.T) {
	needRoot(t)
	ns := newNetns(t, "steer")
	ns.addAddr6(t, "fd97::1/64", "lo")
	ns.addAddr6(t, "fd97::2/64", "lo")
	ns.addAddr6(t, "fd97::3/64", "lo")
	const perFamily = 3
	var w *wire.UDPWire
	var err error
	ns.do(t, func() { w, err = wire.NewUDPWire(wire.UDPWireConfig{QueuesPerFamily: perFamily}) })
	require.NoError(t, err)
	t.Cleanup(func() { w.Close() })
	require.Equal(t, 2*perFamily, w.Queues())
	c := map[string]uint64{}
	w.Counters(c)
	assert.Equal(t, uint64(2*perFamily), c["wire_rx_queues"])

	type qpKey struct {
		dst netip.Addr
		qpn uint32
	}
	want := map[qpKey]int{} // the queue each QP's packets must arrive on
	const runs, run = 3, 6
	sport := uint16(0xc000)
	var sent int
	for r := range runs {
		for fi, fam := range [][3]string{{"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {"fd97::1", "fd97::2", "fd97::3"}} {
			for _, dst := range fam[1:] {
				for qpn := uint32(16); qpn < 24; qpn++ {
					a := netip.MustParseAddr(dst).As16()
					q := fi*perFamily + int((binary.BigEndian.Uint32(a[12:])+qpn)%perFamily)
					want[qpKey{netip.MustParseAddr(dst), qpn}] = q
					// One flow (source port) per QP, so that a run is one
					// super-packet of that QP's packets only.
					port := sport + uint16(qpn) + uint16(fi)<<8 + uint16(a[15])<<4
					var dgs []wire.Datagram
					for k := range run {
						dgs = append(dgs, wire.Datagram{Packet: buildQPDatagram(fam[0], dst, roce.RCWriteMiddle, 1024, 0, uint32(r*run+k), qpn, port)})
					}
					n, err := w.Transmit(dgs)
					require.NoError(t, err)
					require.Equal(t, run, n)
					sent += n
				}
			}
		}
	}

	psns := map[qpKey][]uint32{}
	receiveEach(t, w, sent, 10*time.Second, func(q int, rp *roce.Packet) {
		key := qpKey{netip.AddrFrom16(rp.DstGID()).Unmap(), rp.BTH.DestQP()}
		require.Contains(t, want, key)
		require.Equal(t, want[key], q, "queue of QP %v", key)
		psns[key] = append(psns[key], uint32(rp.BTH.PSN()))
	})
	inOrder := make([]uint32, runs*run)
	for i := range inOrder {
		inOrder[i] = uint32(i)
	}
	for key, p := range psns {
		assert.Equal(t, inOrder, p, "QP %v in order", key)
	}
	used := map[int]bool{}
	for _, q := range want {
		used[q] = true
	}
	assert.Len(t, used, 2*perFamily, "the QPs spread over every queue")
	c = map[string]uint64{}
	w.Counters(c)
	assert.NotZero(t, c["wire_rx_coalesced"], "super-packets taken coalesced: %v", c)
}

// inheritCopies returns duplicates of w's receive sockets, as exec or the
// descriptor store pass them to a successor.
func inheritCopies(t *testing.T, w *wire.UDPWire) []*os.File {
	t.Helper()
	var inherit []*os.File
	for name, fd := range w.ReceiveSockets() {
		dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
		inherit = append(inherit, os.NewFile(uintptr(dup), name))
	}
	return inherit
}

// assertQueuedInOrder takes n packets for QP 0x77 from w's queues and
// checks that they came on one queue, with PSNs 0 to n-1 in order.
func assertQueuedInOrder(t *testing.T, w *wire.UDPWire, n int) {
	t.Helper()
	byQueue := receiveQPs(t, w, n)
	assert.Len(t, byQueue, 1, "one QP's packets on one queue")
	for _, qps := range byQueue {
		assert.Equal(t, map[uint32][]uint32{0x77: seq(0, n)}, qps, "every datagram queued across the hand-over, in order")
	}
}

// seq returns from, from+1, ... to-1.
func seq(from, to int) []uint32 {
	out := make([]uint32, 0, to-from)
	for i := from; i < to; i++ {
		out = append(out, uint32(i))
	}
	return out
}

// handOverQueued opens a wire with from receive sockets per family on a
// TUN peer, lets check look at it, pauses it, queues 40 datagrams on it,
// and hands its sockets over to a successor configured for to: it returns
// the successor once it has received the 40, in order, and the peer.
func handOverQueued(t *testing.T, from, to int, check func(*wire.UDPWire)) (*wire.UDPWire, *tunPeer) {
	t.Helper()
	p := newTunPeer(t)
	var w1 *wire.UDPWire
	var err error
	p.ns.do(t, func() { w1, err = wire.NewUDPWire(wire.UDPWireConfig{Interface: "rt0", QueuesPerFamily: from}) })
	require.NoError(t, err)
	check(w1)
	w1.PauseReceive()
	const n = 40
	for i := range n {
		_, err := p.tun.Write(buildDatagram("10.98.0.2", "10.98.0.1", roce.RCWriteOnly, 256, uint16(i), uint32(i)))
		require.NoError(t, err)
	}
	inherit := inheritCopies(t, w1)
	require.Len(t, inherit, 2*from)
	require.NoError(t, w1.Close())

	var w2 *wire.UDPWire
	p.ns.do(t, func() {
		w2, err = wire.NewUDPWire(wire.UDPWireConfig{Interface: "rt0", Inherit: inherit, Paused: true, QueuesPerFamily: to})
	})
	require.NoError(t, err)
	t.Cleanup(func() { w2.Close() })
	w2.ResumeReceive()
	assertQueuedInOrder(t, w2, n)
	return w2, p
}

// TestUDPWireInheritOneSocketPerFamily: the sockets of a predecessor with
// one receive socket per family, bound without SO_REUSEPORT (an earlier
// version), are taken over although no other socket can join them: each
// family keeps that one queue, with what was queued on it, in order.
func TestUDPWireInheritOneSocketPerFamily(t *testing.T) {
	w2, _ := handOverQueued(t, 1, 3, func(w1 *wire.UDPWire) {
		for _, fd := range w1.ReceiveSockets() {
			v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT)
			require.NoError(t, err)
			require.Zero(t, v, "one socket per family: the port is not shared")
		}
	})
	assert.Equal(t, 2, w2.Adopted())
	assert.Equal(t, 2, w2.Queues(), "one queue per family")
	assert.Len(t, w2.ReceiveSockets(), 2)
}

// TestUDPWireInheritGrowsGroup: a successor configured for more receive
// sockets than its predecessor had takes over the predecessor's group,
// with what was queued, and adds sockets to it; the steering then
// spreads the QPs over all of them, each QP's packets on one queue, in
// order.
func TestUDPWireInheritGrowsGroup(t *testing.T) {
	w2, p := handOverQueued(t, 2, 3, func(*wire.UDPWire) {})
	assert.Equal(t, 4, w2.Adopted())
	assert.Equal(t, 6, w2.Queues())
	names := w2.ReceiveSockets()
	for _, name := range []string{"udp4", "udp4.1", "udp4.2", "udp6", "udp6.1", "udp6.2"} {
		assert.Contains(t, names, name)
	}

	// New traffic for several QPs: each QP on one queue, in order, and
	// the QPs on all three IPv4 queues.
	const qps, per = 12, 5
	for i := range per {
		for qpn := uint32(16); qpn < 16+qps; qpn++ {
			_, err := p.tun.Write(buildQPDatagram("10.98.0.2", "10.98.0.1", roce.RCWriteMiddle, 256, 0, uint32(i), qpn, 0xc000+uint16(qpn)))
			require.NoError(t, err)
		}
	}
	byQueue := receiveQPs(t, w2, qps*per)
	assert.Len(t, byQueue, 3, "every IPv4 queue takes some QPs")
	seen := map[uint32]bool{}
	for _, qpsns := range byQueue {
		for qpn, psns := range qpsns {
			assert.False(t, seen[qpn], "QP %d on one queue only", qpn)
			seen[qpn] = true
			assert.Equal(t, seq(0, per), psns, "QP %d in order", qpn)
		}
	}
	assert.Len(t, seen, qps)
}

// receiveQPs takes n packets from w's queues and returns, for each queue
// that received any, the PSNs of each destination QP in the order
// received.
func receiveQPs(t *testing.T, w *wire.UDPWire, n int) map[int]map[uint32][]uint32 {
	t.Helper()
	out := map[int]map[uint32][]uint32{}
	receiveEach(t, w, n, 5*time.Second, func(q int, rp *roce.Packet) {
		if out[q] == nil {
			out[q] = map[uint32][]uint32{}
		}
		out[q][rp.BTH.DestQP()] = append(out[q][rp.BTH.DestQP()], uint32(rp.BTH.PSN()))
	})
	return out
}

// receiveEach takes n packets from w's queues, waiting up to within, and
// calls each with every packet and the queue it came from; it fails the
// test if fewer arrive.
func receiveEach(t *testing.T, w *wire.UDPWire, n int, within time.Duration, each func(q int, rp *roce.Packet)) {
	t.Helper()
	bufs, out := make([][]byte, 64), make([][]byte, 64)
	for i := range bufs {
		bufs[i] = make([]byte, wire.MaxDatagram)
	}
	got := 0
	for deadline := time.Now().Add(within); got < n && time.Now().Before(deadline); {
		idle := true
		for q := range w.Queues() {
			k, err := w.TryReceive(q, bufs, out)
			require.NoError(t, err)
			for i := range k {
				var rp roce.Packet
				require.NoError(t, rp.Parse(out[i]))
				each(q, &rp)
			}
			got += k
			idle = idle && k == 0
		}
		if idle {
			time.Sleep(5 * time.Millisecond)
		}
	}
	require.Equal(t, n, got, "every packet received")
}

// TestUDPWirePortTaken: with port 4791 held (by kernel rxe, say), opening
// the wire fails with an error that says so, releasing what it opened; a
// socket of another program holding the port with SO_REUSEPORT (which
// would let the wire's sockets join it and share the traffic) makes
// opening it fail the same way.
func TestUDPWirePortTaken(t *testing.T) {
	needRoot(t)
	for _, reuse := range []bool{false, true} {
		t.Run(fmt.Sprintf("reuseport=%v", reuse), func(t *testing.T) {
			ns := newNetns(t, fmt.Sprintf("taken%v", reuse))
			var w *wire.UDPWire
			var err error
			ns.do(t, func() {
				fd, e := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
				require.NoError(t, e)
				t.Cleanup(func() { unix.Close(fd) })
				cfg := wire.UDPWireConfig{}
				if reuse {
					require.NoError(t, unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1))
					cfg.QueuesPerFamily = 2
				}
				require.NoError(t, unix.Bind(fd, &unix.SockaddrInet4{Port: roce.UDPPort}))
				w, err = wire.NewUDPWire(cfg)
			})
			require.Error(t, err)
			assert.Nil(t, w)
			assert.Contains(t, err.Error(), "bind udp 4791")
		})
	}
}
