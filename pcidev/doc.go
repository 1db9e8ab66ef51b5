// Package pcidev is a generic PCI function model for devices served over
// vfio-user: a type-0 configuration space with a capability list, BAR
// sizing, command-register gating (memory and I/O decode, bus master), an
// MSI-X capability with its table and PBA in a BAR, and INTx. A device is
// described declaratively (IDs, class, BARs with read/write callbacks,
// interrupts), in the spirit of libvfio-user's vfu_pci_* API; New turns the
// description into a Function that implements vfiouser.Device and gives the
// device model its interrupt and bus-state helpers.
//
// A PVRDMA-shaped function (15ad:0820, network-other; BAR0 16 KiB with the
// MSI-X table at 0 and the PBA at 0x2000 for 3 vectors; BAR1 4 KiB of
// registers; BAR2 2 MiB of UAR pages, 64-bit), glued to a device model dev
// inside a vfiouser.NewDeviceFunc:
//
//	fn, err := pcidev.New(h, pcidev.Config{
//		VendorID: 0x15ad, DeviceID: 0x0820, SubVendorID: 0x15ad, SubDeviceID: 0x0820,
//		ClassCode: 0x028000, IntPin: 1, RequireSharedMemory: true,
//		BARs: [6]pcidev.BAR{
//			0: {Size: 16 << 10, Type: pcidev.BARMem32},
//			1: {Size: 4 << 10, Type: pcidev.BARMem32,
//				Read:  func(off uint64, p []byte) error { return dev.ReadBAR(1, off, p) },
//				Write: func(off uint64, p []byte) error { return dev.WriteBAR(1, off, p) }},
//			2: {Size: 2 << 20, Type: pcidev.BARMem64, ...},
//		},
//		MSIX:      &pcidev.MSIX{Vectors: 3, BAR: 0, TableOffset: 0, PBAOffset: 0x2000},
//		INTxLevel: dev.InterruptPending, // e.g. ICR != 0
//		Reset:     func(vfiouser.ResetReason) { dev.Reset() },
//		Close:     dev.Close,
//	})
//	// dev raises interrupts with fn.Trigger(vector) / fn.TriggerMSIX, and
//	// checks fn.BusMaster() before touching guest memory.
//	return fn, err
//
// Callbacks run on the connection's goroutine in message order. BAR
// accesses are dropped (reads return all-ones) while the guest has memory
// (or I/O) decode off, as a real function does. The config space follows
// the PCI Local Bus Specification 3.0 (type-0 header, section 6.1): every
// access, of any size and alignment, goes byte by byte through per-byte
// write and write-one-to-clear masks, which makes BAR sizing, read-only
// IDs and RW1C status bits one rule. MSI-X follows the MSI-X ECN
// (capability 0x11, 16-byte table entries, a PBA bit per vector).
package pcidev
