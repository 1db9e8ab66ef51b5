package roce

import (
	"encoding/binary"
	"errors"
)

// Reasons Parse rejects a datagram. The receive path counts each one.
var (
	ErrTruncated  = errors.New("roce: datagram too short for its headers")
	ErrIPVersion  = errors.New("roce: not IPv4 or IPv6")
	ErrIPHeader   = errors.New("roce: IP header options or length mismatch")
	ErrFragment   = errors.New("roce: IP fragment")
	ErrNotUDP     = errors.New("roce: not UDP")
	ErrUDPPort    = errors.New("roce: UDP destination port is not 4791")
	ErrUDPLength  = errors.New("roce: UDP length mismatch")
	ErrOpcode     = errors.New("roce: unsupported opcode")
	ErrTVer       = errors.New("roce: unsupported transport header version")
	ErrPadding    = errors.New("roce: bad pad count or unaligned length")
	ErrNoPayload  = errors.New("roce: payload on an opcode that carries none")
	ErrAddrFamily = errors.New("roce: address family mismatch")
	ErrGRH        = errors.New("roce: GRH version, length or next header mismatch")
)

// Packet is a parsed RoCE v2 datagram (Parse) or RoCE v1 packet
// (ParseV1). Its slices are views into the buffer given to Parse, valid
// while that buffer is.
type Packet struct {
	// Datagram is the whole IP datagram (v2) or GRH-framed packet (v1).
	Datagram []byte
	// V1 is true for a RoCE v1 packet: IPHeader is then its GRH, laid
	// out as an IPv6 header (IPv6 is true), and there is no UDP header.
	V1 bool
	// IPv6 is true for IPv6 (and a v1 GRH), false for IPv4.
	IPv6 bool
	// IPHeader is the 20- or 40-byte IP header, or the 40-byte GRH.
	IPHeader []byte
	// UDP is the UDP header (nil for RoCE v1).
	UDP UDP
	// BTH is the base transport header.
	BTH BTH
	// Op is the opcode and Info its table entry.
	Op   Opcode
	Info *OpInfo
	// Headers is the transport headers, BTH first.
	Headers []byte
	// Payload is the payload without pad.
	Payload []byte
}

// Parse validates d as a RoCE v2 datagram of an opcode this codec
// implements and fills p with views into it. It checks every length, the
// UDP port, the pad count and alignment; it does not check the ICRC (call
// ICRCValid) or anything about QPs.
func (p *Packet) Parse(d []byte) error {
	*p = Packet{Datagram: d}
	if len(d) < 1 {
		return ErrTruncated
	}
	var ipLen, udpLen int
	switch d[0] >> 4 {
	case 4:
		if len(d) < IPv4HeaderSize {
			return ErrTruncated
		}
		if d[0]&0x0f != 5 || int(binary.BigEndian.Uint16(d[2:])) != len(d) {
			return ErrIPHeader
		}
		if binary.BigEndian.Uint16(d[6:])&0x3fff != 0 { // MF or offset
			return ErrFragment
		}
		if d[9] != 17 {
			return ErrNotUDP
		}
		ipLen = IPv4HeaderSize
	case 6:
		if len(d) < IPv6HeaderSize {
			return ErrTruncated
		}
		if int(binary.BigEndian.Uint16(d[4:]))+IPv6HeaderSize != len(d) {
			return ErrIPHeader
		}
		if d[6] != 17 {
			return ErrNotUDP
		}
		ipLen = IPv6HeaderSize
		p.IPv6 = true
	default:
		return ErrIPVersion
	}
	p.IPHeader = d[:ipLen]
	if len(d) < ipLen+UDPHeaderSize {
		return ErrTruncated
	}
	p.UDP = UDP(d[ipLen : ipLen+UDPHeaderSize])
	if p.UDP.DstPort() != UDPPort {
		return ErrUDPPort
	}
	udpLen = p.UDP.Length()
	if udpLen != len(d)-ipLen {
		return ErrUDPLength
	}
	return p.parseTransport(d[ipLen+UDPHeaderSize:])
}

