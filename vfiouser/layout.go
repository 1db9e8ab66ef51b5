package vfiouser

import "encoding/binary"

// Payload layouts of the vfio-user messages (vfio-user spec, one section
// per command; offsets are relative to the end of the header). Each layout
// is one struct with a Size constant, a Decode function that reads the
// fixed part of a payload at least Size bytes long, and an Encode method.
// Callers check lengths before decoding (the dispatcher does, once per
// message).

var le = binary.LittleEndian

// DMA_MAP / DMA_UNMAP flags.
const (
	DMAFlagRead  uint32 = 1 << 0 // DMA_MAP: readable
	DMAFlagWrite uint32 = 1 << 1 // DMA_MAP: writeable

	UnmapFlagDirtyBitmap uint32 = 1 << 0 // DMA_UNMAP: return a dirty bitmap (not supported)
	UnmapFlagAll         uint32 = 1 << 1 // DMA_UNMAP: remove every mapping
)

// DMAMapSize is the size of a DMA_MAP payload.
const DMAMapSize = 32

// DMAMap is the DMA_MAP payload:
//
//	0 argsz u32 | 4 flags u32 | 8 offset u64 | 16 address u64 | 24 size u64
type DMAMap struct {
	Argsz   uint32
	Flags   uint32
	Offset  uint64 // offset into the file descriptor sent with the message
	Address uint64 // IOVA (guest-physical address)
	Size    uint64
}

// DecodeDMAMap decodes a DMA_MAP payload.
func DecodeDMAMap(b []byte) DMAMap {
	_ = b[DMAMapSize-1]
	return DMAMap{Argsz: le.Uint32(b[0:]), Flags: le.Uint32(b[4:]), Offset: le.Uint64(b[8:]),
		Address: le.Uint64(b[16:]), Size: le.Uint64(b[24:])}
}

// Encode writes m into b[:DMAMapSize].
func (m DMAMap) Encode(b []byte) {
	_ = b[DMAMapSize-1]
	le.PutUint32(b[0:], m.Argsz)
	le.PutUint32(b[4:], m.Flags)
	le.PutUint64(b[8:], m.Offset)
	le.PutUint64(b[16:], m.Address)
	le.PutUint64(b[24:], m.Size)
}

// DMAUnmapSize is the size of a DMA_UNMAP payload (and of its reply).
const DMAUnmapSize = 24

// DMAUnmap is the DMA_UNMAP payload, echoed in the reply:
//
//	0 argsz u32 | 4 flags u32 | 8 address u64 | 16 size u64
type DMAUnmap struct {
	Argsz   uint32
	Flags   uint32
	Address uint64
	Size    uint64
}

// DecodeDMAUnmap decodes a DMA_UNMAP payload.
func DecodeDMAUnmap(b []byte) DMAUnmap {
	_ = b[DMAUnmapSize-1]
	return DMAUnmap{Argsz: le.Uint32(b[0:]), Flags: le.Uint32(b[4:]), Address: le.Uint64(b[8:]), Size: le.Uint64(b[16:])}
}

// Encode writes u into b[:DMAUnmapSize].
func (u DMAUnmap) Encode(b []byte) {
	_ = b[DMAUnmapSize-1]
	le.PutUint32(b[0:], u.Argsz)
	le.PutUint32(b[4:], u.Flags)
	le.PutUint64(b[8:], u.Address)
	le.PutUint64(b[16:], u.Size)
}

// DEVICE_GET_INFO flags (VFIO_DEVICE_FLAGS_*).
const (
	DeviceFlagReset uint32 = 1 << 0
	DeviceFlagPCI   uint32 = 1 << 1
)

// DeviceInfoSize is the size of a DEVICE_GET_INFO payload.
const DeviceInfoSize = 16

// DeviceInfo is the DEVICE_GET_INFO payload (request and reply):
//
//	0 argsz u32 | 4 flags u32 | 8 num_regions u32 | 12 num_irqs u32
type DeviceInfo struct {
	Argsz      uint32
	Flags      uint32
	NumRegions uint32
	NumIRQs    uint32
}

// DecodeDeviceInfo decodes a DEVICE_GET_INFO payload.
func DecodeDeviceInfo(b []byte) DeviceInfo {
	_ = b[DeviceInfoSize-1]
	return DeviceInfo{Argsz: le.Uint32(b[0:]), Flags: le.Uint32(b[4:]), NumRegions: le.Uint32(b[8:]), NumIRQs: le.Uint32(b[12:])}
}

// Encode writes d into b[:DeviceInfoSize].
func (d DeviceInfo) Encode(b []byte) {
	_ = b[DeviceInfoSize-1]
	le.PutUint32(b[0:], d.Argsz)
	le.PutUint32(b[4:], d.Flags)
	le.PutUint32(b[8:], d.NumRegions)
	le.PutUint32(b[12:], d.NumIRQs)
}

