package roce

import "encoding/binary"

// RoCE v2 carries the transport headers in UDP to port 4791 (IBA Annex
// A17.2) over IPv4 or IPv6. A GID is the IPv6 address, or the IPv4-mapped
// IPv6 address ::ffff:a.b.c.d of an IPv4 endpoint.

// UDPPort is the RoCE v2 UDP destination port.
const UDPPort = 4791

// Sizes of the encapsulation headers.
const (
	IPv4HeaderSize = 20
	IPv6HeaderSize = 40
	UDPHeaderSize  = 8
	ICRCSize       = 4
)

// Source ports of RoCE v2 packets lie in [0xC000, 0xFFFF] (IBA A17.2.4).
const (
	SourcePortMin = 0xc000
	flowLabelMask = 0x000fffff
)

// FlowLabelToSourcePort folds a 20-bit flow label into a UDP source port
// in the RoCE range, the way the Linux IB core does (rdma_flow_label_to_udp_sport):
// the low 14 bits xor the high 6.
func FlowLabelToSourcePort(fl uint32) uint16 {
	lo := fl & 0x3fff
	hi := fl & 0xfc000
	lo ^= hi >> 14
	return uint16(lo | SourcePortMin)
}

// FlowLabel derives a flow label from a QP pair when the address vector
// carries none (rdma_calc_flow_label): the product of the QPNs, folded.
func FlowLabel(lqpn, rqpn uint32) uint32 {
	v := uint64(lqpn) * uint64(rqpn)
	v ^= v >> 20
	v ^= v >> 40
	return uint32(v & flowLabelMask)
}

// SourcePort is the UDP source port rxe uses for a connected QP pair
// (rdma_get_udp_sport): from the AV's flow label, or from the QPNs.
func SourcePort(flowLabel, lqpn, rqpn uint32) uint16 {
	if flowLabel&flowLabelMask == 0 {
		flowLabel = FlowLabel(lqpn, rqpn)
	}
	return FlowLabelToSourcePort(flowLabel & flowLabelMask)
}

// QPSourcePort is the source port rxe gives a QP before any address vector
// is known (UD QPs keep it): 0xC000 plus a 14-bit multiplicative hash of
// the QPN (hash_32 with the golden ratio).
func QPSourcePort(qpn uint32) uint16 {
	return uint16(SourcePortMin + ((qpn*0x61c88647)>>(32-14))&0x3fff)
}

// IsV4Mapped reports whether a 16-byte GID is an IPv4-mapped address.
func IsV4Mapped(g *[16]byte) bool {
	return binary.BigEndian.Uint64(g[0:8]) == 0 && binary.BigEndian.Uint32(g[8:12]) == 0xffff
}

// NetFields describe the IP and UDP encapsulation of one RoCE v2 packet.
type NetFields struct {
	// Src and Dst are GIDs; both IPv4-mapped (an IPv4 packet) or neither.
	Src, Dst [16]byte
	// TClass is the IPv4 TOS / IPv6 traffic class byte (DSCP << 2 | ECN).
	TClass uint8
	// HopLimit is the IPv4 TTL / IPv6 hop limit.
	HopLimit uint8
	// FlowLabel is the IPv6 flow label (20 bits).
	FlowLabel uint32
	// ID is the IPv4 identification; rxe sends non-zero, incrementing IDs
	// with DF set. The ICRC covers it.
	ID uint16
	// SrcPort is the UDP source port.
	SrcPort uint16
}

// NetHeaderSize is the IP plus UDP header length for a packet between
// GIDs of the given family.
func NetHeaderSize(v4 bool) int {
	if v4 {
		return IPv4HeaderSize + UDPHeaderSize
	}
	return IPv6HeaderSize + UDPHeaderSize
}

// EncodeNet writes the IP and UDP headers for a UDP payload (transport
// headers, payload, pad and ICRC) of udpPayload bytes, and returns the
// header length. IPv4 packets get DF and a valid header checksum; the UDP
// checksum is 0, as rxe sends it. b must hold NetHeaderSize bytes.
func EncodeNet(b []byte, f *NetFields, udpPayload int) int {
	v4 := IsV4Mapped(&f.Dst)
	var n int
	if v4 {
		h := b[:IPv4HeaderSize]
		h[0] = 0x45
		h[1] = f.TClass
		binary.BigEndian.PutUint16(h[2:], uint16(IPv4HeaderSize+UDPHeaderSize+udpPayload))
		binary.BigEndian.PutUint16(h[4:], f.ID)
		binary.BigEndian.PutUint16(h[6:], 0x4000) // DF
		h[8] = f.HopLimit
		h[9] = 17
		h[10], h[11] = 0, 0
		copy(h[12:16], f.Src[12:])
		copy(h[16:20], f.Dst[12:])
		binary.BigEndian.PutUint16(h[10:], IPv4Checksum(h))
		n = IPv4HeaderSize
	} else {
		h := b[:IPv6HeaderSize]
		binary.BigEndian.PutUint32(h, 6<<28|uint32(f.TClass)<<20|f.FlowLabel&flowLabelMask)
		binary.BigEndian.PutUint16(h[4:], uint16(UDPHeaderSize+udpPayload))
		h[6] = 17
		h[7] = f.HopLimit
		copy(h[8:24], f.Src[:])
		copy(h[24:40], f.Dst[:])
		n = IPv6HeaderSize
	}
	u := b[n : n+UDPHeaderSize]
	binary.BigEndian.PutUint16(u[0:], f.SrcPort)
	binary.BigEndian.PutUint16(u[2:], UDPPort)
	binary.BigEndian.PutUint16(u[4:], uint16(UDPHeaderSize+udpPayload))
	u[6], u[7] = 0, 0
	return n + UDPHeaderSize
}

// IPv4Checksum returns the header checksum of a 20-byte IPv4 header whose
// checksum field is treated as zero.
func IPv4Checksum(h []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(h); i += 2 {
		if i == 10 {
			continue
		}
		s += uint32(h[i])<<8 | uint32(h[i+1])
	}
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// UDP is a UDP header view.
type UDP []byte

// SrcPort returns the source port.
func (u UDP) SrcPort() uint16 { return binary.BigEndian.Uint16(u[0:]) }

// DstPort returns the destination port.
func (u UDP) DstPort() uint16 { return binary.BigEndian.Uint16(u[2:]) }

// Length returns the UDP length field (header included).
func (u UDP) Length() int { return int(binary.BigEndian.Uint16(u[4:])) }