// parseTransport fills the transport views from t: the transport
// headers, payload, pad and ICRC.
func (p *Packet) parseTransport(t []byte) error {
	if len(t) < BTHSize+ICRCSize {
		return ErrTruncated
	}
	p.BTH = BTH(t[:BTHSize])
	p.Op = p.BTH.Opcode()
	p.Info = p.Op.Info()
	if !p.Info.Valid() {
		return ErrOpcode
	}
	if p.BTH.TVer() != 0 {
		return ErrTVer
	}
	if len(t) < p.Info.Length+ICRCSize {
		return ErrTruncated
	}
	p.Headers = t[:p.Info.Length]
	body := len(t) - p.Info.Length - ICRCSize // payload + pad
	pad := p.BTH.PadCount()
	if body%4 != 0 || pad > body {
		return ErrPadding
	}
	if !p.Info.Has(MaskPayload) && body != 0 {
		return ErrNoPayload
	}
	p.Payload = t[p.Info.Length : p.Info.Length+body-pad]
	return nil
}

// ICRCValid reports whether the stored ICRC matches the datagram.
func (p *Packet) ICRCValid() bool {
	d := p.Datagram
	want := binary.LittleEndian.Uint32(d[len(d)-ICRCSize:])
	if p.V1 {
		return want == ICRCv1(d)
	}
	return want == ICRC(d, len(p.IPHeader))
}

// RETH returns the RETH view; valid only if Info has MaskRETH.
func (p *Packet) RETH() RETH { return RETH(p.Headers[p.Info.RETHOff:]) }

// AETH returns the AETH view; valid only if Info has MaskAETH.
func (p *Packet) AETH() AETH { return AETH(p.Headers[p.Info.AETHOff:]) }

// AtomicETH returns the AtomicETH view; valid only with MaskAtomicETH.
func (p *Packet) AtomicETH() AtomicETH { return AtomicETH(p.Headers[p.Info.AtomicETHOff:]) }

// AtomicAckETH returns the AtomicAckETH view; valid only with MaskAtomicAck.
func (p *Packet) AtomicAckETH() AtomicAckETH {
	return AtomicAckETH(p.Headers[p.Info.AtomicAckOff:])
}

// DETH returns the DETH view; valid only with MaskDETH.
func (p *Packet) DETH() DETH { return DETH(p.Headers[p.Info.DETHOff:]) }

// ImmDt returns the ImmDt view; valid only with MaskImm.
func (p *Packet) ImmDt() ImmDt { return ImmDt(p.Headers[p.Info.ImmOff:]) }

// IETH returns the IETH view; valid only with MaskIETH.
func (p *Packet) IETH() IETH { return IETH(p.Headers[p.Info.IETHOff:]) }

// SrcGID returns the source address as a GID (IPv4 mapped).
func (p *Packet) SrcGID() (g [16]byte) {
	if p.IPv6 {
		copy(g[:], p.IPHeader[8:24])
	} else {
		g[10], g[11] = 0xff, 0xff
		copy(g[12:], p.IPHeader[12:16])
	}
	return g
}

// DstGID returns the destination address as a GID (IPv4 mapped).
func (p *Packet) DstGID() (g [16]byte) {
	if p.IPv6 {
		copy(g[:], p.IPHeader[24:40])
	} else {
		g[10], g[11] = 0xff, 0xff
		copy(g[12:], p.IPHeader[16:20])
	}
	return g
}

// TClass returns the IPv4 TOS or IPv6 traffic class.
func (p *Packet) TClass() uint8 {
	if p.IPv6 {
		return uint8(binary.BigEndian.Uint32(p.IPHeader) >> 20)
	}
	return p.IPHeader[1]
}

// HopLimit returns the IPv4 TTL or IPv6 hop limit.
func (p *Packet) HopLimit() uint8 {
	if p.IPv6 {
		return p.IPHeader[7]
	}
	return p.IPHeader[8]
}

