package vdev

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// The replay of a journal's records (Restore): the replayer applies each
// record as the guest's register write or command was applied, with the
// handles, QPNs and keys it records forced, and checks that the device
// answers what the journal holds. An object the provider cannot take
// back keeps its handle as a tombstone (lost).

// force holds the values a replayed command must produce: the handle,
// QPN and keys the journal recorded, and the last size of a CQ resized
// later in the journal.
type force struct {
	handle, qpn, lkey, rkey, cqe uint32
}

// replayer is a restore in progress (Device.rp): the command handlers ask
// it for the values to force, and for rings to adopt instead of reset.
type replayer struct {
	d         *Device
	rep       *RestoreReport
	force     force
	lostCause error             // why the provider object of the last create is a stand-in
	cqEff     map[int]uint32    // CREATE_CQ record index -> CQEs after its last resize
	broken    map[uint32]error  // QPs a replayed MODIFY_QP failed on
	gidLost   map[uint32]string // GID indices whose binding was refused
	// transport holds, by QP handle, the transport states of the
	// transport records the journal ends with so far; srqRecvs, by SRQ
	// handle, the receives of its SRQ receive records; srqKept the SRQs
	// whose receives were posted again (finish).
	transport map[uint32][]byte
	srqRecvs  map[uint32]*savedRecvs
	srqKept   map[uint32]bool
	// fastRegs holds, by MR handle, the registrations of the fast-reg
	// records the journal ends with so far (finish registers them again).
	fastRegs map[uint32]hostverbs.FastReg
	// lostNotes holds the note that says why each object the replay
	// could not rebuild so far was lost: a later DESTROY of it in the
	// journal (the guest destroyed it before the crash) withdraws the
	// note, since the object is not lost but gone, as the report's counts
	// say.
	lostNotes map[lostKey]string
	extra     int // notes left out
}

// lostKey names an object of a kind by its handle.
type lostKey struct {
	kind   string
	handle uint32
}

// newReplayer prepares the replay of recs on d, reporting to rep.
func newReplayer(d *Device, rep *RestoreReport, recs []jrec) *replayer {
	return &replayer{d: d, rep: rep, cqEff: lastCQSizes(recs), broken: map[uint32]error{}, gidLost: map[uint32]string{},
		transport: map[uint32][]byte{}, srqRecvs: map[uint32]*savedRecvs{}, srqKept: map[uint32]bool{},
		fastRegs: map[uint32]hostverbs.FastReg{}, lostNotes: map[lostKey]string{}}
}

// lastCQSizes returns, by CREATE_CQ record index, the CQEs of the CQs
// resized later in the journal, after their last RESIZE_CQ. A CQ's ring
// runs with that size: the ring is adopted with that geometry when the CQ
// is created (its prod_tail is only valid for it), the resizes then
// change the provider CQ only.
func lastCQSizes(recs []jrec) map[int]uint32 {
	last := map[int]uint32{}
	open := map[uint32]int{}
	for i, r := range recs {
		p := r.payload
		switch {
		case r.typ == recRegister && len(p) == 8:
			reg, v := binary.LittleEndian.Uint32(p), binary.LittleEndian.Uint32(p[4:])
			if reg == abi.RegDSRHigh || (reg == abi.RegCtl && v == abi.CtlReset) {
				clear(open)
			}
		case r.typ == recCommand && len(p) >= abi.CmdHdrSize:
			code := binary.LittleEndian.Uint32(p[abi.CmdHdrCmdOffset:])
			if code >= abi.NumCmds || len(p) != commands[code].reqSize+commands[code].respSize {
				continue // apply refuses it
			}
			c := &commands[code]
			switch code {
			case abi.CmdCreateCQ:
				var resp abi.CreateCQResp
				resp.Decode(p[c.reqSize:])
				open[resp.CQHandle] = i
			case abi.CmdResizeCQ:
				var r abi.ResizeCQ
				r.Decode(p)
				if j, ok := open[r.CQHandle]; ok {
					last[j] = r.CQE
				}
			case abi.CmdDestroyCQ:
				var r abi.HandleReq
				r.Decode(p)
				delete(open, r.Handle)
			}
		}
	}
	return last
}

