package vfiousertest

import (
	"bytes"
	"encoding/json"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// QEMUCaps is the capability text QEMU 11's vfio-user-pci proposes.
const QEMUCaps = `{"capabilities":{"migration":{"pgsize":4096,"max_bitmap_size":268435456},` +
	`"max_msg_fds":16,"max_data_xfer_size":1048576,"pgsizes":4096,"max_dma_maps":65535,"write_multiple":true}}`

// ServerCaps is the decoded capability reply.
type ServerCaps struct {
	Capabilities struct {
		MaxMsgFDs       int   `json:"max_msg_fds"`
		MaxDataXferSize int   `json:"max_data_xfer_size"`
		MaxDMAMaps      int   `json:"max_dma_maps"`
		PgSizes         int64 `json:"pgsizes"`
		WriteMultiple   *bool `json:"write_multiple"`
	} `json:"capabilities"`
}

// Negotiate sends VERSION 0.0 with caps (NUL-terminated for you; empty:
// no capabilities) and decodes the reply.
func (c *Client) Negotiate(caps string) (ServerCaps, error) {
	var sc ServerCaps
	p := make([]byte, 4, 4+len(caps)+1)
	if caps != "" {
		p = append(p, caps...)
		p = append(p, 0)
	}
	m, err := c.Call(vfiouser.CmdVersion, p)
	if err != nil {
		return sc, err
	}
	if len(m.Body) < 5 || m.Body[len(m.Body)-1] != 0 {
		return sc, fmt.Errorf("VERSION reply of %d bytes is not NUL-terminated JSON", len(m.Body))
	}
	if major, minor := le.Uint16(m.Body), le.Uint16(m.Body[2:]); major != 0 || minor != 0 {
		return sc, fmt.Errorf("server version %d.%d", major, minor)
	}
	dec := json.NewDecoder(bytes.NewReader(m.Body[4 : len(m.Body)-1]))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&sc); err != nil {
		return sc, fmt.Errorf("VERSION reply JSON %q: %w", m.Body[4:], err)
	}
	return sc, nil
}

// DMAMap maps [addr, addr+size) with flags; fd < 0 sends no descriptor.
func (c *Client) DMAMap(addr, size uint64, flags uint32, fd int, offset uint64) error {
	p := make([]byte, vfiouser.DMAMapSize)
	vfiouser.DMAMap{Argsz: vfiouser.DMAMapSize, Flags: flags, Offset: offset, Address: addr, Size: size}.Encode(p)
	var err error
	if fd >= 0 {
		_, err = c.Call(vfiouser.CmdDMAMap, p, fd)
	} else {
		_, err = c.Call(vfiouser.CmdDMAMap, p)
	}
	return err
}

// DMAUnmap removes the mapping [addr, addr+size) and checks the echo.
func (c *Client) DMAUnmap(addr, size uint64, flags uint32) error {
	p := make([]byte, vfiouser.DMAUnmapSize)
	req := vfiouser.DMAUnmap{Argsz: vfiouser.DMAUnmapSize, Flags: flags, Address: addr, Size: size}
	req.Encode(p)
	m, err := c.Call(vfiouser.CmdDMAUnmap, p)
	if err != nil {
		return err
	}
	if len(m.Body) != vfiouser.DMAUnmapSize || vfiouser.DecodeDMAUnmap(m.Body) != req {
		return fmt.Errorf("DMA_UNMAP reply %x does not echo the request", m.Body)
	}
	return nil
}

// DeviceInfo queries DEVICE_GET_INFO.
func (c *Client) DeviceInfo() (vfiouser.DeviceInfo, error) {
	p := make([]byte, vfiouser.DeviceInfoSize)
	vfiouser.DeviceInfo{Argsz: vfiouser.DeviceInfoSize}.Encode(p)
	m, err := c.Call(vfiouser.CmdDeviceGetInfo, p)
	if err != nil {
		return vfiouser.DeviceInfo{}, err
	}
	if len(m.Body) != vfiouser.DeviceInfoSize {
		return vfiouser.DeviceInfo{}, fmt.Errorf("DEVICE_GET_INFO reply of %d bytes", len(m.Body))
	}
	return vfiouser.DecodeDeviceInfo(m.Body), nil
}

// RegionInfo queries DEVICE_GET_REGION_INFO with argsz; it returns the
// info, the capability bytes after it, and any descriptors (the caller
// closes them).
func (c *Client) RegionInfo(index, argsz uint32) (vfiouser.RegionInfo, []byte, []int, error) {
	p := make([]byte, vfiouser.RegionInfoSize)
	vfiouser.RegionInfo{Argsz: argsz, Index: index}.Encode(p)
	m, err := c.Call(vfiouser.CmdDeviceGetRegionInfo, p)
	if err != nil {
		return vfiouser.RegionInfo{}, nil, m.FDs, err
	}
	if len(m.Body) < vfiouser.RegionInfoSize {
		return vfiouser.RegionInfo{}, nil, m.FDs, fmt.Errorf("GET_REGION_INFO reply of %d bytes", len(m.Body))
	}
	return vfiouser.DecodeRegionInfo(m.Body), m.Body[vfiouser.RegionInfoSize:], m.FDs, nil
}

