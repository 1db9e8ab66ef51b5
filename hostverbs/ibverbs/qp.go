//go:build linux && cgo

package ibverbs

/*
#include <stdlib.h>
#include "pv.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// QP is a host queue pair.
type QP struct {
	p       *PD
	qp      *C.struct_ibv_qp
	typ     hostverbs.QPType
	send    *CQ
	recv    *CQ
	srq     *SRQ
	cap     hostverbs.QPCap
	context uint64

	sendMu  sync.Mutex
	sendSGE *C.struct_ibv_sge // cap.MaxSendSGE entries, C memory
	polled  *C.int            // how many completions the post's poll took; C memory, under sendMu
	recvMu  sync.Mutex
	recvSGE *C.struct_ibv_sge
	dead    bool // guarded by p.d.mu
}

var _ hostverbs.QP = (*QP)(nil)

// CreateQP creates an RC or UD QP. The host kernel owns QP1 (GSI) on a
// real device, so a VM's GSI QP is refused: rdma_cm from a guest needs the
// soft transport.
func (p *PD) CreateQP(attr hostverbs.QPInitAttr) (hostverbs.QP, error) {
	if attr.QPN != 0 {
		// The host device numbers its QPs; libibverbs cannot ask for one.
		return nil, fmt.Errorf("create qp: QPN %#x requested: the host device chooses its QPNs: %w", attr.QPN, hostverbs.ErrNotSupported)
	}
	if attr.Type != hostverbs.QPTypeRC && attr.Type != hostverbs.QPTypeUD {
		return nil, fmt.Errorf("create qp: type %s: the ibverbs relay carries RC and UD (the host kernel owns QP1): %w", attr.Type, hostverbs.ErrNotSupported)
	}
	send, ok1 := attr.SendCQ.(*CQ)
	recv, ok2 := attr.RecvCQ.(*CQ)
	if !ok1 || !ok2 || send.d != p.d || recv.d != p.d {
		return nil, fmt.Errorf("create qp: CQs of another device: %w", hostverbs.ErrInvalid)
	}
	var srq *SRQ
	if attr.SRQ != nil {
		s, ok := attr.SRQ.(*SRQ)
		if !ok || s.p.d != p.d {
			return nil, fmt.Errorf("create qp: SRQ of another device: %w", hostverbs.ErrInvalid)
		}
		srq = s
	}
	c := attr.Cap
	if c.MaxSendSGE == 0 || c.MaxSendSGE > uint32(p.d.p.attr.max_sge) || c.MaxRecvSGE > uint32(p.d.p.attr.max_sge) ||
		c.MaxSendWR == 0 || c.MaxSendWR > uint32(p.d.p.attr.max_qp_wr) || c.MaxRecvWR > uint32(p.d.p.attr.max_qp_wr) {
		return nil, fmt.Errorf("create qp: caps %+v beyond the host's: %w", c, hostverbs.ErrInvalid)
	}
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if p.dead || d.closed {
		return nil, hostverbs.ErrClosed
	}
	if err := d.limit(d.counts.qp, d.cfg.Limits.MaxQP, "create qp"); err != nil {
		return nil, err
	}
	var ia C.struct_ibv_qp_init_attr
	ia.send_cq = send.cq
	ia.recv_cq = recv.cq
	if srq != nil {
		ia.srq = srq.srq
	}
	ia.cap.max_send_wr = C.uint32_t(c.MaxSendWR)
	ia.cap.max_recv_wr = C.uint32_t(c.MaxRecvWR)
	ia.cap.max_send_sge = C.uint32_t(c.MaxSendSGE)
	ia.cap.max_recv_sge = C.uint32_t(c.MaxRecvSGE)
	ia.qp_type = C.enum_ibv_qp_type(attr.Type)
	if attr.SigAll {
		ia.sq_sig_all = 1
	}
	qp, err := C.pv_create_qp(d.p.lib.l, p.pd, &ia)
	if qp == nil {
		return nil, fmt.Errorf("create qp: %w", hostErr(err))
	}
	q := &QP{p: p, qp: qp, typ: attr.Type, send: send, recv: recv, srq: srq, context: attr.Context,
		cap: hostverbs.QPCap{MaxSendWR: uint32(ia.cap.max_send_wr), MaxRecvWR: uint32(ia.cap.max_recv_wr),
			MaxSendSGE: uint32(ia.cap.max_send_sge), MaxRecvSGE: uint32(ia.cap.max_recv_sge)}}
	sgeSize := C.size_t(unsafe.Sizeof(C.struct_ibv_sge{}))
	q.sendSGE = (*C.struct_ibv_sge)(C.calloc(C.size_t(max(q.cap.MaxSendSGE, 1)), sgeSize))
	q.recvSGE = (*C.struct_ibv_sge)(C.calloc(C.size_t(max(q.cap.MaxRecvSGE, 1)), sgeSize))
	q.polled = (*C.int)(C.calloc(1, C.size_t(unsafe.Sizeof(C.int(0)))))
	p.qps[q] = struct{}{}
	send.users++
	recv.users++
	qpn := uint32(C.pv_qp_num(qp))
	send.qps[qpn] = attr.Context
	recv.qps[qpn] = attr.Context
	if srq != nil {
		srq.users++
	}
	d.counts.qp++
	d.p.track(unsafe.Pointer(qp), asyncTarget{d: d, context: attr.Context, qpn: qpn})
	return q, nil
}

// QPN is the host QP number.
func (q *QP) QPN() uint32 { return uint32(C.pv_qp_num(q.qp)) }

// Modify applies attr's fields selected by mask; the host validates the
// transition. The AV's source GID index is the VM's; it becomes the host
// index of the same GID.
func (q *QP) Modify(attr *hostverbs.QPAttr, mask hostverbs.AttrMask) error {
	if mask&^hostverbs.AttrAll != 0 || mask&(hostverbs.AttrAltPath|hostverbs.AttrPathMigState) != 0 {
		return fmt.Errorf("modify qp: mask %#x: %w", mask, hostverbs.ErrInvalid)
	}
	var a C.struct_ibv_qp_attr
	a.qp_state = C.enum_ibv_qp_state(attr.State)
	a.cur_qp_state = C.enum_ibv_qp_state(attr.CurState)
	a.path_mtu = C.enum_ibv_mtu(attr.PathMTU)
	a.qkey = C.uint32_t(attr.QKey)
	a.rq_psn = C.uint32_t(attr.RQPSN)
	a.sq_psn = C.uint32_t(attr.SQPSN)
	a.dest_qp_num = C.uint32_t(attr.DestQPN)
	a.qp_access_flags = C.uint(attr.AccessFlags)
	a.pkey_index = C.uint16_t(attr.PKeyIndex)
	if attr.EnSQDAsyncNotify {
		a.en_sqd_async_notify = 1
	}
	a.max_rd_atomic = C.uint8_t(attr.MaxRdAtomic)
	a.max_dest_rd_atomic = C.uint8_t(attr.MaxDestRdAtomic)
	a.min_rnr_timer = C.uint8_t(attr.MinRNRTimer)
	a.port_num = C.uint8_t(q.p.d.p.port)
	a.timeout = C.uint8_t(attr.Timeout)
	a.retry_cnt = C.uint8_t(attr.RetryCnt)
	a.rnr_retry = C.uint8_t(attr.RNRRetry)
	if mask&hostverbs.AttrAV != 0 {
		sgid, err := q.p.d.hostSGID(attr.AV.SGIDIndex)
		if err != nil {
			return fmt.Errorf("modify qp %#x: %w", q.QPN(), err)
		}
		q.p.d.fillAH(&a.ah_attr, &attr.AV, sgid)
	}
	d := q.p.d
	if rc, err := C.pv_modify_qp(d.p.lib.l, q.qp, &a, C.int(mask)); rc != 0 {
		return fmt.Errorf("modify qp %#x to %s (mask %#x): %w", q.QPN(), attr.State, mask, hostErr(errnoErr("ibv_modify_qp", rc, err)))
	}
	return nil
}

// Query returns the host QP's attributes.
func (q *QP) Query() (hostverbs.QPAttr, error) {
	var a C.struct_ibv_qp_attr
	var ia C.struct_ibv_qp_init_attr
	mask := C.IBV_QP_STATE | C.IBV_QP_PKEY_INDEX | C.IBV_QP_PORT | C.IBV_QP_QKEY | C.IBV_QP_AV | C.IBV_QP_PATH_MTU |
		C.IBV_QP_TIMEOUT | C.IBV_QP_RETRY_CNT | C.IBV_QP_RNR_RETRY | C.IBV_QP_RQ_PSN | C.IBV_QP_MAX_QP_RD_ATOMIC |
		C.IBV_QP_MIN_RNR_TIMER | C.IBV_QP_SQ_PSN | C.IBV_QP_MAX_DEST_RD_ATOMIC | C.IBV_QP_CAP | C.IBV_QP_DEST_QPN |
		C.IBV_QP_ACCESS_FLAGS
	d := q.p.d
	if rc, err := C.pv_query_qp(d.p.lib.l, q.qp, &a, C.int(mask), &ia); rc != 0 {
		return hostverbs.QPAttr{}, fmt.Errorf("query qp: %w", hostErr(errnoErr("ibv_query_qp", rc, err)))
	}
	out := hostverbs.QPAttr{
		State: hostverbs.QPState(a.qp_state), CurState: hostverbs.QPState(a.cur_qp_state),
		PathMTU: hostverbs.MTU(a.path_mtu), QKey: uint32(a.qkey), RQPSN: uint32(a.rq_psn), SQPSN: uint32(a.sq_psn),
		DestQPN: uint32(a.dest_qp_num), AccessFlags: hostverbs.Access(a.qp_access_flags), PKeyIndex: uint16(a.pkey_index),
		MaxRdAtomic: uint8(a.max_rd_atomic), MaxDestRdAtomic: uint8(a.max_dest_rd_atomic), MinRNRTimer: uint8(a.min_rnr_timer),
		Port: 1, Timeout: uint8(a.timeout), RetryCnt: uint8(a.retry_cnt), RNRRetry: uint8(a.rnr_retry),
		Cap: q.cap,
	}
	out.AV.DGID = *(*hostverbs.GID)(unsafe.Pointer(&a.ah_attr.grh.dgid))
	out.AV.HopLimit = uint8(a.ah_attr.grh.hop_limit)
	out.AV.TrafficClass = uint8(a.ah_attr.grh.traffic_class)
	out.AV.FlowLabel = uint32(a.ah_attr.grh.flow_label)
	out.AV.SL = uint8(a.ah_attr.sl)
	out.AV.Port = 1
	return out, nil
}

// wrOpcode maps our (IB core) send opcode to libibverbs'.
func wrOpcode(o hostverbs.WROpcode) (C.int, bool) {
	switch o {
	case hostverbs.WRRDMAWrite:
		return C.IBV_WR_RDMA_WRITE, true
	case hostverbs.WRRDMAWriteWithImm:
		return C.IBV_WR_RDMA_WRITE_WITH_IMM, true
	case hostverbs.WRSend:
		return C.IBV_WR_SEND, true
	case hostverbs.WRSendWithImm:
		return C.IBV_WR_SEND_WITH_IMM, true
	case hostverbs.WRRDMARead:
		return C.IBV_WR_RDMA_READ, true
	case hostverbs.WRAtomicCmpAndSwp:
		return C.IBV_WR_ATOMIC_CMP_AND_SWP, true
	case hostverbs.WRAtomicFetchAndAdd:
		return C.IBV_WR_ATOMIC_FETCH_AND_ADD, true
	case hostverbs.WRSendWithInv:
		return C.IBV_WR_SEND_WITH_INV, true
	}
	return 0, false
}

// fillSGL copies sgl into the QP's C SGE array.
func fillSGL(dst *C.struct_ibv_sge, limit uint32, sgl []hostverbs.SGE) error {
	if uint32(len(sgl)) > limit {
		return fmt.Errorf("%d SGEs, the QP has %d: %w", len(sgl), limit, hostverbs.ErrInvalid)
	}
	if len(sgl) == 0 {
		return nil
	}
	s := unsafe.Slice(dst, limit)
	for i, e := range sgl {
		s[i] = C.struct_ibv_sge{addr: C.uint64_t(e.Addr), length: C.uint32_t(e.Length), lkey: C.uint32_t(e.LKey)}
	}
	return nil
}

// PostSend posts one send WR. Inline is dropped: the SGEs are guest IOVAs
// under host lkeys, which the host device reads itself.
func (q *QP) PostSend(wr *hostverbs.SendWR) error {
	op, ok := wrOpcode(wr.Opcode)
	if !ok {
		return fmt.Errorf("post send: opcode %s: %w", wr.Opcode, hostverbs.ErrNotSupported)
	}
	var ah *C.struct_ibv_ah
	if q.typ == hostverbs.QPTypeUD {
		var err error
		if ah, err = q.p.ah(&wr.AV); err != nil {
			return fmt.Errorf("post send: %w", err)
		}
	}
	// Take what the post completed at once, in the same C call (see
	// CQ.tryLockLive): the send CQ's lock, if free, is held across the post.
	cq := q.send.tryLockLive()
	n, err := q.postSend(wr, op, ah, cq)
	if cq != nil {
		cq.deliverPolled(n)
		cq.mu.Unlock()
	}
	if err != nil {
		return fmt.Errorf("post send: %w", err)
	}
	return nil
}

// postSend posts wr and, if cq is set (locked by the caller), polls up to
// pollBatch of its completions into its buffer; it returns how many (a
// negative count is the poll's failure).
func (q *QP) postSend(wr *hostverbs.SendWR, op C.int, ah *C.struct_ibv_ah, cq *CQ) (int, error) {
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	if q.sendSGE == nil { // destroyed
		return 0, hostverbs.ErrClosed
	}
	if err := fillSGL(q.sendSGE, q.cap.MaxSendSGE, wr.SGL); err != nil {
		return 0, err
	}
	var ccq *C.struct_ibv_cq
	var wc *C.struct_ibv_wc
	if cq != nil {
		ccq, wc = cq.cq, cq.wc
	}
	flags := C.uint(wr.Flags &^ hostverbs.SendInline)
	rc := C.pv_post_send(q.qp, C.uint64_t(wr.WRID), op, flags, C.uint32_t(wr.ImmData), q.sendSGE, C.int(len(wr.SGL)),
		C.uint64_t(wr.RemoteAddr), C.uint32_t(wr.RKey), C.uint64_t(wr.CompareAdd), C.uint64_t(wr.Swap),
		ah, C.uint32_t(wr.RemoteQPN), C.uint32_t(wr.RemoteQKey), ccq, pollBatch, wc, q.polled)
	if rc != 0 {
		return 0, hostErr(errnoErr("ibv_post_send", rc, nil))
	}
	return int(*q.polled), nil
}

// PostRecv posts one receive WR on the QP's own RQ.
func (q *QP) PostRecv(wr *hostverbs.RecvWR) error {
	if q.srq != nil {
		return fmt.Errorf("post recv: the QP uses an SRQ: %w", hostverbs.ErrInvalid)
	}
	q.recvMu.Lock()
	defer q.recvMu.Unlock()
	if q.recvSGE == nil { // destroyed
		return fmt.Errorf("post recv: %w", hostverbs.ErrClosed)
	}
	if err := fillSGL(q.recvSGE, q.cap.MaxRecvSGE, wr.SGL); err != nil {
		return fmt.Errorf("post recv: %w", err)
	}
	if rc := C.pv_post_recv(q.qp, C.uint64_t(wr.WRID), q.recvSGE, C.int(len(wr.SGL))); rc != 0 {
		return fmt.Errorf("post recv: %w", hostErr(errnoErr("ibv_post_recv", rc, nil)))
	}
	return nil
}

// Destroy destroys the host QP.
func (q *QP) Destroy() error {
	d := q.p.d
	d.mu.Lock()
	if q.dead {
		d.mu.Unlock()
		return nil
	}
	q.dead = true
	qpn := q.QPN()
	delete(q.p.qps, q)
	d.counts.qp--
	d.mu.Unlock()
	d.p.untrack(unsafe.Pointer(q.qp))
	// Hold both post locks: no post is in flight on a destroyed QP.
	q.sendMu.Lock()
	q.recvMu.Lock()
	rc, err := C.pv_destroy_qp(d.p.lib.l, q.qp)
	C.free(unsafe.Pointer(q.sendSGE))
	C.free(unsafe.Pointer(q.recvSGE))
	C.free(unsafe.Pointer(q.polled))
	q.sendSGE, q.recvSGE, q.polled = nil, nil, nil
	q.recvMu.Unlock()
	q.sendMu.Unlock()
	d.mu.Lock()
	q.send.users--
	q.recv.users--
	delete(q.send.qps, qpn)
	delete(q.recv.qps, qpn)
	if q.srq != nil {
		q.srq.users--
	}
	d.mu.Unlock()
	return errors.Join(errnoErr("ibv_destroy_qp", rc, err))
}
