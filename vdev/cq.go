package vdev

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Arm states of a CQ, weakest first (a later ARM upgrades an ARM_SOL).
const (
	armNone = iota
	armSolicited
	armNext
)

// cq is a completion queue: a guest ring of CQEs (page 0 ring state, rx
// half; CQEs from page 1) that the device produces into, and a provider CQ
// whose completion handler it is. Complete runs on provider goroutines and
// takes only mu.
type cq struct {
	dev    *Device
	handle uint32
	uar    uint32
	hv     hostverbs.CQ
	pages  int
	cost   uint64 // bytes charged to the VM's budget
	refs   int    // QPs using it; guarded by Device.mu

	// mu guards the CQ ring and, for the QPs whose send or receive queue
	// completes here, that queue's workQueue.
	mu         sync.Mutex
	ring       *ringbuf.Producer
	armed      uint8
	dead       bool
	overflowed bool
	cqe        abi.CQE
	buf        [abi.CQESize]byte
	wc         hostverbs.WorkCompletion // scratch: a provider completion translated, or one the device makes
	// notifyDue and errDue are what the CQEs written under mu call for
	// once it is released (see unlock).
	notifyDue, errDue bool
	// beforeCommit, if set (tests only), runs in put between the WQE's
	// release and the CQE's publication.
	beforeCommit func()

	// The lost-arm safety net of memory doorbells (uarmem.go), guarded
	// by Device.mu: suspect says a lost arm of this CQ cannot be ruled
	// out, suspectTail its prod_tail then, suspectSince and suspectHead
	// since when the guest has left cons_head there with CQEs pending (or
	// produced since), grace how long it may.
	suspect      bool
	suspectSince time.Time
	suspectHead  uint32
	suspectTail  uint32
	grace        time.Duration
	// watched mirrors suspect for the completion paths (which do not
	// hold Device.mu): a CQE for a watched CQ wakes the poller.
	watched atomic.Bool
	// memDB says the CQ's context rings its doorbells in memory (memory
	// mode, a user context's page): a CQE for it is activity that keeps
	// the poller awake, since the guest is about to poll and post.
	memDB bool

	// rec and resizeRec are the journal payloads of its CREATE_CQ and last
	// RESIZE_CQ (Checkpoint; guarded by Device.mu).
	rec, resizeRec []byte
}

// cqRingPages is how many pages a CQ ring of n CQEs needs: the ring-state
// page and the CQEs (pvrdma_create_cq and rdma-core compute the same).
func cqRingPages(n uint32) uint64 {
	return 1 + (uint64(n)*abi.CQESize+guestmem.PageSize-1)/guestmem.PageSize
}

func (d *Device) cmdCreateCQ(req, resp []byte) error {
	var r abi.CreateCQ
	r.Decode(req)
	uar, err := d.context(r.CtxHandle)
	if err != nil {
		return err
	}
	if r.CQE == 0 || r.CQE > d.caps.MaxCQE || r.CQE&(r.CQE-1) != 0 {
		return fmt.Errorf("%d CQEs (power of two up to %d): %w", r.CQE, d.caps.MaxCQE, syscall.EINVAL)
	}
	need, most := cqRingPages(r.CQE), cqRingPages(d.caps.MaxCQE)
	if uint64(r.NChunks) < need || uint64(r.NChunks) > most {
		return fmt.Errorf("CQ of %d CQEs in %d pages (needs %d, at most %d): %w", r.CQE, r.NChunks, need, most, ringbuf.ErrPageCount)
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(r.PDirDMA), int(r.NChunks), int(most))
	if err != nil {
		return fmt.Errorf("CQ page directory: %w", err)
	}
	ring, err := d.cqRing(pages, r.CQE)
	if err != nil {
		return err
	}
	c := &cq{dev: d, uar: uar, ring: ring, pages: len(pages), cost: costCQ + uint64(len(pages))*costPageEntry,
		memDB: d.uarm != nil && uar != 0 && uar < UARPages}
	if err := d.heap.Charge(c.cost); err != nil {
		return fmt.Errorf("CQ of %d CQEs: %w", r.CQE, err)
	}
	h, ok := allocHandle(d, &d.cqs, c)
	if !ok {
		d.heap.Release(c.cost)
		return fmt.Errorf("%d CQs: %w", d.cqs.len(), ErrLimit)
	}
	c.handle = h
	c.hv, err = d.verbs.CreateCQ(hostverbs.CQAttr{Depth: int(r.CQE), Context: uint64(h), Handler: c})
	if err != nil {
		d.cqs.free(h)
		d.heap.Release(c.cost)
		return fmt.Errorf("create CQ: %w", err)
	}
	abi.CreateCQResp{CQHandle: h, CQE: r.CQE}.Encode(resp)
	return nil
}

