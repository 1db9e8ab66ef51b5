package vdev

import (
	"errors"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// opInfo describes what a send opcode needs, per the driver's opcode table
// (pvrdma_qp.c): which QP types may post it, whether the device writes the
// local SGEs, which union member it uses, and its completion opcode.
type opInfo struct {
	valid      bool
	rc, ud     bool // allowed on RC / on UD and GSI
	kernelOnly bool // only kernel QPs: these name keys and page lists beyond a process's reach
	local      bool // executed by the device, never posted
	atomic     bool
	writeLocal bool // the device writes into the SGEs (READ, atomic results)
	wcOpcode   hostverbs.WCOpcode
}

var sendOps = [...]opInfo{
	hostverbs.WRRDMAWrite:         {valid: true, rc: true, wcOpcode: hostverbs.WCRDMAWrite},
	hostverbs.WRRDMAWriteWithImm:  {valid: true, rc: true, wcOpcode: hostverbs.WCRDMAWrite},
	hostverbs.WRSend:              {valid: true, rc: true, ud: true, wcOpcode: hostverbs.WCSend},
	hostverbs.WRSendWithImm:       {valid: true, rc: true, ud: true, wcOpcode: hostverbs.WCSend},
	hostverbs.WRRDMARead:          {valid: true, rc: true, writeLocal: true, wcOpcode: hostverbs.WCRDMARead},
	hostverbs.WRAtomicCmpAndSwp:   {valid: true, rc: true, atomic: true, writeLocal: true, wcOpcode: hostverbs.WCCompSwap},
	hostverbs.WRAtomicFetchAndAdd: {valid: true, rc: true, atomic: true, writeLocal: true, wcOpcode: hostverbs.WCFetchAdd},
	hostverbs.WRLSO:               {wcOpcode: hostverbs.WCLSO},
	hostverbs.WRSendWithInv:       {valid: true, rc: true, kernelOnly: true, wcOpcode: hostverbs.WCSend},
	hostverbs.WRRDMAReadWithInv:   {wcOpcode: hostverbs.WCRDMARead},
	hostverbs.WRLocalInv:          {valid: true, rc: true, kernelOnly: true, local: true, wcOpcode: hostverbs.WCLocalInv},
	hostverbs.WRRegMR:             {valid: true, rc: true, kernelOnly: true, local: true, wcOpcode: hostverbs.WCRegMR},
	// Masked atomics: the driver reports masked_atomic_cap = atomic_cap,
	// but the provider interface has no masks; they complete with an error.
	hostverbs.WRMaskedAtomicCmpSwp: {wcOpcode: hostverbs.WCMaskedCompSwap},
	hostverbs.WRMaskedAtomicFAdd:   {wcOpcode: hostverbs.WCMaskedFetchAdd},
	hostverbs.WRBindMW:             {wcOpcode: hostverbs.WCBindMW},
}

func sendOp(op uint32) opInfo {
	if op < uint32(len(sendOps)) {
		return sendOps[op]
	}
	return opInfo{wcOpcode: hostverbs.WCSend}
}

// maxMsgSize is the largest message the device accepts (port max_msg_sz).
const maxMsgSize = 1 << 31

// postSends drains the QP's send queue (a SEND doorbell): every pending
// WQE is read once from guest memory, validated, translated and posted to
// the provider, or completed by the device (an error, a flush in ERR, a
// local operation). Either way only the ring's posted cursor moves; the
// WQE's slot is released when it completes (workQueue). If the provider's
// queue is full the rest stays in the ring until a CQ doorbell retries.
// doorbell says whether the guest rang the SQ doorbell (rather than the
// device resuming or flushing the queue): only then is the queue's depth
// observed (metrics.go).
func (d *Device) postSends(q *qp, doorbell bool) {
	w := q.sq
	sample := doorbell && d.dist != nil
	if q.stalledSQ && !sample {
		return // a CQ doorbell will resume in order
	}
	n, depth, err := w.pending()
	if sample && err == nil {
		d.observeDepth(depth)
	}
	if q.stalledSQ {
		return
	}
	if err != nil {
		d.qpFatal(q, err)
		return
	}
	w.at = d.sendStamp(w)
	for ; n > 0; n-- {
		if !d.sendOne(q, n == 1) {
			break
		}
	}
	w.waiting = 0
	if q.stalledSQ {
		w.waiting = w.at // what the stall left waits since this pass
	}
	w.at = 0
	if q.State() == hostverbs.QPStateErr && q.rq != nil && !q.stalledRQ {
		d.postRecvs(q) // a bad WQE moved the QP to ERR: flush the RQ too
	}
}

// sendOne handles the WQE at the SQ's posted cursor; last says whether it
// is the last one the doorbell found. It returns false to stop the drain
// (stalled on a full provider queue, or the QP became unusable).
func (d *Device) sendOne(q *qp, last bool) bool {
	w := q.sq
	gpa := w.next()
	hb := d.wqe[:abi.SQWQEHdrSize]
	if err := d.mem.ReadAt(hb, gpa); err != nil {
		d.qpFatal(q, err)
		return false
	}
	var h abi.SQWQEHdr
	h.Decode(hb)
	info := sendOp(h.Opcode)
	signaled := q.sigAll || h.SendFlags&uint32(hostverbs.SendSignaled) != 0
	status := hostverbs.WCSuccess
	switch st := q.State(); {
	case st == hostverbs.QPStateErr:
		d.stats.flushedWQEs.Add(1)
		return d.finish(q, w, h.WRID, info.wcOpcode, hostverbs.WCWRFlushErr, true)
	case st < hostverbs.QPStateRTS:
		status = hostverbs.WCLocQPOpErr // posting before RTS (the drivers refuse it themselves)
	default:
		status = d.buildSend(q, &h, info, gpa)
	}
	if status == hostverbs.WCSuccess && info.local {
		status = d.execLocal(q, &h)
		if status == hostverbs.WCSuccess {
			return d.finish(q, w, h.WRID, info.wcOpcode, hostverbs.WCSuccess, signaled)
		}
	}
	if status != hostverbs.WCSuccess {
		d.stats.badWQEs.Add(1)
		ok := d.finish(q, w, h.WRID, info.wcOpcode, status, true)
		if q.typ == hostverbs.QPTypeRC {
			d.errorQP(q)
		}
		return ok
	}
	provSignaled := signaled
	if !signaled && q.uar == 0 && (last || d.nextIsLocal(q)) {
		// A kernel QP's local operations complete in the device, in order
		// after the sends before them: the send a local operation may
		// follow is signaled to the provider (its success is not reported
		// to the guest), so that the local operation's completion waits
		// for the send's, which will come (see workQueue).
		d.swr.Flags |= hostverbs.SendSignaled
		provSignaled = true
	}
	wrid, err := w.post(h.WRID, info.wcOpcode, signaled, provSignaled)
	if err != nil {
		d.qpFatal(q, err)
		return false
	}
	d.swr.WRID = wrid
	if err := q.hv.PostSend(&d.swr); err != nil {
		w.unpost()
		if errors.Is(err, hostverbs.ErrQueueFull) {
			d.stall(q, true)
			return false
		}
		d.stats.badWQEs.Add(1)
		ok := d.finish(q, w, h.WRID, info.wcOpcode, postStatus(err), true)
		if q.typ == hostverbs.QPTypeRC {
			d.errorQP(q)
		}
		return ok
	}
	d.stats.sendWQEs.Add(1)
	return true
}

// nextIsLocal reports whether the WQE after the one at the SQ's posted
// cursor (already in the ring) is a local operation, or cannot be read.
func (d *Device) nextIsLocal(q *qp) bool {
	ring := q.sq.ring
	op, err := d.mem.Uint32(ring.Elem(ring.Geometry().Inc(ring.NextIndex())) + abi.SQWQEOpcodeOffset)
	return err != nil || sendOp(op).local
}

// postStatus is the completion status of a WR the provider refused.
func postStatus(err error) hostverbs.WCStatus {
	switch {
	case errors.Is(err, hostverbs.ErrInvalid), errors.Is(err, hostverbs.ErrNotSupported):
		return hostverbs.WCLocQPOpErr
	case errors.Is(err, hostverbs.ErrNotFound):
		return hostverbs.WCLocProtErr
	}
	return hostverbs.WCGeneralErr
}

// buildSend validates a send WQE and translates it into d.swr.
func (d *Device) buildSend(q *qp, h *abi.SQWQEHdr, info opInfo, gpa guestmem.GPA) hostverbs.WCStatus {
	isRC := q.typ == hostverbs.QPTypeRC
	switch {
	case !info.valid, isRC && !info.rc, !isRC && !info.ud:
		return hostverbs.WCLocQPOpErr
	case info.kernelOnly && q.uar != 0:
		return hostverbs.WCLocQPOpErr
	case info.atomic && d.caps.AtomicOps == 0:
		return hostverbs.WCLocQPOpErr
	case h.NumSGE > q.sendSGE:
		return hostverbs.WCLocLenErr
	}
	n := h.NumSGE
	sges := d.wqe[abi.SQWQEHdrSize : abi.SQWQEHdrSize+abi.SGESize*n]
	if err := d.mem.ReadAt(sges, gpa+abi.SQWQEHdrSize); err != nil {
		return hostverbs.WCLocProtErr
	}
	total := uint64(0)
	for i := uint32(0); i < n; i++ {
		var s abi.SGE
		s.Decode(sges[i*abi.SGESize:])
		lkey, st := d.checkSGE(&s, q.pd, info.writeLocal)
		if st != hostverbs.WCSuccess {
			return st
		}
		d.sgl[i] = hostverbs.SGE{Addr: s.Addr, Length: s.Length, LKey: lkey}
		total += uint64(s.Length)
	}
	if total > maxMsgSize || (info.atomic && total != 8) {
		return hostverbs.WCLocLenErr
	}
	d.swr = hostverbs.SendWR{
		WRID:   h.WRID,
		Opcode: hostverbs.WROpcode(h.Opcode),
		Flags:  hostverbs.SendFlags(h.SendFlags) & (hostverbs.SendFence | hostverbs.SendSignaled | hostverbs.SendSolicited),
		SGL:    d.sgl[:n],
	}
	switch hostverbs.WROpcode(h.Opcode) {
	case hostverbs.WRSendWithImm, hostverbs.WRRDMAWriteWithImm, hostverbs.WRSendWithInv:
		d.swr.ImmData = h.Ex
	}
	if !isRC {
		var ud abi.WRUD
		ud.Decode(h.WR[:])
		if ud.AV.Port() != portNum || d.checkSGID(ud.AV.GIDIndex) != nil {
			return hostverbs.WCLocQPOpErr
		}
		d.swr.RemoteQPN, d.swr.RemoteQKey = ud.RemoteQPN&0xFFFFFF, ud.RemoteQKey
		f := ud.AV.SLTClassFlowLabel
		d.swr.AV = hostverbs.AddressVector{
			DGID: hostverbs.GID(ud.AV.DGID), SGIDIndex: ud.AV.GIDIndex, HopLimit: ud.AV.HopLimit,
			TrafficClass: uint8(f >> 20), FlowLabel: f & 0xFFFFF, SL: uint8(f >> 28),
			StaticRate: ud.AV.StatRate, Port: portNum, DMAC: ud.AV.DMAC,
		}
		return hostverbs.WCSuccess
	}
	switch {
	case info.atomic:
		var a abi.WRAtomic
		a.Decode(h.WR[:])
		d.swr.RemoteAddr, d.swr.RKey, d.swr.CompareAdd, d.swr.Swap = a.RemoteAddr, a.RKey, a.CompareAdd, a.Swap
	case h.Opcode == uint32(hostverbs.WRRDMAWrite), h.Opcode == uint32(hostverbs.WRRDMAWriteWithImm),
		h.Opcode == uint32(hostverbs.WRRDMARead):
		var r abi.WRRDMA
		r.Decode(h.WR[:])
		d.swr.RemoteAddr, d.swr.RKey = r.RemoteAddr, r.RKey
	}
	return hostverbs.WCSuccess
}

// execLocal runs the work requests the device executes itself.
func (d *Device) execLocal(q *qp, h *abi.SQWQEHdr) hostverbs.WCStatus {
	if hostverbs.WROpcode(h.Opcode) == hostverbs.WRLocalInv {
		return d.localInv(q, h.Ex)
	}
	var fr abi.WRFastReg
	fr.Decode(h.WR[:])
	return d.fastReg(q, &fr)
}
