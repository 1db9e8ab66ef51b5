package crc

import (
	"bytes"
	"hash/crc32"
	"math/rand/v2"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// Every length from 0 to a few lanes past the eight-lane block, at every
// alignment of a 16-byte lane, from several starting registers: Update
// and CopyUpdate agree with hash/crc32, and the copy is exact and stays
// within its length.
func TestMatchesHashCRC32(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 4096+64)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	for _, seed := range []uint32{0, 0xffffffff, 0x12345678} {
		for off := range 16 {
			for n := 0; n < 600 && off+n <= len(buf); n++ {
				p := buf[off : off+n]
				want := crc32.Update(seed, crc32.IEEETable, p)
				if got := Update(seed, p); got != want {
					t.Fatalf("Update(%#x, %d bytes at %d) = %#x, want %#x", seed, n, off, got, want)
				}
				dst := make([]byte, n+8)
				for i := range dst {
					dst[i] = 0xa5
				}
				if got := CopyUpdate(seed, dst[:n], p); got != want {
					t.Fatalf("CopyUpdate(%#x, %d bytes at %d) = %#x, want %#x", seed, n, off, got, want)
				}
				if !bytes.Equal(dst[:n], p) {
					t.Fatalf("CopyUpdate(%d bytes at %d) copied wrongly", n, off)
				}
				for i := n; i < len(dst); i++ {
					if dst[i] != 0xa5 {
						t.Fatalf("CopyUpdate(%d bytes) wrote past its length at %d", n, i)
					}
				}
			}
		}
	}
	// Long inputs, and continuation: a CRC in two parts is the whole one.
	for _, n := range []int{4096, 4096 + 12, 4111, 4112} {
		p := buf[:n]
		want := crc32.ChecksumIEEE(p)
		if got := Update(0, p); got != want {
			t.Fatalf("Update(%d bytes) = %#x, want %#x", n, got, want)
		}
		for cut := 0; cut <= n; cut += 97 {
			if got := Update(Update(0, p[:cut]), p[cut:]); got != want {
				t.Fatalf("Update of %d bytes cut at %d = %#x, want %#x", n, cut, got, want)
			}
		}
	}
}

func TestCopyUpdateShortDestination(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("CopyUpdate into a short destination did not panic")
		}
	}()
	CopyUpdate(0, make([]byte, 100), make([]byte, 200))
}

func FuzzUpdate(f *testing.F) {
	f.Add(uint32(0), []byte("123456789"))
	f.Add(uint32(0xffffffff), bytes.Repeat([]byte{0x5a}, 300))
	f.Fuzz(func(t *testing.T, seed uint32, p []byte) {
		want := crc32.Update(seed, crc32.IEEETable, p)
		if got := Update(seed, p); got != want {
			t.Fatalf("Update = %#x, want %#x", got, want)
		}
		dst := make([]byte, len(p))
		if got := CopyUpdate(seed, dst, p); got != want || !bytes.Equal(dst, p) {
			t.Fatalf("CopyUpdate = %#x, want %#x (copy equal: %v)", got, want, bytes.Equal(dst, p))
		}
	})
}

var sink uint32

// cpuBench runs f b.N times on a locked thread and reports the thread's
// CPU time per call (on a shared machine wall time measures the others).
func cpuBench(b *testing.B, size int, f func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.SetBytes(int64(size))
	var r0, r1 unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &r0)
	for b.Loop() {
		f()
	}
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &r1)
	ns := r1.Utime.Nano() + r1.Stime.Nano() - r0.Utime.Nano() - r0.Stime.Nano()
	b.ReportMetric(float64(ns)/float64(b.N), "cpu_ns/op")
}

func BenchmarkUpdate4K(b *testing.B) {
	p := make([]byte, 4096)
	cpuBench(b, len(p), func() { sink = Update(sink, p) })
}

func BenchmarkHashCRC32_4K(b *testing.B) {
	p := make([]byte, 4096)
	cpuBench(b, len(p), func() { sink = crc32.Update(sink, crc32.IEEETable, p) })
}

func BenchmarkCopyUpdate4K(b *testing.B) {
	p, q := make([]byte, 4096), make([]byte, 4096)
	cpuBench(b, len(p), func() { sink = CopyUpdate(sink, q, p) })
}

func BenchmarkCopyThenHashCRC32_4K(b *testing.B) {
	p, q := make([]byte, 4096), make([]byte, 4096)
	cpuBench(b, len(p), func() { copy(q, p); sink = crc32.Update(sink, crc32.IEEETable, q) })
}

func BenchmarkCopy4K(b *testing.B) {
	p, q := make([]byte, 4096), make([]byte, 4096)
	cpuBench(b, len(p), func() { copy(q, p) })
}

func BenchmarkUpdate44(b *testing.B) {
	p := make([]byte, 44)
	cpuBench(b, len(p), func() { sink = Update(sink, p) })
}
