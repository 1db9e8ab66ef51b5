package roce

import (
	"encoding/binary"
	"time"
)

// AETH is the ACK Extended Transport Header (IBA 9.3.5, figure 106),
// 4 bytes, on acknowledgements and RDMA READ response FIRST/LAST/ONLY:
//
//	 0                   1                   2                   3
//	 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|   Syndrome    |                      MSN                      |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//
// The syndrome's top three bits say ACK (000), RNR NAK (001) or NAK (011);
// the low five carry the credit count, the RNR timer or the NAK code
// (IBA 9.7.5.2, table 44).
type AETH []byte

// AETHSize is the AETH length.
const AETHSize = 4

// Syndrome is the AETH syndrome byte.
type Syndrome uint8

// Syndrome types and values.
const (
	SyndromeTypeMask Syndrome = 0xe0
	SyndromeACK      Syndrome = 0x00
	SyndromeRNRNAK   Syndrome = 0x20
	SyndromeNAK      Syndrome = 0x60

	// SyndromeACKUnlimited is an ACK with the "invalid credit count" code:
	// end-to-end credits are not used (what rxe and RoCE HCAs send).
	SyndromeACKUnlimited Syndrome = 0x1f

	NAKPSNSequenceError Syndrome = 0x60
	NAKInvalidRequest   Syndrome = 0x61
	NAKRemoteAccess     Syndrome = 0x62
	NAKRemoteOperation  Syndrome = 0x63
	NAKInvalidRDRequest Syndrome = 0x64
)

// Type returns the syndrome's type bits.
func (s Syndrome) Type() Syndrome { return s & SyndromeTypeMask }

// Value returns the low five bits (credits, RNR timer or NAK code).
func (s Syndrome) Value() uint8 { return uint8(s &^ SyndromeTypeMask) }

// RNRNAK returns the syndrome of an RNR NAK carrying timer code t.
func RNRNAK(t uint8) Syndrome { return SyndromeRNRNAK | Syndrome(t&0x1f) }

// Syndrome returns the syndrome.
func (a AETH) Syndrome() Syndrome { return Syndrome(a[0]) }

// MSN returns the 24-bit message sequence number.
func (a AETH) MSN() uint32 { return binary.BigEndian.Uint32(a) & 0x00ffffff }

// Encode writes the fields.
func (a AETH) Encode(s Syndrome, msn uint32) {
	binary.BigEndian.PutUint32(a, msn&0x00ffffff)
	a[0] = uint8(s)
}

// rnrTimerMicros is the RNR NAK timer encoding of IBA 9.7.5.2.8 (table 45),
// in microseconds; code 0 is the longest, 655.36 ms.
var rnrTimerMicros = [32]uint32{
	655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
	2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
	163840, 245760, 327680, 491520,
}

// RNRTimer returns the delay an RNR NAK timer code (0..31) asks for.
func RNRTimer(code uint8) time.Duration {
	return time.Duration(rnrTimerMicros[code&0x1f]) * time.Microsecond
}

// LocalACKTimeout returns the local ACK timeout a QP's timeout attribute
// (0..31) encodes: 4.096 µs × 2^timeout, and 0 (no timeout) for 0
// (IBA 11.2.4.2, C11-13.2.1).
func LocalACKTimeout(timeout uint8) time.Duration {
	if timeout == 0 {
		return 0
	}
	return time.Duration(4096<<(timeout&0x1f)) * time.Nanosecond
}