// note adds a line to the report.
func (rp *replayer) note(format string, args ...any) {
	if len(rp.rep.Notes) < maxNotes-1 {
		rp.rep.Notes = append(rp.rep.Notes, fmt.Sprintf(format, args...))
		return
	}
	rp.extra++
}

// noteLost notes why an object was lost, until the journal destroys it.
func (rp *replayer) noteLost(kind string, h uint32, cause error) {
	n := fmt.Sprintf("%s %d lost: %v", kind, h, cause)
	rp.lostNotes[lostKey{kind, h}] = n
	rp.note("%s", n)
}

// destroyed withdraws the lost note of an object the journal destroys.
func (rp *replayer) destroyed(kind string, h uint32) {
	k := lostKey{kind, h}
	n, ok := rp.lostNotes[k]
	if !ok {
		return
	}
	delete(rp.lostNotes, k)
	if i := slices.Index(rp.rep.Notes, n); i >= 0 {
		rp.rep.Notes = slices.Delete(rp.rep.Notes, i, i+1)
		return
	}
	if rp.extra > 0 {
		rp.extra-- // it was among those left out
	}
}

// replay applies the records in order, with the device in its restore
// mode (Device.rp). A record after the hand-over's records voids them
// (the hand-over did not end there). On an error the device is closed.
func (rp *replayer) replay(recs []jrec) error {
	d := rp.d
	d.rp = rp
	for i, r := range recs {
		if !handoverRecord(r.typ) && rp.handoverPending() {
			rp.voidTransports(r)
		}
		if err := rp.apply(i, r); err != nil {
			d.rp = nil
			d.resetLocked()
			d.closed = true
			d.lim.Flush()
			return fmt.Errorf("vdev: restore: record %d (number %d at byte %d): %w", i, r.seq, r.off, err)
		}
		rp.rep.Records++
	}
	d.rp = nil
	return nil
}

func (rp *replayer) apply(i int, r jrec) error {
	switch r.typ {
	case recRegister:
		return rp.register(r.payload)
	case recTransport:
		return rp.transportRecord(r.payload)
	case recSRQRecvs:
		return rp.srqRecord(r.payload)
	case recFastReg:
		return rp.fastRegRecord(r.payload)
	case recHandoverAbort:
		if len(r.payload) != 0 {
			return fmt.Errorf("hand-over abort record of %d bytes: %w", len(r.payload), ErrJournal)
		}
		return nil
	}
	return rp.command(i, r.payload)
}

// register replays a register write.
func (rp *replayer) register(p []byte) error {
	d := rp.d
	if len(p) != 8 {
		return fmt.Errorf("register record of %d bytes: %w", len(p), ErrJournal)
	}
	reg, v := uint64(binary.LittleEndian.Uint32(p)), binary.LittleEndian.Uint32(p[4:])
	switch reg {
	case abi.RegDSRLow, abi.RegDSRHigh:
		if d.active {
			return fmt.Errorf("DSR write while the device is active: %w", ErrJournal)
		}
	case abi.RegCtl:
		switch {
		case v != abi.CtlActivate && v != abi.CtlReset:
			return fmt.Errorf("CTL %d: %w", v, ErrJournal)
		case v == abi.CtlActivate && d.dsr == nil:
			return fmt.Errorf("activate: %w", rp.noDSR())
		}
	case abi.RegIMR, abi.RegMACL, abi.RegMACH:
	default:
		return fmt.Errorf("register %#x: %w", reg, ErrJournal)
	}
	d.writeReg(reg, v)
	if reg == abi.RegDSRHigh && d.dsr == nil {
		rp.note("device shared region not loaded again: %v", d.fault)
	}
	return nil
}

// noDSR explains why a record that needs the DSR cannot be replayed: the
// guest memory no longer holds a DSR the device accepts (the fault), or
// the journal never loaded one.
func (rp *replayer) noDSR() error {
	if f := rp.d.fault; f != nil {
		return fmt.Errorf("the device shared region could not be loaded again: %w", f)
	}
	return fmt.Errorf("no device shared region loaded: %w", ErrJournal)
}

