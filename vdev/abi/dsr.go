package abi

import "encoding/binary"

// RingPageInfoSize is sizeof(struct pvrdma_ring_page_info).
const RingPageInfoSize = 16

// RingPageInfo is struct pvrdma_ring_page_info: a device ring named by a
// page directory, page 0 holding the ring state.
type RingPageInfo struct {
	NumPages uint32 // pages including the ring-state page
	PDirDMA  uint64 // GPA of the page directory
}

const (
	rpiNumPages = 0
	rpiPDirDMA  = 8
)

// Decode reads r from b.
func (r *RingPageInfo) Decode(b []byte) {
	_ = b[RingPageInfoSize-1]
	r.NumPages = u32(b, rpiNumPages)
	r.PDirDMA = u64(b, rpiPDirDMA)
}

// Encode writes r to b.
func (r RingPageInfo) Encode(b []byte) {
	_ = b[RingPageInfoSize-1]
	put32(b, rpiNumPages, r.NumPages)
	put32(b, 4, 0)
	put64(b, rpiPDirDMA, r.PDirDMA)
}

// DSRSize is sizeof(struct pvrdma_device_shared_region) (packed).
const DSRSize = 280

// Offsets inside the DSR.
const (
	dsrDriverVersion = 0
	dsrGOSInfo       = 8
	dsrCmdSlot       = 16
	dsrRespSlot      = 24
	dsrAsyncRing     = 32
	dsrCQRing        = 48
	dsrUARPFN        = 64
	// DSRCapsOffset is where the device writes its capabilities.
	DSRCapsOffset = 72
)

// DSR is the part of struct pvrdma_device_shared_region the driver writes.
// The device answers by writing Caps at DSRCapsOffset.
type DSR struct {
	DriverVersion uint32
	// GOSInfo is the guest OS bitfield {bits:2, type:4, ver:16, misc:10}.
	GOSInfo   uint32
	CmdSlot   uint64 // GPA of the command slot page
	RespSlot  uint64 // GPA of the response slot page
	AsyncRing RingPageInfo
	CQRing    RingPageInfo
	// UARPFN is uar_pfn64 (device version >= 19) or uar_pfn: the page frame
	// of UAR page 0 (BAR2).
	UARPFN uint64
	Caps   Caps
}

// Decode reads the driver-written fields and the caps from b.
func (d *DSR) Decode(b []byte) {
	_ = b[DSRSize-1]
	d.DriverVersion = u32(b, dsrDriverVersion)
	d.GOSInfo = u32(b, dsrGOSInfo)
	d.CmdSlot = u64(b, dsrCmdSlot)
	d.RespSlot = u64(b, dsrRespSlot)
	d.AsyncRing.Decode(b[dsrAsyncRing:])
	d.CQRing.Decode(b[dsrCQRing:])
	d.UARPFN = u64(b, dsrUARPFN)
	d.Caps.Decode(b[DSRCapsOffset:])
}

// Encode writes d to b.
func (d DSR) Encode(b []byte) {
	_ = b[DSRSize-1]
	clear(b[:DSRSize])
	put32(b, dsrDriverVersion, d.DriverVersion)
	put32(b, dsrGOSInfo, d.GOSInfo)
	put64(b, dsrCmdSlot, d.CmdSlot)
	put64(b, dsrRespSlot, d.RespSlot)
	d.AsyncRing.Encode(b[dsrAsyncRing:])
	d.CQRing.Encode(b[dsrCQRing:])
	put64(b, dsrUARPFN, d.UARPFN)
	d.Caps.Encode(b[DSRCapsOffset:])
}

// CapsSize is sizeof(struct pvrdma_device_caps).
const CapsSize = 208

// Offsets inside struct pvrdma_device_caps.
const (
	capFWVer                 = 0
	capNodeGUID              = 8
	capSysImageGUID          = 16
	capMaxMRSize             = 24
	capPageSizeCap           = 32
	capVendorID              = 64
	capVendorPartID          = 68
	capHWVer                 = 72
	capMaxQP                 = 76
	capMaxQPWR               = 80
	capDeviceCapFlags        = 84
	capMaxSGE                = 88
	capMaxSGERd              = 92
	capMaxCQ                 = 96
	capMaxCQE                = 100
	capMaxMR                 = 104
	capMaxPD                 = 108
	capMaxQPRdAtom           = 112
	capMaxResRdAtom          = 120
	capMaxQPInitRdAtom       = 124
	capMaxAH                 = 164
	capMaxSRQ                = 176
	capMaxSRQWR              = 180
	capMaxSRQSGE             = 184
	capMaxUAR                = 188
	capGIDTblLen             = 192
	capMaxPKeys              = 196
	capLocalCAAckDelay       = 198
	capPhysPortCnt           = 199
	capMode                  = 200
	capAtomicOps             = 201
	capBMMEFlags             = 202
	capGIDTypes              = 203
	capMaxFastRegPageListLen = 204
)

