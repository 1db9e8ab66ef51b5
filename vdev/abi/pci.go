package abi

// PCI identity of the PVRDMA function, which the driver binds to
// (pvrdma.h, pvrdma_dev_api.h).
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

// BARs of the PVRDMA function (PVRDMA_PCI_RESOURCE_*): the MSI-X table, the
// register file (the Reg* offsets) and the UAR pages (the UAR* doorbells),
// one UARPageSize page per user context.
const (
	MSIXBAR     = 0
	RegsBAR     = 1
	UARBAR      = 2
	NumBARs     = 3
	UARPageSize = 4096
)