// Region info flags (VFIO_REGION_INFO_FLAG_*).
const (
	RegionFlagRead  uint32 = 1 << 0
	RegionFlagWrite uint32 = 1 << 1
	RegionFlagMmap  uint32 = 1 << 2
	RegionFlagCaps  uint32 = 1 << 3
)

// Region capability IDs (VFIO_REGION_INFO_CAP_*).
const (
	RegionCapSparseMmap uint16 = 1
)

// RegionInfoSize is the size of a DEVICE_GET_REGION_INFO payload without
// capabilities.
const RegionInfoSize = 32

// RegionInfo is the DEVICE_GET_REGION_INFO payload (request and reply):
//
//	0 argsz u32 | 4 flags u32 | 8 index u32 | 12 cap_offset u32 | 16 size u64 | 24 offset u64
//
// In a reply, capabilities follow at CapOffset (relative to the payload).
type RegionInfo struct {
	Argsz     uint32
	Flags     uint32
	Index     uint32
	CapOffset uint32
	Size      uint64
	Offset    uint64
}

// DecodeRegionInfo decodes a DEVICE_GET_REGION_INFO payload.
func DecodeRegionInfo(b []byte) RegionInfo {
	_ = b[RegionInfoSize-1]
	return RegionInfo{Argsz: le.Uint32(b[0:]), Flags: le.Uint32(b[4:]), Index: le.Uint32(b[8:]),
		CapOffset: le.Uint32(b[12:]), Size: le.Uint64(b[16:]), Offset: le.Uint64(b[24:])}
}

// Encode writes r into b[:RegionInfoSize].
func (r RegionInfo) Encode(b []byte) {
	_ = b[RegionInfoSize-1]
	le.PutUint32(b[0:], r.Argsz)
	le.PutUint32(b[4:], r.Flags)
	le.PutUint32(b[8:], r.Index)
	le.PutUint32(b[12:], r.CapOffset)
	le.PutUint64(b[16:], r.Size)
	le.PutUint64(b[24:], r.Offset)
}

// CapHeaderSize is the size of a region capability header
// (struct vfio_info_cap_header: id u16, version u16, next u32).
const CapHeaderSize = 8

// SparseMmapHeaderSize is the size of the sparse-mmap capability before its
// areas: cap header, nr_areas u32, reserved u32.
const SparseMmapHeaderSize = CapHeaderSize + 8

// SparseAreaSize is the size of one sparse-mmap area (offset u64, size u64).
const SparseAreaSize = 16

// MmapArea is one client-mappable part of a region, relative to the
// region's mmap offset.
type MmapArea struct {
	Offset uint64
	Size   uint64
}

// EncodeSparseMmap writes a sparse-mmap capability with next = 0 into b,
// which must hold SparseMmapHeaderSize + len(areas)*SparseAreaSize bytes.
func EncodeSparseMmap(b []byte, areas []MmapArea) {
	le.PutUint16(b[0:], RegionCapSparseMmap)
	le.PutUint16(b[2:], 1) // version
	le.PutUint32(b[4:], 0) // next: last capability
	le.PutUint32(b[8:], uint32(len(areas)))
	le.PutUint32(b[12:], 0)
	for i, a := range areas {
		o := SparseMmapHeaderSize + i*SparseAreaSize
		le.PutUint64(b[o:], a.Offset)
		le.PutUint64(b[o+8:], a.Size)
	}
}

// IRQ info flags (VFIO_IRQ_INFO_*).
const (
	IRQInfoEventfd    uint32 = 1 << 0
	IRQInfoMaskable   uint32 = 1 << 1
	IRQInfoAutomasked uint32 = 1 << 2
	IRQInfoNoResize   uint32 = 1 << 3
)

// IRQInfoSize is the size of a DEVICE_GET_IRQ_INFO payload.
const IRQInfoSize = 16

// IRQInfo is the DEVICE_GET_IRQ_INFO payload (request and reply):
//
//	0 argsz u32 | 4 flags u32 | 8 index u32 | 12 count u32
type IRQInfo struct {
	Argsz uint32
	Flags uint32
	Index uint32
	Count uint32
}

// DecodeIRQInfo decodes a DEVICE_GET_IRQ_INFO payload.
func DecodeIRQInfo(b []byte) IRQInfo {
	_ = b[IRQInfoSize-1]
	return IRQInfo{Argsz: le.Uint32(b[0:]), Flags: le.Uint32(b[4:]), Index: le.Uint32(b[8:]), Count: le.Uint32(b[12:])}
}

// Encode writes i into b[:IRQInfoSize].
func (i IRQInfo) Encode(b []byte) {
	_ = b[IRQInfoSize-1]
	le.PutUint32(b[0:], i.Argsz)
	le.PutUint32(b[4:], i.Flags)
	le.PutUint32(b[8:], i.Index)
	le.PutUint32(b[12:], i.Count)
}

