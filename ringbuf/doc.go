// Package ringbuf implements the PVRDMA ring (a prod_tail/cons_head pair
// whose indices carry a wrap bit) and the two-level page directory that
// names a ring's guest pages, over guest memory. Every index, page count and
// page address read from the guest is validated before use.
//
// Index ownership is in the type (as in Linux rxe's queue types): a ring the
// guest fills and the device drains is a Consumer, which owns cons_head and
// only ever loads prod_tail; a ring the device fills and the guest drains is
// a Producer, which owns prod_tail and only ever loads cons_head. Indices
// the device owns live in Go memory (the truth) and are mirrored to guest
// memory with atomic stores; indices the guest owns are loaded once per use
// with an atomic load, masked and validated, and never written.
//
// A Consumer separates reading from releasing: its posted cursor (Next,
// Take) runs ahead of cons_head, which moves only when the caller releases
// elements (Release). A queue whose work completes in order releases an
// element when its completion is written, so the ring in guest memory is
// the durable record of the work outstanding: everything between cons_head
// and prod_tail was posted by the guest and has not completed. A device
// rebuilt over a running guest (after a crash) starts from that record
// with AdoptConsumer and AdoptProducer instead of NewConsumer and
// NewProducer, which reset the device's index to 0.
//
// Layouts follow the PVRDMA ABI (Linux drivers/infiniband/hw/vmw_pvrdma,
// pvrdma_ring.h and pvrdma_dev_api.h): struct pvrdma_ring {prod_tail,
// cons_head} is 8 bytes; indices run over [0, 2*n) where n is the element
// count and bit n is the generation (wrap) bit.
package ringbuf
