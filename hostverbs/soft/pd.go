package soft

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// pd is a protection domain: MRs, QPs and SRQs are created in one, and a
// QP may only touch memory of MRs in its own PD.
type pd struct {
	dev  *device
	refs atomic.Int32
}

const accessAll = hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite |
	hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic | hostverbs.AccessMWBind |
	hostverbs.AccessZeroBased

func (p *pd) RegMR(attr hostverbs.MRAttr) (hostverbs.MR, error) {
	d := p.dev
	if attr.Access&^accessAll != 0 {
		return nil, fmt.Errorf("reg mr: access %#x: %w", uint32(attr.Access), hostverbs.ErrInvalid)
	}
	// MW_BIND only allows memory windows to be bound to the MR later (IBA
	// 10.6.3.1); this device has no memory windows (max_mw 0), so there is
	// nothing to bind and the MR is registered as it would be without the
	// flag, as rxe and HCAs do. Applications that ask for it (rdma-core's
	// memory-window tests) then fail, or skip, where they allocate a window.
	if attr.Access&hostverbs.AccessZeroBased != 0 {
		return nil, fmt.Errorf("reg mr: zero-based MRs: %w", hostverbs.ErrNotSupported)
	}
	// IBA 10.6.3.1: remote write or atomic requires local write.
	if attr.Access&(hostverbs.AccessRemoteWrite|hostverbs.AccessRemoteAtomic) != 0 &&
		attr.Access&hostverbs.AccessLocalWrite == 0 {
		return nil, fmt.Errorf("reg mr: remote write/atomic without local write: %w", hostverbs.ErrInvalid)
	}
	pl := attr.Pages
	if pl.Pages != nil {
		// Re-validate: the page list may come straight from a guest.
		v, err := guestmem.NewPageList(pl.IOVA, pl.Length, pl.Pages)
		if err != nil {
			return nil, fmt.Errorf("reg mr: %w: %w", err, hostverbs.ErrInvalid)
		}
		pl = v
		if pl.Length > maxMRSize {
			return nil, fmt.Errorf("reg mr: length %#x: %w", pl.Length, hostverbs.ErrInvalid)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("reg mr: %w", hostverbs.ErrClosed)
	}
	if _, ok := d.pds[p]; !ok {
		return nil, fmt.Errorf("reg mr: pd was deallocated: %w", hostverbs.ErrNotFound)
	}
	if d.nMR >= d.attr.MaxMR {
		return nil, fmt.Errorf("reg mr: %d MRs: %w", d.nMR, hostverbs.ErrNoResources)
	}
	bytes := pl.Length
	if pl.Pages == nil {
		bytes = 0 // a DMA MR pins nothing new
	}
	if lim := d.cfg.Limits.MaxMRBytes; lim > 0 && d.mrBytes+bytes > lim {
		return nil, fmt.Errorf("reg mr: %d + %d bytes registered exceeds %d: %w", d.mrBytes, bytes, lim, hostverbs.ErrNoResources)
	}
	var key uint32
	if attr.LKey != 0 || attr.RKey != 0 {
		// A restored MR keeps its keys; this device has one key per MR.
		if attr.LKey == 0 || (attr.RKey != 0 && attr.RKey != attr.LKey) {
			return nil, fmt.Errorf("reg mr: keys %#x/%#x: one key serves both here: %w", attr.LKey, attr.RKey, hostverbs.ErrNotSupported)
		}
		if err := d.keys.take(attr.LKey); err != nil {
			return nil, fmt.Errorf("reg mr: %w", err)
		}
		key = attr.LKey
	} else {
		var ok bool
		if key, ok = d.keys.alloc(); !ok {
			return nil, fmt.Errorf("reg mr: key space: %w", hostverbs.ErrNoResources)
		}
	}
	m := &mr{dev: d, pd: p, key: key, access: attr.Access, pages: pl, mem: d.mem}
	d.keys.set(key, m)
	d.nMR++
	d.mrBytes += bytes
	p.refs.Add(1)
	return m, nil
}

func (p *pd) CreateQP(attr hostverbs.QPInitAttr) (hostverbs.QP, error) {
	return p.dev.createQP(p, attr)
}

func (p *pd) CreateSRQ(attr hostverbs.SRQAttr) (hostverbs.SRQ, error) {
	d := p.dev
	if attr.MaxWR < 1 || attr.MaxWR > maxSRQWR || attr.MaxSGE < 1 || attr.MaxSGE > maxSGE {
		return nil, fmt.Errorf("create srq: max_wr %d max_sge %d: %w", attr.MaxWR, attr.MaxSGE, hostverbs.ErrInvalid)
	}
	if attr.Limit > attr.MaxWR {
		return nil, fmt.Errorf("create srq: limit %d above max_wr %d: %w", attr.Limit, attr.MaxWR, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("create srq: %w", hostverbs.ErrClosed)
	}
	if _, ok := d.pds[p]; !ok {
		return nil, fmt.Errorf("create srq: pd was deallocated: %w", hostverbs.ErrNotFound)
	}
	if len(d.srqs) >= d.attr.MaxSRQ {
		return nil, fmt.Errorf("create srq: %d SRQs: %w", len(d.srqs), hostverbs.ErrNoResources)
	}
	s := &srq{dev: d, pd: p, ctx: attr.Context, limit: attr.Limit}
	s.rq.init(int(attr.MaxWR), int(attr.MaxSGE))
	d.srqs[s] = struct{}{}
	p.refs.Add(1)
	return s, nil
}

func (p *pd) Dealloc() error {
	d := p.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.pds[p]; !ok {
		return fmt.Errorf("dealloc pd: %w", hostverbs.ErrNotFound)
	}
	if n := p.refs.Load(); n > 0 {
		return fmt.Errorf("dealloc pd: %d objects use it: %w", n, hostverbs.ErrBusy)
	}
	delete(d.pds, p)
	return nil
}

// cq is a completion queue: completions go straight to its handler.
type cq struct {
	dev     *device
	handler hostverbs.CompletionHandler
	ctx     uint64
	depth   atomic.Int64
	refs    atomic.Int32
}

func (c *cq) Resize(depth int) error {
	if depth < 1 || depth > maxCQE {
		return fmt.Errorf("resize cq: depth %d: %w", depth, hostverbs.ErrInvalid)
	}
	c.depth.Store(int64(depth))
	return nil
}

func (c *cq) Destroy() error {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.cqs[c]; !ok {
		return fmt.Errorf("destroy cq: %w", hostverbs.ErrNotFound)
	}
	if n := c.refs.Load(); n > 0 {
		return fmt.Errorf("destroy cq: %d QPs use it: %w", n, hostverbs.ErrBusy)
	}
	delete(d.cqs, c)
	return nil
}

// complete pushes wc to the handler. wc is only valid during the call.
func (c *cq) complete(wc *hostverbs.WorkCompletion) {
	c.dev.ctrs.inc(cntCompletions)
	c.handler.Complete(wc)
}

// srq is a shared receive queue.
type srq struct {
	dev   *device
	pd    *pd
	ctx   uint64
	mu    sync.Mutex
	rq    recvQueue
	limit uint32 // 0 = disarmed
	refs  atomic.Int32
	// frozen: SaveRecvs handed the receives over; no QP takes one until
	// ResumeRecvs, a post or a modify.
	frozen bool
}

var _ hostverbs.SRQSaver = (*srq)(nil)

func (s *srq) PostRecv(wr *hostverbs.RecvWR) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dev.isClosed() {
		return fmt.Errorf("srq post recv: %w", hostverbs.ErrClosed)
	}
	s.frozen = false // a hand-over abandoned
	return s.rq.post(wr)
}

// SaveRecvs freezes the SRQ and returns the receives no QP has taken,
// oldest (the next to be taken) first.
func (s *srq) SaveRecvs() ([]hostverbs.RecvWR, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dev.isClosed() {
		return nil, fmt.Errorf("save srq receives: %w", hostverbs.ErrClosed)
	}
	s.frozen = true
	out := make([]hostverbs.RecvWR, 0, s.rq.len())
	s.rq.each(func(w *recvWQE) {
		out = append(out, hostverbs.RecvWR{WRID: w.wrID, SGL: slices.Clone(w.sgl)})
	})
	return out, nil
}

// ResumeRecvs undoes SaveRecvs.
func (s *srq) ResumeRecvs() {
	s.mu.Lock()
	s.frozen = false
	s.mu.Unlock()
}

func (s *srq) Modify(attr hostverbs.SRQAttr, mask hostverbs.SRQAttrMask) error {
	if mask&^(hostverbs.SRQAttrMaxWR|hostverbs.SRQAttrLimit) != 0 {
		return fmt.Errorf("modify srq: mask %#x: %w", uint32(mask), hostverbs.ErrInvalid)
	}
	if mask&hostverbs.SRQAttrMaxWR != 0 {
		return fmt.Errorf("modify srq: resize: %w", hostverbs.ErrNotSupported)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.frozen = false // a hand-over abandoned
	if mask&hostverbs.SRQAttrLimit != 0 {
		if attr.Limit > uint32(s.rq.cap()) {
			return fmt.Errorf("modify srq: limit %d above max_wr %d: %w", attr.Limit, s.rq.cap(), hostverbs.ErrInvalid)
		}
		s.limit = attr.Limit
	}
	return nil
}

func (s *srq) Query() (hostverbs.SRQAttr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return hostverbs.SRQAttr{MaxWR: uint32(s.rq.cap()), MaxSGE: uint32(s.rq.maxSGE), Limit: s.limit, Context: s.ctx}, nil
}

func (s *srq) Destroy() error {
	d := s.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.srqs[s]; !ok {
		return fmt.Errorf("destroy srq: %w", hostverbs.ErrNotFound)
	}
	if n := s.refs.Load(); n > 0 {
		return fmt.Errorf("destroy srq: %d QPs use it: %w", n, hostverbs.ErrBusy)
	}
	delete(d.srqs, s)
	s.pd.refs.Add(-1)
	return nil
}

// take pops the next receive WQE into dst. The limit event fires once
// when fewer than limit WQEs remain, then disarms (IBA 11.5.2.3). A
// frozen SRQ (SaveRecvs) gives none and says so: the caller drops the
// packet rather than answer it (no RNR NAK), as a frozen QP does.
func (s *srq) take(dst *recvWQE) (ok, frozen bool) {
	s.mu.Lock()
	if s.frozen {
		s.mu.Unlock()
		return false, true
	}
	ok = s.rq.take(dst)
	fire := false
	if ok && s.limit > 0 && uint32(s.rq.len()) < s.limit {
		s.limit = 0
		fire = true
	}
	s.mu.Unlock()
	if fire {
		s.dev.event(hostverbs.EventSRQLimitReached, s.ctx, 0)
	}
	return ok, false
}

func (d *device) isClosed() bool { return d.closedFlag.Load() }
