package roce

// PSN is a 24-bit packet sequence number. PSNs wrap: compare them only with
// these methods, which treat the 2^23 PSNs after p as later and the 2^23
// before it as earlier (IBA 9.7.1), never with raw arithmetic.
type PSN uint32

const psnMask = 1<<24 - 1

// MaxPSN is the largest PSN; MaxPSN.Add(1) is 0.
const MaxPSN PSN = psnMask

// Valid reports whether p fits in 24 bits.
func (p PSN) Valid() bool { return p <= psnMask }

// Add returns p advanced by n (mod 2^24).
func (p PSN) Add(n uint32) PSN { return PSN((uint32(p) + n) & psnMask) }

// Sub returns p moved back by n (mod 2^24).
func (p PSN) Sub(n uint32) PSN { return PSN((uint32(p) - n) & psnMask) }

// Diff returns the signed distance p - q in [-2^23, 2^23).
func (p PSN) Diff(q PSN) int32 { return int32((uint32(p)-uint32(q))<<8) >> 8 }

// Distance returns how many PSNs p lies after q (mod 2^24): p == q.Add(n).
func (p PSN) Distance(q PSN) uint32 { return (uint32(p) - uint32(q)) & psnMask }

// Before reports whether p comes strictly before q.
func (p PSN) Before(q PSN) bool { return p.Diff(q) < 0 }

// After reports whether p comes strictly after q.
func (p PSN) After(q PSN) bool { return p.Diff(q) > 0 }

// InRange reports whether p lies in [first, last] (inclusive, in sequence
// order).
func (p PSN) InRange(first, last PSN) bool {
	return p.Distance(first) <= last.Distance(first)
}
