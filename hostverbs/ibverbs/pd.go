//go:build linux && cgo

package ibverbs

/*
#include "pv.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// maxAHs bounds the address handles a PD caches for UD sends.
const maxAHs = 256

// PD is a host protection domain with the objects created in it.
type PD struct {
	d    *Device
	pd   *C.struct_ibv_pd
	mrs  map[*MR]struct{}
	qps  map[*QP]struct{}
	srqs map[*SRQ]struct{}
	ahs  map[ahKey]*C.struct_ibv_ah // guarded by d.mu
	dead bool
}

var _ hostverbs.PD = (*PD)(nil)

type ahKey struct {
	dgid        hostverbs.GID
	sgid        int
	hop, tc, sl uint8
	flow        uint32
}

// Dealloc destroys the PD; it fails with ErrBusy while objects use it.
func (p *PD) Dealloc() error {
	d := p.d
	d.mu.Lock()
	if len(p.mrs)+len(p.qps)+len(p.srqs) > 0 {
		d.mu.Unlock()
		return fmt.Errorf("dealloc pd: %w", hostverbs.ErrBusy)
	}
	d.mu.Unlock()
	return p.destroyAll()
}

// destroyAll destroys the PD's QPs, SRQs, AHs and MRs, then the PD.
func (p *PD) destroyAll() error {
	d := p.d
	d.mu.Lock()
	if p.dead {
		d.mu.Unlock()
		return nil
	}
	qps := make([]*QP, 0, len(p.qps))
	for q := range p.qps {
		qps = append(qps, q)
	}
	srqs := make([]*SRQ, 0, len(p.srqs))
	for s := range p.srqs {
		srqs = append(srqs, s)
	}
	mrs := make([]*MR, 0, len(p.mrs))
	for m := range p.mrs {
		mrs = append(mrs, m)
	}
	d.mu.Unlock()
	var errs []error
	for _, q := range qps {
		errs = append(errs, q.Destroy())
	}
	for _, s := range srqs {
		errs = append(errs, s.destroy(true))
	}
	for _, m := range mrs {
		errs = append(errs, m.Dereg())
	}
	d.mu.Lock()
	for k, ah := range p.ahs {
		if rc, err := C.pv_destroy_ah(d.p.lib.l, ah); rc != 0 {
			errs = append(errs, errnoErr("ibv_destroy_ah", rc, err))
		}
		delete(p.ahs, k)
	}
	p.dead = true
	delete(d.pds, p)
	d.counts.pd--
	d.mu.Unlock()
	if rc, err := C.pv_dealloc_pd(d.p.lib.l, p.pd); rc != 0 {
		errs = append(errs, errnoErr("ibv_dealloc_pd", rc, err))
	}
	return errors.Join(errs...)
}

// ah returns the PD's address handle for av, creating it on first use.
func (p *PD) ah(av *hostverbs.AddressVector) (*C.struct_ibv_ah, error) {
	sgid, err := p.d.hostSGID(av.SGIDIndex)
	if err != nil {
		return nil, err
	}
	k := ahKey{dgid: av.DGID, sgid: sgid, hop: av.HopLimit, tc: av.TrafficClass, sl: av.SL, flow: av.FlowLabel}
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if ah := p.ahs[k]; ah != nil {
		return ah, nil
	}
	if len(p.ahs) >= maxAHs {
		return nil, fmt.Errorf("address handles: %d cached: %w", maxAHs, hostverbs.ErrNoResources)
	}
	var a C.struct_ibv_ah_attr
	p.d.fillAH(&a, av, sgid)
	ah, err := C.pv_create_ah(d.p.lib.l, p.pd, &a)
	if ah == nil {
		return nil, fmt.Errorf("create ah to %s: %w", av.DGID, hostErr(err))
	}
	p.ahs[k] = ah
	return ah, nil
}

// fillAH fills a host AH attribute from a VM's AV (RoCE: always global).
func (d *Device) fillAH(a *C.struct_ibv_ah_attr, av *hostverbs.AddressVector, hostSGID int) {
	a.is_global = 1
	C.pv_set_gid(a, (*C.uint8_t)(unsafe.Pointer(&av.DGID[0])))
	a.grh.sgid_index = C.uint8_t(hostSGID)
	a.grh.hop_limit = C.uint8_t(av.HopLimit)
	if a.grh.hop_limit == 0 {
		a.grh.hop_limit = 64
	}
	a.grh.traffic_class = C.uint8_t(av.TrafficClass)
	a.grh.flow_label = C.uint32_t(av.FlowLabel)
	a.sl = C.uint8_t(av.SL)
	a.port_num = C.uint8_t(d.p.port)
}

// MR is a host memory region over the VM's pages, registered at the
// VM's IOVA through a contiguous host alias of those pages.
type MR struct {
	p      *PD
	mr     *C.struct_ibv_mr
	alias  unsafe.Pointer
	length uintptr
	bytes  uint64
	runs   int
	holds  []guestmem.Hold // the guest regions it aliases: kept until Dereg
	dead   bool
}

var _ hostverbs.MR = (*MR)(nil)

// RegMR registers the guest pages of attr.Pages with the host device.
func (p *PD) RegMR(attr hostverbs.MRAttr) (hostverbs.MR, error) {
	if attr.LKey != 0 || attr.RKey != 0 {
		// The host device picks its keys; libibverbs cannot ask for some.
		return nil, fmt.Errorf("reg mr: keys %#x/%#x requested: the host device chooses its keys: %w",
			attr.LKey, attr.RKey, hostverbs.ErrNotSupported)
	}
	pl := attr.Pages
	if pl.Pages == nil {
		return p.dmaMR(attr)
	}
	if pl.Length == 0 {
		return nil, fmt.Errorf("reg mr: empty: %w", hostverbs.ErrInvalid)
	}
	d := p.d
	d.mu.Lock()
	if p.dead || d.closed {
		d.mu.Unlock()
		return nil, hostverbs.ErrClosed
	}
	if err := d.limit(d.counts.mr, d.cfg.Limits.MaxMR, "reg mr"); err != nil {
		d.mu.Unlock()
		return nil, err
	}
	if max := d.cfg.Limits.MaxMRBytes; max > 0 && d.mrLen+pl.Length > max {
		d.mu.Unlock()
		return nil, fmt.Errorf("reg mr: %d bytes registered, %d more exceed %d: %w", d.mrLen, pl.Length, max, hostverbs.ErrNoResources)
	}
	// Each run of guest pages costs the daemon one mapping, and mappings
	// are a per-process resource (vm.max_map_count) every VM shares: a
	// VM's runs are capped, and all VMs' together.
	runs := pageRuns(pl.Pages)
	if err := d.p.chargeRuns(d, runs); err != nil {
		d.mu.Unlock()
		return nil, fmt.Errorf("reg mr: %w", err)
	}
	d.counts.mr++
	d.mrLen += pl.Length
	d.mu.Unlock()
	undo := func() {
		d.mu.Lock()
		d.counts.mr--
		d.mrLen -= pl.Length
		d.p.releaseRuns(d, runs)
		d.mu.Unlock()
	}
	// The host device may write the MR's pages only if the guest may, and
	// only if the client mapped them writable: the alias allows no more.
	write := attr.Access&(hostverbs.AccessLocalWrite|hostverbs.AccessRemoteWrite|hostverbs.AccessRemoteAtomic) != 0
	alias, length, holds, err := aliasPages(d.guestMemory(), pl.Pages, write)
	if err != nil {
		undo()
		return nil, fmt.Errorf("reg mr: %w", err)
	}
	addr := unsafe.Add(alias, pl.IOVA&(guestmem.PageSize-1))
	mr, err := C.pv_reg_mr(d.p.lib.l, p.pd, addr, C.size_t(pl.Length), C.uint64_t(pl.IOVA), C.uint(attr.Access))
	if mr == nil {
		_ = unix.MunmapPtr(alias, length)
		releaseHolds(holds)
		undo()
		return nil, fmt.Errorf("reg mr %#x+%#x: %w", pl.IOVA, pl.Length, hostErr(err))
	}
	m := &MR{p: p, mr: mr, alias: alias, length: length, bytes: pl.Length, runs: runs, holds: holds}
	d.mu.Lock()
	p.mrs[m] = struct{}{}
	d.mu.Unlock()
	return m, nil
}

// pageRuns counts the runs of guest-physically contiguous pages: an upper
// bound of the mappings aliasPages makes.
func pageRuns(pages []guestmem.GPA) int {
	n := 0
	for i := range pages {
		if i == 0 || pages[i] != pages[i-1]+guestmem.PageSize {
			n++
		}
	}
	return n
}

// aliasPages maps pages (guest page addresses) next to each other in a new
// host range, from the guest memory's file: runs of pages contiguous in
// the file take one mmap. The guest memory regions are pinned while mapping
// (their descriptors must not close under us); the mapping then holds the
// file itself.
//
// The alias is writable only for write, and then only from regions the
// client mapped writable (guestmem.ErrReadOnly).
func aliasPages(m *guestmem.Memory, pages []guestmem.GPA, write bool) (unsafe.Pointer, uintptr, []guestmem.Hold, error) {
	prot := unix.PROT_READ
	if write {
		prot |= unix.PROT_WRITE
	}
	length := uintptr(len(pages)) * guestmem.PageSize
	base, err := unix.MmapPtr(-1, 0, nil, length, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reserve %d bytes for the MR alias: %w", length, err)
	}
	var holds []guestmem.Hold
	fail := func(err error) (unsafe.Pointer, uintptr, []guestmem.Hold, error) {
		_ = unix.MunmapPtr(base, length)
		releaseHolds(holds)
		return nil, 0, nil, err
	}
	for i := 0; i < len(pages); {
		fd, off, pin, err := m.FileRange(pages[i], guestmem.PageSize, write)
		if err != nil {
			return fail(fmt.Errorf("MR page %d (%v): %w", i, pages[i], err))
		}
		// Extend the run while the next page follows in the same region.
		n := 1
		for i+n < len(pages) && pages[i+n] == pages[i]+guestmem.GPA(n*guestmem.PageSize) {
			fd2, off2, pin2, err := m.FileRange(pages[i+n], guestmem.PageSize, write)
			if err != nil {
				break
			}
			same := fd2 == fd && off2 == off+int64(n*guestmem.PageSize)
			pin2.Release()
			if !same {
				break
			}
			n++
		}
		at := unsafe.Add(base, uintptr(i)*guestmem.PageSize)
		_, err = unix.MmapPtr(fd, off, at, uintptr(n)*guestmem.PageSize, prot, unix.MAP_SHARED|unix.MAP_FIXED)
		if err != nil {
			pin.Release()
			return fail(fmt.Errorf("map MR pages %d-%d: %w", i, i+n-1, err))
		}
		// The region stays the client's while the MR lives: its DMA_UNMAP
		// is refused (EBUSY) rather than leaving pages pinned by the host
		// device after the client gave them back.
		h, err := pin.Hold()
		if err != nil {
			return fail(fmt.Errorf("MR pages %d-%d: %w", i, i+n-1, err))
		}
		holds = append(holds, h)
		i += n
	}
	return base, length, holds, nil
}

func releaseHolds(hs []guestmem.Hold) {
	for i := range hs {
		hs[i].Release()
	}
}

// dmaKeyBase marks the placeholder keys of DMA MRs: above any lkey a host
// device hands out for its MR indexes (rxe: index<<8, fewer than 2^20 MRs).
const dmaKeyBase = 0xfff00000

// dmaMR accepts the guest kernel's DMA MR (all of guest memory, local
// access only) as a placeholder: the kernel uses it only in GSI (QP1)
// work requests, and the relay carries no GSI QP (the host kernel owns
// QP1). Its key is never valid on the host device, so a WR that uses it
// fails there with a protection error instead of reaching memory.
func (p *PD) dmaMR(attr hostverbs.MRAttr) (hostverbs.MR, error) {
	if attr.Access&^hostverbs.AccessLocalWrite != 0 {
		return nil, fmt.Errorf("reg mr: a DMA MR with access %#x: %w", attr.Access, hostverbs.ErrInvalid)
	}
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if p.dead || d.closed {
		return nil, hostverbs.ErrClosed
	}
	d.dmaKeys++
	return &dmaMR{key: dmaKeyBase | d.dmaKeys&0xfffff}, nil
}

type dmaMR struct{ key uint32 }

func (m *dmaMR) LKey() uint32 { return m.key }
func (m *dmaMR) RKey() uint32 { return 0 }
func (m *dmaMR) Dereg() error { return nil }

// LKey is the host lkey.
func (m *MR) LKey() uint32 { return uint32(C.pv_mr_lkey(m.mr)) }

// RKey is the host rkey.
func (m *MR) RKey() uint32 { return uint32(C.pv_mr_rkey(m.mr)) }

// Dereg deregisters the MR and unmaps its alias.
func (m *MR) Dereg() error {
	d := m.p.d
	d.mu.Lock()
	if m.dead {
		d.mu.Unlock()
		return nil
	}
	m.dead = true
	delete(m.p.mrs, m)
	d.counts.mr--
	d.mrLen -= m.bytes
	d.p.releaseRuns(d, m.runs)
	d.mu.Unlock()
	var errs []error
	if rc, err := C.pv_dereg_mr(d.p.lib.l, m.mr); rc != 0 {
		errs = append(errs, errnoErr("ibv_dereg_mr", rc, err))
	}
	if err := unix.MunmapPtr(m.alias, m.length); err != nil {
		errs = append(errs, fmt.Errorf("unmap MR alias: %w", err))
	}
	releaseHolds(m.holds)
	return errors.Join(errs...)
}
