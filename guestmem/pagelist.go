package guestmem

import (
	"errors"
	"fmt"
)

// ErrOutOfRange: an access through a PageList falls outside
// [IOVA, IOVA+Length).
var ErrOutOfRange = errors.New("access outside the memory region")

// PageList maps a virtually contiguous range (an MR's IOVA, the guest's
// user virtual address) onto guest pages that need not be contiguous: byte
// IOVA+k lives at Pages[(IOVA+k)>>12 - IOVA>>12] + ((IOVA+k) & 0xfff).
// It is how PVRDMA MRs and rings arrive (a page directory of page GPAs).
//
// A PageList with Pages == nil is the identity map over guest-physical
// memory (a DMA MR: IOVA is a GPA).
type PageList struct {
	IOVA   uint64
	Length uint64
	Pages  []GPA
}

// NewPageList checks that pages cover [iova, iova+length) exactly as the
// PVRDMA ABI requires (one page per 4 KiB page spanned, each page-aligned)
// and returns the list. It rejects the length/nchunks mismatch of
// CVE-2021-3582.
func NewPageList(iova, length uint64, pages []GPA) (PageList, error) {
	end := iova + length
	if end < iova {
		return PageList{}, fmt.Errorf("page list %#x+%#x: %w", iova, length, ErrRange)
	}
	want := uint64(0)
	if length > 0 {
		want = (end-1)>>PageShift - iova>>PageShift + 1
	}
	if uint64(len(pages)) != want {
		return PageList{}, fmt.Errorf("page list %#x+%#x spans %d pages, %d given: %w", iova, length, want, len(pages), ErrRange)
	}
	for i, p := range pages {
		if p.PageOffset() != 0 {
			return PageList{}, fmt.Errorf("page list entry %d %v not page-aligned: %w", i, p, ErrAlign)
		}
	}
	return PageList{IOVA: iova, Length: length, Pages: pages}, nil
}

// Identity returns the identity PageList over all of guest-physical memory.
func Identity() PageList { return PageList{IOVA: 0, Length: ^uint64(0)} }

// Contains reports whether [iova, iova+n) lies inside the list's range.
func (pl PageList) Contains(iova, n uint64) bool {
	end := iova + n
	if end < iova || iova < pl.IOVA {
		return false
	}
	return end-pl.IOVA <= pl.Length
}

// Chunks calls fn for each physically contiguous piece of [iova, iova+n),
// in order, with the piece's GPA and length (at most one page unless the
// list is the identity). It stops at the first error.
func (pl PageList) Chunks(iova, n uint64, fn func(gpa GPA, cnt uint64) error) error {
	if !pl.Contains(iova, n) {
		return fmt.Errorf("iova %#x+%#x outside %#x+%#x: %w", iova, n, pl.IOVA, pl.Length, ErrOutOfRange)
	}
	if pl.Pages == nil {
		if n == 0 {
			return nil
		}
		return fn(GPA(iova), n)
	}
	base := pl.IOVA >> PageShift
	for n > 0 {
		idx := iova>>PageShift - base
		off := iova & (PageSize - 1)
		cnt := min(n, PageSize-off)
		if err := fn(pl.Pages[idx]+GPA(off), cnt); err != nil {
			return err
		}
		iova += cnt
		n -= cnt
	}
	return nil
}

// Translate returns the GPA of the single byte at iova.
func (pl PageList) Translate(iova uint64) (GPA, error) {
	var g GPA
	err := pl.Chunks(iova, 1, func(gpa GPA, _ uint64) error { g = gpa; return nil })
	return g, err
}

// ReadAt reads len(p) bytes at iova through the list.
func (pl PageList) ReadAt(m *Memory, p []byte, iova uint64) error {
	return pl.Chunks(iova, uint64(len(p)), func(gpa GPA, cnt uint64) error {
		err := m.ReadAt(p[:cnt], gpa)
		p = p[cnt:]
		return err
	})
}

// WriteAt writes p at iova through the list.
func (pl PageList) WriteAt(m *Memory, p []byte, iova uint64) error {
	return pl.Chunks(iova, uint64(len(p)), func(gpa GPA, cnt uint64) error {
		err := m.WriteAt(p[:cnt], gpa)
		p = p[cnt:]
		return err
	})
}