// checkCaps compares the capabilities the device would report with those
// the guest read at probe (still in its DSR): a daemon restarted with
// other limits or another provider may have to refuse what the guest
// believes it may do.
func (rp *replayer) checkCaps(caps []byte, gpa guestmem.GPA) {
	old := make([]byte, len(caps))
	if err := rp.d.mem.ReadAt(old, gpa); err != nil || !bytes.Equal(old, caps) {
		rp.note("the capabilities differ from those the guest read at probe")
	}
}

// checkNew checks the handle a create record names: in the table's range
// and free.
func checkNew[T comparable](t *table[T], h uint32, kind string) error {
	if h < t.first || h >= t.max {
		return fmt.Errorf("%s handle %d outside [%d, %d): %w", kind, h, t.first, t.max, ErrJournal)
	}
	if _, ok := t.get(h); ok {
		return fmt.Errorf("%s handle %d created twice: %w", kind, h, ErrJournal)
	}
	return nil
}

// checkLive checks the handle a record names: an object of the journal.
func checkLive[T comparable](t *table[T], h uint32, kind string) error {
	if _, ok := t.get(h); !ok {
		return fmt.Errorf("%s %d does not exist: %w", kind, h, ErrJournal)
	}
	return nil
}

// command replays a command record: the request runs as the guest's did,
// with the recorded handle, QPN and keys forced, and must produce the
// recorded response.
func (rp *replayer) command(i int, p []byte) error {
	d := rp.d
	c, code, err := rp.commandOf(p)
	if err != nil {
		return err
	}
	payload := append([]byte(nil), p...)
	req, want := payload[:c.reqSize], payload[c.reqSize:]
	clear(want[:abi.RespHdrSize]) // the dispatcher's, not the command's
	rp.force, rp.lostCause = force{}, nil
	h, create, err := rp.expect(i, code, req, want)
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	rp.force.handle = h
	out := d.resp[:c.respSize]
	clear(out)
	err = c.run(d, req, out)
	if err == nil {
		if !bytes.Equal(out, want) {
			return fmt.Errorf("%s: the device answers %x, the journal %x: %w", c.name, out, want, ErrJournal)
		}
		d.keep(code, payload, c.reqSize)
		rp.succeeded(code, req, h)
		return nil
	}
	if create {
		// What a checkpoint repeats is what the create would answer.
		canonicalResp(code, req, want)
		return rp.tombstone(code, req, want, payload, h, err)
	}
	return rp.failed(code, req, h, fmt.Errorf("%s: %w", c.name, err))
}

// commandOf checks a command record's frame: a command the journal
// holds, with its request and response sizes, and a DSR to run it on.
func (rp *replayer) commandOf(p []byte) (*command, uint32, error) {
	if len(p) < abi.CmdHdrSize {
		return nil, 0, fmt.Errorf("command record of %d bytes: %w", len(p), ErrJournal)
	}
	var hdr abi.CmdHdr
	hdr.Decode(p)
	if !journaledCmd(hdr.Cmd) {
		return nil, 0, fmt.Errorf("command %d in the journal: %w", hdr.Cmd, ErrJournal)
	}
	c := &commands[hdr.Cmd]
	if len(p) != c.reqSize+c.respSize {
		return nil, 0, fmt.Errorf("%s record of %d bytes (%d+%d): %w", c.name, len(p), c.reqSize, c.respSize, ErrJournal)
	}
	if rp.d.dsr == nil {
		return nil, 0, fmt.Errorf("%s: %w", c.name, rp.noDSR())
	}
	return c, hdr.Cmd, nil
}

