package vdev

import "github.com/pvrdma-backend/pvrdma-backend/vdev/abi"

// doorbell decodes a UAR write (BAR2): the register is the offset within
// its page (0 QP, 4 CQ, 8 SRQ) and the low 24 bits of the value name the
// object. An object may only be rung from the UAR page of the context
// that owns it (page 0 for the kernel's). A doorbell that names nothing is
// counted and ignored. POLL doorbells, written by the provider on every
// empty poll, cost one table lookup unless a queue is stalled.
func (d *Device) doorbell(off uint64, v uint32) {
	d.stats.doorbells.Add(1)
	if d.dsr == nil {
		d.stats.badDoorbells.Add(1)
		return
	}
	page := uint32(off / abi.UARPageSize)
	h := v & abi.UARHandleMask
	switch off % abi.UARPageSize {
	case abi.UARQPOffset:
		d.stats.trappedDBs[dbQP].Add(1)
		guardSlow()
		q, ok := d.qps.get(h)
		if !ok || q.uar != page || q.sq == nil { // no rings: lost in a restore
			d.stats.badDoorbells.Add(1)
			return
		}
		if v&abi.UARQPRecv != 0 {
			d.postRecvs(q)
		}
		if v&abi.UARQPSend != 0 {
			d.postSends(q, true)
		}
	case abi.UARCQOffset:
		if v&abi.UARCQPoll != 0 {
			d.stats.pollDoorbells.Add(1)
			d.stats.trappedDBs[dbCQPoll].Add(1)
		}
		if v&(abi.UARCQArm|abi.UARCQArmSol) != 0 {
			d.stats.trappedDBs[dbCQArm].Add(1)
		}
		c, ok := d.cqs.get(h)
		if !ok || c.uar != page {
			d.stats.badDoorbells.Add(1)
			return
		}
		switch {
		case v&abi.UARCQArm != 0:
			c.arm(armNext)
		case v&abi.UARCQArmSol != 0:
			c.arm(armSolicited)
		}
		if d.stalled > 0 {
			d.resumeStalled()
		}
	case abi.UARSRQOffset:
		d.stats.trappedDBs[dbSRQ].Add(1)
		guardSlow()
		s, ok := d.srqs.get(h)
		if !ok || s.uar != page || s.ring == nil {
			d.stats.badDoorbells.Add(1)
			return
		}
		if v&abi.UARSRQRecv != 0 {
			d.postSRQ(s)
		}
	default:
		d.stats.badDoorbells.Add(1)
	}
}

// stall records that a queue has work the provider could not take yet.
// The guest reaps completions before it can post more, and both drivers
// ring a CQ doorbell (POLL on an empty poll, ARM before sleeping) while
// waiting for them, so CQ doorbells retry stalled queues.
func (d *Device) stall(q *qp, send bool) {
	d.stats.stalledPosts.Add(1)
	if send && !q.stalledSQ {
		q.stalledSQ = true
		d.stalled++
	}
	if !send && !q.stalledRQ {
		q.stalledRQ = true
		d.stalled++
	}
}

func (d *Device) unstall(q *qp) {
	if q.stalledSQ {
		q.stalledSQ = false
		d.stalled--
	}
	if q.stalledRQ {
		q.stalledRQ = false
		d.stalled--
	}
}

// resumeStalled retries every stalled queue.
func (d *Device) resumeStalled() {
	d.qps.each(func(_ uint32, q *qp) {
		if q.stalledRQ {
			q.stalledRQ = false
			d.stalled--
			d.postRecvs(q)
		}
		if q.stalledSQ {
			q.stalledSQ = false
			d.stalled--
			d.postSends(q, false)
		}
	})
	d.srqs.each(func(_ uint32, s *srq) {
		if s.stalled {
			s.stalled = false
			d.stalled--
			d.postSRQ(s)
		}
	})
}
