package vfiouser

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// DMA_MAP and DMA_UNMAP (vfio-user spec): the client tells the server which
// guest-physical ranges it may access. A map with a file descriptor is
// mmapped MAP_SHARED with the protection it asks for and mlocked (the
// device reads rings in place and must never fault on swapped-out pages);
// a map without one (QEMU's BIOS ROM at 0xfffc0000, and all of guest RAM
// unless it is a shared memfd) is recorded and reached with DMA_READ and
// DMA_WRITE messages, or refused at access time for devices that need
// memory in place.

const pageMask = pageSize4K - 1

func (c *conn) handleDMAMap(m *ownedMsg) (int, error) {
	d := DecodeDMAMap(m.body)
	if d.Argsz < DMAMapSize {
		return 0, fmt.Errorf("DMA_MAP argsz %d: %w", d.Argsz, ErrInvalid)
	}
	if d.Flags&^(DMAFlagRead|DMAFlagWrite) != 0 || d.Flags == 0 {
		return 0, fmt.Errorf("DMA_MAP flags %#x: %w", d.Flags, ErrInvalid)
	}
	if d.Size == 0 || d.Address&pageMask != 0 || d.Size&pageMask != 0 || d.Offset&pageMask != 0 {
		return 0, fmt.Errorf("DMA_MAP %#x+%#x offset %#x: not 4 KiB aligned: %w", d.Address, d.Size, d.Offset, ErrInvalid)
	}
	if end := d.Address + d.Size; end < d.Address {
		return 0, fmt.Errorf("DMA_MAP %#x+%#x overflows: %w", d.Address, d.Size, ErrInvalid)
	}
	fd := -1
	if len(m.fds) == 1 {
		fd = m.fds[0]
	}
	var prot guestmem.Prot
	if d.Flags&DMAFlagRead != 0 {
		prot |= guestmem.ProtRead
	}
	if d.Flags&DMAFlagWrite != 0 {
		prot |= guestmem.ProtWrite
	}
	if err := c.mapRegion(d.Address, d.Size, d.Offset, prot, fd); err != nil {
		return 0, err
	}
	if fd >= 0 {
		m.fds[0] = -1 // owned by the region now; its Release closes it
		c.keepMapped(guestmem.GPA(d.Address), fd)
	}
	c.keepSaved()
	return 0, nil
}

// mapRegion maps [addr, addr+size) of guest memory: from fd at offset (fd
// >= 0; the region owns fd once this succeeds), or as a range reached by
// DMA messages. The device is told.
func (c *conn) mapRegion(addr, size, offset uint64, prot guestmem.Prot, fd int) error {
	if c.dmaMaps >= c.cfg.MaxDMAMaps {
		return fmt.Errorf("DMA_MAP: %d mappings already (max_dma_maps): %w", c.dmaMaps, ErrInvalid)
	}
	base := guestmem.GPA(addr)
	var spec guestmem.RegionSpec
	if fd >= 0 {
		if offset > 1<<62 {
			return fmt.Errorf("DMA_MAP offset %#x: %w", offset, ErrInvalid)
		}
		id, err := c.checkMemFD(fd, offset, size)
		if err != nil {
			return fmt.Errorf("DMA_MAP %#x+%#x: %w", addr, size, err)
		}
		span := fileSpan{offset, offset + size}
		if err := c.claimFile(id, span); err != nil {
			return fmt.Errorf("DMA_MAP %#x+%#x: %w", addr, size, err)
		}
		spec, err = guestmem.MapFD(base, size, prot, fd, int64(offset))
		if err != nil {
			c.releaseFile(id, span)
			return fmt.Errorf("DMA_MAP %#x+%#x: %w", addr, size, err)
		}
		unmap := spec.Release
		spec.Release = func() error {
			err := unmap()
			c.releaseFile(id, span)
			return err
		}
	} else {
		spec = guestmem.RegionSpec{Base: base, Size: size, Prot: prot, FD: -1}
		switch {
		case c.offeredArea(size):
			// QEMU maps the device's own mmap'd BAR area (a RAM-device
			// region in the guest's address space) into its DMA space
			// too: not guest RAM, nothing to warn about.
			if c.trace {
				c.log.Debug("DMA_MAP of an area the device offered for mmap", "addr", fmt.Sprintf("%#x", addr), "size", size)
			}
		case c.desc.RequireSharedMemory && prot&guestmem.ProtWrite != 0 && !c.warnedRAM:
			c.warnedRAM = true
			c.log.Warn("client mapped writable guest memory without a file descriptor; the device cannot reach it",
				"addr", fmt.Sprintf("%#x", addr), "size", size, "fix", guestmem.ErrNotShared.Error())
		}
	}
	if err := c.mem.Add(spec); err != nil {
		if spec.Release != nil {
			_ = spec.Release()
		}
		return fmt.Errorf("DMA_MAP %#x+%#x: %w", addr, size, err)
	}
	c.dmaMaps++
	if c.trace {
		c.log.Debug("DMA_MAP", "addr", fmt.Sprintf("%#x", addr), "size", size, "flags", uint32(prot),
			"fd", spec.FD >= 0, "locked_bytes", c.mem.LockedBytes())
	}
	if n, ok := c.dev.(DMANotifier); ok {
		s := spec
		s.Data, s.Release = nil, nil
		n.DMAMapped(s)
	}
	return nil
}

