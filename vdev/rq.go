package vdev

import (
	"errors"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// postRecvs drains the QP's receive queue (a RECV doorbell) into the
// provider. Receive SGEs need local write access. In RESET nothing is
// taken (the guest resets its indices); in ERR every WQE completes with
// WR_FLUSH_ERR. As for sends, a WQE's slot is released when it completes.
func (d *Device) postRecvs(q *qp) {
	if q.rq == nil || q.stalledRQ || q.State() == hostverbs.QPStateReset {
		return
	}
	n, _, err := q.rq.pending()
	if err != nil {
		d.qpFatal(q, err)
		return
	}
	for ; n > 0; n-- {
		if !d.recvOne(q) {
			return
		}
	}
}

func (d *Device) recvOne(q *qp) bool {
	w := q.rq
	wrid, status := d.buildRecv(w.ring, w.next(), q.pd, q.recvSGE)
	if status == statusUnreadable {
		d.qpFatal(q, errUnreadableWQE)
		return false
	}
	if q.State() == hostverbs.QPStateErr {
		d.stats.flushedWQEs.Add(1)
		return d.finish(q, w, wrid, hostverbs.WCRecv, hostverbs.WCWRFlushErr, true)
	}
	if status == hostverbs.WCSuccess {
		pw, err := w.post(wrid, hostverbs.WCRecv, true, true)
		if err != nil {
			d.qpFatal(q, err)
			return false
		}
		d.rwr.WRID = pw
		err = q.hv.PostRecv(&d.rwr)
		if err == nil {
			d.stats.recvWQEs.Add(1)
			return true
		}
		w.unpost()
		if errors.Is(err, hostverbs.ErrQueueFull) {
			d.stall(q, false)
			return false
		}
		status = postStatus(err)
	}
	d.stats.badWQEs.Add(1)
	ok := d.finish(q, w, wrid, hostverbs.WCRecv, status, true)
	if q.typ == hostverbs.QPTypeRC {
		d.errorQP(q)
	}
	return ok
}

// statusUnreadable marks a WQE whose bytes could not be read at all.
const statusUnreadable = hostverbs.WCStatus(0xff)

var errUnreadableWQE = errors.New("receive WQE not readable")

// buildRecv reads and validates the receive WQE at gpa into d.rwr: at most
// maxSGE SGEs, each in an MR of PD p with local write access.
func (d *Device) buildRecv(ring *ringbuf.Consumer, gpa guestmem.GPA, p *pd, maxSGE uint32) (uint64, hostverbs.WCStatus) {
	hb := d.wqe[:abi.RQWQEHdrSize]
	if err := d.mem.ReadAt(hb, gpa); err != nil {
		return 0, statusUnreadable
	}
	var h abi.RQWQEHdr
	h.Decode(hb)
	if h.NumSGE > maxSGE {
		return h.WRID, hostverbs.WCLocLenErr
	}
	sges := d.wqe[abi.RQWQEHdrSize : abi.RQWQEHdrSize+abi.SGESize*h.NumSGE]
	if err := d.mem.ReadAt(sges, gpa+abi.RQWQEHdrSize); err != nil {
		return h.WRID, hostverbs.WCLocProtErr
	}
	for i := uint32(0); i < h.NumSGE; i++ {
		var s abi.SGE
		s.Decode(sges[i*abi.SGESize:])
		lkey, st := d.checkSGE(&s, p, true)
		if st != hostverbs.WCSuccess {
			return h.WRID, st
		}
		d.sgl[i] = hostverbs.SGE{Addr: s.Addr, Length: s.Length, LKey: lkey}
	}
	d.rwr = hostverbs.RecvWR{WRID: h.WRID, SGL: d.sgl[:h.NumSGE]}
	return h.WRID, hostverbs.WCSuccess
}

// postSRQ drains a shared receive queue (an SRQ doorbell). A bad WQE
// belongs to no QP yet, so it cannot complete: it is dropped, counted and
// reported with an SRQ_ERR event. Unlike a QP's queues, the SRQ ring is
// released at post (Advance): receives complete out of order, in whichever
// QP takes them, and carry the guest's wr_id to the provider and back.
func (d *Device) postSRQ(s *srq) {
	if s.stalled {
		return
	}
	n, err := s.ring.Pending()
	if err != nil {
		d.lim.Debug("srq-ring", "pvrdma: SRQ ring unusable", "srq", s.handle, "err", err)
		d.pushEvent(uint32(hostverbs.EventSRQErr), s.handle)
		return
	}
	for ; n > 0; n-- {
		_, status := d.buildRecv(s.ring, s.ring.Next(), s.pd, s.maxSGE)
		if status == hostverbs.WCSuccess {
			err := s.hv.PostRecv(&d.rwr)
			if errors.Is(err, hostverbs.ErrQueueFull) {
				s.stalled = true
				d.stalled++
				d.stats.stalledPosts.Add(1)
				return
			}
			if err == nil {
				d.stats.recvWQEs.Add(1)
			} else {
				status = postStatus(err)
			}
		}
		if status != hostverbs.WCSuccess {
			d.stats.badWQEs.Add(1)
			d.pushEvent(uint32(hostverbs.EventSRQErr), s.handle)
		}
		if err := s.ring.Advance(); err != nil {
			d.pushEvent(uint32(hostverbs.EventSRQErr), s.handle)
			return
		}
	}
}