// expect reads what the record of command code says the command does:
// the handle it creates (checked free, with the QPN, keys and CQ size to
// force) or the object it names (checked live).
func (rp *replayer) expect(i int, code uint32, req, want []byte) (h uint32, create bool, err error) {
	d := rp.d
	switch code {
	case abi.CmdCreatePD:
		var r abi.CreatePDResp
		r.Decode(want)
		h, create, err = r.PDHandle, true, checkNew(&d.pds, r.PDHandle, "PD")
	case abi.CmdCreateMR:
		var r abi.CreateMRResp
		r.Decode(want)
		h, create, err = r.MRHandle, true, checkNew(&d.mrs, r.MRHandle, "MR")
		rp.force.lkey, rp.force.rkey = r.LKey, r.RKey
		var q abi.CreateMR
		q.Decode(req)
		if err == nil && q.Flags == abi.MRFlagFRMR {
			err = rp.checkFRMRKey(r.LKey, r.RKey)
		}
	case abi.CmdCreateCQ:
		var r abi.CreateCQResp
		r.Decode(want)
		h, create, err = r.CQHandle, true, checkNew(&d.cqs, r.CQHandle, "CQ")
		rp.force.cqe = rp.cqEff[i]
	case abi.CmdCreateQP:
		var r abi.CreateQPResp
		r.Decode(want)
		h, create, err = r.QPHandle, true, checkNew(&d.qps, r.QPHandle, "QP")
		rp.force.qpn = r.QPN
	case abi.CmdCreateSRQ:
		var r abi.CreateSRQResp
		r.Decode(want)
		h, create, err = r.SRQN, true, checkNew(&d.srqs, r.SRQN, "SRQ")
	case abi.CmdModifyQP:
		// The state the guest believed current may be one a completion
		// or event set, which the journal does not hold: the replayed
		// state is the truth here.
		mask := binary.LittleEndian.Uint32(req[20:])
		binary.LittleEndian.PutUint32(req[20:], mask&^uint32(hostverbs.AttrCurState))
		h = binary.LittleEndian.Uint32(req[16:])
		err = checkLive(&d.qps, h, "QP")
	case abi.CmdDestroyQP:
		h = reqHandle(req)
		err = checkLive(&d.qps, h, "QP")
	case abi.CmdDestroyPD:
		h = reqHandle(req)
		err = checkLive(&d.pds, h, "PD")
	case abi.CmdDestroyMR:
		h = reqHandle(req)
		err = checkLive(&d.mrs, h, "MR")
	case abi.CmdResizeCQ, abi.CmdDestroyCQ:
		h = reqHandle(req)
		err = checkLive(&d.cqs, h, "CQ")
	case abi.CmdModifySRQ, abi.CmdDestroySRQ:
		h = reqHandle(req)
		err = checkLive(&d.srqs, h, "SRQ")
	case abi.CmdDestroyUC:
		h = reqHandle(req)
		err = checkLive(&d.ucs, h, "context")
	}
	return h, create, err
}

// checkFRMRKey checks the key of a fast-reg MR, which its provider chose:
// the same lkey and rkey (the base key), whose index no MR holds.
func (rp *replayer) checkFRMRKey(lkey, rkey uint32) error {
	d := rp.d
	if rkey != lkey || lkey>>8 == 0 {
		return fmt.Errorf("fast-reg MR keys %#x/%#x: %w", lkey, rkey, ErrJournal)
	}
	_, taken := d.keys[lkey]
	_, takenFR := d.frmrs[lkey>>8]
	if taken || takenFR {
		return fmt.Errorf("fast-reg MR key %#x in use: %w", lkey, ErrJournal)
	}
	return nil
}

// succeeded notes what a replayed command that worked tells the report.
func (rp *replayer) succeeded(code uint32, req []byte, h uint32) {
	switch code {
	case abi.CmdCreateQP:
		if rp.lostCause != nil {
			rp.noteLost("QP", h, rp.lostCause)
		}
	case abi.CmdDestroyPD:
		rp.destroyed("PD", h)
	case abi.CmdDestroyMR:
		rp.destroyed("MR", h)
	case abi.CmdDestroyCQ:
		rp.destroyed("CQ", h)
	case abi.CmdDestroyQP:
		rp.destroyed("QP", h)
	case abi.CmdDestroySRQ:
		rp.destroyed("SRQ", h)
	case abi.CmdCreateBind:
		var r abi.CreateBind
		r.Decode(req)
		delete(rp.gidLost, r.Index)
	case abi.CmdDestroyBind:
		var r abi.DestroyBind
		r.Decode(req)
		delete(rp.gidLost, r.Index)
	}
}