// DEVICE_SET_IRQS flags (VFIO_IRQ_SET_*): one data type and one action.
const (
	IRQSetDataNone      uint32 = 1 << 0
	IRQSetDataBool      uint32 = 1 << 1
	IRQSetDataEventfd   uint32 = 1 << 2
	IRQSetActionMask    uint32 = 1 << 3
	IRQSetActionUnmask  uint32 = 1 << 4
	IRQSetActionTrigger uint32 = 1 << 5

	// IRQSetDataTypes and IRQSetActionTypes select the two flag groups.
	IRQSetDataTypes   = IRQSetDataNone | IRQSetDataBool | IRQSetDataEventfd
	IRQSetActionTypes = IRQSetActionMask | IRQSetActionUnmask | IRQSetActionTrigger
)

// IRQSetSize is the size of a DEVICE_SET_IRQS payload before its data.
const IRQSetSize = 20

// IRQSet is the DEVICE_SET_IRQS payload:
//
//	0 argsz u32 | 4 flags u32 | 8 index u32 | 12 start u32 | 16 count u32 | 20 data
//
// With IRQSetDataBool, data is count bytes; with IRQSetDataEventfd the
// eventfds travel as SCM_RIGHTS.
type IRQSet struct {
	Argsz uint32
	Flags uint32
	Index uint32
	Start uint32
	Count uint32
}

// DecodeIRQSet decodes the fixed part of a DEVICE_SET_IRQS payload.
func DecodeIRQSet(b []byte) IRQSet {
	_ = b[IRQSetSize-1]
	return IRQSet{Argsz: le.Uint32(b[0:]), Flags: le.Uint32(b[4:]), Index: le.Uint32(b[8:]),
		Start: le.Uint32(b[12:]), Count: le.Uint32(b[16:])}
}

// Encode writes s into b[:IRQSetSize].
func (s IRQSet) Encode(b []byte) {
	_ = b[IRQSetSize-1]
	le.PutUint32(b[0:], s.Argsz)
	le.PutUint32(b[4:], s.Flags)
	le.PutUint32(b[8:], s.Index)
	le.PutUint32(b[12:], s.Start)
	le.PutUint32(b[16:], s.Count)
}

// RegionAccessSize is the size of a REGION_READ/REGION_WRITE payload before
// its data (and of a REGION_WRITE reply).
const RegionAccessSize = 16

// RegionAccess is the REGION_READ/REGION_WRITE payload and reply:
//
//	0 offset u64 | 8 region u32 | 12 count u32 | 16 data
type RegionAccess struct {
	Offset uint64
	Region uint32
	Count  uint32
}

// DecodeRegionAccess decodes the fixed part of a region access payload.
func DecodeRegionAccess(b []byte) RegionAccess {
	_ = b[RegionAccessSize-1]
	return RegionAccess{Offset: le.Uint64(b[0:]), Region: le.Uint32(b[8:]), Count: le.Uint32(b[12:])}
}

// Encode writes a into b[:RegionAccessSize].
func (a RegionAccess) Encode(b []byte) {
	_ = b[RegionAccessSize-1]
	le.PutUint64(b[0:], a.Offset)
	le.PutUint32(b[8:], a.Region)
	le.PutUint32(b[12:], a.Count)
}

// REGION_WRITE_MULTI layout: a u64 write count, then that many 24-byte
// entries {offset u64, region u32, count u32, data [8]byte} (count <= 8).
// QEMU coalesces at most MultiMaxWrites posted writes into one message.
const (
	MultiHeaderSize = 8
	MultiEntrySize  = 24
	MultiDataSize   = 8
	MultiMaxWrites  = 200
)

// DMAAccessSize is the size of a DMA_READ/DMA_WRITE payload before its
// data, and of a DMA_WRITE reply.
const DMAAccessSize = 16

// DMAAccess is the fixed part of the server-to-client DMA_READ and
// DMA_WRITE messages and their replies:
//
//	0 address u64 | 8 count u64 | 16 data
//
// QEMU 11's client answers a DMA_READ in this layout (checked against QEMU
// 11.1 in the VM test) and a DMA_WRITE with a bare header.
type DMAAccess struct {
	Address uint64
	Count   uint64
}

// DecodeDMAAccess decodes the fixed part of a DMA access payload.
func DecodeDMAAccess(b []byte) DMAAccess {
	_ = b[DMAAccessSize-1]
	return DMAAccess{Address: le.Uint64(b[0:]), Count: le.Uint64(b[8:])}
}

// Encode writes a into b[:DMAAccessSize].
func (a DMAAccess) Encode(b []byte) {
	_ = b[DMAAccessSize-1]
	le.PutUint64(b[0:], a.Address)
	le.PutUint64(b[8:], a.Count)
}
