package roce

import (
	"encoding/binary"
	"hash/crc32"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/crc"
)

// The invariant CRC (IBA 7.8.1 and Annex A17.3.3) is CRC-32 (IEEE 802.3)
// over a pseudo-packet: 8 bytes of 0xFF standing for the masked LRH, then
// the IP header, the UDP header and the transport headers with every field
// a router may change replaced by ones, then the payload and pad. Masked:
// IPv4 TOS, TTL and header checksum; IPv6 traffic class, flow label and
// hop limit; the UDP checksum; BTH byte 4 (FECN, BECN, reserved). Not
// masked: IPv4 ID and flags, lengths, addresses and ports. The result is
// stored little-endian (Linux stores ~crc as a native u32).

// icrcSeed is the CRC state after the eight 0xFF bytes, in hash/crc32's
// convention (Update takes and returns the complemented register).
var icrcSeed = crc32.Update(0, crc32.IEEETable, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})

// ICRC computes the invariant CRC of a RoCE v2 datagram d: the IP header
// (ipLen bytes, 20 or 40) at d[0], then UDP, transport headers, payload,
// pad and the 4-byte ICRC field, which is not covered. d must hold at least
// ipLen + UDPHeaderSize + BTHSize + ICRCSize bytes.
func ICRC(d []byte, ipLen int) uint32 {
	n := ipLen + UDPHeaderSize + BTHSize
	return crc.Update(ICRCPrefix(d, ipLen, n), d[n:len(d)-ICRCSize])
}

// ICRCPrefix returns the invariant CRC's state (hash/crc32's convention)
// after d[:end]: the masked IP, UDP and base transport headers (ipLen is
// 20 or 40), then d up to end, which is at or past the BTH's end. A sender
// continues it over the payload as it writes it (crc.CopyUpdate) and over
// the pad, and stores the result little-endian in the ICRC field.
func ICRCPrefix(d []byte, ipLen, end int) uint32 {
	var ps [IPv6HeaderSize + UDPHeaderSize + BTHSize]byte
	n := copy(ps[:], d[:ipLen+UDPHeaderSize+BTHSize])
	if ipLen == IPv4HeaderSize {
		ps[1] = 0xff                // TOS
		ps[8] = 0xff                // TTL
		ps[10], ps[11] = 0xff, 0xff // header checksum
	} else {
		ps[0] |= 0x0f // low nibble of the traffic class
		ps[1], ps[2], ps[3] = 0xff, 0xff, 0xff
		ps[7] = 0xff // hop limit
	}
	u := ipLen
	ps[u+6], ps[u+7] = 0xff, 0xff // UDP checksum
	ps[u+UDPHeaderSize+bthResv8a] = 0xff
	return crc.Update(crc.Update(icrcSeed, ps[:n]), d[n:end])
}

// SealICRC computes the ICRC of datagram d and stores it in its last four
// bytes.
func SealICRC(d []byte, ipLen int) {
	binary.LittleEndian.PutUint32(d[len(d)-ICRCSize:], ICRC(d, ipLen))
}

// ICRCv1 computes the invariant CRC of a RoCE v1 packet d (IBA Annex
// A16.4.3, 7.8.1): the masked LRH's eight 0xFF bytes, then the GRH with
// the fields a router may change (traffic class, flow label, hop limit)
// replaced by ones, the BTH with byte 4 replaced by ones, then the rest
// up to the ICRC field. d starts at the GRH and must hold at least
// GRHSize + BTHSize + ICRCSize bytes.
func ICRCv1(d []byte) uint32 {
	var ps [GRHSize + BTHSize]byte
	n := copy(ps[:], d[:GRHSize+BTHSize])
	ps[0] |= 0x0f // low nibble of the traffic class
	ps[1], ps[2], ps[3] = 0xff, 0xff, 0xff
	ps[7] = 0xff // hop limit
	ps[GRHSize+bthResv8a] = 0xff
	return crc.Update(crc.Update(icrcSeed, ps[:n]), d[n:len(d)-ICRCSize])
}

// SealICRCv1 computes the ICRC of RoCE v1 packet d and stores it in its
// last four bytes.
func SealICRCv1(d []byte) {
	binary.LittleEndian.PutUint32(d[len(d)-ICRCSize:], ICRCv1(d))
}
