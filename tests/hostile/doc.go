// Package hostile is the hostile-guest harness: a Go stand-in for the
// vmw_pvrdma driver that talks to an in-process daemon (package backend)
// over vfio-user exactly as QEMU's vfio-user-pci and the guest driver do
// (negotiation, DMA_MAP of a memfd as guest RAM, config space, MSI-X
// eventfds, the DSR, the command slot, page directories, rings, UAR
// doorbells), first well-behaved and then malicious.
//
// Its tests reproduce every CVE class published against QEMU's former
// pvrdma device and the latent bugs found in its final code, the malformed
// inputs of the project's issue (bad DSR addresses, zero and huge ring
// page counts, nchunks/length mismatches, num_sge above max, commands
// before the DSR, out-of-range and stale handles, invalid ring index
// bits, doorbells for unknown handles, odd-size and unaligned BAR
// accesses) and guests that disappear mid-transfer. Each asserts the exact
// outcome the device promises (an errno in ERR and the response, an error
// completion that consumes its slot, a dropped-doorbell counter, an async
// event), then that the daemon still serves a fresh pair of VMs, and that
// goroutines, file descriptors and locked memory are back to their
// baseline. FuzzDriver drives arbitrary command, doorbell and register
// sequences through the whole stack.
//
// Everything lives in _test.go files; the package has no API.
package hostile
