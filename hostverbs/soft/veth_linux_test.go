//go:build linux

package soft

import (
	"encoding/binary"
	"fmt"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"math/rand/v2"
	"net"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The kernel path between two network namespaces. tc netem would impair
// the veth, but this kernel is built without sch_netem
// (CONFIG_NET_SCH_NETEM is not set), so a third namespace in the middle
// forwards Ethernet frames between two veths through AF_PACKET sockets and
// impairs the RoCE ones (loss, duplication, reordering) with a seeded
// generator: both endpoints still run the real kernel path (routing, ARP,
// raw sockets, socket buffers).
//
//	ns A: a0 10.99.0.1 fd99::1 ==veth== ma [ns M: impairer] mb ==veth== b0 10.99.0.2 fd99::2 :ns B

type l2Impairer struct {
	imp     wire.Impairment
	mu      sync.Mutex
	rng     *rand.Rand
	fds     [2]int
	stop    atomic.Bool
	wg      sync.WaitGroup
	lost    atomic.Int64
	dups    atomic.Int64
	reorder atomic.Int64
	// first is the first RoCE frame seen (for header checks).
	first atomic.Pointer[[]byte]
	// corrupt is the probability that a RoCE packet gets a payload or
	// ICRC byte flipped and its UDP checksum cleared, so that only the
	// ICRC can catch it; corrupted counts them.
	corrupt   float64
	corrupted atomic.Int64
	// keepGSO forwards super-packets whole (corrupting single segments
	// inside them) instead of cutting them: the receiver then gets them
	// coalesced, as from a NIC with GRO.
	keepGSO bool
}

type topo struct {
	a, b, m *netns
	imp     *l2Impairer
}

// newTopo builds the three namespaces; the impairer also corrupts RoCE
// packets with probability corrupt, and forwards super-packets whole if
// keepGSO.
func newTopo(t *testing.T, imp wire.Impairment, corrupt float64, keepGSO bool, seed uint64) *topo {
	needRoot(t)
	tp := &topo{a: newNetns(t, "a"), b: newNetns(t, "b"), m: newNetns(t, "m")}
	run(t, "ip", "link", "add", "a0", "netns", tp.a.name, "type", "veth", "peer", "name", "ma", "netns", tp.m.name)
	run(t, "ip", "link", "add", "b0", "netns", tp.b.name, "type", "veth", "peer", "name", "mb", "netns", tp.m.name)
	for _, x := range []struct {
		ns       *netns
		dev, ip4 string
		ip6      string
	}{{tp.a, "a0", "10.99.0.1/24", "fd99::1/64"}, {tp.b, "b0", "10.99.0.2/24", "fd99::2/64"}} {
		x.ns.ip(t, "link", "set", "dev", x.dev, "mtu", "9000", "up")
		x.ns.ip(t, "addr", "add", x.ip4, "dev", x.dev)
		x.ns.addAddr6(t, x.ip6, x.dev)
	}
	for _, dev := range []string{"ma", "mb"} {
		tp.m.ip(t, "link", "set", "dev", dev, "mtu", "9000", "up")
	}
	tp.imp = &l2Impairer{imp: imp, corrupt: corrupt, keepGSO: keepGSO, rng: rand.New(rand.NewPCG(seed, 99))}
	if tp.imp.imp.ReorderDepth == 0 {
		tp.imp.imp.ReorderDepth = 3
	}
	tp.m.do(t, func() {
		for i, dev := range []string{"ma", "mb"} {
			ifi, err := net.InterfaceByName(dev)
			require.NoError(t, err)
			fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
			require.NoError(t, err)
			require.NoError(t, unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}))
			// Wake every 2 ms when nothing comes, so that held frames
			// leave at their hold time when traffic stops (a tail packet
			// held longer waits for the sender's timer instead).
			require.NoError(t, unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 2000}))
			mmsg.SetBuffers(fd, 16<<20)
			// Frames come with a virtio_net_hdr: a UDP GSO super-packet
			// (veth passes them whole) is cut into its packets here, as
			// a NIC would, so loss, duplication and reordering hit
			// single packets.
			require.NoError(t, unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1))
			tp.imp.fds[i] = fd
		}
	})
	tp.imp.wg.Add(2)
	go tp.imp.forward(0, 1)
	go tp.imp.forward(1, 0)
	t.Cleanup(func() {
		tp.imp.stop.Store(true)
		tp.imp.wg.Wait()
		unix.Close(tp.imp.fds[0])
		unix.Close(tp.imp.fds[1])
	})
	return tp
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// roceFrame reports whether an Ethernet frame carries UDP to port 4791.
func roceFrame(f []byte) bool {
	if len(f) < 14 {
		return false
	}
	ip := f[14:]
	switch binary.BigEndian.Uint16(f[12:]) {
	case 0x0800:
		if len(ip) < 28 || ip[9] != 17 {
			return false
		}
		ihl := int(ip[0]&0xf) * 4
		return len(ip) >= ihl+8 && binary.BigEndian.Uint16(ip[ihl+2:]) == roce.UDPPort
	case 0x86dd:
		return len(ip) >= 48 && ip[6] == 17 && binary.BigEndian.Uint16(ip[42:]) == roce.UDPPort
	}
	return false
}