// cmdResizeCQ changes the number of CQEs of a CQ within the pages it was
// created with. The ring must be empty; the device restarts prod_tail at 0
// and the guest restarts its cons_head (no Linux driver issues
// RESIZE_CQ: it returns EOPNOTSUPP to its callers).
func (d *Device) cmdResizeCQ(req, resp []byte) error {
	var r abi.ResizeCQ
	r.Decode(req)
	c, ok := d.cqs.get(r.CQHandle)
	if !ok {
		return fmt.Errorf("CQ %d: %w", r.CQHandle, ErrBadHandle)
	}
	if r.CQE == 0 || r.CQE > d.caps.MaxCQE || r.CQE&(r.CQE-1) != 0 || cqRingPages(r.CQE) > uint64(c.pages) {
		return fmt.Errorf("resize CQ %d to %d CQEs in %d pages: %w", r.CQHandle, r.CQE, c.pages, syscall.EINVAL)
	}
	geo, err := ringbuf.NewGeometry(r.CQE)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.hv.Resize(int(r.CQE)); err != nil {
		return fmt.Errorf("resize provider CQ: %w", err)
	}
	if err := d.resizeCQRing(c, geo); err != nil {
		if errors.Is(err, ringbuf.ErrFull) {
			return fmt.Errorf("resize CQ %d: %w", r.CQHandle, syscall.EBUSY)
		}
		return err
	}
	c.overflowed = false
	abi.ResizeCQResp{CQE: r.CQE}.Encode(resp)
	return nil
}

func (d *Device) cmdDestroyCQ(req, resp []byte) error {
	var r abi.DestroyCQ
	r.Decode(req)
	c, ok := d.cqs.get(r.CQHandle)
	if !ok {
		return fmt.Errorf("CQ %d: %w", r.CQHandle, ErrBadHandle)
	}
	if c.refs > 0 {
		return fmt.Errorf("CQ %d used by %d QPs: %w", r.CQHandle, c.refs, syscall.EBUSY)
	}
	return d.destroyCQ(c)
}

func (d *Device) destroyCQ(c *cq) error {
	d.cqs.free(c.handle)
	d.heap.Release(c.cost)
	c.mu.Lock()
	c.dead = true // a completion racing with Destroy is dropped
	c.mu.Unlock()
	if err := c.hv.Destroy(); err != nil {
		d.lim.Warn("destroy-cq", "pvrdma: provider refused to destroy a CQ", "cq", c.handle, "err", err)
		return fmt.Errorf("destroy CQ: %w", err)
	}
	return nil
}

// cq validates a CQ handle from a command.
func (d *Device) cq(h uint32) (*cq, error) {
	c, ok := d.cqs.get(h)
	if !ok {
		return nil, fmt.Errorf("CQ %d: %w", h, ErrBadHandle)
	}
	return c, nil
}

// quiesce waits until no completion handler is inside the CQ: one that
// looked a QP up before it left the live table has finished writing.
func (c *cq) quiesce() {
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.dead // the lock is the point: a barrier against Complete
}

