// Package vdev is the PVRDMA device model: PCI identity and MSI-X, the BAR1
// register file, the device shared region, the command channel (21
// commands), UAR doorbells, the async-event and CQ-notification rings, and
// the translation of guest work requests and completions to and from a
// hostverbs.Device.
package vdev
