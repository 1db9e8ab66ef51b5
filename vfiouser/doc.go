// Package vfiouser is a generic vfio-user server: it listens on a unix
// socket (one per VM), negotiates the protocol with QEMU's vfio-user-pci
// client, maps the guest memory the client shares into a guestmem.Memory,
// serves region reads and writes to a device's callbacks, and signals the
// device's interrupts through the eventfds the client assigns. It knows
// nothing about PVRDMA. The protocol is QEMU's docs/interop/vfio-user.rst
// (version 0.0); TestQEMUSequence replays what QEMU 11 was seen to send.
//
// # Use
//
//	srv, err := vfiouser.NewServer(vfiouser.Config{
//		NewDevice: func(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
//			// h.Memory: guest memory; h.IRQs: interrupt eventfds.
//			return pcidev.New(h, pcidev.Config{...})
//		},
//	})
//	go srv.ListenAndServe("/run/pvrdma/vm1.sock") // or Serve(ln), ServeFD(fd)
//	...
//	srv.Shutdown(ctx)
//
// Each connection gets its own Device from the factory, its own
// guestmem.Memory and IRQs. When the client goes away (EOF is QEMU's only
// shutdown signal) the connection fails outstanding requests, resets and
// closes the device, closes every eventfd, unmaps (and munlocks) all guest
// memory after the accesses in flight, closes every descriptor it still
// holds, and the server goes on serving other sockets and new clients.
//
// # Pipeline
//
// Every command goes through the same stages: header (size checked against
// the negotiated maximum; an untrustworthy size ends the connection) ->
// body (always read whole: no unread bytes are ever left) -> validation
// (the command table gives payload sizes and how many descriptors may
// come) -> state gate (VERSION first, once) -> dispatch -> reply (an error
// reply carries an errno and no payload; a command with No_reply never gets
// a reply, not even an error). Descriptors received with a message and not
// taken by its handler are closed before the reply goes out.
//
// REGION_WRITE, the doorbell path, is handled on the connection goroutine
// that read it: one recvmsg, the device callback, one write, no allocation
// (see BenchmarkRegionWriteRoundTrip).
//
// # Guest memory
//
// DMA_MAP with a descriptor is mmapped MAP_SHARED with the requested
// protection and mlocked; Stats reports the locked bytes. A map without a
// descriptor (QEMU always maps its firmware ROM that way, and all guest RAM
// unless it is a shared memfd) is accepted and reached with server-to-client
// DMA_READ/DMA_WRITE messages, unless the device's Description sets
// RequireSharedMemory: then an access fails with guestmem.ErrNotShared,
// whose text names the QEMU options to use. DMA_UNMAP replies after the
// region's accesses in flight have finished.
//
// Caveat for devices that reach descriptor-less memory: QEMU's vCPU waits
// for the reply to an MMIO access while holding QEMU's big lock, and QEMU
// serves DMA_READ/DMA_WRITE on its main loop, which needs that lock. A
// device callback that issues such a DMA before it returns therefore stalls
// QEMU until its 5 s reply timeout (after which QEMU drops the connection).
// Run such DMA on another goroutine after the access returned, as a DMA
// engine does; the server then serves the client's commands while the
// request waits.
//
// # Interrupts
//
// IRQs.Trigger writes the assigned eventfd; it is safe from any goroutine
// while the client replaces or removes eventfds, and never writes to a
// closed descriptor. Auto-masked indexes (INTx) mask on trigger until the
// client unmasks; devices that implement IRQNotifier hear about assignment
// and mask changes. QEMU emulates the MSI-X table itself and masks vectors
// inside QEMU; it forwards PBA reads.
package vfiouser
