package vdev

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// uctx is a user context: one UAR page of BAR2, whose index is also the
// context's handle (index 0 is the kernel's and has no context).
type uctx struct{ uar uint32 }

// pd is a protection domain.
type pd struct {
	handle uint32
	uar    uint32 // UAR page its context may ring doorbells on (0: kernel)
	hv     hostverbs.PD
	refs   int // MRs, QPs and SRQs in it
}

const portNum = 1

func (d *Device) cmdQueryPort(req, resp []byte) error {
	var r abi.QueryPort
	r.Decode(req)
	if r.PortNum != portNum {
		return fmt.Errorf("port %d: %w", r.PortNum, syscall.EINVAL)
	}
	pa, err := d.verbs.QueryPort(portNum)
	if err != nil {
		return fmt.Errorf("query port: %w", err)
	}
	a := abi.PortAttr{
		State: uint32(pa.State), MaxMTU: uint32(pa.MaxMTU), ActiveMTU: uint32(pa.ActiveMTU),
		GIDTblLen: d.caps.GIDTblLen, PortCapFlags: pa.PortCapFlags, MaxMsgSz: pa.MaxMsgSize,
		BadPKeyCntr: pa.BadPKeyCntr, QKeyViolCntr: pa.QKeyViolCntr, PKeyTblLen: 1,
		LMC: pa.LMC, MaxVLNum: max(pa.MaxVLNum, 1), SMSL: pa.SMSL, SubnetTimeout: pa.SubnetTimeout,
		InitTypeRepl: pa.InitTypeReply, ActiveWidth: max(pa.ActiveWidth, 1), ActiveSpeed: max(pa.ActiveSpeed, 1),
		PhysState: pa.PhysState,
	}
	if a.PhysState == 0 && pa.State == hostverbs.PortActive {
		a.PhysState = 5 // LinkUp
	}
	abi.QueryPortResp{Attrs: a}.Encode(resp)
	return nil
}

func (d *Device) cmdQueryPKey(req, resp []byte) error {
	var r abi.QueryPKey
	r.Decode(req)
	if r.PortNum != portNum || r.Index != 0 {
		return fmt.Errorf("port %d pkey index %d: %w", r.PortNum, r.Index, syscall.EINVAL)
	}
	abi.QueryPKeyResp{PKey: 0xFFFF}.Encode(resp)
	return nil
}

// cmdCreateUC binds a user context to the UAR page whose frame number the
// driver passes: UAR page index = pfn - DSR uar_pfn, in [1, max_uar).
func (d *Device) cmdCreateUC(req, resp []byte) error {
	var r abi.CreateUC
	r.Decode(req)
	idx := r.PFN - d.dsr.uarPFN
	if r.PFN < d.dsr.uarPFN || idx == 0 || idx >= uint64(d.caps.MaxUAR) {
		return fmt.Errorf("UAR pfn %#x (BAR2 at pfn %#x, %d pages): %w", r.PFN, d.dsr.uarPFN, d.caps.MaxUAR, syscall.EINVAL)
	}
	if !d.ucs.set(uint32(idx), &uctx{uar: uint32(idx)}) {
		return fmt.Errorf("UAR page %d already in use: %w", idx, syscall.EBUSY)
	}
	if d.uarm != nil && d.uarm.mem != nil && d.rp == nil {
		// (A restore's replay keeps what the guest stored there: doorbells
		// the previous daemon had not seen yet.)
		d.uarm.clearPage(uint32(idx))
	}
	abi.CreateUCResp{CtxHandle: uint32(idx)}.Encode(resp)
	return nil
}

func (d *Device) cmdDestroyUC(req, resp []byte) error {
	var r abi.DestroyUC
	r.Decode(req)
	if _, ok := d.ucs.get(r.CtxHandle); !ok {
		return fmt.Errorf("context %d: %w", r.CtxHandle, ErrBadHandle)
	}
	d.ucs.free(r.CtxHandle)
	return nil
}

// context validates a context handle from a command: 0 is the kernel's.
func (d *Device) context(h uint32) (uint32, error) {
	if h == 0 {
		return 0, nil
	}
	if _, ok := d.ucs.get(h); !ok {
		return 0, fmt.Errorf("context %d: %w", h, ErrBadHandle)
	}
	return h, nil
}

func (d *Device) cmdCreatePD(req, resp []byte) error {
	var r abi.CreatePD
	r.Decode(req)
	uar, err := d.context(r.CtxHandle)
	if err != nil {
		return err
	}
	p := &pd{uar: uar}
	h, ok := allocHandle(d, &d.pds, p)
	if !ok {
		return fmt.Errorf("%d PDs: %w", d.pds.len(), ErrLimit)
	}
	p.handle = h
	if p.hv, err = d.verbs.AllocPD(); err != nil {
		d.pds.free(h)
		return fmt.Errorf("alloc PD: %w", err)
	}
	abi.CreatePDResp{PDHandle: h}.Encode(resp)
	return nil
}

