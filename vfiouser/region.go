package vfiouser

import (
	"fmt"
	"syscall"
)

// Device information, regions and region accesses (vfio-user spec,
// DEVICE_GET_INFO, DEVICE_GET_REGION_INFO, REGION_READ, REGION_WRITE,
// REGION_WRITE_MULTI, DEVICE_RESET, DEVICE_FEATURE).

func (c *conn) handleGetInfo(m *ownedMsg) (int, error) {
	in := DecodeDeviceInfo(m.body)
	if in.Argsz < DeviceInfoSize {
		return 0, fmt.Errorf("DEVICE_GET_INFO argsz %d: %w", in.Argsz, ErrInvalid)
	}
	flags := DeviceFlagReset
	if c.desc.PCI {
		flags |= DeviceFlagPCI
	}
	p := c.payload(DeviceInfoSize)
	DeviceInfo{Argsz: DeviceInfoSize, Flags: flags, NumRegions: uint32(len(c.desc.Regions)), NumIRQs: uint32(len(c.desc.IRQs))}.Encode(p)
	return DeviceInfoSize, nil
}

func (c *conn) handleGetRegionInfo(m *ownedMsg) (int, error) {
	in := DecodeRegionInfo(m.body)
	if in.Argsz < RegionInfoSize {
		return 0, fmt.Errorf("DEVICE_GET_REGION_INFO argsz %d: %w", in.Argsz, ErrInvalid)
	}
	if uint64(in.Index) >= uint64(len(c.desc.Regions)) {
		return 0, fmt.Errorf("DEVICE_GET_REGION_INFO index %d of %d: %w", in.Index, len(c.desc.Regions), ErrInvalid)
	}
	r := c.desc.Regions[in.Index]
	out := RegionInfo{Argsz: RegionInfoSize, Index: in.Index, Size: r.Size}
	if r.Read {
		out.Flags |= RegionFlagRead
	}
	if r.Write {
		out.Flags |= RegionFlagWrite
	}
	var areas []MmapArea
	if r.Mmap != nil {
		out.Flags |= RegionFlagMmap
		out.Offset = r.Mmap.Offset
		areas = r.Mmap.Areas
		if len(areas) > 0 {
			out.Argsz = uint32(RegionInfoSize + SparseMmapHeaderSize + len(areas)*SparseAreaSize)
		}
	}
	n := RegionInfoSize
	if len(areas) > 0 && in.Argsz >= out.Argsz {
		// The whole answer fits: add the sparse-mmap capability. Otherwise
		// argsz tells the client how much room to ask for next time.
		out.Flags |= RegionFlagCaps
		out.CapOffset = RegionInfoSize
		n = int(out.Argsz)
	}
	p := c.payload(n)
	out.Encode(p)
	if n > RegionInfoSize {
		EncodeSparseMmap(p[RegionInfoSize:], areas)
	}
	if r.Mmap != nil {
		c.outFDs = append(c.outFDs[:0], r.Mmap.FD)
	}
	return n, nil
}

// regionAccess validates an access to a region: the index exists, the
// range lies inside it (overflow-checked), the region allows the access,
// and the count respects our max_data_xfer_size.
func (c *conn) regionAccess(region uint32, off uint64, count uint32, write bool) error {
	if uint64(region) >= uint64(len(c.desc.Regions)) {
		return fmt.Errorf("region %d of %d: %w", region, len(c.desc.Regions), ErrInvalid)
	}
	if count > c.cfg.MaxDataXfer {
		return fmt.Errorf("region %d access of %d bytes (max %d): %w", region, count, c.cfg.MaxDataXfer, ErrTooBig)
	}
	r := &c.desc.Regions[region]
	if end := off + uint64(count); end < off || end > r.Size {
		return fmt.Errorf("region %d access %#x+%#x outside size %#x: %w", region, off, count, r.Size, ErrInvalid)
	}
	if write && !r.Write || !write && !r.Read {
		return fmt.Errorf("region %d does not allow this access (write %v): %w", region, write, syscall.EPERM)
	}
	return nil
}

