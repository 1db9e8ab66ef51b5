package crc

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// haveFold is set when the CPU has the carry-less multiplier.
var haveFold = cpu.X86.HasPCLMULQDQ && cpu.X86.HasSSE2

// haveWide is set when it also multiplies 256-bit registers (VPCLMULQDQ
// with AVX2, CPUID leaf 7 ECX bit 10) and the OS saves them.
var haveWide = haveFold && cpu.X86.HasAVX2 && func() bool { _, ecx := cpuid7(); return ecx&(1<<10) != 0 }()

// foldK are the folding constants the assembly reads: for a distance of
// 1024 bits (eight lanes) and of 128 bits (one lane), each a pair
// (x^(D+63) mod P, x^(D-1) mod P), bit-reflected in 64 bits.
//
//lint:ignore U1000 read by the assembly (fold_amd64.s) only
var foldK = [4]uint64{
	reflectedPow(1024 + 63), reflectedPow(1024 - 1),
	reflectedPow(128 + 63), reflectedPow(128 - 1),
}

// fold folds src (a multiple of 16 bytes, at least 16) into st starting
// from the raw register r (xored into its first four bytes), copying src
// to dst on the way unless dst is nil.
func fold(r uint32, dst, src []byte, st *[16]byte) {
	var d *byte
	if dst != nil {
		d = unsafe.SliceData(dst)
	}
	if haveWide && useWide {
		foldVPCLMUL(r, d, unsafe.SliceData(src), len(src), st)
		return
	}
	foldCLMUL(r, d, unsafe.SliceData(src), len(src), st)
}

// useWide lets tests and benchmarks compare the two.
var useWide = true

// foldCLMUL is fold in assembly: n is a multiple of 16, at least 16; dst
// may be nil (no copy).
//
//go:noescape
func foldCLMUL(r uint32, dst, src *byte, n int, st *[16]byte)

// foldVPCLMUL is foldCLMUL with 256-bit multiplies while 128 bytes remain.
//
//go:noescape
func foldVPCLMUL(r uint32, dst, src *byte, n int, st *[16]byte)

func cpuid7() (ebx, ecx uint32)