// FlowLabel returns the IPv6 flow label (0 for IPv4).
func (p *Packet) FlowLabel() uint32 {
	if p.IPv6 {
		return binary.BigEndian.Uint32(p.IPHeader) & flowLabelMask
	}
	return 0
}

// TransportFields are the values of the transport headers of one packet to
// encode: the BTH and whichever extended headers the opcode carries.
type TransportFields struct {
	BTH BTHFields
	// RETH and AtomicETH share VA and RKey.
	VA        uint64
	RKey      uint32
	DMALength uint32
	SwapAdd   uint64
	Compare   uint64
	Syndrome  Syndrome
	MSN       uint32
	OrigData  uint64
	QKey      uint32
	SrcQP     uint32
	Imm       uint32
	IETHRKey  uint32
}

// EncodeTransport writes the transport headers for f.BTH.Opcode into b and
// returns their length. b must hold the opcode's Length bytes; the opcode
// must be valid.
func EncodeTransport(b []byte, f *TransportFields) int {
	info := f.BTH.Opcode.Info()
	BTH(b).Encode(&f.BTH)
	if info.RETHOff != 0 {
		RETH(b[info.RETHOff:]).Encode(f.VA, f.RKey, f.DMALength)
	}
	if info.AtomicETHOff != 0 {
		AtomicETH(b[info.AtomicETHOff:]).Encode(f.VA, f.RKey, f.SwapAdd, f.Compare)
	}
	if info.AETHOff != 0 {
		AETH(b[info.AETHOff:]).Encode(f.Syndrome, f.MSN)
	}
	if info.AtomicAckOff != 0 {
		AtomicAckETH(b[info.AtomicAckOff:]).Encode(f.OrigData)
	}
	if info.DETHOff != 0 {
		DETH(b[info.DETHOff:]).Encode(f.QKey, f.SrcQP)
	}
	if info.ImmOff != 0 {
		ImmDt(b[info.ImmOff:]).Encode(f.Imm)
	}
	if info.IETHOff != 0 {
		IETH(b[info.IETHOff:]).Encode(f.IETHRKey)
	}
	if info.Has(MaskCNP) {
		clear(b[BTHSize : BTHSize+CNPReservedSize])
	}
	return info.Length
}

// PadFor returns the pad count for a payload of n bytes.
func PadFor(n int) int { return -n & 3 }

// MaxHeaderSize bounds the encapsulation plus transport headers and ICRC
// of any packet: IPv6, UDP, the longest transport header set, ICRC.
const MaxHeaderSize = IPv6HeaderSize + UDPHeaderSize + BTHSize + AtomicETHSize + ICRCSize

// DatagramSize returns the length of a datagram carrying n payload bytes
// with the given opcode.
func DatagramSize(v4 bool, op Opcode, n int) int {
	return NetHeaderSize(v4) + op.Info().Length + n + PadFor(n) + ICRCSize
}

// Build lays out a datagram carrying n payload bytes in b: it encodes the
// IP and UDP headers and the transport headers (setting the BTH pad
// count), zeroes the pad, and returns the datagram and the offset where the
// caller writes the payload. Seal it with SealICRC once the payload is in
// place. b must hold DatagramSize bytes.
func Build(b []byte, net *NetFields, tf *TransportFields, n int) (d []byte, payloadOff int) {
	return layout(b, tf, n, func(udpPayload int) int { return EncodeNet(b, net, udpPayload) })
}

// layout writes the network headers (encode, given the length of what
// follows them: transport headers, payload, pad and ICRC; it returns their
// own length), then the transport headers with the pad count set, zeroes
// the pad, and returns the packet and the payload's offset.
func layout(b []byte, tf *TransportFields, n int, encode func(rest int) int) (d []byte, payloadOff int) {
	pad := PadFor(n)
	tf.BTH.PadCount = uint8(pad)
	info := tf.BTH.Opcode.Info()
	rest := info.Length + n + pad + ICRCSize
	h := encode(rest)
	EncodeTransport(b[h:], tf)
	payloadOff = h + info.Length
	clear(b[payloadOff+n : payloadOff+n+pad])
	return b[:h+rest], payloadOff
}
