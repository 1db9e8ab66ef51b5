#include "textflag.h"

// FOLD moves lane acc forward by the distance of constant pair k (low
// quadword: x^(D+63) mod P for the lane's first eight bytes; high: x^(D-1)
// mod P for its last eight), t a scratch register.
#define FOLD(acc, k, t) \
	MOVOU     acc, t; \
	PCLMULQDQ $0x00, k, acc; \
	PCLMULQDQ $0x11, k, t; \
	PXOR      t, acc

// LANE folds lane acc over the block at off(SI).
#define LANE(acc, off) \
	FOLD(acc, X8, X10); \
	MOVOU off(SI), X11; \
	PXOR  X11, acc

// LANECOPY is LANE that also stores the block at off(DI).
#define LANECOPY(acc, off) \
	LANE(acc, off); \
	MOVOU X11, off(DI)

// func foldCLMUL(r uint32, dst, src *byte, n int, st *[16]byte)
TEXT ·foldCLMUL(SB), NOSPLIT, $0-40
	MOVL  r+0(FP), AX
	MOVQ  dst+8(FP), DI
	MOVQ  src+16(FP), SI
	MOVQ  n+24(FP), CX
	MOVQ  st+32(FP), DX
	MOVQ  AX, X14
	MOVOU ·foldK+16(SB), X9
	CMPQ  CX, $128
	JB    single

	// Eight lanes: the first 128 bytes, the register xored into the
	// first four.
	MOVOU 0(SI), X0
	MOVOU 16(SI), X1
	MOVOU 32(SI), X2
	MOVOU 48(SI), X3
	MOVOU 64(SI), X4
	MOVOU 80(SI), X5
	MOVOU 96(SI), X6
	MOVOU 112(SI), X7
	PXOR  X14, X0
	ADDQ  $128, SI
	SUBQ  $128, CX
	MOVOU ·foldK+0(SB), X8
	TESTQ DI, DI
	JZ    loop8

	// The same with the copy.
	MOVOU X0, X12
	PXOR  X14, X12 // the block as it was
	MOVOU X12, 0(DI)
	MOVOU X1, 16(DI)
	MOVOU X2, 32(DI)
	MOVOU X3, 48(DI)
	MOVOU X4, 64(DI)
	MOVOU X5, 80(DI)
	MOVOU X6, 96(DI)
	MOVOU X7, 112(DI)
	ADDQ  $128, DI

loop8copy:
	CMPQ CX, $128
	JB   reduce8
	LANECOPY(X0, 0)
	LANECOPY(X1, 16)
	LANECOPY(X2, 32)
	LANECOPY(X3, 48)
	LANECOPY(X4, 64)
	LANECOPY(X5, 80)
	LANECOPY(X6, 96)
	LANECOPY(X7, 112)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JMP  loop8copy

loop8:
	CMPQ CX, $128
	JB   reduce8
	LANE(X0, 0)
	LANE(X1, 16)
	LANE(X2, 32)
	LANE(X3, 48)
	LANE(X4, 64)
	LANE(X5, 80)
	LANE(X6, 96)
	LANE(X7, 112)
	ADDQ $128, SI
	SUBQ $128, CX
	JMP  loop8

reduce8:
	// Fold the eight lanes into the last, 128 bits at a time.
	FOLD(X0, X9, X10)
	PXOR X0, X1
	FOLD(X1, X9, X10)
	PXOR X1, X2
	FOLD(X2, X9, X10)
	PXOR X2, X3
	FOLD(X3, X9, X10)
	PXOR X3, X4
	FOLD(X4, X9, X10)
	PXOR X4, X5
	FOLD(X5, X9, X10)
	PXOR X5, X6
	FOLD(X6, X9, X10)
	PXOR X6, X7
	JMP  tail

single:
	// Fewer than 128 bytes: one lane from the start.
	MOVOU 0(SI), X7
	TESTQ DI, DI
	JZ    single1
	MOVOU X7, 0(DI)
	ADDQ  $16, DI

single1:
	PXOR X14, X7
	ADDQ $16, SI
	SUBQ $16, CX

tail:
	CMPQ  CX, $16
	JB    done
	FOLD(X7, X9, X10)
	MOVOU 0(SI), X11
	PXOR  X11, X7
	TESTQ DI, DI
	JZ    tail1
	MOVOU X11, 0(DI)
	ADDQ  $16, DI