// failed handles a replayed command (not a create) the device refused.
// A destroy whose object stays, or a context command, means the journal
// contradicts itself; the rest leaves the object as the replay has it.
func (rp *replayer) failed(code uint32, req []byte, h uint32, err error) error {
	d := rp.d
	switch code {
	case abi.CmdModifyQP:
		if q, ok := d.qps.get(h); ok && !isLost(q.hv) {
			rp.broken[h] = err
		}
	case abi.CmdCreateBind:
		var r abi.CreateBind
		r.Decode(req)
		rp.gidLost[r.Index] = err.Error()
		rp.note("GID %d not bound: %v", r.Index, err)
	case abi.CmdResizeCQ, abi.CmdModifySRQ, abi.CmdDestroyBind:
		rp.note("%v", err)
	case abi.CmdDestroyPD, abi.CmdDestroyCQ, abi.CmdDestroyQP, abi.CmdDestroySRQ:
		if !d.goneAnyway(code, req) {
			return fmt.Errorf("%w (%w)", err, ErrJournal)
		}
		rp.note("%v", err)
	default:
		return fmt.Errorf("%w (%w)", err, ErrJournal)
	}
	return nil
}

// tombstone keeps the handle of an object whose create the replay could
// not repeat: a lost object that fails commands (DESTROY excepted) and
// ignores doorbells. The objects it names must exist (lost or not).
func (rp *replayer) tombstone(code uint32, req, want, payload []byte, h uint32, cause error) error {
	d := rp.d
	kind := ""
	switch code {
	case abi.CmdCreatePD:
		var r abi.CreatePD
		r.Decode(req)
		uar, err := d.context(r.CtxHandle)
		if err != nil {
			return fmt.Errorf("CREATE_PD %d: %w (%w)", h, err, ErrJournal)
		}
		if !d.pds.set(h, &pd{handle: h, uar: uar, hv: lostPD{}}) {
			return fmt.Errorf("PD handle %d: %w", h, ErrJournal)
		}
		kind = "PD"
	case abi.CmdCreateMR:
		var r abi.CreateMR
		r.Decode(req)
		p, err := d.pd(r.PDHandle)
		if err != nil {
			return fmt.Errorf("CREATE_MR %d: %w (%w)", h, err, ErrJournal)
		}
		var resp abi.CreateMRResp
		resp.Decode(want)
		if !d.mrs.set(h, &mr{handle: h, pd: p, lkey: resp.LKey, rkey: resp.RKey, lost: true, rec: payload}) {
			return fmt.Errorf("MR handle %d: %w", h, ErrJournal)
		}
		p.refs++
		kind = "MR"
	case abi.CmdCreateCQ:
		var r abi.CreateCQ
		r.Decode(req)
		uar, err := d.context(r.CtxHandle)
		if err != nil {
			return fmt.Errorf("CREATE_CQ %d: %w (%w)", h, err, ErrJournal)
		}
		if !d.cqs.set(h, &cq{dev: d, handle: h, uar: uar, hv: lostCQ{}, dead: true, rec: payload}) {
			return fmt.Errorf("CQ handle %d: %w", h, ErrJournal)
		}
		kind = "CQ"
	case abi.CmdCreateSRQ:
		var r abi.CreateSRQ
		r.Decode(req)
		p, err := d.pd(r.PDHandle)
		if err != nil {
			return fmt.Errorf("CREATE_SRQ %d: %w (%w)", h, err, ErrJournal)
		}
		s := &srq{handle: h, pd: p, uar: p.uar, hv: lostSRQ{}, maxWR: r.Attrs.MaxWR, maxSGE: r.Attrs.MaxSGE, rec: payload}
		if !d.srqs.set(h, s) {
			return fmt.Errorf("SRQ handle %d: %w", h, ErrJournal)
		}
		p.refs++
		kind = "SRQ"
	case abi.CmdCreateQP:
		if err := rp.qpTombstone(req, want, payload, h); err != nil {
			return err
		}
		kind = "QP"
	}
	rp.noteLost(kind, h, cause)
	return nil
}

