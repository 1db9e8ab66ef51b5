package roce

import (
	"encoding/binary"
	"hash/crc32"
	"math/bits"
	"sync/atomic"
)

// The ICRC of a RoCE v2 packet over IPv4 covers the IP identification and
// the DF flag, fields that a UDP socket with segmentation offload does not
// let the sender choose and that a UDP socket's receiver never sees. CRC-32
// is affine: for messages of one length, crc(m ^ e) = crc(m) ^ L(e), with L
// linear in e. So changing the ID by x changes the ICRC by L(x), a
// function of x and of the datagram's length only; a sender can move a
// sealed packet to another ID for the cost of a table lookup, and a
// receiver can find the ID (and DF) that make a packet's ICRC check by
// solving a 17-unknown linear system over GF(2). IPIDTable holds, per
// datagram length, the 17 columns of L and their reduced basis.

// ipidUnknowns is the number of header bits IPIDTable solves for: the 16
// ID bits, then DF.
const ipidUnknowns = 17

// ipidMaxLen bounds the datagram lengths IPIDTable serves (a 4096-byte
// path MTU plus the largest header set, as the wires' MaxDatagram).
const ipidMaxLen = 4096 + 128

// IPIDTable computes how the ICRC of an IPv4 RoCE datagram changes with
// its identification and DF flag. It builds what a length needs on first
// use (about 2 us) and is safe for concurrent use; the zero value is ready.
type IPIDTable struct {
	byLen [ipidMaxLen + 1]atomic.Pointer[ipidColumns]
}

// ipidColumns are L's columns for one length: col[b] is the ICRC change
// when bit b of the ID (b < 16) or DF (b == 16) flips, and basis is a
// reduced echelon basis of them: basis[i].vec has its pivot bit cleared
// in every later entry, and comb says which columns it sums.
type ipidColumns struct {
	col   [ipidUnknowns]uint32
	basis [ipidUnknowns]struct {
		vec, comb uint32
		pivot     uint32 // the pivot bit, as a mask
	}
	n int
}

// columns returns the table for datagrams of dlen bytes, nil if dlen is
// out of range.
func (t *IPIDTable) columns(dlen int) *ipidColumns {
	if dlen < IPv4HeaderSize+UDPHeaderSize+BTHSize+ICRCSize || dlen > ipidMaxLen {
		return nil
	}
	if c := t.byLen[dlen].Load(); c != nil {
		return c
	}
	c := newIPIDColumns(dlen)
	t.byLen[dlen].Store(c)
	return c
}

// newIPIDColumns computes L's columns for dlen-byte datagrams. The ICRC
// covers 8 bytes of ones, then the datagram up to its ICRC field; the ID
// is at datagram offset 4, DF is bit 0x40 of offset 6. A column is the
// CRC of the flipped bit followed by the bytes that come after it, minus
// (xor) the CRC of as many zeros: leading bytes common to both cancel.
func newIPIDColumns(dlen int) *ipidColumns {
	suffix := make([]byte, dlen-ICRCSize-4) // from the ID's first byte on
	zero := crc32.ChecksumIEEE(suffix)
	c := &ipidColumns{}
	for b := range ipidUnknowns {
		pos, val := 0, byte(0)
		switch {
		case b < 8:
			pos, val = 1, byte(1)<<b // low byte of the big-endian ID
		case b < 16:
			pos, val = 0, byte(1)<<(b-8)
		default:
			pos, val = 2, 0x40
		}
		suffix[pos] = val
		c.col[b] = crc32.ChecksumIEEE(suffix) ^ zero
		suffix[pos] = 0
	}
	for b := range ipidUnknowns {
		vec, comb := c.col[b], uint32(1)<<b
		for i := range c.n {
			if vec&c.basis[i].pivot != 0 {
				vec ^= c.basis[i].vec
				comb ^= c.basis[i].comb
			}
		}
		if vec == 0 {
			continue // dependent (does not happen: CRC-32 catches every burst of up to 32 bits)
		}
		e := &c.basis[c.n]
		e.vec, e.comb, e.pivot = vec, comb, uint32(1)<<(31-bits.LeadingZeros32(vec))
		c.n++
	}
	return c
}

// Delta returns how the ICRC of a dlen-byte IPv4 datagram changes when its
// ID is xored with x. It returns 0 for lengths outside the table, which
// callers avoid (RoCE datagrams are at most a 4096-byte MTU plus headers).
func (t *IPIDTable) Delta(dlen int, x uint16) uint32 {
	c := t.columns(dlen)
	if c == nil {
		return 0
	}
	var d uint32
	for v := uint32(x); v != 0; v &= v - 1 {
		d ^= c.col[bits.TrailingZeros32(v)]
	}
	return d
}

// Solve finds the change of ID (x, to xor into it) and of DF that
// explains an ICRC difference diff (the ICRC carried xor the one computed
// over the assumed header) of a dlen-byte datagram. ok is false when no
// change of those fields explains it: the packet is corrupt elsewhere.
func (t *IPIDTable) Solve(dlen int, diff uint32) (x uint16, flipDF, ok bool) {
	c := t.columns(dlen)
	if c == nil {
		return 0, false, false
	}
	var comb uint32
	for i := range c.n {
		e := &c.basis[i]
		if diff&e.pivot != 0 {
			diff ^= e.vec
			comb ^= e.comb
		}
	}
	if diff != 0 {
		return 0, false, false
	}
	return uint16(comb), comb&(1<<16) != 0, true
}

// SetIPv4ID rewrites the identification of a sealed IPv4 RoCE datagram d
// to id, updating the ICRC (and the IP header checksum) to match; d must
// have been parsed or built as an IPv4 RoCE datagram.
func (t *IPIDTable) SetIPv4ID(d []byte, id uint16) {
	old := binary.BigEndian.Uint16(d[4:])
	if old == id {
		return
	}
	icrc := d[len(d)-ICRCSize:]
	binary.LittleEndian.PutUint32(icrc, binary.LittleEndian.Uint32(icrc)^t.Delta(len(d), old^id))
	binary.BigEndian.PutUint16(d[4:], id)
	binary.BigEndian.PutUint16(d[10:], IPv4Checksum(d[:IPv4HeaderSize]))
}

// RecoverIPv4ID sets the ID and DF of IPv4 RoCE datagram d, received
// without its IP header and rebuilt with a guessed ID and DF, to the
// values under which its ICRC checks; it reports false (leaving d as it
// was) when none does. A corrupted packet passes this check with
// probability 2^-15 rather than CRC-32's 2^-32 (17 of the 32 bits are
// spent on the unknowns), which is why callers first try the ID they
// expect: a match there is the full-strength check.
func (t *IPIDTable) RecoverIPv4ID(d []byte) bool {
	got := binary.LittleEndian.Uint32(d[len(d)-ICRCSize:])
	diff := got ^ ICRC(d, IPv4HeaderSize)
	if diff == 0 {
		return true
	}
	x, flip, ok := t.Solve(len(d), diff)
	if !ok {
		return false
	}
	binary.BigEndian.PutUint16(d[4:], binary.BigEndian.Uint16(d[4:])^x)
	if flip {
		d[6] ^= 0x40
	}
	binary.BigEndian.PutUint16(d[10:], IPv4Checksum(d[:IPv4HeaderSize]))
	return true
}
