//go:build linux && cgo

package ibverbs

/*
#include <stdlib.h>
#include "pv.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// CQ is a host completion queue whose completions go to a handler.
type CQ struct {
	d       *Device
	handle  uintptr
	handler hostverbs.CompletionHandler
	users   int // QPs using the CQ; guarded by d.mu

	mu   sync.Mutex // serialises drain, poll, resize and destroy
	cq   *C.struct_ibv_cq
	wc   *C.struct_ibv_wc // pollBatch entries, C memory, used under mu
	dead bool
	qps  map[uint32]uint64 // QPN -> QP context, guarded by d.mu

	// touched is set when a poster's own poll took completions, so that a
	// busy-polling completion goroutine counts them as activity and keeps
	// the CQ unarmed (see Config.BusyPoll).
	touched atomic.Bool
}

var _ hostverbs.CQ = (*CQ)(nil)

// CreateCQ creates a completion queue.
func (d *Device) CreateCQ(attr hostverbs.CQAttr) (hostverbs.CQ, error) {
	if attr.Handler == nil || attr.Depth <= 0 || attr.Depth > int(d.p.attr.max_cqe) {
		return nil, fmt.Errorf("create cq: depth %d (max %d) or no handler: %w", attr.Depth, d.p.attr.max_cqe, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, hostverbs.ErrClosed
	}
	if err := d.limit(d.counts.cq, d.cfg.Limits.MaxCQ, "create cq"); err != nil {
		return nil, err
	}
	d.nextCQ++
	c := &CQ{d: d, handle: d.nextCQ, handler: attr.Handler, qps: map[uint32]uint64{}}
	cq, err := C.pv_create_cq(d.p.lib.l, d.p.ctx, C.int(attr.Depth), C.uintptr_t(c.handle), d.channel)
	if cq == nil {
		return nil, fmt.Errorf("create cq: %w", hostErr(err))
	}
	c.cq = cq
	if rc, err := C.pv_arm_cq(cq); rc != 0 {
		C.pv_destroy_cq(d.p.lib.l, cq)
		return nil, errnoErr("create cq: arm", rc, err)
	}
	c.wc = (*C.struct_ibv_wc)(C.calloc(pollBatch, C.size_t(unsafe.Sizeof(C.struct_ibv_wc{}))))
	d.cqs[c.handle] = c
	d.counts.cq++
	d.p.track(unsafe.Pointer(cq), asyncTarget{d: d, context: attr.Context})
	return c, nil
}

// Resize changes the depth.
func (c *CQ) Resize(depth int) error {
	if depth <= 0 || depth > int(c.d.p.attr.max_cqe) {
		return fmt.Errorf("resize cq: depth %d: %w", depth, hostverbs.ErrInvalid)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return hostverbs.ErrClosed
	}
	if rc, err := C.pv_resize_cq(c.d.p.lib.l, c.cq, C.int(depth)); rc != 0 {
		return fmt.Errorf("resize cq: %w", hostErr(errnoErr("ibv_resize_cq", rc, err)))
	}
	return nil
}

// Destroy fails with ErrBusy while QPs use the CQ.
func (c *CQ) Destroy() error { return c.destroy(false) }

func (c *CQ) destroy(force bool) error {
	d := c.d
	d.mu.Lock()
	if c.users > 0 && !force {
		d.mu.Unlock()
		return fmt.Errorf("destroy cq: %d QPs use it: %w", c.users, hostverbs.ErrBusy)
	}
	delete(d.cqs, c.handle)
	d.mu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return nil
	}
	c.dead = true
	C.free(unsafe.Pointer(c.wc))
	c.wc = nil
	d.mu.Lock()
	d.counts.cq--
	d.mu.Unlock()
	d.p.untrack(unsafe.Pointer(c.cq))
	if rc, err := C.pv_destroy_cq(d.p.lib.l, c.cq); rc != 0 {
		return fmt.Errorf("destroy cq: %w", errnoErr("ibv_destroy_cq", rc, err))
	}
	return nil
}

// drain re-arms the CQ, then hands every completion in it to the handler.
// Arming first means a completion that lands after the last poll raises a
// new event.
func (c *CQ) drain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return
	}
	C.pv_arm_cq(c.cq)
	c.pollLocked()
}

// poll takes every completion without arming the CQ and returns how many
// (-1: the CQ is destroyed).
func (c *CQ) poll() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return -1
	}
	return c.pollLocked()
}

// tryLockLive locks the CQ for the poster's own poll right after its post,
// so that a device that completes within the post (rxe, a loopback) needs
// no event and no wake-up of the completion goroutine for it. It returns
// nil, locking nothing, if another goroutine is taking the CQ's completions
// (that one delivers them) or the CQ is destroyed.
func (c *CQ) tryLockLive() *CQ {
	if !c.mu.TryLock() {
		return nil
	}
	if c.dead {
		c.mu.Unlock()
		return nil
	}
	return c
}

// deliverPolled hands over the n completions a post's poll put in the
// CQ's buffer, and the rest if the batch was full. The caller holds mu.
func (c *CQ) deliverPolled(n int) {
	if n < 0 {
		c.d.log.Error("ibv_poll_cq failed", "rc", n)
		return
	}
	c.deliver(n)
	if n == pollBatch {
		c.pollLocked()
	}
	if n > 0 && c.d.p.busy > 0 {
		c.touched.Store(true)
	}
}

// pollLocked hands the CQ's completions to the handler, pollBatch at a
// time, and returns how many there were.
func (c *CQ) pollLocked() int {
	total := 0
	for {
		n := int(C.pv_poll_cq(c.cq, pollBatch, c.wc))
		if n <= 0 {
			if n < 0 {
				c.d.log.Error("ibv_poll_cq failed", "rc", n)
			}
			return total
		}
		c.deliver(n)
		total += n
		if n < pollBatch {
			return total
		}
	}
}

// deliver converts the first n completions in the CQ's buffer and hands
// them to the handler. The caller holds mu.
func (c *CQ) deliver(n int) {
	var wc hostverbs.WorkCompletion
	ws := unsafe.Slice(c.wc, n)
	for i := range ws {
		c.convert(&ws[i], &wc)
		c.handler.Complete(&wc)
	}
}

// convert translates a host completion; libibverbs' opcode and flag
// numbering differs from the IB core's that hostverbs uses.
func (c *CQ) convert(w *C.struct_ibv_wc, wc *hostverbs.WorkCompletion) {
	*wc = hostverbs.WorkCompletion{
		WRID:      uint64(w.wr_id),
		Status:    hostverbs.WCStatus(w.status),
		VendorErr: uint32(w.vendor_err),
		ByteLen:   uint32(w.byte_len),
		QPN:       uint32(w.qp_num),
		SrcQP:     uint32(w.src_qp),
		PKeyIndex: uint16(w.pkey_index),
		SLID:      uint16(w.slid),
		SL:        uint8(w.sl),
		DLIDBits:  uint8(w.dlid_path_bits),
		Port:      1,
	}
	switch w.opcode {
	case C.IBV_WC_SEND:
		wc.Opcode = hostverbs.WCSend
	case C.IBV_WC_RDMA_WRITE:
		wc.Opcode = hostverbs.WCRDMAWrite
	case C.IBV_WC_RDMA_READ:
		wc.Opcode = hostverbs.WCRDMARead
	case C.IBV_WC_COMP_SWAP:
		wc.Opcode = hostverbs.WCCompSwap
	case C.IBV_WC_FETCH_ADD:
		wc.Opcode = hostverbs.WCFetchAdd
	case C.IBV_WC_BIND_MW:
		wc.Opcode = hostverbs.WCBindMW
	case C.IBV_WC_LOCAL_INV:
		wc.Opcode = hostverbs.WCLocalInv
	case C.IBV_WC_RECV:
		wc.Opcode = hostverbs.WCRecv
	case C.IBV_WC_RECV_RDMA_WITH_IMM:
		wc.Opcode = hostverbs.WCRecvRDMAWithImm
	}
	flags := uint32(w.wc_flags)
	if flags&C.IBV_WC_GRH != 0 {
		wc.Flags |= hostverbs.WCFlagGRH
	}
	if flags&C.IBV_WC_WITH_IMM != 0 {
		wc.Flags |= hostverbs.WCFlagWithImm
		wc.ImmData = uint32(*(*C.uint32_t)(unsafe.Pointer(&w.anon0)))
	}
	if flags&C.IBV_WC_WITH_INV != 0 {
		wc.Flags |= hostverbs.WCFlagWithInvalidate
		wc.ImmData = uint32(*(*C.uint32_t)(unsafe.Pointer(&w.anon0)))
	}
	if flags&C.IBV_WC_IP_CSUM_OK != 0 {
		wc.Flags |= hostverbs.WCFlagIPCsumOK
	}
	c.d.mu.Lock()
	wc.QPContext = c.qps[wc.QPN]
	c.d.mu.Unlock()
}