type heldFrame struct {
	b     []byte
	after int
	at    time.Time
}

// vnetHdrLen is the size of the virtio_net_hdr that PACKET_VNET_HDR
// sockets put before each frame.
const vnetHdrLen = 10

// segmentFrames cuts a frame that carries a UDP GSO super-packet (its
// virtio_net_hdr says VIRTIO_NET_HDR_GSO_UDP_L4) into the frames of its
// packets, each with a virtio_net_hdr of its own, the IPv4 IDs counted up
// from the super-packet's as Linux's segmentation does, and a complete UDP
// checksum; any other frame is returned as it is.
func segmentFrames(vf []byte) [][]byte {
	const gsoUDPL4 = 5
	if len(vf) < vnetHdrLen+14+28 || vf[1]&0x7f != gsoUDPL4 {
		return [][]byte{vf}
	}
	gso := int(binary.LittleEndian.Uint16(vf[4:]))
	f := vf[vnetHdrLen:]
	v6 := binary.BigEndian.Uint16(f[12:]) == 0x86dd
	hl := 20
	if v6 {
		hl = 40
	}
	hdrs := 14 + hl + 8
	if gso == 0 || len(f) < hdrs {
		return [][]byte{vf}
	}
	payload := f[hdrs:]
	id0 := binary.BigEndian.Uint16(f[14+4:])
	var out [][]byte
	for k := 0; len(payload) > 0; k++ {
		n := min(gso, len(payload))
		seg := make([]byte, vnetHdrLen+hdrs+n)
		copy(seg[vnetHdrLen:], f[:hdrs])
		copy(seg[vnetHdrLen+hdrs:], payload[:n])
		payload = payload[n:]
		ip := seg[vnetHdrLen+14:]
		udp := ip[hl:]
		binary.BigEndian.PutUint16(udp[4:], uint16(8+n))
		udp[6], udp[7] = 0, 0
		var sum uint32
		if v6 {
			binary.BigEndian.PutUint16(ip[4:], uint16(8+n))
			sum = csumAdd(0, ip[8:40])
		} else {
			binary.BigEndian.PutUint16(ip[2:], uint16(hl+8+n))
			binary.BigEndian.PutUint16(ip[4:], id0+uint16(k))
			binary.BigEndian.PutUint16(ip[10:], roce.IPv4Checksum(ip[:20]))
			sum = csumAdd(0, ip[12:20])
		}
		sum += 17 + uint32(8+n)
		c := ^csumFold(csumAdd(sum, udp))
		if c == 0 {
			c = 0xffff
		}
		binary.BigEndian.PutUint16(udp[6:], c)
		out = append(out, seg)
	}
	return out
}

