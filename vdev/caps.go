package vdev

import (
	"math/bits"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// ABI bounds on what the device may report.
const (
	// maxSGELimit bounds SGEs per WQE so that a send WQE (80 + 16*sge bytes,
	// rounded up to a power of two) stays within 1 KiB and never straddles
	// a page.
	maxSGELimit = 32
	// maxHandle bounds object counts: doorbells carry 24-bit handles and
	// CQEs are matched with qp & 0xFFFF.
	maxQPHandles    = 1 << 16
	maxHandles      = 1 << 24
	maxQueueDepth   = 1 << 15
	maxGIDTableLen  = 255
	firmwareVersion = 1 << 32 // reported as 1.0.0 when the provider has none
)

// computeCaps derives the capabilities reported to the guest: the smallest
// of the provider's attributes, the per-VM limits and the ABI's bounds.
// Queue depths and SGE counts are rounded down to powers of two because
// the driver rounds requests up before checking them against the caps.
func computeCaps(a hostverbs.DeviceAttr, l Limits, mac [6]byte) abi.Caps {
	pos := func(v int) uint32 {
		if v < 0 {
			return 0
		}
		return uint32(min(v, 1<<31-1))
	}
	minu := func(vs ...uint32) uint32 {
		m := vs[0]
		for _, v := range vs[1:] {
			m = min(m, v)
		}
		return m
	}
	pow2Floor := func(v uint32) uint32 {
		if v == 0 {
			return 0
		}
		return 1 << (31 - bits.LeadingZeros32(v))
	}
	c := abi.Caps{
		FWVer:        a.FWVersion,
		NodeGUID:     nodeGUID(mac, a.NodeGUID),
		PageSizeCap:  4096,
		VendorID:     abi.PCIVendorID,
		VendorPartID: abi.PCIDeviceID,
		HWVer:        1,
		MaxUAR:       UARPages,
		MaxPKeys:     1,
		PhysPortCnt:  1,
		Mode:         abi.DeviceModeRoCE,
		GIDTypes:     abi.GIDTypeFlagRoCEv2,
	}
	if a.GIDType == hostverbs.GIDTypeRoCEv1 {
		// One type only: the driver refuses a device offering both.
		c.GIDTypes = abi.GIDTypeFlagRoCEv1
	}
	if c.FWVer == 0 {
		c.FWVer = firmwareVersion
	}
	c.SysImageGUID = c.NodeGUID
	c.MaxMRSize = min(a.MaxMRSize, l.MaxMRBytes, ringbuf.PageDirMaxPages*4096)
	c.MaxQP = minu(pos(a.MaxQP), pos(l.MaxQP), maxQPHandles)
	c.MaxQPWR = pow2Floor(minu(pos(a.MaxQPWR), pos(l.MaxQPWR), maxQueueDepth))
	c.MaxSGE = pow2Floor(minu(pos(a.MaxSGE), pos(l.MaxSGE), maxSGELimit))
	c.MaxSGERd = minu(pos(a.MaxSGERd), c.MaxSGE)
	c.MaxCQ = minu(pos(a.MaxCQ), pos(l.MaxCQ), maxHandles)
	c.MaxCQE = pow2Floor(minu(pos(a.MaxCQE), pos(l.MaxCQE), maxQueueDepth))
	c.MaxMR = minu(pos(a.MaxMR), pos(l.MaxMR), maxHandles)
	c.MaxPD = minu(pos(a.MaxPD), pos(l.MaxPD), maxHandles)
	c.MaxQPRdAtom = pos(a.MaxQPRdAtom)
	c.MaxQPInitRdAtom = pos(a.MaxQPInitRdAtom)
	c.MaxResRdAtom = c.MaxQPRdAtom
	c.MaxAH = minu(pos(a.MaxAH), pos(l.MaxAH))
	c.MaxSRQ = minu(pos(a.MaxSRQ), pos(l.MaxSRQ), maxHandles)
	c.MaxSRQWR = pow2Floor(minu(pos(a.MaxSRQWR), pos(l.MaxSRQWR), maxQueueDepth))
	c.MaxSRQSGE = pow2Floor(minu(pos(a.MaxSRQSGE), c.MaxSGE))
	if c.MaxSRQWR == 0 || c.MaxSRQSGE == 0 {
		c.MaxSRQ = 0 // the driver registers SRQ verbs only if max_srq != 0
	}
	c.GIDTblLen = minu(pos(a.GIDTableLen), pos(l.GIDTableLen), maxGIDTableLen)
	c.LocalCAAckDelay = a.LocalCAAckDelay
	if a.DeviceCapFlags&hostverbs.DeviceCapMemMgtExtensions != 0 && a.MaxFastRegPageListLen > 0 {
		// Fast registration, local and remote invalidation: the driver
		// then sets IB_DEVICE_MEM_MGT_EXTENSIONS, which kernel consumers
		// (nvme-rdma, xprtrdma, iSER, SRP, RDS) require. Page lists hold
		// 4 KiB pages (page_size_cap) and at most the ABI's 128 entries.
		c.BMMEFlags = fastRegBMME
		c.MaxFastRegPageListLen = minu(pos(a.MaxFastRegPageListLen), ringbuf.MaxFastRegPages)
	}
	if a.AtomicCap != hostverbs.AtomicNone {
		c.AtomicOps = abi.AtomicOpCompSwap | abi.AtomicOpFetchAdd
	}
	return c
}

// nodeGUID is the EUI-64 of the paired NIC's MAC (U/L bit flipped,
// ff:fe inserted), or the provider's GUID when no MAC is configured.
func nodeGUID(mac [6]byte, fallback uint64) uint64 {
	if mac == [6]byte{} {
		return fallback
	}
	return uint64(mac[0]^0x02)<<56 | uint64(mac[1])<<48 | uint64(mac[2])<<40 | 0xff<<32 | 0xfe<<24 |
		uint64(mac[3])<<16 | uint64(mac[4])<<8 | uint64(mac[5])
}
