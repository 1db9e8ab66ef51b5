// Package vfiouser is a generic vfio-user server: it listens on a unix
// socket (one per VM), negotiates the protocol with QEMU's vfio-user-pci
// client, maps the guest memory the client shares into a guestmem.Memory,
// serves region reads and writes to a device's callbacks, and signals the
// device's interrupts through the eventfds the client assigns. It knows
// nothing about PVRDMA.
package vfiouser
