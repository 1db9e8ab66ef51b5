package vfiouser

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
)

// Layouts pinned against the vfio-user spec's tables (offsets from the end
// of the header): encode a struct with distinct field values and check the
// bytes at each offset.
func TestLayouts(t *testing.T) {
	b := make([]byte, 64)
	Header{ID: 0x0102, Command: 0x0304, Size: 0x05060708, Flags: 0x090a0b0c, Error: 0x0d0e0f10}.Encode(b)
	assert.Equal(t, []byte{2, 1, 4, 3, 8, 7, 6, 5, 0xc, 0xb, 0xa, 9, 0x10, 0xf, 0xe, 0xd}, b[:HeaderSize])
	assert.Equal(t, Header{ID: 0x0102, Command: 0x0304, Size: 0x05060708, Flags: 0x090a0b0c, Error: 0x0d0e0f10}, DecodeHeader(b))

	check := func(name string, size int, enc func([]byte), fields map[int][]byte) {
		t.Helper()
		buf := make([]byte, size)
		enc(buf)
		for off, want := range fields {
			assert.Equal(t, want, buf[off:off+len(want)], "%s at offset %d", name, off)
		}
	}
	u32 := func(v uint32) []byte { return []byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)} }
	u64 := func(v uint64) []byte { return append(u32(uint32(v)), u32(uint32(v>>32))...) }

	assert.Equal(t, 32, DMAMapSize)
	check("DMAMap", DMAMapSize, DMAMap{Argsz: 1, Flags: 2, Offset: 3, Address: 4, Size: 5}.Encode,
		map[int][]byte{0: u32(1), 4: u32(2), 8: u64(3), 16: u64(4), 24: u64(5)})
	assert.Equal(t, DMAMap{Argsz: 1, Flags: 2, Offset: 3, Address: 4, Size: 5},
		DecodeDMAMap(append(append(append(append(u32(1), u32(2)...), u64(3)...), u64(4)...), u64(5)...)))

	assert.Equal(t, 24, DMAUnmapSize)
	check("DMAUnmap", DMAUnmapSize, DMAUnmap{Argsz: 1, Flags: 2, Address: 3, Size: 4}.Encode,
		map[int][]byte{0: u32(1), 4: u32(2), 8: u64(3), 16: u64(4)})

	assert.Equal(t, 16, DeviceInfoSize)
	check("DeviceInfo", DeviceInfoSize, DeviceInfo{Argsz: 1, Flags: 2, NumRegions: 3, NumIRQs: 4}.Encode,
		map[int][]byte{0: u32(1), 4: u32(2), 8: u32(3), 12: u32(4)})

	assert.Equal(t, 32, RegionInfoSize)
	check("RegionInfo", RegionInfoSize, RegionInfo{Argsz: 1, Flags: 2, Index: 3, CapOffset: 4, Size: 5, Offset: 6}.Encode,
		map[int][]byte{0: u32(1), 4: u32(2), 8: u32(3), 12: u32(4), 16: u64(5), 24: u64(6)})

	assert.Equal(t, 16, IRQInfoSize)
	check("IRQInfo", IRQInfoSize, IRQInfo{Argsz: 1, Flags: 2, Index: 3, Count: 4}.Encode,
		map[int][]byte{0: u32(1), 4: u32(2), 8: u32(3), 12: u32(4)})

	assert.Equal(t, 20, IRQSetSize)
	check("IRQSet", IRQSetSize, IRQSet{Argsz: 1, Flags: 2, Index: 3, Start: 4, Count: 5}.Encode,
		map[int][]byte{0: u32(1), 4: u32(2), 8: u32(3), 12: u32(4), 16: u32(5)})

	assert.Equal(t, 16, RegionAccessSize)
	check("RegionAccess", RegionAccessSize, RegionAccess{Offset: 1, Region: 2, Count: 3}.Encode,
		map[int][]byte{0: u64(1), 8: u32(2), 12: u32(3)})

	// Sparse mmap capability: header {id 1, version 1, next}, nr_areas,
	// reserved, then {offset, size} pairs.
	sp := make([]byte, SparseMmapHeaderSize+2*SparseAreaSize)
	EncodeSparseMmap(sp, []MmapArea{{Offset: 7, Size: 8}, {Offset: 9, Size: 10}})
	assert.Equal(t, append(append(append([]byte{1, 0, 1, 0}, u32(0)...), u32(2)...), u32(0)...), sp[:16])
	assert.Equal(t, append(append(append(u64(7), u64(8)...), u64(9)...), u64(10)...), sp[16:])

	// REGION_WRITE_MULTI: u64 count then 24-byte entries with 8 data bytes.
	assert.Equal(t, 8, MultiHeaderSize)
	assert.Equal(t, RegionAccessSize+MultiDataSize, MultiEntrySize)

	assert.Equal(t, 16, DMAAccessSize)
	check("DMAAccess", DMAAccessSize, DMAAccess{Address: 0x1122334455667788, Count: 0x99}.Encode,
		map[int][]byte{0: u64(0x1122334455667788), 8: u64(0x99)})
}

func TestCommandStrings(t *testing.T) {
	assert.Equal(t, "REGION_WRITE", CmdRegionWrite.String())
	assert.Equal(t, "Command(14)", Command(14).String())
	assert.Equal(t, "MSI-X", IRQMSIX.String())
	assert.True(t, bytes.Contains([]byte(Header{Command: CmdDMAMap, Flags: FlagReply}.String()), []byte("reply DMA_MAP")))
}

// TestOfferedArea: a DMA_MAP without a file descriptor of the size of an
// area the device offered for mmap (QEMU maps a RAM-device BAR into its
// DMA space too) is recognised, and no other size is.
func TestOfferedArea(t *testing.T) {
	c := &conn{desc: Description{Regions: []Region{
		{Size: 4096},
		{Size: 2 << 20, Mmap: &RegionMmap{FD: 3, Areas: []MmapArea{{Offset: 4096, Size: 2<<20 - 4096}}}},
		{Size: 1 << 16, Mmap: &RegionMmap{FD: 4}},
	}}}
	for size, want := range map[uint64]bool{2<<20 - 4096: true, 1 << 16: true, 2 << 20: false, 4096: false, 1 << 30: false} {
		if got := c.offeredArea(size); got != want {
			t.Errorf("offeredArea(%#x) = %v, want %v", size, got, want)
		}
	}
}