func (d *Device) cmdDestroyPD(req, resp []byte) error {
	var r abi.DestroyPD
	r.Decode(req)
	p, ok := d.pds.get(r.PDHandle)
	if !ok {
		return fmt.Errorf("PD %d: %w", r.PDHandle, ErrBadHandle)
	}
	if p.refs > 0 {
		return fmt.Errorf("PD %d has %d objects: %w", r.PDHandle, p.refs, syscall.EBUSY)
	}
	return d.destroyPD(p)
}

func (d *Device) destroyPD(p *pd) error {
	d.pds.free(p.handle)
	if err := p.hv.Dealloc(); err != nil {
		d.lim.Warn("free-pd", "pvrdma: provider refused to free a PD", "pd", p.handle, "err", err)
		return fmt.Errorf("dealloc PD: %w", err)
	}
	return nil
}

// pd validates a PD handle from a command.
func (d *Device) pd(h uint32) (*pd, error) {
	p, ok := d.pds.get(h)
	if !ok {
		return nil, fmt.Errorf("PD %d: %w", h, ErrBadHandle)
	}
	return p, nil
}

// cmdCreateBind installs one of the guest's GIDs (from its vmxnet3
// addresses, sent by ib_core's add_gid) in the provider, binding that
// address to this VM on its fabric.
func (d *Device) cmdCreateBind(req, resp []byte) error {
	var r abi.CreateBind
	r.Decode(req)
	if r.Index >= uint32(len(d.gids)) {
		return fmt.Errorf("GID index %d of %d: %w", r.Index, len(d.gids), syscall.EINVAL)
	}
	typ := hostverbs.GIDType(r.GIDType)
	if typ != hostverbs.GIDTypeRoCEv1 && typ != hostverbs.GIDTypeRoCEv2 {
		return fmt.Errorf("GID type %d: %w", r.GIDType, syscall.EINVAL)
	}
	if d.caps.GIDTypes&(1<<(typ-1)) == 0 {
		// The device offers one RoCE version (caps gid_types).
		return fmt.Errorf("%v GID on a device of GID types %#x: %w", typ, d.caps.GIDTypes, syscall.EINVAL)
	}
	e := hostverbs.GIDEntry{GID: hostverbs.GID(r.NewGID), Type: typ}
	if e.GID.IsZero() {
		return fmt.Errorf("zero GID: %w", syscall.EINVAL)
	}
	prev := d.gids[r.Index]
	if prev.bound && prev.entry == e {
		return nil
	}
	if d.checkGID != nil {
		if err := d.checkGID(int(r.Index), e); err != nil {
			// Refused by the VM's policy: the index keeps what it had.
			d.stats.gidRefusals.Add(1)
			var en syscall.Errno
			if !errors.As(err, &en) {
				err = fmt.Errorf("%w (%w)", err, syscall.EPERM)
			}
			return fmt.Errorf("bind GID %d: %w", r.Index, err)
		}
	}
	if prev.bound {
		d.unbindGID(int(r.Index))
	}
	if err := d.verbs.SetGID(int(r.Index), e); err != nil {
		// A refused command changes nothing: the index keeps the GID it
		// had (say, when another VM owns the new one).
		if prev.bound && d.verbs.SetGID(int(r.Index), prev.entry) == nil {
			d.gids[r.Index] = prev
			if d.onGID != nil {
				d.onGID(int(r.Index), prev.entry, true)
			}
		} else if prev.bound {
			d.journalUnbind(r.Index, prev.entry.GID) // the index lost its GID
		}
		return fmt.Errorf("set GID %d %v: %w", r.Index, e.GID, err)
	}
	d.gids[r.Index] = gidSlot{bound: true, entry: e}
	if d.onGID != nil {
		d.onGID(int(r.Index), e, true)
	}
	return nil
}

func (d *Device) cmdDestroyBind(req, resp []byte) error {
	var r abi.DestroyBind
	r.Decode(req)
	if r.Index >= uint32(len(d.gids)) || !d.gids[r.Index].bound {
		return fmt.Errorf("GID index %d not bound: %w", r.Index, syscall.EINVAL)
	}
	if d.gids[r.Index].entry.GID != hostverbs.GID(r.DestGID) {
		return fmt.Errorf("GID index %d holds %v, not %v: %w", r.Index, d.gids[r.Index].entry.GID,
			hostverbs.GID(r.DestGID), syscall.EINVAL)
	}
	d.unbindGID(int(r.Index))
	return nil
}

func (d *Device) unbindGID(i int) {
	e := d.gids[i].entry
	d.gids[i] = gidSlot{}
	if err := d.verbs.ClearGID(i); err != nil {
		d.lim.Warn("clear-gid", "pvrdma: provider refused to clear a GID", "index", i, "err", err)
	}
	if d.onGID != nil {
		d.onGID(i, e, false)
	}
}

// GIDs returns the GID table the guest has bound (unbound slots zero).
func (d *Device) GIDs() []hostverbs.GIDEntry {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]hostverbs.GIDEntry, len(d.gids))
	for i, g := range d.gids {
		if g.bound {
			out[i] = g.entry
		}
	}
	return out
}
