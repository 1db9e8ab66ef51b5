package vdev

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// The command handlers' side of a restore: while Device.rp is set they
// take the handle, QPN and keys the journal recorded instead of choosing
// them, adopt rings instead of resetting them, and get stand-ins for the
// provider objects of lost objects.

// allocHandle stores v under the lowest free handle of t, or during a
// restore under the handle the journal recorded.
func allocHandle[T comparable](d *Device, t *table[T], v T) (uint32, bool) {
	if d.rp != nil {
		h := d.rp.force.handle
		return h, t.set(h, v)
	}
	return t.alloc(v)
}

// newProducer builds the device side of a device-produced ring, adopting
// its prod_tail during a restore.
func (d *Device) newProducer(state guestmem.GPA, geo ringbuf.Geometry, area ringbuf.Area) (*ringbuf.Producer, error) {
	if d.rp != nil || d.adopt {
		return ringbuf.AdoptProducer(d.mem, state, geo, area)
	}
	return ringbuf.NewProducer(d.mem, state, geo, area)
}

// cqRing builds a CQ's ring of n CQEs in pages (page 0 the ring state).
// During a restore the ring of a CQ resized later in the journal gets its
// last size, which its prod_tail belongs to.
func (d *Device) cqRing(pages []guestmem.GPA, n uint32) (*ringbuf.Producer, error) {
	if d.rp != nil && d.rp.force.cqe != 0 {
		last := d.rp.force.cqe
		if last > d.caps.MaxCQE || last&(last-1) != 0 || cqRingPages(last) > uint64(len(pages)) {
			return nil, fmt.Errorf("CQ resized to %d CQEs in %d pages: %w", last, len(pages), syscall.EINVAL)
		}
		n = last
	}
	geo, err := ringbuf.NewGeometry(n)
	if err != nil {
		return nil, err
	}
	area, err := ringbuf.NewArea(pages, guestmem.PageSize, abi.CQESize, n)
	if err != nil {
		return nil, err
	}
	ring, err := d.newProducer(pages[0]+ringStateRx, geo, area)
	if err != nil {
		return nil, fmt.Errorf("CQ ring state: %w", err)
	}
	return ring, nil
}

// resizeCQRing gives a CQ's ring a new size; a restore built it with its
// last size already.
func (d *Device) resizeCQRing(c *cq, geo ringbuf.Geometry) error {
	switch {
	case d.rp != nil:
		return nil
	case d.adopt:
		return c.ring.ResizeAdopt(geo, abi.CQESize) // the ring has been in use since
	}
	return c.ring.Resize(geo, abi.CQESize)
}

// createProviderQP creates the provider QP of a new QP. During a restore
// it asks for the recorded QPN, and a QP the provider refuses (or whose
// PD, CQ or SRQ is lost) gets a stand-in: the QP keeps its rings, is lost
// and flushes what the guest posts.
func (d *Device) createProviderQP(p *pd, init hostverbs.QPInitAttr) (hostverbs.QP, error) {
	lostDep := isLost(p.hv) || isLost(init.SendCQ) || isLost(init.RecvCQ) || (init.SRQ != nil && isLost(init.SRQ))
	rp := d.rp
	if rp == nil {
		if lostDep {
			return nil, fmt.Errorf("its PD, CQ or SRQ: %w", errLost)
		}
		return p.hv.CreateQP(init)
	}
	qpn := rp.force.qpn
	if lostDep {
		rp.lostCause = errors.New("its PD, CQ or SRQ is lost")
		return lostQP{qpn: qpn, rings: true}, nil
	}
	init.QPN = qpn
	hv, err := p.hv.CreateQP(init)
	if err == nil && hv.QPN() != qpn {
		_ = hv.Destroy()
		err = fmt.Errorf("the provider gave QPN %#x: %w", hv.QPN(), hostverbs.ErrNotSupported)
	}
	if err != nil {
		rp.lostCause = fmt.Errorf("create QP %#x: %w", qpn, err)
		return lostQP{qpn: qpn, rings: true}, nil
	}
	return hv, nil
}

// regMR registers an MR with the provider, during a restore with the
// recorded keys (a provider that gives others is refused).
func (d *Device) regMR(p *pd, attr hostverbs.MRAttr) (hostverbs.MR, error) {
	if d.rp == nil {
		return p.hv.RegMR(attr)
	}
	attr.LKey, attr.RKey = d.rp.force.lkey, d.rp.force.rkey
	hv, err := p.hv.RegMR(attr)
	if err != nil {
		return nil, fmt.Errorf("keys %#x/%#x: %w", attr.LKey, attr.RKey, err)
	}
	if hv.LKey() != attr.LKey || hv.RKey() != attr.RKey {
		_ = hv.Dereg()
		return nil, fmt.Errorf("the provider gave keys %#x/%#x for %#x/%#x: %w", hv.LKey(), hv.RKey(),
			attr.LKey, attr.RKey, hostverbs.ErrNotSupported)
	}
	return hv, nil
}

// Stand-ins for the provider objects of lost objects: every operation
// fails with errLost but destruction, which succeeds.

type lostMarker interface{ lostInRestore() }

func isLost(v any) bool {
	_, ok := v.(lostMarker)
	return ok
}

type lostPD struct{}

func (lostPD) RegMR(hostverbs.MRAttr) (hostverbs.MR, error)        { return nil, errLost }
func (lostPD) CreateQP(hostverbs.QPInitAttr) (hostverbs.QP, error) { return nil, errLost }
func (lostPD) CreateSRQ(hostverbs.SRQAttr) (hostverbs.SRQ, error)  { return nil, errLost }
func (lostPD) Dealloc() error                                      { return nil }
func (lostPD) lostInRestore()                                      {}

type lostCQ struct{}

func (lostCQ) Resize(int) error { return errLost }
func (lostCQ) Destroy() error   { return nil }
func (lostCQ) lostInRestore()   {}

type lostSRQ struct{}

func (lostSRQ) PostRecv(*hostverbs.RecvWR) error                      { return errLost }
func (lostSRQ) Modify(hostverbs.SRQAttr, hostverbs.SRQAttrMask) error { return errLost }
func (lostSRQ) Query() (hostverbs.SRQAttr, error)                     { return hostverbs.SRQAttr{}, errLost }
func (lostSRQ) Destroy() error                                        { return nil }
func (lostSRQ) lostInRestore()                                        {}

// lostQP stands in for a lost QP's provider QP. One with rings accepts
// a move to ERR (drain logic such as ib_drain_qp's), the state it is in.
type lostQP struct {
	qpn   uint32
	rings bool
}

func (q lostQP) QPN() uint32 { return q.qpn }
func (q lostQP) Modify(a *hostverbs.QPAttr, mask hostverbs.AttrMask) error {
	if q.rings && mask&^hostverbs.AttrCurState == hostverbs.AttrState && a.State == hostverbs.QPStateErr {
		return nil
	}
	return errLost
}
func (lostQP) Query() (hostverbs.QPAttr, error) { return hostverbs.QPAttr{}, errLost }
func (lostQP) PostSend(*hostverbs.SendWR) error { return errLost }
func (lostQP) PostRecv(*hostverbs.RecvWR) error { return errLost }
func (lostQP) Destroy() error                   { return nil }
func (lostQP) lostInRestore()                   {}
