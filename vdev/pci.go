package vdev

// PCI identity of the PVRDMA function (pvrdma.h, pvrdma_dev_api.h, and what
// QEMU 11 and the 6.1 driver accepted, OBSERVED.md section "Device model the
// server presented").
const (
	PCIVendorID    = 0x15ad   // VMware
	PCIDeviceID    = 0x0820   // PVRDMA
	PCIClassCode   = 0x028000 // network controller, other
	PCIRevision    = 0
	PCIIntPin      = 1 // INTA#
	PCIFunction    = 1 // function 1 of the slot whose function 0 is vmxnet3
	PairedVendorID = 0x15ad
	PairedDeviceID = 0x07b0 // vmxnet3: the driver refuses to bind without it at function 0
)

// BAR sizes.
const (
	BAR0Size    = 16 << 10 // MSI-X table and PBA
	BAR1Size    = 4 << 10  // registers (the ABI uses the first 0x28 bytes)
	UARPages    = 512      // BAR2 pages: caps.max_uar, a power of two
	BAR2Size    = UARPages * UARPageSize
	MSIXTable   = 0x0000 // offset of the MSI-X table in BAR0
	MSIXPBA     = 0x2000 // offset of the MSI-X pending-bit array in BAR0
	MSIXBAR     = 0
	RegsBAR     = 1
	UARBAR      = 2
	NumBARs     = 3
	UARPageSize = 4096
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
	// of the same slot must be a vmxnet3 (PairedVendorID:PairedDeviceID).
	Function int
	BARs     [NumBARs]BARInfo
	MSIX     MSIXInfo
}

// PCI returns the PCI description of the PVRDMA function.
func PCI() PCIInfo {
	return PCIInfo{
		VendorID: PCIVendorID, DeviceID: PCIDeviceID,
		SubVendorID: PCIVendorID, SubDeviceID: PCIDeviceID,
		Revision: PCIRevision, ClassCode: PCIClassCode, IntPin: PCIIntPin, Function: PCIFunction,
		BARs: [NumBARs]BARInfo{
			{Size: BAR0Size},
			{Size: BAR1Size},
			{Size: BAR2Size, Is64Bit: true},
		},
		MSIX: MSIXInfo{Vectors: NumVectors, BAR: MSIXBAR, TableOffset: MSIXTable, PBAOffset: MSIXPBA},
	}
}