// arm requests a notification for the next completion (or the next
// solicited or unsuccessful one).
func (c *cq) arm(level uint8) {
	c.mu.Lock()
	c.armed = max(c.armed, level)
	c.mu.Unlock()
}

// Complete is the provider CQ's handler (any goroutine, never blocking):
// it writes a provider work completion into the guest's CQ ring. The QP is
// resolved from the completion's context under the CQ lock, so nothing is
// written for a QP once DestroyQP has returned: the drivers would not find
// it (rdma-core then never advances past the CQE). The WRID is the one the
// device posted with (workQueue.providerWRID) and becomes the guest's
// wr_id again; completions the device cannot place (a stale epoch, a WQE
// the provider does not hold) are dropped and counted as stale.
func (c *cq) Complete(wc *hostverbs.WorkCompletion) {
	d := c.dev
	c.mu.Lock()
	q := d.liveQP(wc.QPContext)
	if c.dead || q == nil {
		c.mu.Unlock()
		d.stats.staleCompletions.Add(1)
		return
	}
	w, idx, ok := q.route(c, wc)
	switch {
	case !ok:
		d.stats.staleCompletions.Add(1)
		d.lim.Debug("wc-unknown", "pvrdma: completion for no WQE the provider holds", "qp", q.handle, "wr_id", wc.WRID)
	case w == nil:
		c.put(q, wc, nil, 0, 0) // an SRQ receive: the guest's wr_id, its ring released at post
	default:
		w.complete(q, idx, wc)
	}
	c.unlock()
}

// route returns the queue a provider completion that arrived on c belongs
// to and the ring index of its WQE, or a nil queue for a receive from the
// QP's SRQ, or false if it names no WQE the provider holds. c.mu held.
func (q *qp) route(c *cq, wc *hostverbs.WorkCompletion) (*workQueue, uint32, bool) {
	if q.srq != nil && c == q.rcq {
		// SRQ receives carry the guest's own wr_id (the SRQ ring is released
		// at post: its WQEs complete out of order). On a CQ the QP shares
		// for both queues a success tells a receive by its opcode, an error
		// (whose opcode providers need not set) by its WRID not being one
		// the device gave a send the provider holds.
		if c != q.scq {
			return nil, 0, true
		}
		if wc.Status == hostverbs.WCSuccess {
			if wc.Opcode&hostverbs.WCRecv != 0 {
				return nil, 0, true
			}
		} else if _, ok := q.sq.owns(wc.WRID); !ok {
			return nil, 0, true
		}
	}
	w := q.sq
	if wc.WRID&wridRecv != 0 {
		w = q.rq
	}
	if w == nil || w.cq != c {
		return nil, 0, false
	}
	idx, ok := w.owns(wc.WRID)
	return w, idx, ok
}

// putSlot writes the CQE of a WQE the device completed itself (s), after
// releasing the ring to upTo. c.mu held.
func (c *cq) putSlot(q *qp, w *workQueue, s *wqSlot, upTo uint32) {
	c.wc = hostverbs.WorkCompletion{WRID: s.wrid, Status: s.status, Opcode: s.op, QPN: q.hv.QPN(),
		QPContext: q.context(), Port: portNum}
	c.put(q, &c.wc, w, upTo, s.at)
}

