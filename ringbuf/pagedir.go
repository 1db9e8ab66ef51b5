package ringbuf

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Page directory geometry (pvrdma_dev_api.h): a directory page holds the
// GPAs of page tables, each page table holds the GPAs of up to 512 pages.
// The ABI uses a single directory, so one directory names at most
// PageDirMaxPages pages (1 GiB of 4 KiB pages).
const (
	// PageTableEntries is the number of u64 entries in a directory or table page.
	PageTableEntries = guestmem.PageSize / 8
	// PageDirMaxPages is PVRDMA_PAGE_DIR_MAX_PAGES: one directory of 512
	// tables of 512 pages.
	PageDirMaxPages = PageTableEntries * PageTableEntries
	// MaxFastRegPages is PVRDMA_MAX_FAST_REG_PAGES, the page list limit of
	// a fast-register work request.
	MaxFastRegPages = 128
)

// Errors returned (wrapped) by this package.
var (
	// ErrPageCount: a page count from the guest is zero, too large for the
	// structure, or does not match the object it describes.
	ErrPageCount = errors.New("invalid page count")
	// ErrPageAddr: a page address from the guest is misaligned or outside
	// guest RAM.
	ErrPageAddr = errors.New("invalid page address")
	// ErrIndex: a ring index read from the guest is out of range.
	ErrIndex = errors.New("invalid ring index")
	// ErrFull: a device-produced ring has no free slot.
	ErrFull = errors.New("ring full")
	// ErrGeometry: a ring's element count, stride or page span is invalid.
	ErrGeometry = errors.New("invalid ring geometry")
)

// ReadPageDir reads the page directory at dir that names n pages and
// returns their guest-physical addresses in order. n must be in
// [1, maxPages] and maxPages may not exceed PageDirMaxPages (the caller
// passes the bound its structure allows: CVE-2021-3607 and CVE-2023-1544
// were unchecked counts). The directory, every page table and every named
// page must be page-aligned and lie in guest memory; the result is the only
// allocation, sized by the validated n.
func ReadPageDir(m *guestmem.Memory, dir guestmem.GPA, n, maxPages int) ([]guestmem.GPA, error) {
	if maxPages > PageDirMaxPages {
		maxPages = PageDirMaxPages
	}
	if n <= 0 || n > maxPages {
		return nil, fmt.Errorf("page directory %v: %d pages (allowed 1..%d): %w", dir, n, maxPages, ErrPageCount)
	}
	if err := checkPage(m, dir); err != nil {
		return nil, fmt.Errorf("page directory %v: %w", dir, err)
	}
	ntables := (n + PageTableEntries - 1) / PageTableEntries
	var buf [guestmem.PageSize]byte
	if err := m.ReadAt(buf[:ntables*8], dir); err != nil {
		return nil, fmt.Errorf("page directory %v: %w: %w", dir, ErrPageAddr, err)
	}
	var tables [PageTableEntries]guestmem.GPA
	for t := 0; t < ntables; t++ {
		tables[t] = guestmem.GPA(binary.LittleEndian.Uint64(buf[t*8:]))
		if err := checkPage(m, tables[t]); err != nil {
			return nil, fmt.Errorf("page directory %v: table %d: %w", dir, t, err)
		}
	}
	pages := make([]guestmem.GPA, n)
	for t := 0; t < ntables; t++ {
		cnt := min(PageTableEntries, n-t*PageTableEntries)
		if err := m.ReadAt(buf[:cnt*8], tables[t]); err != nil {
			return nil, fmt.Errorf("page table %v: %w: %w", tables[t], ErrPageAddr, err)
		}
		for i := 0; i < cnt; i++ {
			p := guestmem.GPA(binary.LittleEndian.Uint64(buf[i*8:]))
			if err := checkPage(m, p); err != nil {
				return nil, fmt.Errorf("page directory %v: page %d: %w", dir, t*PageTableEntries+i, err)
			}
			pages[t*PageTableEntries+i] = p
		}
	}
	return pages, nil
}

// checkPage verifies that gpa is page-aligned and that the whole page is
// readable guest memory. Regions are byte-granular, so both ends are probed.
func checkPage(m *guestmem.Memory, gpa guestmem.GPA) error {
	if gpa.PageOffset() != 0 {
		return fmt.Errorf("%v not page-aligned: %w", gpa, ErrPageAddr)
	}
	last, ok := gpa.Add(guestmem.PageSize - 1)
	if !ok {
		return fmt.Errorf("%v: %w", gpa, ErrPageAddr)
	}
	var b [1]byte
	if err := m.ReadAt(b[:], gpa); err != nil {
		return fmt.Errorf("%v: %w: %w", gpa, ErrPageAddr, err)
	}
	if err := m.ReadAt(b[:], last); err != nil {
		return fmt.Errorf("%v: %w: %w", gpa, ErrPageAddr, err)
	}
	return nil
}
