package vdev

import "github.com/pvrdma-backend/pvrdma-backend/vdev/abi"

// BAR sizes and the MSI-X layout: the device's choices (the driver reads
// them from the BARs and the MSI-X capability).
const (
	BAR0Size  = 16 << 10 // MSI-X table and PBA
	BAR1Size  = 4 << 10  // registers (the ABI uses the first 0x28 bytes)
	UARPages  = 512      // BAR2 pages: caps.max_uar, a power of two
	BAR2Size  = UARPages * abi.UARPageSize
	MSIXTable = 0x0000 // offset of the MSI-X table in BAR0
	MSIXPBA   = 0x2000 // offset of the MSI-X pending-bit array in BAR0
)

// BARInfo describes one memory BAR.
type BARInfo struct {
	Size         uint64
	Is64Bit      bool
	Prefetchable bool
}

// MSIXInfo describes the MSI-X capability.
type MSIXInfo struct {
	Vectors     int
	BAR         int
	TableOffset uint64
	PBAOffset   uint64
}

// PCIInfo is what a generic PCI function model needs to present the
// device: identity, BARs and MSI-X. The device answers BAR accesses
// through ReadBAR and WriteBAR; config space, the MSI-X table and INTx are
// the framework's.
type PCIInfo struct {
	VendorID, DeviceID       uint16
	SubVendorID, SubDeviceID uint16
	Revision                 uint8
	ClassCode                uint32
	IntPin                   uint8
	// Function is the PCI function number the device must sit at; function 0
	// of the same slot must be a vmxnet3 (abi.PairedVendorID:abi.PairedDeviceID).
	Function int
	BARs     [abi.NumBARs]BARInfo
	MSIX     MSIXInfo
}

// PCI returns the PCI description of the PVRDMA function.
func PCI() PCIInfo {
	return PCIInfo{
		VendorID: abi.PCIVendorID, DeviceID: abi.PCIDeviceID,
		SubVendorID: abi.PCIVendorID, SubDeviceID: abi.PCIDeviceID,
		Revision: abi.PCIRevision, ClassCode: abi.PCIClassCode, IntPin: abi.PCIIntPin, Function: abi.PCIFunction,
		BARs: [abi.NumBARs]BARInfo{
			{Size: BAR0Size},
			{Size: BAR1Size},
			{Size: BAR2Size, Is64Bit: true},
		},
		MSIX: MSIXInfo{Vectors: abi.NumVectors, BAR: abi.MSIXBAR, TableOffset: MSIXTable, PBAOffset: MSIXPBA},
	}
}
