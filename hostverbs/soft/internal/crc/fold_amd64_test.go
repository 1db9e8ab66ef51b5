package crc

import "testing"

// Both folding variants, where the CPU has them: the tests of crc_test.go
// again with the 128-bit one.
func TestNarrowFold(t *testing.T) {
	t.Logf("PCLMULQDQ %v, VPCLMULQDQ %v", haveFold, haveWide)
	if !haveWide {
		t.Skip("the 256-bit variant is not in use here: the default tests ran the 128-bit one")
	}
	useWide = false
	defer func() { useWide = true }()
	TestMatchesHashCRC32(t)
}

func BenchmarkUpdate4KNarrow(b *testing.B) {
	useWide = false
	defer func() { useWide = true }()
	BenchmarkUpdate4K(b)
}

func BenchmarkCopyUpdate4KNarrow(b *testing.B) {
	useWide = false
	defer func() { useWide = true }()
	BenchmarkCopyUpdate4K(b)
}
