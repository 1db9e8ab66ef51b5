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
	"unsafe"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// SRQ is a host shared receive queue.
type SRQ struct {
	p       *PD
	srq     *C.struct_ibv_srq
	maxSGE  uint32
	context uint64
	users   int  // QPs on it; guarded by p.d.mu
	dead    bool // guarded by p.d.mu

	mu  sync.Mutex
	sge *C.struct_ibv_sge
}

var _ hostverbs.SRQ = (*SRQ)(nil)

// CreateSRQ creates a shared receive queue.
func (p *PD) CreateSRQ(attr hostverbs.SRQAttr) (hostverbs.SRQ, error) {
	if attr.MaxWR == 0 || attr.MaxWR > uint32(p.d.p.attr.max_srq_wr) || attr.MaxSGE == 0 || attr.MaxSGE > uint32(p.d.p.attr.max_srq_sge) {
		return nil, fmt.Errorf("create srq: %d WRs, %d SGEs beyond the host's: %w", attr.MaxWR, attr.MaxSGE, hostverbs.ErrInvalid)
	}
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if p.dead || d.closed {
		return nil, hostverbs.ErrClosed
	}
	if err := d.limit(d.counts.srq, d.cfg.Limits.MaxSRQ, "create srq"); err != nil {
		return nil, err
	}
	var ia C.struct_ibv_srq_init_attr
	ia.attr.max_wr = C.uint32_t(attr.MaxWR)
	ia.attr.max_sge = C.uint32_t(attr.MaxSGE)
	ia.attr.srq_limit = C.uint32_t(attr.Limit)
	srq, err := C.pv_create_srq(d.p.lib.l, p.pd, &ia)
	if srq == nil {
		return nil, fmt.Errorf("create srq: %w", hostErr(err))
	}
	s := &SRQ{p: p, srq: srq, maxSGE: uint32(ia.attr.max_sge), context: attr.Context}
	s.sge = (*C.struct_ibv_sge)(C.calloc(C.size_t(s.maxSGE), C.size_t(unsafe.Sizeof(C.struct_ibv_sge{}))))
	p.srqs[s] = struct{}{}
	d.counts.srq++
	d.p.track(unsafe.Pointer(srq), asyncTarget{d: d, context: attr.Context})
	return s, nil
}

// PostRecv posts one receive WR.
func (s *SRQ) PostRecv(wr *hostverbs.RecvWR) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sge == nil {
		return hostverbs.ErrClosed
	}
	if err := fillSGL(s.sge, s.maxSGE, wr.SGL); err != nil {
		return fmt.Errorf("post srq recv: %w", err)
	}
	if rc := C.pv_post_srq_recv(s.srq, C.uint64_t(wr.WRID), s.sge, C.int(len(wr.SGL))); rc != 0 {
		return fmt.Errorf("post srq recv: %w", hostErr(errnoErr("ibv_post_srq_recv", rc, nil)))
	}
	return nil
}

// Modify changes the depth or arms the limit.
func (s *SRQ) Modify(attr hostverbs.SRQAttr, mask hostverbs.SRQAttrMask) error {
	var a C.struct_ibv_srq_attr
	a.max_wr = C.uint32_t(attr.MaxWR)
	a.srq_limit = C.uint32_t(attr.Limit)
	if rc, err := C.pv_modify_srq(s.p.d.p.lib.l, s.srq, &a, C.int(mask)); rc != 0 {
		return fmt.Errorf("modify srq: %w", hostErr(errnoErr("ibv_modify_srq", rc, err)))
	}
	return nil
}

// Query returns the SRQ's attributes.
func (s *SRQ) Query() (hostverbs.SRQAttr, error) {
	var a C.struct_ibv_srq_attr
	if rc, err := C.pv_query_srq(s.p.d.p.lib.l, s.srq, &a); rc != 0 {
		return hostverbs.SRQAttr{}, fmt.Errorf("query srq: %w", hostErr(errnoErr("ibv_query_srq", rc, err)))
	}
	return hostverbs.SRQAttr{MaxWR: uint32(a.max_wr), MaxSGE: uint32(a.max_sge), Limit: uint32(a.srq_limit), Context: s.context}, nil
}

// Destroy fails with ErrBusy while QPs use the SRQ.
func (s *SRQ) Destroy() error { return s.destroy(false) }

func (s *SRQ) destroy(force bool) error {
	d := s.p.d
	d.mu.Lock()
	if s.dead {
		d.mu.Unlock()
		return nil
	}
	if s.users > 0 && !force {
		d.mu.Unlock()
		return fmt.Errorf("destroy srq: %d QPs use it: %w", s.users, hostverbs.ErrBusy)
	}
	s.dead = true
	delete(s.p.srqs, s)
	d.counts.srq--
	d.mu.Unlock()
	d.p.untrack(unsafe.Pointer(s.srq))
	s.mu.Lock()
	defer s.mu.Unlock()
	rc, err := C.pv_destroy_srq(d.p.lib.l, s.srq)
	C.free(unsafe.Pointer(s.sge))
	s.sge = nil
	return errnoErr("ibv_destroy_srq", rc, err)
}
