package ringbuf

import (
	"encoding/binary"
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// FuzzReadPageDir reads a page directory out of guest memory whose
// contents, directory address and page count are all attacker-chosen. It
// must never panic, and any result must name aligned pages inside RAM.
func FuzzReadPageDir(f *testing.F) {
	f.Add([]byte{0x00, 0x20, 0, 0, 0, 0, 0, 0}, uint64(0x1000), 1, 4)
	f.Add([]byte{0x00, 0x20, 0, 0, 0, 0, 0, 0, 0x08, 0x30}, uint64(0x1000), 600, 1024)
	f.Add([]byte{}, uint64(0xfffffffffffff000), 0, 0)
	f.Fuzz(func(t *testing.T, data []byte, dir uint64, n, max int) {
		m, raw := guestmem.NewFlat(0, 64*guestmem.PageSize)
		// data seeds the directory page and then every page in turn.
		for i := 0; i < len(data) && 0x1000+i < len(raw); i++ {
			raw[0x1000+i] = data[i]
		}
		// A plausible table so that deeper paths are reached.
		for i := 0; i < PageTableEntries; i++ {
			binary.LittleEndian.PutUint64(raw[0x2000+i*8:], uint64(i%64)*guestmem.PageSize)
		}
		if max > 1<<20 {
			max = 1 << 20 // keep the fuzzer's own allocations sane
		}
		pages, err := ReadPageDir(m, guestmem.GPA(dir), n, max)
		if err != nil {
			return
		}
		if len(pages) != n || n > max {
			t.Fatalf("got %d pages for n=%d max=%d", len(pages), n, max)
		}
		for _, p := range pages {
			if p.PageOffset() != 0 || uint64(p)+guestmem.PageSize > uint64(len(raw)) {
				t.Fatalf("page %v accepted", p)
			}
		}
	})
}

// FuzzRing drives a consumer and a producer while the "guest" scribbles
// arbitrary values into the indices it owns and the ones it does not.
func FuzzRing(f *testing.F) {
	f.Add(uint32(4), []byte{1, 2, 3, 4, 5, 6, 7, 8, 0xff, 0x10})
	f.Add(uint32(3072), []byte{0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})
	f.Add(uint32(1536), []byte{9, 8, 7, 6, 5, 4, 3, 2, 1})
	f.Fuzz(func(t *testing.T, slots uint32, ops []byte) {
		g, err := NewGeometry(slots)
		if err != nil || g.Len() > 4096 {
			return
		}
		m, raw := guestmem.NewFlat(0, 8*guestmem.PageSize)
		pages := []guestmem.GPA{0, 0x1000, 0x2000, 0x3000, 0x4000}
		stride := uint32(4)
		a, err := NewArea(pages, guestmem.PageSize, stride, g.Len())
		if err != nil {
			t.Fatal(err)
		}
		c, err := NewConsumer(m, 0, g, a)
		if err != nil {
			t.Fatal(err)
		}
		p, err := NewProducer(m, 8, g, a)
		if err != nil {
			t.Fatal(err)
		}
		lo, hi := uint64(guestmem.PageSize), uint64(guestmem.PageSize)+uint64(g.Len())*uint64(stride)
		for i := 0; i+4 < len(ops); i += 5 {
			v := binary.LittleEndian.Uint32(ops[i+1:])
			switch ops[i] % 8 {
			case 0: // guest writes its producer index
				binary.LittleEndian.PutUint32(raw[0:], v)
			case 1: // guest writes its consumer index
				binary.LittleEndian.PutUint32(raw[12:], v)
			case 2: // guest scribbles over the device's indices
				binary.LittleEndian.PutUint32(raw[4:], v)
				binary.LittleEndian.PutUint32(raw[8:], v)
			case 3:
				n, err := c.Pending()
				if err != nil {
					continue
				}
				if n > g.Len() {
					t.Fatalf("pending %d > %d", n, g.Len())
				}
				for ; n > 0; n-- {
					if h := uint64(c.Head()); h < lo || h >= hi {
						t.Fatalf("consumer element %#x outside [%#x,%#x)", h, lo, hi)
					}
					if err := c.Advance(); err != nil {
						t.Fatal(err)
					}
				}
			case 4:
				gpa, err := p.Reserve()
				if err != nil {
					continue
				}
				if uint64(gpa) < lo || uint64(gpa) >= hi {
					t.Fatalf("producer element %v outside [%#x,%#x)", gpa, lo, hi)
				}
				if err := p.Commit(); err != nil {
					t.Fatal(err)
				}
			case 5:
				if !g.Valid(c.HeadIndex()) || !g.Valid(p.TailIndex()) || !g.Valid(c.NextIndex()) {
					t.Fatalf("device index invalid: %#x %#x %#x", c.HeadIndex(), p.TailIndex(), c.NextIndex())
				}
				if c.Outstanding() > g.Len() {
					t.Fatalf("%d outstanding in a ring of %d", c.Outstanding(), g.Len())
				}
			case 6: // take without releasing
				if n, err := c.Pending(); err == nil && n > 0 {
					if h := uint64(c.Next()); h < lo || h >= hi {
						t.Fatalf("consumer element %#x outside [%#x,%#x)", h, lo, hi)
					}
					if err := c.Take(); err != nil {
						t.Fatal(err)
					}
				}
			case 7: // release to an arbitrary index: monotonic, never past the posted cursor
				before, out := c.HeadIndex(), c.Outstanding()
				if err := c.Release(v); err == nil {
					if moved := g.Used(before, c.HeadIndex()); moved > out {
						t.Fatalf("released %d of %d outstanding", moved, out)
					}
				} else if c.HeadIndex() != before {
					t.Fatalf("failed release moved cons_head")
				}
			}
		}
	})
}