func csumAdd(s uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

func csumFold(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

func (l *l2Impairer) forward(from, to int) {
	defer l.wg.Done()
	buf := make([]byte, vnetHdrLen+65536)
	var held []heldFrame
	send := func(b []byte) { _ = unix.Send(l.fds[to], b, 0) }
	for !l.stop.Load() {
		n, sa, err := unix.Recvfrom(l.fds[from], buf, 0)
		now := time.Now()
		// Held frames go out after enough others or after 2 ms.
		kept := held[:0]
		for _, h := range held {
			if h.after <= 0 || now.Sub(h.at) > 2*time.Millisecond {
				send(h.b)
			} else {
				kept = append(kept, h)
			}
		}
		held = kept
		if err != nil {
			continue
		}
		if ll, ok := sa.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		if l.keepGSO && isGSO(buf[:n]) {
			send(l.corruptSegments(buf[:n]))
			continue
		}
		for _, f := range segmentFrames(buf[:n]) {
			held = l.impair(f, held, now, send)
		}
	}
}

// impair forwards frame vf (a virtio_net_hdr, then the frame) or, if it is
// RoCE, loses, duplicates or holds it back; it returns the frames held.
func (l *l2Impairer) impair(vf []byte, held []heldFrame, now time.Time, send func([]byte)) []heldFrame {
	f := vf
	if len(vf) < vnetHdrLen || !roceFrame(vf[vnetHdrLen:]) {
		send(vf)
		return held
	}
	if l.first.Load() == nil {
		c := append([]byte(nil), vf[vnetHdrLen:]...)
		l.first.CompareAndSwap(nil, &c)
	}
	l.mu.Lock()
	lose := l.imp.Loss > 0 && l.rng.Float64() < l.imp.Loss
	dup := l.imp.Duplicate > 0 && l.rng.Float64() < l.imp.Duplicate
	hold := l.imp.Reorder > 0 && l.rng.Float64() < l.imp.Reorder
	corrupt := l.corrupt > 0 && l.rng.Float64() < l.corrupt
	pick := l.rng.Uint32()
	l.mu.Unlock()
	if corrupt {
		f = corruptFrame(f, pick)
		l.corrupted.Add(1)
	}
	for i := range held {
		held[i].after--
	}
	switch {
	case lose:
		l.lost.Add(1)
	case hold:
		l.reorder.Add(1)
		held = append(held, heldFrame{b: append([]byte(nil), f...), after: l.imp.ReorderDepth, at: now})
	default:
		send(f)
		if dup {
			l.dups.Add(1)
			send(f)
		}
	}
	return held
}

// isGSO reports whether vf (virtio_net_hdr first) holds a UDP GSO
// super-packet.
func isGSO(vf []byte) bool {
	const gsoUDPL4 = 5
	return len(vf) > vnetHdrLen && vf[1]&0x7f == gsoUDPL4
}

// corruptSegments flips, with probability l.corrupt per segment, one byte
// after the BTH of segments of super-packet vf in place; the checksum
// stays to be completed (CHECKSUM_PARTIAL), so the kernel passes them on.
func (l *l2Impairer) corruptSegments(vf []byte) []byte {
	gso := int(binary.LittleEndian.Uint16(vf[4:]))
	f := vf[vnetHdrLen:]
	hl := 20
	if binary.BigEndian.Uint16(f[12:]) == 0x86dd {
		hl = 40
	}
	payload := f[14+hl+8:]
	if gso == 0 {
		return vf
	}
	for off := 0; off < len(payload); off += gso {
		seg := payload[off:min(off+gso, len(payload))]
		l.mu.Lock()
		hit := l.rng.Float64() < l.corrupt
		pick := l.rng.Uint32()
		l.mu.Unlock()
		if hit && len(seg) > roce.BTHSize {
			seg[roce.BTHSize+int(pick%uint32(len(seg)-roce.BTHSize))] ^= byte(1 + pick>>24%255)
			l.corrupted.Add(1)
		}
	}
	return vf
}

// corruptFrame returns a copy of RoCE frame vf (virtio_net_hdr first) with
// one byte after the BTH flipped (payload, pad or ICRC) and the UDP
// checksum cleared (none, for IPv4; RoCE's zero, which the wire accepts,
// for IPv6) and no checksum offload: the kernel passes it on, and only
// the ICRC can tell.
func corruptFrame(vf []byte, pick uint32) []byte {
	c := append([]byte(nil), vf...)
	clear(c[:vnetHdrLen])
	ip := c[vnetHdrLen+14:]
	hl := 20
	if ip[0]>>4 == 6 {
		hl = 40
	}
	udp := ip[hl:]
	udp[6], udp[7] = 0, 0
	from := 8 + roce.BTHSize
	if len(udp) > from {
		udp[from+int(pick%uint32(len(udp)-from))] ^= byte(1 + pick>>24%255)
	}
	return c
}

func netemAvailable(t *testing.T, ns *netns) bool {
	out, err := exec.Command("ip", "netns", "exec", ns.name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "0%").CombinedOutput()
	if err == nil {
		_ = exec.Command("ip", "netns", "exec", ns.name, "tc", "qdisc", "del", "dev", "lo", "root").Run()
		return true
	}
	t.Logf("tc netem unavailable (%s): impairing in user space instead", bytesTrim(out))
	return false
}

func bytesTrim(b []byte) string {
	s := string(b)
	for len(s) > 0 && (s[len(s)-1] == '\n' || s[len(s)-1] == ' ') {
		s = s[:len(s)-1]
	}
	return s
}

func TestVethNetnsImpaired(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		name    string
		imp     wire.Impairment
		corrupt float64
		keepGSO bool
	}{
		{name: "clean", imp: wire.Impairment{}},
		{name: "loss1", imp: wire.Impairment{Loss: 0.01}},
		{name: "loss5", imp: wire.Impairment{Loss: 0.05}},
		{name: "reorder", imp: wire.Impairment{Reorder: 0.03, ReorderDepth: 4}},
		{name: "duplicate", imp: wire.Impairment{Duplicate: 0.03}},
		// Corruption in flight: of single packets (checksum cleared), and
		// of segments inside super-packets that reach the receiver whole
		// and coalesced, where each corrupted segment is dropped alone.
		{name: "corrupt", corrupt: 0.01},
		{name: "corrupt-coalesced", corrupt: 0.01, keepGSO: true},
	} {
		for _, v6 := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/ipv6=%v", tc.name, v6), func(t *testing.T) {
				tp := newTopo(t, tc.imp, tc.corrupt, tc.keepGSO, 11)
				if tc.name == "clean" && !v6 {
					netemAvailable(t, tp.m)
				}
				// The kernel's network runs on the machine's clock, and so
				// do the fabrics' timers: a retransmission timer that fires
				// while a slow machine still works through a go-back-N
				// window resends it all again, and enough of those in a row
				// spend the retry budget without any loss (a loaded
				// machine did, at 1 MiB windows and 33.5 ms). So the
				// window is 256 KiB and the timeout 67 ms: only a machine
				// that moves less than 4 MB/s through the impairer times
				// out without a loss.
				cfg := Config{LinkMTU: 9000, DefaultTOS: 0x48, Window: 64}
				fa := newKernelFabric(t, tp.a, cfg)
				fb := newKernelFabric(t, tp.b, cfg)
				ipa, ipb := "10.99.0.1", "10.99.0.2"
				if v6 {
					ipa, ipb = "fd99::1", "fd99::2"
				}
				a := newEndpoint(t, fa, "a", ipa, 16<<20)
				b := newEndpoint(t, fb, "b", ipb, 16<<20)
				o := defaultRC()
				o.timeout = 14
				qa, qb := connectRC(t, a, b, o)
				p := pair{a, b, qa, qb}
				icmp0 := tp.b.snmp(t, "Icmp", "OutDestUnreachs")
				streamCheck(t, p, 300, 60*time.Second)
				bulkCheck(t, p, 60*time.Second)
				ca, cb := fa.Counters(), fb.Counters()
				t.Logf("impairer: lost %d dup %d reordered %d; a: tx %d retransmitted %d timeouts %d nak_seq %d; b: dup_req %d out_of_seq %d bad_icrc %d",
					tp.imp.lost.Load(), tp.imp.dups.Load(), tp.imp.reorder.Load(), ca["tx_packets"],
					ca["retransmitted_packets"], ca["retransmit_timeouts"], ca["rx_nak_psn_sequence"],
					cb["rx_duplicate_requests"], cb["rx_out_of_sequence"], cb["drop_bad_icrc"])
				t.Logf("wire a: %v; wire b: %v", wireCounters(ca), wireCounters(cb))
				// The super-packets were cut on the way (segmentFrames) and
				// came in one by one: for IPv4 the receiver found the IDs
				// the segments were given.
				assert.NotZero(t, ca["wire_tx_segmented"], "segmentation offload used")
				if !v6 && !tc.keepGSO {
					assert.NotZero(t, cb["wire_rx_ipid_solved"])
				}
				if tc.corrupt > 0 {
					// Every corrupted packet dropped by the ICRC check, none
					// taken: the transfers above checked every byte.
					assert.NotZero(t, tp.imp.corrupted.Load())
					assert.Equal(t, uint64(tp.imp.corrupted.Load()), ca["drop_bad_icrc"]+cb["drop_bad_icrc"],
						"corrupted packets dropped as bad ICRC")
					t.Logf("corrupted %d; coalesced messages a %d b %d", tp.imp.corrupted.Load(),
						ca["wire_rx_coalesced"], cb["wire_rx_coalesced"])
					if tc.keepGSO {
						assert.NotZero(t, cb["wire_rx_coalesced"])
					}
				} else {
					assert.Zero(t, ca["drop_bad_icrc"]+cb["drop_bad_icrc"])
				}
				assert.Equal(t, icmp0, tp.b.snmp(t, "Icmp", "OutDestUnreachs"), "no ICMP port unreachable")
				if tc.imp.Loss > 0 {
					assert.NotZero(t, tp.imp.lost.Load())
					assert.NotZero(t, ca["retransmitted_packets"])
				}
				if tc.imp.Duplicate > 0 {
					assert.NotZero(t, cb["rx_duplicate_requests"]+ca["drop_unexpected_response"])
				}
				checkWireHeaders(t, *tp.imp.first.Load(), v6, true)
			})
		}
	}
}

