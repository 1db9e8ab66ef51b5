package roce

import "encoding/binary"

// BTH is the Base Transport Header (IBA 9.2, figure 100), 12 bytes:
//
//	 0                   1                   2                   3
//	 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|    OpCode     |S|M|Pad|  TVer |           P_Key               |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|F|B|  Resv6    |              Destination QP                   |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|A|   Resv7     |                     PSN                       |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//
// S is Solicited Event, M MigReq, Pad the pad count, F/B the FECN/BECN
// bits (reserved in RoCE v2 and masked out of the ICRC with the rest of
// byte 4), A AckReq.
type BTH []byte

// BTHSize is the BTH length.
const BTHSize = 12

const (
	bthOpcode  = 0
	bthFlags   = 1
	bthPKey    = 2
	bthResv8a  = 4
	bthDestQP  = 4 // 24 bits in bytes 5..7 of the word at 4
	bthAckPSN  = 8
	bthSE      = 0x80
	bthMig     = 0x40
	bthPadMask = 0x30
	bthPadShft = 4
	bthTVer    = 0x0f
	bthFECN    = 0x80
	bthBECN    = 0x40
	bthAckReq  = 0x80
	qpnMask    = 0x00ffffff
)

// Opcode returns the opcode.
func (b BTH) Opcode() Opcode { return Opcode(b[bthOpcode]) }

// SolicitedEvent returns the SE bit.
func (b BTH) SolicitedEvent() bool { return b[bthFlags]&bthSE != 0 }

// MigReq returns the M bit.
func (b BTH) MigReq() bool { return b[bthFlags]&bthMig != 0 }

// PadCount returns the number of pad bytes after the payload (0..3).
func (b BTH) PadCount() int { return int(b[bthFlags]&bthPadMask) >> bthPadShft }

// TVer returns the transport header version (0).
func (b BTH) TVer() uint8 { return b[bthFlags] & bthTVer }

// PKey returns the partition key.
func (b BTH) PKey() uint16 { return binary.BigEndian.Uint16(b[bthPKey:]) }

// FECN returns the forward explicit congestion notification bit.
func (b BTH) FECN() bool { return b[bthResv8a]&bthFECN != 0 }

// BECN returns the backward explicit congestion notification bit.
func (b BTH) BECN() bool { return b[bthResv8a]&bthBECN != 0 }

// DestQP returns the 24-bit destination QP number.
func (b BTH) DestQP() uint32 { return binary.BigEndian.Uint32(b[bthDestQP:]) & qpnMask }

// AckReq returns the acknowledge-request bit.
func (b BTH) AckReq() bool { return b[bthAckPSN]&bthAckReq != 0 }

// PSN returns the packet sequence number.
func (b BTH) PSN() PSN { return PSN(binary.BigEndian.Uint32(b[bthAckPSN:]) & psnMask) }

// BTHFields are the values of a BTH to encode.
type BTHFields struct {
	Opcode         Opcode
	SolicitedEvent bool
	MigReq         bool
	PadCount       uint8
	PKey           uint16
	FECN, BECN     bool
	DestQP         uint32
	AckReq         bool
	PSN            PSN
}

// Encode writes f into b (TVer 0, reserved bits zero).
func (b BTH) Encode(f *BTHFields) {
	b[bthOpcode] = uint8(f.Opcode)
	fl := (f.PadCount << bthPadShft) & bthPadMask
	if f.SolicitedEvent {
		fl |= bthSE
	}
	if f.MigReq {
		fl |= bthMig
	}
	b[bthFlags] = fl
	binary.BigEndian.PutUint16(b[bthPKey:], f.PKey)
	binary.BigEndian.PutUint32(b[bthDestQP:], f.DestQP&qpnMask)
	var r uint8
	if f.FECN {
		r |= bthFECN
	}
	if f.BECN {
		r |= bthBECN
	}
	b[bthResv8a] = r
	binary.BigEndian.PutUint32(b[bthAckPSN:], uint32(f.PSN)&psnMask)
	if f.AckReq {
		b[bthAckPSN] |= bthAckReq
	}
}

// Fields decodes b.
func (b BTH) Fields() BTHFields {
	return BTHFields{
		Opcode: b.Opcode(), SolicitedEvent: b.SolicitedEvent(), MigReq: b.MigReq(),
		PadCount: uint8(b.PadCount()), PKey: b.PKey(), FECN: b.FECN(), BECN: b.BECN(),
		DestQP: b.DestQP(), AckReq: b.AckReq(), PSN: b.PSN(),
	}
}

// DefaultPKey is the full-membership default partition key, the only one
// RoCE devices use.
const DefaultPKey = 0xffff

// PKeyMatch reports whether two P_Keys are in the same partition and at
// least one is a full member (IBA 10.9.3).
func PKeyMatch(a, b uint16) bool {
	const member = 0x7fff
	if a&member != b&member || a&member == 0 {
		return false
	}
	return (a|b)&0x8000 != 0
}