// offeredArea reports whether size is the size of an area of a region the
// device offers for mmap (DEVICE_GET_REGION_INFO's sparse areas, or the
// whole region when it lists none).
func (c *conn) offeredArea(size uint64) bool {
	for _, r := range c.desc.Regions {
		if r.Mmap == nil {
			continue
		}
		if len(r.Mmap.Areas) == 0 && r.Size == size {
			return true
		}
		for _, a := range r.Mmap.Areas {
			if a.Size == size {
				return true
			}
		}
	}
	return false
}

// checkMemFD refuses a file too short for the mapping (touching pages past
// its end would fault) and one that could be made so later: a client that
// truncates the file under us would make the daemon's next access to those
// pages raise SIGBUS and take every VM's device down with it. A file must
// be sealed against shrinking; a memfd that allows sealing gets the seal
// here, anything else (a regular or hugetlbfs file, a memfd whose seals
// are sealed) is refused. QEMU's memory-backend-memfd has the seal already
// (seal=on, its default).
func (c *conn) checkMemFD(fd int, off, size uint64) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fileID{}, fmt.Errorf("fstat: %w", err)
	}
	id := fileID{st.Dev, st.Ino}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return id, nil // device memory etc.: mmap decides
	}
	if end := off + size; end < off || end > uint64(st.Size) {
		return id, fmt.Errorf("file of %#x bytes is too short for offset %#x size %#x: %w", st.Size, off, size, ErrInvalid)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err == nil && seals&unix.F_SEAL_SHRINK != 0 {
		return id, nil
	}
	if err == nil {
		if _, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err == nil {
			return id, nil
		}
	}
	return id, fmt.Errorf("guest memory file cannot be sealed against shrinking (%v): use QEMU's memory-backend-memfd "+
		"with seal=on (the default): %w", err, ErrInvalid)
}

// fileID names a file (device and inode); fileSpan is a byte range of it.
type (
	fileID   struct{ dev, ino uint64 }
	fileSpan struct{ off, end uint64 }
)

// claimFile records that span of file id is mapped, refusing a range that
// overlaps one mapped already (the same pages twice would be locked, and
// counted, twice) and charging the lock budget.
func (c *conn) claimFile(id fileID, span fileSpan) error {
	c.fdMu.Lock()
	defer c.fdMu.Unlock()
	for _, s := range c.fdMaps[id] {
		if span.off < s.end && s.off < span.end {
			return fmt.Errorf("file range %#x-%#x is mapped already at %#x-%#x (aliased guest memory): %w",
				span.off, span.end, s.off, s.end, ErrInvalid)
		}
	}
	if b := c.cfg.LockBudget; b != nil {
		if err := b.Charge(span.end - span.off); err != nil {
			return fmt.Errorf("guest memory to lock: %w (%w)", err, ErrInvalid)
		}
	}
	if c.fdMaps == nil {
		c.fdMaps = map[fileID][]fileSpan{}
	}
	c.fdMaps[id] = append(c.fdMaps[id], span)
	return nil
}

// releaseFile undoes claimFile once the range is unmapped.
func (c *conn) releaseFile(id fileID, span fileSpan) {
	c.fdMu.Lock()
	defer c.fdMu.Unlock()
	spans := c.fdMaps[id]
	for i, s := range spans {
		if s == span {
			c.fdMaps[id] = append(spans[:i], spans[i+1:]...)
			if b := c.cfg.LockBudget; b != nil {
				b.Release(span.end - span.off)
			}
			break
		}
	}
	if len(c.fdMaps[id]) == 0 {
		delete(c.fdMaps, id)
	}
}

func (c *conn) handleDMAUnmap(m *ownedMsg) (int, error) {
	u := DecodeDMAUnmap(m.body)
	if u.Argsz < DMAUnmapSize {
		return 0, fmt.Errorf("DMA_UNMAP argsz %d: %w", u.Argsz, ErrInvalid)
	}
	switch u.Flags {
	case 0:
		if _, err := c.mem.Remove(guestmem.GPA(u.Address), u.Size); err != nil {
			return 0, fmt.Errorf("DMA_UNMAP %#x+%#x: %w", u.Address, u.Size, err)
		}
		c.dmaMaps--
		c.keepUnmapped(guestmem.GPA(u.Address))
		if n, ok := c.dev.(DMANotifier); ok {
			n.DMAUnmapped(guestmem.GPA(u.Address), u.Size)
		}
	case UnmapFlagAll:
		if u.Address != 0 || u.Size != 0 {
			return 0, fmt.Errorf("DMA_UNMAP all with range %#x+%#x: %w", u.Address, u.Size, ErrInvalid)
		}
		regions := c.mem.Regions()
		if err := c.mem.RemoveAll(); err != nil {
			return 0, fmt.Errorf("DMA_UNMAP all: %w", err)
		}
		c.dmaMaps = 0
		for _, r := range regions {
			c.keepUnmapped(r.Base)
		}
		if n, ok := c.dev.(DMANotifier); ok {
			for _, r := range regions {
				n.DMAUnmapped(r.Base, r.Size)
			}
		}
	case UnmapFlagDirtyBitmap:
		return 0, fmt.Errorf("DMA_UNMAP dirty bitmap: %w", ErrUnsupported)
	default:
		return 0, fmt.Errorf("DMA_UNMAP flags %#x: %w", u.Flags, ErrInvalid)
	}
	if c.trace {
		c.log.Debug("DMA_UNMAP", "addr", fmt.Sprintf("%#x", u.Address), "size", u.Size, "locked_bytes", c.mem.LockedBytes())
	}
	c.keepSaved()
	p := c.payload(DMAUnmapSize)
	u.Argsz = DMAUnmapSize
	u.Encode(p)
	return DMAUnmapSize, nil
}