// Caps is struct pvrdma_device_caps, the capabilities the device reports.
// Fields of the C struct not listed here (extended verbs, EE, RDD, MW,
// raw QPs, multicast, FMR) are reported as zero.
type Caps struct {
	FWVer uint64
	// NodeGUID and SysImageGUID are __be64 in the ABI: the value here is
	// the GUID as a number, stored big-endian.
	NodeGUID              uint64
	SysImageGUID          uint64
	MaxMRSize             uint64
	PageSizeCap           uint64
	VendorID              uint32
	VendorPartID          uint32
	HWVer                 uint32
	MaxQP                 uint32
	MaxQPWR               uint32
	DeviceCapFlags        uint32
	MaxSGE                uint32
	MaxSGERd              uint32
	MaxCQ                 uint32
	MaxCQE                uint32
	MaxMR                 uint32
	MaxPD                 uint32
	MaxQPRdAtom           uint32
	MaxResRdAtom          uint32
	MaxQPInitRdAtom       uint32
	MaxAH                 uint32
	MaxSRQ                uint32
	MaxSRQWR              uint32
	MaxSRQSGE             uint32
	MaxUAR                uint32
	GIDTblLen             uint32
	MaxPKeys              uint16
	LocalCAAckDelay       uint8
	PhysPortCnt           uint8
	Mode                  uint8
	AtomicOps             uint8
	BMMEFlags             uint8
	GIDTypes              uint8
	MaxFastRegPageListLen uint32
}

// Decode reads c from b.
func (c *Caps) Decode(b []byte) {
	_ = b[CapsSize-1]
	c.FWVer = u64(b, capFWVer)
	c.NodeGUID = binary.BigEndian.Uint64(b[capNodeGUID:])
	c.SysImageGUID = binary.BigEndian.Uint64(b[capSysImageGUID:])
	c.MaxMRSize = u64(b, capMaxMRSize)
	c.PageSizeCap = u64(b, capPageSizeCap)
	c.VendorID = u32(b, capVendorID)
	c.VendorPartID = u32(b, capVendorPartID)
	c.HWVer = u32(b, capHWVer)
	c.MaxQP = u32(b, capMaxQP)
	c.MaxQPWR = u32(b, capMaxQPWR)
	c.DeviceCapFlags = u32(b, capDeviceCapFlags)
	c.MaxSGE = u32(b, capMaxSGE)
	c.MaxSGERd = u32(b, capMaxSGERd)
	c.MaxCQ = u32(b, capMaxCQ)
	c.MaxCQE = u32(b, capMaxCQE)
	c.MaxMR = u32(b, capMaxMR)
	c.MaxPD = u32(b, capMaxPD)
	c.MaxQPRdAtom = u32(b, capMaxQPRdAtom)
	c.MaxResRdAtom = u32(b, capMaxResRdAtom)
	c.MaxQPInitRdAtom = u32(b, capMaxQPInitRdAtom)
	c.MaxAH = u32(b, capMaxAH)
	c.MaxSRQ = u32(b, capMaxSRQ)
	c.MaxSRQWR = u32(b, capMaxSRQWR)
	c.MaxSRQSGE = u32(b, capMaxSRQSGE)
	c.MaxUAR = u32(b, capMaxUAR)
	c.GIDTblLen = u32(b, capGIDTblLen)
	c.MaxPKeys = u16(b, capMaxPKeys)
	c.LocalCAAckDelay = b[capLocalCAAckDelay]
	c.PhysPortCnt = b[capPhysPortCnt]
	c.Mode = b[capMode]
	c.AtomicOps = b[capAtomicOps]
	c.BMMEFlags = b[capBMMEFlags]
	c.GIDTypes = b[capGIDTypes]
	c.MaxFastRegPageListLen = u32(b, capMaxFastRegPageListLen)
}

// Encode writes c to b, zeroing the fields Caps does not carry.
func (c Caps) Encode(b []byte) {
	_ = b[CapsSize-1]
	clear(b[:CapsSize])
	put64(b, capFWVer, c.FWVer)
	binary.BigEndian.PutUint64(b[capNodeGUID:], c.NodeGUID)
	binary.BigEndian.PutUint64(b[capSysImageGUID:], c.SysImageGUID)
	put64(b, capMaxMRSize, c.MaxMRSize)
	put64(b, capPageSizeCap, c.PageSizeCap)
	put32(b, capVendorID, c.VendorID)
	put32(b, capVendorPartID, c.VendorPartID)
	put32(b, capHWVer, c.HWVer)
	put32(b, capMaxQP, c.MaxQP)
	put32(b, capMaxQPWR, c.MaxQPWR)
	put32(b, capDeviceCapFlags, c.DeviceCapFlags)
	put32(b, capMaxSGE, c.MaxSGE)
	put32(b, capMaxSGERd, c.MaxSGERd)
	put32(b, capMaxCQ, c.MaxCQ)
	put32(b, capMaxCQE, c.MaxCQE)
	put32(b, capMaxMR, c.MaxMR)
	put32(b, capMaxPD, c.MaxPD)
	put32(b, capMaxQPRdAtom, c.MaxQPRdAtom)
	put32(b, capMaxResRdAtom, c.MaxResRdAtom)
	put32(b, capMaxQPInitRdAtom, c.MaxQPInitRdAtom)
	put32(b, capMaxAH, c.MaxAH)
	put32(b, capMaxSRQ, c.MaxSRQ)
	put32(b, capMaxSRQWR, c.MaxSRQWR)
	put32(b, capMaxSRQSGE, c.MaxSRQSGE)
	put32(b, capMaxUAR, c.MaxUAR)
	put32(b, capGIDTblLen, c.GIDTblLen)
	put16(b, capMaxPKeys, c.MaxPKeys)
	b[capLocalCAAckDelay] = c.LocalCAAckDelay
	b[capPhysPortCnt] = c.PhysPortCnt
	b[capMode] = c.Mode
	b[capAtomicOps] = c.AtomicOps
	b[capBMMEFlags] = c.BMMEFlags
	b[capGIDTypes] = c.GIDTypes
	put32(b, capMaxFastRegPageListLen, c.MaxFastRegPageListLen)
}