// canonicalResp rewrites the recorded response of a create the replay
// could not repeat as the device would have answered it: the handle, QPN
// and keys recorded, the rest derived from the request.
func canonicalResp(code uint32, req, resp []byte) {
	switch code {
	case abi.CmdCreatePD:
		var r abi.CreatePDResp
		r.Decode(resp)
		abi.CreatePDResp{PDHandle: r.PDHandle}.Encode(resp)
	case abi.CmdCreateMR:
		var r abi.CreateMRResp
		r.Decode(resp)
		abi.CreateMRResp{MRHandle: r.MRHandle, LKey: r.LKey, RKey: r.RKey}.Encode(resp)
	case abi.CmdCreateCQ:
		var r abi.CreateCQResp
		r.Decode(resp)
		var q abi.CreateCQ
		q.Decode(req)
		abi.CreateCQResp{CQHandle: r.CQHandle, CQE: q.CQE}.Encode(resp)
	case abi.CmdCreateSRQ:
		var r abi.CreateSRQResp
		r.Decode(resp)
		abi.CreateSRQResp{SRQN: r.SRQN}.Encode(resp)
	case abi.CmdCreateQP:
		var r abi.CreateQPResp
		r.Decode(resp)
		var q abi.CreateQP
		q.Decode(req)
		c := abi.CreateQPResp{QPN: r.QPN, QPHandle: r.QPHandle, MaxSendWR: q.MaxSendWR, MaxRecvWR: q.MaxRecvWR,
			MaxSendSGE: q.MaxSendSGE, MaxRecvSGE: q.MaxRecvSGE}
		if q.IsSRQ != 0 {
			c.MaxRecvWR, c.MaxRecvSGE = 0, 0
		}
		c.Encode(resp)
	}
}

// qpTombstone keeps a QP's handle, QPN and objects without rings.
func (rp *replayer) qpTombstone(req, want, payload []byte, h uint32) error {
	d := rp.d
	var r abi.CreateQP
	r.Decode(req)
	var resp abi.CreateQPResp
	resp.Decode(want)
	typ := hostverbs.QPType(r.QPType)
	p, err := d.pd(r.PDHandle)
	var scq, rcq *cq
	var s *srq
	if err == nil {
		scq, err = d.cqOrLost(r.SendCQHandle)
	}
	if err == nil {
		rcq, err = d.cqOrLost(r.RecvCQHandle)
	}
	if err == nil && r.IsSRQ != 0 {
		s, err = d.srq(r.SRQHandle)
	}
	switch {
	case err != nil:
	case typ != hostverbs.QPTypeRC && typ != hostverbs.QPTypeUD && typ != hostverbs.QPTypeGSI:
		err = fmt.Errorf("QP type %d", r.QPType)
	case typ == hostverbs.QPTypeGSI && d.gsi != nil:
		err = errors.New("a second GSI QP")
	}
	if err != nil {
		return fmt.Errorf("CREATE_QP %d: %w (%w)", h, err, ErrJournal)
	}
	q := &qp{dev: d, typ: typ, pd: p, scq: scq, rcq: rcq, srq: s, uar: p.uar, hv: lostQP{qpn: resp.QPN},
		sendWR: resp.MaxSendWR, recvWR: resp.MaxRecvWR, sendSGE: resp.MaxSendSGE, recvSGE: resp.MaxRecvSGE,
		sigAll: r.SQSigAll != 0, rec: payload}
	if !d.qps.set(h, q) {
		return fmt.Errorf("QP handle %d: %w", h, ErrJournal)
	}
	d.qpGen++
	q.handle, q.gen = h, d.qpGen
	q.state.Store(uint32(hostverbs.QPStateErr))
	d.attachQP(q, p, scq, rcq, s)
	return nil
}

// cqOrLost returns the CQ with handle h, lost or not.
func (d *Device) cqOrLost(h uint32) (*cq, error) {
	c, ok := d.cqs.get(h)
	if !ok {
		return nil, fmt.Errorf("CQ %d: %w", h, ErrBadHandle)
	}
	return c, nil
}

// reqHandle is the handle a request of the HandleReq layout names.
func reqHandle(req []byte) uint32 {
	var r abi.HandleReq
	r.Decode(req)
	return r.Handle
}