func (c *conn) handleRegionRead(m *ownedMsg) (int, error) {
	a := DecodeRegionAccess(m.body)
	if err := c.regionAccess(a.Region, a.Offset, a.Count, false); err != nil {
		return 0, fmt.Errorf("REGION_READ: %w", err)
	}
	p := c.payload(RegionAccessSize + int(a.Count))
	if a.Count > 0 {
		data := p[RegionAccessSize:]
		if err := c.dev.ReadRegion(a.Region, a.Offset, data); err != nil {
			return 0, fmt.Errorf("REGION_READ region %d %#x+%d: %w", a.Region, a.Offset, a.Count, err)
		}
	}
	a.Encode(p)
	return len(p), nil
}

func (c *conn) handleRegionWrite(m *ownedMsg) (int, error) {
	a := DecodeRegionAccess(m.body)
	data := m.body[RegionAccessSize:]
	if uint64(len(data)) != uint64(a.Count) {
		return 0, fmt.Errorf("REGION_WRITE count %d with %d data bytes: %w", a.Count, len(data), ErrInvalid)
	}
	if err := c.regionAccess(a.Region, a.Offset, a.Count, true); err != nil {
		return 0, fmt.Errorf("REGION_WRITE: %w", err)
	}
	if a.Count > 0 {
		if err := c.dev.WriteRegion(a.Region, a.Offset, data); err != nil {
			return 0, fmt.Errorf("REGION_WRITE region %d %#x+%d: %w", a.Region, a.Offset, a.Count, err)
		}
	}
	p := c.payload(RegionAccessSize)
	a.Encode(p)
	return RegionAccessSize, nil
}

// handleWriteMulti applies coalesced posted writes in order (only after
// both sides agreed on write_multiple). The whole message is validated
// before the first write is applied.
func (c *conn) handleWriteMulti(m *ownedMsg) (int, error) {
	if !c.peer.writeMultiple {
		return 0, fmt.Errorf("REGION_WRITE_MULTI without write_multiple: %w", ErrUnsupported)
	}
	cnt := le.Uint64(m.body[0:])
	if cnt == 0 || cnt > MultiMaxWrites || uint64(len(m.body)) != MultiHeaderSize+cnt*MultiEntrySize {
		return 0, fmt.Errorf("REGION_WRITE_MULTI of %d writes in %d bytes: %w", cnt, len(m.body), ErrInvalid)
	}
	for i := uint64(0); i < cnt; i++ {
		e := m.body[MultiHeaderSize+i*MultiEntrySize:]
		a := DecodeRegionAccess(e)
		if a.Count == 0 || a.Count > MultiDataSize {
			return 0, fmt.Errorf("REGION_WRITE_MULTI entry %d count %d: %w", i, a.Count, ErrInvalid)
		}
		if err := c.regionAccess(a.Region, a.Offset, a.Count, true); err != nil {
			return 0, fmt.Errorf("REGION_WRITE_MULTI entry %d: %w", i, err)
		}
	}
	for i := uint64(0); i < cnt; i++ {
		e := m.body[MultiHeaderSize+i*MultiEntrySize:]
		a := DecodeRegionAccess(e)
		if err := c.dev.WriteRegion(a.Region, a.Offset, e[RegionAccessSize:RegionAccessSize+a.Count]); err != nil {
			return 0, fmt.Errorf("REGION_WRITE_MULTI entry %d region %d %#x: %w", i, a.Region, a.Offset, err)
		}
	}
	p := c.payload(8)
	le.PutUint64(p, cnt)
	return 8, nil
}

func (c *conn) handleReset(m *ownedMsg) (int, error) {
	c.lim.Info("reset", "device reset by client")
	if err := c.dev.Reset(ResetClient); err != nil {
		return 0, fmt.Errorf("DEVICE_RESET: %w", err)
	}
	return 0, nil
}

// handleFeature answers DEVICE_FEATURE: no features (migration, dirty
// tracking) are offered, which VFIO signals with ENOTTY.
func (c *conn) handleFeature(m *ownedMsg) (int, error) {
	return 0, fmt.Errorf("DEVICE_FEATURE: %w", syscall.ENOTTY)
}
