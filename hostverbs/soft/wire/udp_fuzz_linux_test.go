//go:build linux

package wire

import (
	"bytes"
	"encoding/binary"
	"testing"
	"unsafe"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"golang.org/x/sys/unix"
)

// FuzzUDPWireSplit feeds the receive path what a UDP socket could hand it,
// from a peer that controls the payload (and so where GRO cuts it) and a
// kernel report of any segment size, with or without the addresses:
// nothing may panic, no packet may exceed MaxDatagram, and every packet
// handed on that parses as RoCE must carry a valid ICRC (the wire checked
// it, the fabric does not). The message is received twice, into slots of
// the default size and into slots of the reported segment size (so that
// segments are handed on in place), and both hand on the same packets.
func FuzzUDPWireSplit(f *testing.F) {
	payloads, seg := fuzzSeedRun()
	f.Add(payloads, seg, false, true, uint8(0x6a))
	f.Add(payloads[:seg], uint16(0), false, true, uint8(0))
	f.Add(payloads, uint16(7), true, true, uint8(1))
	f.Add([]byte{1, 2, 3}, uint16(1), false, false, uint8(0))
	f.Fuzz(func(t *testing.T, payload []byte, gso uint16, v6, pktinfo bool, tos uint8) {
		if len(payload) > 65507 {
			return
		}
		a := splitAll(t, &UDPWire{}, payload, gso, v6, pktinfo, tos, rxDefaultStride)
		b := splitAll(t, &UDPWire{}, payload, gso, v6, pktinfo, tos, int(gso))
		if len(a) != len(b) {
			t.Fatalf("%d packets with %d-byte slots, %d with %d-byte ones", len(a), rxDefaultStride, len(b), gso)
		}
		for i := range a {
			if !bytes.Equal(a[i], b[i]) {
				t.Fatalf("packet %d differs between slot sizes", i)
			}
		}
	})
}

// TestUDPWireSplitCoalesced: three packets of one flow, coalesced, come
// out whole with the IDs 0, 1, 2 a UDPWire sender gives them, guessed
// (not solved); the same bytes with one flipped lose that packet only.
func TestUDPWireSplitCoalesced(t *testing.T) {
	payloads, seg := fuzzSeedRun()
	w := &UDPWire{}
	pkts := splitAll(t, w, payloads, seg, false, true, 0, int(seg))
	if len(pkts) != 3 {
		t.Fatalf("%d packets, want 3", len(pkts))
	}
	for k, d := range pkts {
		if id := binary.BigEndian.Uint16(d[4:]); id != uint16(k) {
			t.Errorf("packet %d: ID %d", k, id)
		}
	}
	m := map[string]uint64{}
	w.Counters(m)
	if m["wire_rx_ipid_solved"] != 0 || m["wire_rx_coalesced"] != 1 {
		t.Errorf("counters %v", m)
	}
	payloads[int(seg)+100] ^= 0x10
	if pkts := splitAll(t, w, payloads, seg, false, true, 0, int(seg)); len(pkts) != 2 {
		t.Fatalf("%d packets after corrupting the second, want 2", len(pkts))
	}
	w.Counters(m)
	if m["drop_bad_icrc"] != 1 {
		t.Errorf("drop_bad_icrc %d, want 1", m["drop_bad_icrc"])
	}
}

// fuzzSeedRun is the UDP payloads of three 1 KiB WRITE packets of one flow,
// as a UDPWire sends them (IPv4 IDs 0, 1, 2), back to back, and their size.
func fuzzSeedRun() ([]byte, uint16) {
	net := roce.NetFields{Src: [16]byte{10: 0xff, 11: 0xff, 12: 10, 15: 1}, Dst: [16]byte{10: 0xff, 11: 0xff, 12: 10, 15: 2},
		HopLimit: 64, SrcPort: 0xc000}
	tf := roce.TransportFields{BTH: roce.BTHFields{Opcode: roce.RCWriteMiddle, PKey: roce.DefaultPKey, DestQP: 1}}
	var ids roce.IPIDTable
	var payloads []byte
	for k := range 3 {
		b := make([]byte, MaxDatagram)
		d, _ := roce.Build(b, &net, &tf, 1024)
		roce.SealICRC(d, roce.IPv4HeaderSize)
		ids.SetIPv4ID(d, uint16(k))
		payloads = append(payloads, d[roce.IPv4HeaderSize+roce.UDPHeaderSize:]...)
	}
	return payloads, uint16(len(payloads) / 3)
}

// splitAll runs the receive path over one message as a UDP socket would
// report it, into slots of stride bytes (the default if out of range),
// and returns the packets handed on, checking they are sound.
func splitAll(t *testing.T, w *UDPWire, payload []byte, gso uint16, v6, pktinfo bool, tos uint8, stride int) (out [][]byte) {
	t.Helper()
	net := roce.NetFields{Src: [16]byte{10: 0xff, 11: 0xff, 12: 10, 15: 1}, Dst: [16]byte{10: 0xff, 11: 0xff, 12: 10, 15: 2}}
	s := newUDPRxState(v6)
	if stride >= rxMinStride && stride <= rxMaxStride {
		s.want = stride
		s.layout()
	}
	// What recvmsg does with the message's iovecs: fill slot after slot.
	for k, rest := 0, payload; len(rest) > 0; k++ {
		rest = rest[copy(s.slot(0, k), rest):]
	}
	s.hdrs[0].Len = uint32(len(payload))
	n := 0
	if gso != 0 {
		n += putCmsgInt(s.oob[n:], unix.SOL_UDP, unix.UDP_GRO, int32(gso))
	}
	name := &s.names[0]
	if v6 {
		name.Family = unix.AF_INET6
		name.Addr = net.Src
		if pktinfo {
			var pi unix.Inet6Pktinfo
			pi.Addr = net.Dst
			n += putCmsg(s.oob[n:], unix.IPPROTO_IPV6, unix.IPV6_PKTINFO, unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet6Pktinfo))
		}
		n += putCmsgInt(s.oob[n:], unix.IPPROTO_IPV6, unix.IPV6_TCLASS, int32(tos))
	} else {
		sin := (*unix.RawSockaddrInet4)(unsafe.Pointer(name))
		sin.Family = unix.AF_INET
		copy(sin.Addr[:], net.Src[12:])
		if pktinfo {
			var pi unix.Inet4Pktinfo
			copy(pi.Addr[:], net.Dst[12:])
			n += putCmsg(s.oob[n:], unix.IPPROTO_IP, unix.IP_PKTINFO, unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet4Pktinfo))
		}
		n += putCmsg(s.oob[n:], unix.IPPROTO_IP, unix.IP_TOS, []byte{tos})
	}
	binary.BigEndian.PutUint16((*[2]byte)(unsafe.Pointer(&name.Port))[:], 0xc000)
	s.hdrs[0].Hdr.SetControllen(n)
	w.started(s, 1)
	bufs := make([][]byte, 4)
	for i := range bufs {
		bufs[i] = make([]byte, MaxDatagram)
	}
	got := make([][]byte, len(bufs))
	for rounds := 0; s.cur < s.msgs; rounds++ {
		if rounds > 65536 {
			t.Fatal("split does not advance")
		}
		k := w.split(s, bufs, got)
		for i := range k {
			if len(got[i]) > MaxDatagram {
				t.Fatalf("packet of %d bytes", len(got[i]))
			}
			var p roce.Packet
			if p.Parse(got[i]) == nil && !p.ICRCValid() {
				t.Fatalf("packet %d handed on with a bad ICRC", i)
			}
			out = append(out, append([]byte(nil), got[i]...))
		}
	}
	return out
}
