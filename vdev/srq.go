package vdev

import (
	"fmt"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// srq is a shared receive queue: a guest ring (page 0 ring state, rx half;
// WQEs from page 1) and a provider SRQ.
type srq struct {
	handle  uint32
	pd      *pd
	uar     uint32
	hv      hostverbs.SRQ
	ring    *ringbuf.Consumer
	maxWR   uint32
	maxSGE  uint32
	refs    int // QPs attached
	stalled bool
	cost    uint64 // bytes charged to the VM's budget
	// rec and modRec are the journal payloads of its CREATE_SRQ and last
	// MODIFY_SRQ (Checkpoint).
	rec, modRec []byte
	// saved holds the payloads of the SRQ receive records SaveTransports
	// wrote for a hand-over still pending (Device.handover), nil if none.
	saved [][]byte
}

// srqTypeBasic is IB_SRQT_BASIC, the only SRQ type the driver creates.
const srqTypeBasic = 0

// srqAttrLimit is IB_SRQ_LIMIT in MODIFY_SRQ's attr_mask (IB_SRQ_MAX_WR,
// resizing, is not supported by the driver or the device).
const (
	srqAttrMaxWR = 1 << 0
	srqAttrLimit = 1 << 1
)

func (d *Device) cmdCreateSRQ(req, resp []byte) error {
	var r abi.CreateSRQ
	r.Decode(req)
	if d.caps.MaxSRQ == 0 {
		return fmt.Errorf("SRQs not supported: %w", syscall.EOPNOTSUPP)
	}
	p, err := d.pd(r.PDHandle)
	if err != nil {
		return err
	}
	a := r.Attrs
	if r.SRQType != srqTypeBasic || a.MaxWR == 0 || a.MaxWR > d.caps.MaxSRQWR || a.MaxWR&(a.MaxWR-1) != 0 ||
		a.MaxSGE == 0 || a.MaxSGE > d.caps.MaxSRQSGE || a.SRQLimit > a.MaxWR {
		return fmt.Errorf("SRQ type %d of %d WRs x %d SGEs, limit %d (max %d x %d): %w",
			r.SRQType, a.MaxWR, a.MaxSGE, a.SRQLimit, d.caps.MaxSRQWR, d.caps.MaxSRQSGE, syscall.EINVAL)
	}
	stride := rqStride(a.MaxSGE)
	need := 1 + queuePages(a.MaxWR, stride)
	most := 1 + queuePages(d.caps.MaxSRQWR, rqStride(d.caps.MaxSRQSGE))
	if uint64(r.NChunks) < need || uint64(r.NChunks) > most {
		return fmt.Errorf("SRQ in %d pages (needs %d, at most %d): %w", r.NChunks, need, most, ringbuf.ErrPageCount)
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(r.PDirDMA), int(r.NChunks), int(most))
	if err != nil {
		return fmt.Errorf("SRQ page directory: %w", err)
	}
	// The SRQ ring is released at post (ringbuf.Consumer.Advance), as
	// before: its WQEs complete out of order, in whichever QP takes them,
	// so cons_head cannot wait for completions. Its outstanding receives
	// are not in the ring's record.
	ring, err := d.consumer(pages, pages[0]+ringStateRx, guestmem.PageSize, stride, a.MaxWR)
	if err != nil {
		return fmt.Errorf("SRQ ring: %w", err)
	}
	s := &srq{pd: p, uar: p.uar, ring: ring, maxWR: a.MaxWR, maxSGE: a.MaxSGE,
		cost: costSRQ + uint64(len(pages))*costPageEntry + queueCost(a.MaxWR, a.MaxSGE, costRecvWQE, costRecvSGE)}
	if err := d.heap.Charge(s.cost); err != nil {
		return fmt.Errorf("SRQ of %d WRs: %w", a.MaxWR, err)
	}
	h, ok := allocHandle(d, &d.srqs, s)
	if !ok {
		d.heap.Release(s.cost)
		return fmt.Errorf("%d SRQs: %w", d.srqs.len(), ErrLimit)
	}
	s.handle = h
	s.hv, err = p.hv.CreateSRQ(hostverbs.SRQAttr{MaxWR: a.MaxWR, MaxSGE: a.MaxSGE, Limit: a.SRQLimit, Context: uint64(h)})
	if err != nil {
		d.srqs.free(h)
		d.heap.Release(s.cost)
		return fmt.Errorf("create SRQ: %w", err)
	}
	p.refs++
	abi.CreateSRQResp{SRQN: h}.Encode(resp)
	return nil
}

func (d *Device) srq(h uint32) (*srq, error) {
	s, ok := d.srqs.get(h)
	if !ok {
		return nil, fmt.Errorf("SRQ %d: %w", h, ErrBadHandle)
	}
	return s, nil
}

func (d *Device) cmdModifySRQ(req, resp []byte) error {
	var r abi.ModifySRQ
	r.Decode(req)
	s, err := d.srq(r.SRQHandle)
	if err != nil {
		return err
	}
	if r.AttrMask != srqAttrLimit || r.Attrs.SRQLimit > s.maxWR {
		return fmt.Errorf("modify SRQ %d mask %#x limit %d (only the limit, up to %d): %w",
			s.handle, r.AttrMask, r.Attrs.SRQLimit, s.maxWR, syscall.EINVAL)
	}
	if err := s.hv.Modify(hostverbs.SRQAttr{Limit: r.Attrs.SRQLimit}, hostverbs.SRQAttrLimit); err != nil {
		return fmt.Errorf("modify SRQ %d: %w", s.handle, err)
	}
	return nil
}

func (d *Device) cmdQuerySRQ(req, resp []byte) error {
	var r abi.QuerySRQ
	r.Decode(req)
	s, err := d.srq(r.SRQHandle)
	if err != nil {
		return err
	}
	a, err := s.hv.Query()
	if err != nil {
		return fmt.Errorf("query SRQ %d: %w", s.handle, err)
	}
	abi.QuerySRQResp{Attrs: abi.SRQAttr{MaxWR: s.maxWR, MaxSGE: s.maxSGE, SRQLimit: a.Limit}}.Encode(resp)
	return nil
}

func (d *Device) cmdDestroySRQ(req, resp []byte) error {
	var r abi.DestroySRQ
	r.Decode(req)
	s, err := d.srq(r.SRQHandle)
	if err != nil {
		return err
	}
	if s.refs > 0 {
		return fmt.Errorf("SRQ %d used by %d QPs: %w", s.handle, s.refs, syscall.EBUSY)
	}
	return d.destroySRQ(s)
}

func (d *Device) destroySRQ(s *srq) error {
	if s.stalled {
		s.stalled = false
		d.stalled--
	}
	d.srqs.free(s.handle)
	d.heap.Release(s.cost)
	s.pd.refs--
	if err := s.hv.Destroy(); err != nil {
		d.lim.Warn("destroy-srq", "pvrdma: provider failed to destroy an SRQ", "srq", s.handle, "err", err)
		return fmt.Errorf("destroy SRQ %d: %w", s.handle, err)
	}
	return nil
}