// put writes wc as the guest's next CQE. The WQE it completes is released
// first: w's cons_head moves to upTo before prod_tail publishes the CQE,
// so the guest never sees a completion whose ring slot is still taken
// (libpvrdma checks ring space against cons_head), and a crash between the
// two stores loses the completion rather than writing it twice. A CQE
// that cannot be written (a full or corrupted CQ: IBA's CQ overflow; the
// CQ then takes no more and the guest gets a CQ error event, never a
// block) is dropped, and its WQE released all the same. w is nil for SRQ
// receives. at is the WQE's latency stamp (wqSlot.at), observed once the
// CQE is published. c.mu held.
func (c *cq) put(q *qp, wc *hostverbs.WorkCompletion, w *workQueue, upTo uint32, at int64) {
	d := c.dev
	if c.overflowed || c.ring == nil { // c.ring nil: a CQ a restore could not rebuild (lost)
		if w != nil {
			w.release(q, upTo)
		}
		d.stats.cqOverflows.Add(1)
		return
	}
	gpa, err := c.ring.Reserve()
	if err != nil {
		c.overflowed, c.errDue = true, true
		if w != nil {
			w.release(q, upTo)
		}
		d.stats.cqOverflows.Add(1)
		d.lim.Debug("cq-overflow", "pvrdma: CQ overflow", "cq", c.handle, "err", err)
		return
	}
	e := &c.cqe
	*e = abi.CQE{
		WRID: wc.WRID, QP: uint64(q.handle), Opcode: uint32(wc.Opcode), Status: uint32(wc.Status),
		ByteLen: wc.ByteLen, ImmData: wc.ImmData, SrcQP: wc.SrcQP, WCFlags: cqeFlags(wc.Flags, q.uar != 0),
		VendorErr: wc.VendorErr, PKeyIndex: wc.PKeyIndex, SLID: wc.SLID, SL: cqeSL(wc, q.uar != 0),
		DLIDPathBits: wc.DLIDBits, PortNum: wc.Port, NetworkHdrType: uint8(wc.NetworkHdrType),
	}
	if e.PortNum == 0 {
		e.PortNum = portNum
	}
	e.Encode(c.buf[:])
	err = d.mem.WriteAt(c.buf[:], gpa)
	if w != nil {
		w.release(q, upTo)
	}
	if c.beforeCommit != nil {
		c.beforeCommit()
	}
	if err == nil {
		err = c.ring.Commit()
	}
	if err != nil {
		d.stats.cqOverflows.Add(1)
		return
	}
	d.stats.completions.Add(1)
	d.observeSend(at)
	if wc.Status != hostverbs.WCSuccess {
		c.reportError(q, wc)
	}
	switch {
	case c.armed == armNext:
		c.notifyDue = true
	case c.armed == armSolicited:
		c.notifyDue = c.notifyDue || wc.Solicited || wc.Status != hostverbs.WCSuccess
	}
	if c.notifyDue {
		c.armed = armNone
	}
	if q.typ == hostverbs.QPTypeRC && wc.Status != hostverbs.WCSuccess && wc.Status != hostverbs.WCWRFlushErr {
		q.state.Store(uint32(hostverbs.QPStateErr)) // an RC completion error moves the QP to ERR
	}
}

// reportError counts an unsuccessful CQE and logs it, rate-limited: a
// failure an operator can follow (the QP, the work request, the status;
// the provider's log says why a remote access was refused). c.mu held.
func (c *cq) reportError(q *qp, wc *hostverbs.WorkCompletion) {
	d := c.dev
	if wc.Status == hostverbs.WCWRFlushErr {
		d.stats.flushCQEs.Add(1)
		// Debug: every disconnect flushes the receives still posted.
		d.lim.Debug("wc-flush", "pvrdma: work requests flushed: the QP is in ERR", "qp", q.handle, "qpn", wc.QPN, "wr_id", wc.WRID)
		return
	}
	d.stats.errorCQEs.Add(1)
	d.lim.Warn("wc-error", "pvrdma: work request completed in error", "qp", q.handle, "qpn", wc.QPN,
		"type", q.typ, "status", wc.Status, "opcode", wc.Opcode, "wr_id", wc.WRID, "vendor_err", wc.VendorErr)
}

// unlock releases c.mu, then raises what the CQEs written under it call
// for: the CQ error event of an overflow and the CQ notification of an
// armed CQ (the event and notification rings have locks of their own).
func (c *cq) unlock() {
	notify, cqErr := c.notifyDue, c.errDue
	c.notifyDue, c.errDue = false, false
	c.mu.Unlock()
	if c.memDB || c.watched.Load() {
		c.dev.kickUAR()
	}
	if cqErr {
		c.dev.pushEvent(uint32(hostverbs.EventCQErr), c.handle)
	}
	if notify {
		c.dev.pushCQNotify(c.handle)
	}
}

