package ringbuf

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// buildDir writes a page directory for pages at dir, with page tables
// starting at tables, the way pvrdma_page_dir_init lays it out.
func buildDir(raw []byte, dir, tables uint64, pages []uint64) {
	ntables := (len(pages) + PageTableEntries - 1) / PageTableEntries
	for t := 0; t < ntables; t++ {
		tbl := tables + uint64(t)*guestmem.PageSize
		binary.LittleEndian.PutUint64(raw[dir+uint64(t)*8:], tbl)
		for i := 0; i < PageTableEntries && t*PageTableEntries+i < len(pages); i++ {
			binary.LittleEndian.PutUint64(raw[tbl+uint64(i)*8:], pages[t*PageTableEntries+i])
		}
	}
}

func TestReadPageDir(t *testing.T) {
	m, raw := guestmem.NewFlat(0, 4<<20)
	var pages []uint64
	for i := 0; i < 600; i++ { // spans two page tables
		pages = append(pages, uint64(0x100000+((i*7)%600)*guestmem.PageSize))
	}
	buildDir(raw, 0x1000, 0x2000, pages)
	got, err := ReadPageDir(m, 0x1000, len(pages), PageDirMaxPages)
	require.NoError(t, err)
	require.Len(t, got, len(pages))
	for i := range pages {
		assert.Equal(t, guestmem.GPA(pages[i]), got[i])
	}
	got, err = ReadPageDir(m, 0x1000, 3, 4)
	require.NoError(t, err)
	assert.Len(t, got, 3)
}

func TestReadPageDirHostile(t *testing.T) {
	m, raw := guestmem.NewFlat(0, 1<<20)
	buildDir(raw, 0x1000, 0x2000, []uint64{0x10000, 0x11000, 0x12000, 0x13000})
	cases := []struct {
		name     string
		dir      guestmem.GPA
		n, max   int
		mutate   func()
		wantErrs []error
	}{
		{"zero pages (CVE-2021-3607)", 0x1000, 0, 4, nil, []error{ErrPageCount}},
		{"negative pages", 0x1000, -1, 4, nil, []error{ErrPageCount}},
		{"more than the structure allows (CVE-2023-1544)", 0x1000, 513, 512, nil, []error{ErrPageCount}},
		{"more than one directory", 0x1000, PageDirMaxPages + 1, 1 << 30, nil, []error{ErrPageCount}},
		{"misaligned directory", 0x1008, 4, 4, nil, []error{ErrPageAddr}},
		{"directory outside RAM", 0x7fff000, 4, 4, nil, []error{ErrPageAddr, guestmem.ErrUnmapped}},
		{"directory at the top of the address space", 0xfffffffffffff000, 1, 4, nil, []error{ErrPageAddr}},
		{"misaligned page", 0x1000, 4, 4, func() { binary.LittleEndian.PutUint64(raw[0x2000+8:], 0x11008) }, []error{ErrPageAddr}},
		{"page outside RAM", 0x1000, 4, 4, func() { binary.LittleEndian.PutUint64(raw[0x2000+16:], 0x40000000) }, []error{ErrPageAddr, guestmem.ErrUnmapped}},
		{"page straddling the end of RAM", 0x1000, 4, 4, func() { binary.LittleEndian.PutUint64(raw[0x2000+16:], 1<<20-guestmem.PageSize/2) }, []error{ErrPageAddr}},
		{"table outside RAM", 0x1000, 4, 4, func() { binary.LittleEndian.PutUint64(raw[0x1000:], 0x4000000) }, []error{ErrPageAddr}},
		{"second table outside RAM (nchunks beyond what was built)", 0x1000, 513, 1024, func() { binary.LittleEndian.PutUint64(raw[0x1008:], 0x7000000) }, []error{ErrPageAddr}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			buildDir(raw, 0x1000, 0x2000, []uint64{0x10000, 0x11000, 0x12000, 0x13000})
			binary.LittleEndian.PutUint64(raw[0x1008:], 0)
			if tc.mutate != nil {
				tc.mutate()
			}
			_, err := ReadPageDir(m, tc.dir, tc.n, tc.max)
			require.Error(t, err)
			for _, want := range tc.wantErrs {
				assert.ErrorIs(t, err, want)
			}
		})
	}
}

func TestReadPageDirNotShared(t *testing.T) {
	m := guestmem.New()
	m.RequireShared(true)
	require.NoError(t, m.Add(guestmem.RegionSpec{Base: 0, Size: 1 << 20, Prot: guestmem.ProtRead | guestmem.ProtWrite, FD: -1}))
	_, err := ReadPageDir(m, 0x1000, 1, 4)
	assert.ErrorIs(t, err, guestmem.ErrNotShared, "RAM without an fd is refused with the QEMU hint")
}