// checkWireHeaders asserts what rxe puts on the wire (as captured from kernel
// rxe in the test bed): DF, a non-zero IPv4 ID, the TOS of the traffic class
// (with ECT(0): congestion control is on),
// UDP checksum 0, a source port in the RoCE range, P_Key 0xFFFF, ICRC valid.
func checkWireHeaders(t *testing.T, frame []byte, v6, udpWire bool) {
	t.Helper()
	ip := frame[14:]
	var p roce.Packet
	require.NoError(t, p.Parse(ip))
	assert.True(t, p.ICRCValid())
	assert.Equal(t, uint8(0x48|roce.ECNECT0), p.TClass(), "TOS from the fabric default, ECN-capable (ECT(0))")
	assert.GreaterOrEqual(t, p.UDP.SrcPort(), uint16(roce.SourcePortMin))
	if udpWire {
		// Linux's UDP sockets checksum (segmentation offload needs it)
		// and send unconnected DF packets with ID 0, 1, 2... per
		// super-packet.
		assert.NotZero(t, binary.BigEndian.Uint16(p.UDP[6:]), "UDP checksum")
	} else {
		assert.Equal(t, uint16(0), binary.BigEndian.Uint16(p.UDP[6:]), "UDP checksum 0")
	}
	assert.Equal(t, uint16(0xffff), p.BTH.PKey())
	assert.Equal(t, v6, p.IPv6)
	if !v6 {
		assert.Equal(t, uint16(0x4000), binary.BigEndian.Uint16(ip[6:])&0x4000, "DF")
		if !udpWire {
			assert.NotZero(t, binary.BigEndian.Uint16(ip[4:]), "IPv4 ID")
		}
	}
}