tail1:
	ADDQ $16, SI
	SUBQ $16, CX
	JMP  tail

done:
	MOVOU X7, 0(DX)
	RET

// LANEY folds two lanes (one YMM register) over the 32 bytes at off(SI).
#define LANEY(acc, off) \
	VPCLMULQDQ $0x00, Y8, acc, Y10; \
	VPCLMULQDQ $0x11, Y8, acc, acc; \
	VPXOR      Y10, acc, acc; \
	VMOVDQU    off(SI), Y11; \
	VPXOR      Y11, acc, acc

// LANEYCOPY is LANEY that also stores the 32 bytes at off(DI).
#define LANEYCOPY(acc, off) \
	LANEY(acc, off); \
	VMOVDQU Y11, off(DI)

// func foldVPCLMUL(r uint32, dst, src *byte, n int, st *[16]byte)
//
// foldCLMUL with the eight lanes in four YMM registers (VPCLMULQDQ on
// 256 bits: two lanes per instruction) while 128 bytes remain; the
// reduction and the tail are foldCLMUL's.
TEXT ·foldVPCLMUL(SB), NOSPLIT, $0-40
	MOVL    r+0(FP), AX
	MOVQ    dst+8(FP), DI
	MOVQ    src+16(FP), SI
	MOVQ    n+24(FP), CX
	MOVQ    st+32(FP), DX
	CMPQ    CX, $128
	JB      plain
	VMOVQ   AX, X14 // zeroes the rest of Y14
	VBROADCASTI128 ·foldK+0(SB), Y8
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	TESTQ   DI, DI
	JZ      first
	VMOVDQU Y0, 0(DI)
	VMOVDQU Y1, 32(DI)
	VMOVDQU Y2, 64(DI)
	VMOVDQU Y3, 96(DI)
	ADDQ    $128, DI

first:
	VPXOR Y14, Y0, Y0
	ADDQ  $128, SI
	SUBQ  $128, CX
	TESTQ DI, DI
	JZ    loopy

loopycopy:
	CMPQ CX, $128
	JB   split
	LANEYCOPY(Y0, 0)
	LANEYCOPY(Y1, 32)
	LANEYCOPY(Y2, 64)
	LANEYCOPY(Y3, 96)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JMP  loopycopy

loopy:
	CMPQ CX, $128
	JB   split
	LANEY(Y0, 0)
	LANEY(Y1, 32)
	LANEY(Y2, 64)
	LANEY(Y3, 96)
	ADDQ $128, SI
	SUBQ $128, CX
	JMP  loopy

split:
	// The lanes in order into X0..X7 (each register's high half is the
	// later lane), then back to SSE.
	VEXTRACTI128 $1, Y3, X7
	VMOVDQA      X3, X6
	VEXTRACTI128 $1, Y2, X5
	VMOVDQA      X2, X4
	VEXTRACTI128 $1, Y1, X3
	VMOVDQA      X1, X2
	VEXTRACTI128 $1, Y0, X1
	VZEROUPPER
	MOVOU        ·foldK+16(SB), X9
	FOLD(X0, X9, X10)
	PXOR X0, X1
	FOLD(X1, X9, X10)
	PXOR X1, X2
	FOLD(X2, X9, X10)
	PXOR X2, X3
	FOLD(X3, X9, X10)
	PXOR X3, X4
	FOLD(X4, X9, X10)
	PXOR X4, X5
	FOLD(X5, X9, X10)
	PXOR X5, X6
	FOLD(X6, X9, X10)
	PXOR X6, X7

ytail:
	CMPQ  CX, $16
	JB    ydone
	FOLD(X7, X9, X10)
	MOVOU 0(SI), X11
	PXOR  X11, X7
	TESTQ DI, DI
	JZ    ytail1
	MOVOU X11, 0(DI)
	ADDQ  $16, DI

ytail1:
	ADDQ $16, SI
	SUBQ $16, CX
	JMP  ytail

ydone:
	MOVOU X7, 0(DX)
	RET

plain:
	JMP ·foldCLMUL(SB)

// func cpuid7() (ebx, ecx uint32)
TEXT ·cpuid7(SB), NOSPLIT, $0-8
	MOVL $7, AX
	MOVL $0, CX
	CPUID
	MOVL BX, ebx+0(FP)
	MOVL CX, ecx+4(FP)
	RET