// IRQInfo queries DEVICE_GET_IRQ_INFO.
func (c *Client) IRQInfo(index uint32) (vfiouser.IRQInfo, error) {
	p := make([]byte, vfiouser.IRQInfoSize)
	vfiouser.IRQInfo{Argsz: vfiouser.IRQInfoSize, Index: index}.Encode(p)
	m, err := c.Call(vfiouser.CmdDeviceGetIRQInfo, p)
	if err != nil {
		return vfiouser.IRQInfo{}, err
	}
	if len(m.Body) != vfiouser.IRQInfoSize {
		return vfiouser.IRQInfo{}, fmt.Errorf("GET_IRQ_INFO reply of %d bytes", len(m.Body))
	}
	return vfiouser.DecodeIRQInfo(m.Body), nil
}

// SetIRQs sends DEVICE_SET_IRQS with optional bool data and eventfds.
func (c *Client) SetIRQs(index vfiouser.IRQIndex, flags, start, count uint32, data []byte, fds ...int) error {
	p := make([]byte, vfiouser.IRQSetSize+len(data))
	vfiouser.IRQSet{Argsz: uint32(len(p)), Flags: flags, Index: uint32(index), Start: start, Count: count}.Encode(p)
	copy(p[vfiouser.IRQSetSize:], data)
	_, err := c.Call(vfiouser.CmdDeviceSetIRQs, p, fds...)
	return err
}

// RegionRead reads n bytes of region at off.
func (c *Client) RegionRead(region uint32, off uint64, n uint32) ([]byte, error) {
	p := make([]byte, vfiouser.RegionAccessSize)
	req := vfiouser.RegionAccess{Offset: off, Region: region, Count: n}
	req.Encode(p)
	m, err := c.Call(vfiouser.CmdRegionRead, p)
	if err != nil {
		return nil, err
	}
	if len(m.Body) != vfiouser.RegionAccessSize+int(n) || vfiouser.DecodeRegionAccess(m.Body) != req {
		return nil, fmt.Errorf("REGION_READ reply %x for %+v", m.Body, req)
	}
	return m.Body[vfiouser.RegionAccessSize:], nil
}

// RegionWrite writes data to region at off; a posted write gets no reply
// and returns once sent.
func (c *Client) RegionWrite(region uint32, off uint64, data []byte, posted bool) error {
	p := make([]byte, vfiouser.RegionAccessSize+len(data))
	req := vfiouser.RegionAccess{Offset: off, Region: region, Count: uint32(len(data))}
	req.Encode(p)
	copy(p[vfiouser.RegionAccessSize:], data)
	if posted {
		_, err := c.Send(vfiouser.CmdRegionWrite, vfiouser.FlagNoReply, p)
		return err
	}
	m, err := c.Call(vfiouser.CmdRegionWrite, p)
	if err != nil {
		return err
	}
	if len(m.Body) != vfiouser.RegionAccessSize || vfiouser.DecodeRegionAccess(m.Body) != req {
		return fmt.Errorf("REGION_WRITE reply %x for %+v", m.Body, req)
	}
	return nil
}

// Read32 and Write32 are dword region accesses.
func (c *Client) Read32(region uint32, off uint64) (uint32, error) {
	b, err := c.RegionRead(region, off, 4)
	if err != nil {
		return 0, err
	}
	return le.Uint32(b), nil
}

// Write32 writes a dword (non-posted).
func (c *Client) Write32(region uint32, off uint64, v uint32) error {
	var b [4]byte
	le.PutUint32(b[:], v)
	return c.RegionWrite(region, off, b[:], false)
}

// Reset sends DEVICE_RESET.
func (c *Client) Reset() error {
	_, err := c.Call(vfiouser.CmdDeviceReset, nil)
	return err
}

// Memfd creates a shared memory file of size bytes, sealed against
// shrinking and growing as QEMU's memory-backend-memfd is (seal=on), and
// maps it here, so a test can DMA_MAP it and see the server's writes. The
// caller closes fd and unmaps mem.
func Memfd(size int) (fd int, mem []byte, err error) {
	fd, err = unix.MemfdCreate("vfiousertest-guest", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err = unix.Ftruncate(fd, int64(size)); err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
	}
	if err == nil {
		mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("memfd: %w", err)
	}
	return fd, mem, nil
}

// Eventfd creates a non-blocking eventfd, as QEMU does for interrupts.
func Eventfd() (int, error) {
	return unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
}

// ReadEventfd returns and clears an eventfd's counter (0 if none).
func ReadEventfd(fd int) (uint64, error) {
	var b [8]byte
	_, err := unix.Read(fd, b[:])
	if err == unix.EAGAIN {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return le.Uint64(b[:]), nil
}
