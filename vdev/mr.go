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
type mr struct {
	handle     uint32
	pd         *pd
	lkey, rkey uint32 // as the guest knows them
	hv         hostverbs.MR
	hvLKey     uint32 // lkey to give the provider (== lkey except for FRMRs)
	pages      guestmem.PageList
	access     hostverbs.Access
	dma        bool
	frmr       bool
	maxPages   int  // FRMR page list capacity
	valid      bool // usable in SGEs (FRMR: registered and not invalidated)
	bytes      uint64
	cost       uint64 // bytes charged to the VM's budget
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
	m := &mr{pd: p, access: acc, valid: true}
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
		if r.NChunks == 0 || r.NChunks > ringbuf.MaxFastRegPages {
			return fmt.Errorf("fast-reg MR of %d pages (max %d): %w", r.NChunks, ringbuf.MaxFastRegPages, ringbuf.ErrPageCount)
		}
		m.frmr, m.maxPages, m.valid = true, int(r.NChunks), false
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
		m.lkey = d.frmrKey(h)
		m.rkey, m.hvLKey = m.lkey, m.lkey
		d.frmrs[m.lkey] = m
	} else {
		hv, err := d.regMR(p, hostverbs.MRAttr{Pages: m.pages, Access: acc})
		if err != nil {
			d.mrs.free(h)
			d.heap.Release(m.cost)
			return fmt.Errorf("register MR: %w", err)
		}
		m.hv, m.lkey, m.rkey, m.hvLKey = hv, hv.LKey(), hv.RKey(), hv.LKey()
		if _, dup := d.keys[m.lkey]; dup {
			_ = hv.Dereg()
			d.mrs.free(h)
			d.heap.Release(m.cost)
			return fmt.Errorf("provider lkey %#x already in use: %w", m.lkey, syscall.EBUSY)
		}
	}
	d.keys[m.lkey] = m
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

// frmrKey picks the key of a fast-reg MR: the consumer byte (bits 0-7,
// which ib_update_fast_reg_key changes) is zero and the rest is unique
// among the device's keys.
func (d *Device) frmrKey(h uint32) uint32 {
	if d.rp != nil {
		return d.rp.force.lkey // checked by the replay
	}
	k := 0x80000000 | h<<8
	for {
		_, taken := d.keys[k]
		_, takenFR := d.frmrs[k]
		if !taken && !takenFR {
			return k
		}
		k = (k + 1<<8) | 0x80000000
	}
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
	if m.frmr {
		delete(d.frmrs, m.lkey&^0xff)
	}
	d.mrBytes -= m.bytes
	d.heap.Release(m.cost)
	m.pd.refs--
	d.mrs.free(m.handle)
	return nil
}

// checkSGE validates one guest SGE of a WQE on a QP in PD p: the lkey
// must name a valid MR of the same PD whose range holds the SGE, with
// local write access if the device writes there (receives, READ and atomic
// results). It returns the lkey to hand the provider.
func (d *Device) checkSGE(s *abi.SGE, p *pd, write bool) (uint32, hostverbs.WCStatus) {
	m := d.keys[s.LKey]
	switch {
	case m == nil || !m.valid || m.pd != p:
		return 0, hostverbs.WCLocProtErr
	case write && m.access&hostverbs.AccessLocalWrite == 0:
		return 0, hostverbs.WCLocProtErr
	case !m.pages.Contains(s.Addr, uint64(s.Length)):
		return 0, hostverbs.WCLocProtErr
	}
	return m.hvLKey, hostverbs.WCSuccess
}

// fastReg executes a REG_MR work request of a kernel QP: the fast-reg MR
// named by the key (consumer byte masked) takes the page list at
// pl_pdir_dma, the new key and the access flags. The pages are registered
// with the provider; local SGEs using the new key are translated to the
// provider's lkey.
func (d *Device) fastReg(q *qp, fr *abi.WRFastReg) hostverbs.WCStatus {
	m := d.frmrs[fr.RKey&^0xff]
	if m == nil || m.pd != q.pd {
		return hostverbs.WCLocProtErr
	}
	acc, err := validAccess(fr.AccessFlags)
	if err != nil || fr.PageShift != guestmem.PageShift || fr.PageListLen == 0 || int(fr.PageListLen) > m.maxPages {
		return hostverbs.WCLocQPOpErr
	}
	end := fr.IOVAStart + uint64(fr.Length)
	if fr.Length == 0 || end < fr.IOVAStart {
		return hostverbs.WCLocLenErr
	}
	span := (end-1)>>guestmem.PageShift - fr.IOVAStart>>guestmem.PageShift + 1
	if span > uint64(fr.PageListLen) {
		return hostverbs.WCLocLenErr
	}
	pages, err := ringbuf.ReadPageDir(d.mem, guestmem.GPA(fr.PLPDirDMA), int(fr.PageListLen), m.maxPages)
	if err != nil {
		return hostverbs.WCLocProtErr
	}
	pl, err := guestmem.NewPageList(fr.IOVAStart, uint64(fr.Length), pages[:span])
	if err != nil {
		return hostverbs.WCLocLenErr
	}
	if other, taken := d.keys[fr.RKey]; taken && other != m {
		return hostverbs.WCLocQPOpErr
	}
	if m.hv != nil {
		if err := m.hv.Dereg(); err != nil {
			return hostverbs.WCLocQPOpErr
		}
		m.hv = nil
	}
	hv, err := q.pd.hv.RegMR(hostverbs.MRAttr{Pages: pl, Access: acc})
	if err != nil {
		m.valid = false
		return hostverbs.WCLocQPOpErr
	}
	if d.keys[m.lkey] == m {
		delete(d.keys, m.lkey)
	}
	m.lkey, m.rkey, m.hv, m.hvLKey = fr.RKey, fr.RKey, hv, hv.LKey()
	m.pages, m.access, m.valid = pl, acc, true
	d.keys[m.lkey] = m
	return hostverbs.WCSuccess
}

// localInv executes a LOCAL_INV work request: the fast-reg MR with that
// key stops being usable until the next REG_MR.
func (d *Device) localInv(q *qp, key uint32) hostverbs.WCStatus {
	m := d.keys[key]
	if m == nil || !m.frmr || m.pd != q.pd {
		return hostverbs.WCLocQPOpErr
	}
	if m.hv != nil {
		if err := m.hv.Dereg(); err != nil {
			return hostverbs.WCLocQPOpErr
		}
		m.hv = nil
	}
	m.valid = false
	return hostverbs.WCSuccess
}