// Work completion flags as user space knows them (enum ibv_wc_flags).
// The kernel's (enum ib_wc_flags, which hostverbs.WCFlags and
// pvrdma_wc_flags share) swap two bits and have kernel-only ones where
// libibverbs has tag-matching bits.
const (
	ibvWCGRH      = 1 << 0
	ibvWCWithImm  = 1 << 1
	ibvWCIPCsumOK = 1 << 2
	ibvWCWithInv  = 1 << 3
)

// cqeFlags is a CQE's wc_flags for the guest's consumer of the QP's
// completions. Neither the kernel driver (pvrdma_poll_one) nor
// libvmw_pvrdma (pvrdma_poll_one, cq.c) translates cqe->wc_flags: each
// copies it into its work completion as it is. A kernel QP's CQE
// therefore carries the kernel's flags, which hostverbs uses (with
// WITH_NETWORK_HDR_TYPE and network_hdr_type on UD and GSI receives, as
// ib_init_ah_attr_from_wc wants them), and a user QP's (one with a UAR) the
// ones of ibv_wc: GRH, WITH_IMM, IP_CSUM_OK and WITH_INV at their
// user-space bits, and no SMAC, VLAN or NETWORK_HDR_TYPE, whose bits mean
// TM_SYNC_REQ, TM_MATCH and TM_DATA_VALID there.
func cqeFlags(f hostverbs.WCFlags, user bool) uint32 {
	if !user {
		return uint32(f)
	}
	var u uint32
	if f&hostverbs.WCFlagGRH != 0 {
		u |= ibvWCGRH
	}
	if f&hostverbs.WCFlagWithImm != 0 {
		u |= ibvWCWithImm
	}
	if f&hostverbs.WCFlagIPCsumOK != 0 {
		u |= ibvWCIPCsumOK
	}
	if f&hostverbs.WCFlagWithInvalidate != 0 {
		u |= ibvWCWithInv
	}
	return u
}

// RoCE packet types a user-space UD receive CQE's sl carries (bit 3: the
// frame had a UDP header, RoCE v2; bits 2:0: its L3 header).
const (
	roceSLUDP  = 0x8
	roceSLGRH  = 0x0
	roceSLIPv6 = 0x1
	roceSLIPv4 = 0x2
)

// cqeSL is a CQE's sl. On RoCE an SL does not travel with the packet, and
// for a user QP's UD receive the CQE's sl says instead what the packet
// came as, the way RoCE hardware reports it to user space (libibverbs'
// ibv_wc has no network header type): RoCE v2 over IPv4 (0xa), over IPv6
// (0x9), or RoCE v1 (0). Neither driver translates the field, and user
// space reads it: UCX's UD transport, on RoCE, takes it to tell where the
// receive buffer's 40-byte GRH area holds the destination address (the
// last 4 bytes of the IPv4 header, or the GRH's DGID), and silently drops
// every datagram whose destination is not one of the port's GIDs; with sl
// 0 it read 16 bytes of an IPv4 header as a GID and dropped them all.
// Kernel QPs keep the provider's sl: the kernel's consumers take the
// packet type from network_hdr_type and build reply address handles from
// the sl.
func cqeSL(wc *hostverbs.WorkCompletion, user bool) uint8 {
	if !user || wc.Flags&hostverbs.WCFlagWithNetworkHdrTyp == 0 || wc.Status != hostverbs.WCSuccess {
		return wc.SL
	}
	switch wc.NetworkHdrType {
	case hostverbs.NetworkIPv4:
		return roceSLUDP | roceSLIPv4
	case hostverbs.NetworkIPv6:
		return roceSLUDP | roceSLIPv6
	}
	return roceSLGRH
}
