// Package pcidev is a generic PCI function model for devices served over
// vfio-user: a type-0 configuration space with a capability list, BAR
// sizing, command-register gating (memory and I/O decode, bus master), an
// MSI-X capability with its table and PBA in a BAR, and INTx. A device is
// described declaratively (IDs, class, BARs with read/write callbacks,
// interrupts), in the spirit of libvfio-user's vfu_pci_* API; New turns the
// description into a Function that implements vfiouser.Device and gives the
// device model its interrupt and bus-state helpers.
//
// Layout facts come from the PCI Local Bus Specification 3.0 (type-0
// header, section 6.1) and the MSI-X ECN (capability ID 0x11, table
// entries of 16 bytes, PBA bit per vector).
package pcidev
