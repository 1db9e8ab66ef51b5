package roce

import "encoding/binary"

// DETH is the Datagram Extended Transport Header (IBA 9.3.2, figure 103),
// 8 bytes, on UD packets:
//
//	 0                   1                   2                   3
//	 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                            Q_Key                              |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|   Reserved    |                 Source QP                     |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
type DETH []byte

// DETHSize is the DETH length.
const DETHSize = 8

// GSIQKey is the well-known Q_Key of the General Services QP (QP1).
const GSIQKey = 0x80010000

// QKey returns the queue key.
func (d DETH) QKey() uint32 { return binary.BigEndian.Uint32(d) }

// SrcQP returns the 24-bit source QP number.
func (d DETH) SrcQP() uint32 { return binary.BigEndian.Uint32(d[4:]) & qpnMask }

// Encode writes the fields.
func (d DETH) Encode(qkey, srcQP uint32) {
	binary.BigEndian.PutUint32(d, qkey)
	binary.BigEndian.PutUint32(d[4:], srcQP&qpnMask)
}

// ImmDt is the Immediate Data Extended Transport Header (IBA 9.3.7), the 4
// bytes of immediate data. The bytes are opaque: verbs carry them as a
// network-order value, and so does the wire.
type ImmDt []byte

// ImmDtSize is the ImmDt length.
const ImmDtSize = 4

// Imm returns the immediate data read little-endian: the uint32 whose
// in-memory bytes (on a little-endian host) are the wire bytes, i.e. the
// value verbs report verbatim.
func (i ImmDt) Imm() uint32 { return binary.LittleEndian.Uint32(i) }

// Encode writes imm so that its little-endian bytes are the wire bytes.
func (i ImmDt) Encode(imm uint32) { binary.LittleEndian.PutUint32(i, imm) }

// IETH is the Invalidate Extended Transport Header (IBA 9.3.8), the R_Key
// a SEND with invalidate asks the responder to invalidate.
type IETH []byte

// IETHSize is the IETH length.
const IETHSize = 4

// RKey returns the R_Key to invalidate.
func (i IETH) RKey() uint32 { return binary.BigEndian.Uint32(i) }

// Encode writes the R_Key.
func (i IETH) Encode(rkey uint32) { binary.BigEndian.PutUint32(i, rkey) }
