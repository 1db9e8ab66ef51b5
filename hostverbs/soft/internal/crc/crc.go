// Package crc computes CRC-32 (IEEE 802.3, the ICRC's polynomial) in the
// convention of hash/crc32 (Update takes and returns the complemented
// register), and fuses it with a copy: CopyUpdate checksums the bytes it
// copies in the same pass, so a packet's payload is read once to be
// gathered into a transmit buffer and checksummed on the way.
//
// On amd64 with PCLMULQDQ the bulk of the work is carry-less
// multiplication folding (eight 16-byte lanes in flight, which the
// multiplier's latency needs) in assembly; short inputs, the tails and
// other architectures use slicing-by-8 tables. Nothing here retains or
// leaks its arguments, so callers may checksum stack buffers.
package crc

import "hash/crc32"

// minFold is the shortest input the folding code takes.
const minFold = 64

// Update returns the CRC-32 (IEEE) of p continued from crc, as
// crc32.Update(crc, crc32.IEEETable, p).
func Update(crc uint32, p []byte) uint32 {
	r := ^crc
	if haveFold && len(p) >= minFold {
		n := len(p) &^ 15
		var st [16]byte
		fold(r, nil, p[:n], &st)
		r = slicing(slicing(0, st[:]), p[n:])
		return ^r
	}
	return ^slicing(r, p)
}

// CopyUpdate copies src into dst, which must be at least as long, and
// returns Update(crc, src).
func CopyUpdate(crc uint32, dst, src []byte) uint32 {
	dst = dst[:len(src)] // panics when dst is short, before anything is written
	if haveFold && len(src) >= minFold {
		n := len(src) &^ 15
		var st [16]byte
		fold(^crc, dst[:n], src[:n], &st)
		copy(dst[n:], src[n:])
		// The folded state is congruent to the input so far: its CRC
		// from a zero register is the register after that input.
		return ^slicing(slicing(0, st[:]), src[n:])
	}
	copy(dst, src)
	return ^slicing(^crc, src)
}

// tables are the slicing-by-8 tables of the reflected polynomial:
// tables[0] is crc32.IEEETable, tables[k][b] the register change of byte b
// followed by k zero bytes.
var tables = func() (t [8][256]uint32) {
	t[0] = *crc32.IEEETable
	for k := 1; k < 8; k++ {
		for b := range 256 {
			v := t[k-1][b]
			t[k][b] = v>>8 ^ t[0][byte(v)]
		}
	}
	return t
}()

// slicing advances the raw (uncomplemented) register r over p, eight
// bytes a step.
func slicing(r uint32, p []byte) uint32 {
	t := &tables
	for len(p) >= 8 {
		r ^= uint32(p[0]) | uint32(p[1])<<8 | uint32(p[2])<<16 | uint32(p[3])<<24
		r = t[7][byte(r)] ^ t[6][byte(r>>8)] ^ t[5][byte(r>>16)] ^ t[4][r>>24] ^
			t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]]
		p = p[8:]
	}
	for _, b := range p {
		r = t[0][byte(r)^b] ^ r>>8
	}
	return r
}
