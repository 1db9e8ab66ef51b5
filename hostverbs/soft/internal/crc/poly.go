package crc

// poly is the CRC-32 (IEEE 802.3) generator without its x^32 term.
const poly = 0x04c11db7

// pow returns x^n mod P as a polynomial of degree below 32 (bit i the
// coefficient of x^i).
func pow(n int) uint32 {
	r := uint32(1)
	for range n {
		carry := r&0x80000000 != 0
		r <<= 1
		if carry {
			r ^= poly
		}
	}
	return r
}

// reflectedPow returns x^n mod P bit-reflected in 64 bits (the coefficient
// of x^i at bit 63-i), the layout in which a carry-less product of
// reflected operands is the reflected product times x.
func reflectedPow(n int) uint64 {
	p := pow(n)
	var r uint64
	for i := range 32 {
		if p&(1<<i) != 0 {
			r |= 1 << (63 - i)
		}
	}
	return r
}
