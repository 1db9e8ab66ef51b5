// Package roce is the stateless RoCE v2 packet codec: the InfiniBand
// transport headers (BTH, RETH, AETH, AtomicETH, AtomicAckETH, DETH, ImmDt,
// IETH) as typed byte-slice views, the opcode table that drives parsing,
// 24-bit PSN arithmetic, the IPv4/IPv6/UDP encapsulation of RoCE v2
// (UDP destination port 4791) and the invariant CRC, computed exactly as
// Linux rxe computes it so that rxe and RoCE HCAs accept our packets and we
// can verify theirs.
//
// Views trust their slice: Parse validates every length once, up front, and
// only then hands out views. Accessors never allocate.
//
// References: InfiniBand Architecture Specification vol. 1 release 1.4,
// chapter 9 (transport layer) and Annex A17 (RoCE v2).
package roce
