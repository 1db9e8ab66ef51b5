package roce

import "encoding/binary"

// RoCE v1 (IBA Annex A16) carries an InfiniBand packet without its LRH
// directly in an Ethernet frame of Ethertype 0x8915: a 40-byte GRH (IBA
// 8.3), then the transport headers, payload, pad and ICRC. It has no IP or
// UDP header, so it is not routable: it stays in one L2 domain. The GRH is
// laid out as an IPv6 header (version 6, traffic class, flow label, payload
// length, next header, hop limit, source and destination GID); its next
// header is 0x1B, the IBA transport.

// EtherTypeRoCEv1 is the Ethertype of RoCE v1 frames.
const EtherTypeRoCEv1 = 0x8915

// GRHSize is the length of the Global Route Header.
const GRHSize = 40

// GRHNextHeaderBTH is the GRH next header value of IBA transport (IBA
// 8.3.1: the BTH follows).
const GRHNextHeaderBTH = 0x1b

// EncodeGRH writes the GRH of a RoCE v1 packet whose transport headers,
// payload, pad and ICRC take payLen bytes, and returns GRHSize. f.ID and
// f.SrcPort are not used. b must hold GRHSize bytes.
func EncodeGRH(b []byte, f *NetFields, payLen int) int {
	h := b[:GRHSize]
	binary.BigEndian.PutUint32(h, 6<<28|uint32(f.TClass)<<20|f.FlowLabel&flowLabelMask)
	binary.BigEndian.PutUint16(h[4:], uint16(payLen))
	h[6] = GRHNextHeaderBTH
	h[7] = f.HopLimit
	copy(h[8:24], f.Src[:])
	copy(h[24:40], f.Dst[:])
	return GRHSize
}

// PacketSizeV1 returns the length of a RoCE v1 packet (GRH onwards)
// carrying n payload bytes with the given opcode.
func PacketSizeV1(op Opcode, n int) int {
	return GRHSize + op.Info().Length + n + PadFor(n) + ICRCSize
}

// BuildV1 is Build for RoCE v1: it lays out the GRH and transport headers
// of a packet carrying n payload bytes in b, zeroes the pad, and returns
// the packet and the payload's offset. Seal it with SealICRCv1 once the
// payload is in place. b must hold PacketSizeV1 bytes.
func BuildV1(b []byte, net *NetFields, tf *TransportFields, n int) (d []byte, payloadOff int) {
	return layout(b, tf, n, func(payLen int) int { return EncodeGRH(b, net, payLen) })
}

// ParseV1 validates d, the contents of an Ethertype 0x8915 frame, as a
// RoCE v1 packet of an opcode this codec implements and fills p with views
// into it (p.V1 and p.IPv6 set, IPHeader the GRH, no UDP). It checks the
// GRH version, payload length and next header, and the transport layout as
// Parse does; not the ICRC (call ICRCValid).
func (p *Packet) ParseV1(d []byte) error {
	*p = Packet{Datagram: d, V1: true, IPv6: true}
	if len(d) < GRHSize {
		return ErrTruncated
	}
	if d[0]>>4 != 6 || int(binary.BigEndian.Uint16(d[4:]))+GRHSize != len(d) || d[6] != GRHNextHeaderBTH {
		return ErrGRH
	}
	p.IPHeader = d[:GRHSize]
	return p.parseTransport(d[GRHSize:])
}
