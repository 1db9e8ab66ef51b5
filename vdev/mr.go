package vdev

import (
	"fmt"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// mr is a memory region. Its lkey and rkey are the provider's, returned to
// the guest verbatim, so rkeys that guests exchange resolve in the target
// device's provider; the device keeps its own table by lkey to check
// SGEs (PD, bounds, access) before they reach the provider.
//
// A fast-reg MR (FRMR) is the provider's too (hostverbs.FastRegMR): its
// registration, key byte and state live there, where the responder
// resolves incoming rkeys and SEND with invalidate frees it, so the
// device keeps no copy that could go stale. The device's table holds it
// by key index (frmrs) and checks only the PD of SGEs that use it; the
// provider checks the rest.
type mr struct {
	handle     uint32
	pd         *pd
	lkey, rkey uint32 // as the guest knows them (an FRMR's: its base key)
	hv         hostverbs.MR
	fr         hostverbs.FastRegMR // an FRMR's provider object (hv too); nil if lost
	pages      guestmem.PageList
	access     hostverbs.Access
	dma        bool
	frmr       bool
	maxPages   int // FRMR page list capacity
	// regBytes: an FRMR's bytes charged to the VM's registered bytes
	// (Limits.MaxMRBytes, with the plain MRs' bytes) for its last
	// registration, until an invalidation or its destruction releases
	// them (fastRegCharge).
	regBytes uint64
	saved    []byte // FRMR: its fast-reg record while a hand-over is pending
	bytes    uint64
	cost     uint64 // bytes charged to the VM's budget
	// lost: Restore could not rebuild it (its handle stays reserved).
	lost bool
	rec  []byte // journal payload of its CREATE_MR (Checkpoint)
}

// Access flags the device accepts (pvrdma_access_flags without
// ON_DEMAND, which needs page faults the device cannot take, and
// ZERO_BASED, which the driver's CREATE_MR cannot express).
const mrAccessMask = hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite |
	hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic | hostverbs.AccessMWBind

const remoteAccess = hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic

// mrAccessOptional is the IB core's IB_ACCESS_OPTIONAL range (bits 20-29):
// hints such as RELAXED_ORDERING (bit 20, which perftest sets) that a device
// may ignore. The 6.1 driver passes them through unfiltered.
const mrAccessOptional = 0x3ff00000

// validAccess checks MR access flags the way ib_check_mr_access does:
// known bits only (optional hints dropped), and remote write or atomic
// require local write.
func validAccess(a uint32) (hostverbs.Access, error) {
	acc := hostverbs.Access(a &^ mrAccessOptional)
	if acc&^mrAccessMask != 0 {
		return 0, fmt.Errorf("access flags %#x: %w", a, syscall.EINVAL)
	}
	if acc&(hostverbs.AccessRemoteWrite|hostverbs.AccessRemoteAtomic) != 0 && acc&hostverbs.AccessLocalWrite == 0 {
		return 0, fmt.Errorf("access flags %#x: remote write/atomic without local write: %w", a, syscall.EINVAL)
	}
	return acc, nil
}

func (d *Device) cmdCreateMR(req, resp []byte) error {
	var r abi.CreateMR
	r.Decode(req)
	p, err := d.pd(r.PDHandle)
	if err != nil {
		return err
	}
	acc, err := validAccess(r.AccessFlags)
	if err != nil {
		return err
	}
	m := &mr{pd: p, access: acc}
	switch r.Flags {
	case abi.MRFlagDMA:
		// All of guest-physical memory, for the kernel's own use (GSI
		// MADs). Never for a user context and never remotely accessible:
		// an rkey for it would expose the whole guest to the network.
		if p.uar != 0 || acc&remoteAccess != 0 {
			return fmt.Errorf("DMA MR in PD %d with access %#x: %w", p.handle, r.AccessFlags, syscall.EINVAL)
		}
		m.dma = true
		m.pages = guestmem.Identity()
	case abi.MRFlagFRMR:
		if err := d.canFastReg(p); err != nil {
			d.stats.frmrRefused.Add(1)
			d.lim.Warn("frmr-refused", "pvrdma: fast-reg MR refused", "pd", p.handle, "err", err)
			return err
		}
		if r.NChunks == 0 || r.NChunks > d.caps.MaxFastRegPageListLen {
			return fmt.Errorf("fast-reg MR of %d pages (max %d): %w", r.NChunks, d.caps.MaxFastRegPageListLen, ringbuf.ErrPageCount)
		}
		m.frmr, m.maxPages = true, int(r.NChunks)
	case 0:
		if err := d.userMRPages(m, &r); err != nil {
			return err
		}
	default:
		return fmt.Errorf("MR flags %#x: %w", r.Flags, syscall.EINVAL)
	}
	m.cost = costMR + uint64(len(m.pages.Pages)+m.maxPages)*costPageEntry
	if err := d.heap.Charge(m.cost); err != nil {
		return fmt.Errorf("MR: %w", err)
	}
	h, ok := allocHandle(d, &d.mrs, m)
	if !ok {
		d.heap.Release(m.cost)
		return fmt.Errorf("%d MRs: %w", d.mrs.len(), ErrLimit)
	}
	m.handle = h
	if m.frmr {
		fr, err := d.allocFastReg(p, m.maxPages)
		if err != nil {
			d.mrs.free(h)
			d.heap.Release(m.cost)
			return fmt.Errorf("allocate fast-reg MR: %w", err)
		}
		m.hv, m.fr, m.lkey, m.rkey = fr, fr, fr.LKey(), fr.RKey()
		if _, dup := d.frmrs[m.lkey>>8]; dup {
			_ = fr.Dereg()
			d.mrs.free(h)
			d.heap.Release(m.cost)
			return fmt.Errorf("provider fast-reg key %#x already in use: %w", m.lkey, syscall.EBUSY)
		}
		d.frmrs[m.lkey>>8] = m
	} else {
		hv, err := d.regMR(p, hostverbs.MRAttr{Pages: m.pages, Access: acc})
		if err != nil {
			d.mrs.free(h)
			d.heap.Release(m.cost)
			return fmt.Errorf("register MR: %w", err)
		}
		m.hv, m.lkey, m.rkey = hv, hv.LKey(), hv.RKey()
		if _, dup := d.keys[m.lkey]; dup {
			_ = hv.Dereg()
			d.mrs.free(h)
			d.heap.Release(m.cost)
			return fmt.Errorf("provider lkey %#x already in use: %w", m.lkey, syscall.EBUSY)
		}
		d.keys[m.lkey] = m
	}
	d.mrBytes += m.bytes
	p.refs++
	abi.CreateMRResp{MRHandle: h, LKey: m.lkey, RKey: m.rkey}.Encode(resp)
	return nil
}

// userMRPages validates a user MR's range and page directory: nchunks
// must be exactly the pages [start, start+length) spans (CVE-2021-3582),
// within the MR size cap and the VM's registered-bytes quota.
func (d *Device) userMRPages(m *mr, r *abi.CreateMR) error {
	if r.Length == 0 || r.Length > d.caps.MaxMRSize {
		return fmt.Errorf("MR length %#x (max %#x): %w", r.Length, d.caps.MaxMRSize, syscall.EINVAL)
	}
	if d.mrBytes+r.Length > d.limits.MaxMRBytes {
		d.reclaimFastRegs()
	}
	if d.mrBytes+r.Length > d.limits.MaxMRBytes {
		return fmt.Errorf("MR of %#x bytes with %#x registered: %w", r.Length, d.mrBytes, ErrLimit)
	}
	end := r.Start + r.Length
	if end < r.Start {
		return fmt.Errorf("MR %#x+%#x: %w", r.Start, r.Length, syscall.EINVAL)
	}
	span := (end-1)>>guestmem.PageShift - r.Start>>guestmem.PageShift + 1
	if uint64(r.NChunks) != span {
		return fmt.Errorf("MR %#x+%#x spans %d pages, nchunks %d: %w", r.Start, r.Length, span, r.NChunks, ringbuf.ErrPageCount)
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(r.PDirDMA), int(r.NChunks), ringbuf.PageDirMaxPages)
	if err != nil {
		return fmt.Errorf("MR page directory: %w", err)
	}
	pl, err := guestmem.NewPageList(r.Start, r.Length, pages)
	if err != nil {
		return fmt.Errorf("MR pages: %w", err)
	}
	m.pages, m.bytes = pl, r.Length
	return nil
}

// canFastReg says whether PD p's provider can hold fast-reg MRs: the
// device advertised fast registration (its provider offers it) and the PD
// implements hostverbs.FastRegPD.
func (d *Device) canFastReg(p *pd) error {
	if d.caps.BMMEFlags&fastRegBMME != fastRegBMME {
		return fmt.Errorf("fast registration is not offered by this device's provider: %w", syscall.EOPNOTSUPP)
	}
	if _, ok := p.hv.(hostverbs.FastRegPD); !ok {
		return fmt.Errorf("PD %d's provider has no fast registration: %w", p.handle, syscall.EOPNOTSUPP)
	}
	return nil
}

// allocFastReg creates the provider's fast-reg MR, with the key a replay
// forces.
func (d *Device) allocFastReg(p *pd, maxPages int) (hostverbs.FastRegMR, error) {
	attr := hostverbs.FastRegAttr{MaxPages: maxPages}
	if d.rp != nil {
		attr.Key = d.rp.force.lkey
	}
	fr, err := p.hv.(hostverbs.FastRegPD).AllocFastRegMR(attr)
	if err != nil {
		return nil, err
	}
	if attr.Key != 0 && (fr.LKey() != attr.Key || fr.RKey() != d.rp.force.rkey) {
		_ = fr.Dereg()
		return nil, fmt.Errorf("the provider gave keys %#x/%#x for %#x/%#x: %w", fr.LKey(), fr.RKey(),
			attr.Key, d.rp.force.rkey, hostverbs.ErrNotSupported)
	}
	return fr, nil
}

func (d *Device) cmdDestroyMR(req, resp []byte) error {
	var r abi.DestroyMR
	r.Decode(req)
	m, ok := d.mrs.get(r.MRHandle)
	if !ok {
		return fmt.Errorf("MR %d: %w", r.MRHandle, ErrBadHandle)
	}
	return d.destroyMR(m)
}

func (d *Device) destroyMR(m *mr) error {
	if m.hv != nil {
		if err := m.hv.Dereg(); err != nil {
			return fmt.Errorf("deregister MR %d: %w", m.handle, err)
		}
	}
	if d.keys[m.lkey] == m {
		delete(d.keys, m.lkey)
	}
	if m.frmr && d.frmrs[m.lkey>>8] == m {
		delete(d.frmrs, m.lkey>>8)
	}
	d.mrBytes -= m.bytes + m.regBytes
	m.regBytes = 0
	d.heap.Release(m.cost)
	m.pd.refs--
	d.mrs.free(m.handle)
	return nil
}

// checkSGE validates one guest SGE of a WQE on a QP in PD p: the lkey
// must name an MR of the same PD whose range holds the SGE, with local
// write access if the device writes there (receives, READ and atomic
// results). A fast-reg MR's key is checked here for its PD only: its
// registration, state and key byte are the provider's, which refuses the
// SGE with a local protection error (the QP's, in order) if they do not
// fit. It returns the lkey to hand the provider.
func (d *Device) checkSGE(s *abi.SGE, p *pd, write bool) (uint32, hostverbs.WCStatus) {
	m := d.keys[s.LKey]
	if m == nil {
		if f := d.frmrs[s.LKey>>8]; f != nil && f.pd == p && f.fr != nil {
			return s.LKey, hostverbs.WCSuccess
		}
		return 0, hostverbs.WCLocProtErr
	}
	switch {
	case m.pd != p:
		return 0, hostverbs.WCLocProtErr
	case write && m.access&hostverbs.AccessLocalWrite == 0:
		return 0, hostverbs.WCLocProtErr
	case !m.pages.Contains(s.Addr, uint64(s.Length)):
		return 0, hostverbs.WCLocProtErr
	}
	return m.lkey, hostverbs.WCSuccess
}

// fastRegBMME is what the device advertises when its provider offers fast
// registration: all three bits, which together make the driver set
// IB_DEVICE_MEM_MGT_EXTENSIONS.
const fastRegBMME = abi.BMMEFlagLocalInv | abi.BMMEFlagRemoteInv | abi.BMMEFlagFastRegWR

// fastReg executes a REG_MR work request of a kernel QP: the fast-reg MR
// whose key index the new key has takes the page list at pl_pdir_dma (4
// KiB pages), the IOVA range, the access flags and the key, in the
// provider (the guest's key, base key and consumer byte, is the
// provider's). A refusal is logged with its reason and counted; the WQE
// completes in error and the QP moves to ERR.
func (d *Device) fastReg(q *qp, fr *abi.WRFastReg) hostverbs.WCStatus {
	st, err := d.fastRegMR(q, fr)
	if err != nil {
		d.stats.fastRegRefused.Add(1)
		d.lim.Warn("fastreg-refused", "pvrdma: REG_MR refused", "qp", q.handle, "key", fmt.Sprintf("%#x", fr.RKey),
			"iova", fmt.Sprintf("%#x", fr.IOVAStart), "length", fr.Length, "pages", fr.PageListLen, "err", err)
		return st
	}
	d.stats.fastRegs.Add(1)
	return hostverbs.WCSuccess
}

func (d *Device) fastRegMR(q *qp, fr *abi.WRFastReg) (hostverbs.WCStatus, error) {
	m := d.frmrs[fr.RKey>>8]
	switch {
	case m == nil || !m.frmr:
		return hostverbs.WCLocQPOpErr, fmt.Errorf("no fast-reg MR has key index %#x", fr.RKey>>8)
	case m.pd != q.pd:
		return hostverbs.WCLocProtErr, fmt.Errorf("MR %d is in PD %d, the QP in PD %d", m.handle, m.pd.handle, q.pd.handle)
	case m.fr == nil:
		return hostverbs.WCLocQPOpErr, fmt.Errorf("MR %d was lost in a restore", m.handle)
	}
	acc, err := validAccess(fr.AccessFlags)
	if err != nil {
		return hostverbs.WCLocQPOpErr, err
	}
	if fr.PageShift != guestmem.PageShift {
		return hostverbs.WCLocQPOpErr, fmt.Errorf("page shift %d (the device takes %d)", fr.PageShift, guestmem.PageShift)
	}
	if fr.PageListLen == 0 || int(fr.PageListLen) > m.maxPages {
		return hostverbs.WCLocQPOpErr, fmt.Errorf("%d pages in a fast-reg MR of %d", fr.PageListLen, m.maxPages)
	}
	end := fr.IOVAStart + uint64(fr.Length)
	if fr.Length == 0 || end < fr.IOVAStart {
		return hostverbs.WCLocLenErr, fmt.Errorf("range %#x+%#x", fr.IOVAStart, fr.Length)
	}
	span := (end-1)>>guestmem.PageShift - fr.IOVAStart>>guestmem.PageShift + 1
	if span > uint64(fr.PageListLen) {
		return hostverbs.WCLocLenErr, fmt.Errorf("range %#x+%#x spans %d pages, the list has %d", fr.IOVAStart, fr.Length, span, fr.PageListLen)
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(fr.PLPDirDMA), int(fr.PageListLen), m.maxPages)
	if err != nil {
		return hostverbs.WCLocProtErr, fmt.Errorf("page list: %w", err)
	}
	pl, err := guestmem.NewPageList(fr.IOVAStart, uint64(fr.Length), pages[:span])
	if err != nil {
		return hostverbs.WCLocLenErr, err
	}
	if err := d.fastRegCharge(m, pl.Length); err != nil {
		return hostverbs.WCLocQPOpErr, err
	}
	if err := m.fr.Register(hostverbs.FastReg{Pages: pl, Access: acc, Key: fr.RKey}); err != nil {
		d.fastRegRelease(m)
		return hostverbs.WCLocQPOpErr, err
	}
	return hostverbs.WCSuccess, nil
}

// Fast registrations count toward the VM's registered bytes
// (Limits.MaxMRBytes) as plain MRs do: a REG_MR charges its length, a
// LOCAL_INV or the MR's destruction gives it back. A SEND with invalidate
// frees a registration in the provider, unseen by the device: its bytes
// are given back at the MR's next REG_MR, or when a REG_MR would go over
// the limit (reclaimFastRegs), whichever comes first.

// fastRegCharge charges n bytes for the next registration of FRMR m,
// whose last one is free (else its Register fails and the charge is given
// back). mu held.
func (d *Device) fastRegCharge(m *mr, n uint64) error {
	if m.regBytes != 0 {
		if st, _ := m.fr.Registration(); st == hostverbs.MRValid {
			return fmt.Errorf("MR %d is valid (invalidate it first): %w", m.handle, syscall.EBUSY)
		}
		d.fastRegRelease(m)
	}
	if d.mrBytes+n > d.limits.MaxMRBytes {
		d.reclaimFastRegs()
		if d.mrBytes+n > d.limits.MaxMRBytes {
			return fmt.Errorf("registration of %#x bytes with %#x registered (max-mr-bytes %#x): %w", n, d.mrBytes, d.limits.MaxMRBytes, ErrLimit)
		}
	}
	m.regBytes = n
	d.mrBytes += n
	return nil
}

// fastRegRelease gives back what FRMR m's registration was charged. mu
// held.
func (d *Device) fastRegRelease(m *mr) {
	d.mrBytes -= m.regBytes
	m.regBytes = 0
}

// reclaimFastRegs gives back the bytes of the registrations a SEND with
// invalidate freed. mu held.
func (d *Device) reclaimFastRegs() {
	for _, m := range d.frmrs {
		if m.regBytes == 0 || m.fr == nil {
			continue
		}
		if st, _ := m.fr.Registration(); st != hostverbs.MRValid {
			d.fastRegRelease(m)
		}
	}
}

// localInv executes a LOCAL_INV work request: the fast-reg MR with that
// key stops being usable (locally and remotely) until the next REG_MR.
func (d *Device) localInv(q *qp, key uint32) hostverbs.WCStatus {
	m := d.frmrs[key>>8]
	var err error
	switch {
	case m == nil:
		err = fmt.Errorf("no fast-reg MR has key index %#x", key>>8)
	case m.pd != q.pd:
		err = fmt.Errorf("MR %d is in PD %d, the QP in PD %d", m.handle, m.pd.handle, q.pd.handle)
	case m.fr == nil:
		err = fmt.Errorf("MR %d was lost in a restore", m.handle)
	default:
		if err = m.fr.Invalidate(key); err == nil {
			d.fastRegRelease(m)
		}
	}
	if err != nil {
		d.stats.localInvRefused.Add(1)
		d.lim.Warn("localinv-refused", "pvrdma: LOCAL_INV refused", "qp", q.handle, "key", fmt.Sprintf("%#x", key), "err", err)
		return hostverbs.WCLocQPOpErr
	}
	d.stats.localInvs.Add(1)
	return hostverbs.WCSuccess
}
