package vdev

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// ErrJournal: a journal Restore was given is malformed or contradicts
// itself (a record that is not the last is damaged, numbers skip, a
// handle is created twice or used before it exists).
var ErrJournal = errors.New("corrupt device journal")

// errLost is what the guest sees for an object a restore could not
// rebuild: commands on it fail (but DESTROY), doorbells are ignored.
var errLost = fmt.Errorf("object lost when the daemon restarted: %w", syscall.EIO)

// ObjectCounts counts objects by kind.
type ObjectCounts struct {
	UC, PD, MR, CQ, QP, SRQ, GID int
}

// Total is the number of objects counted.
func (c ObjectCounts) Total() int { return c.UC + c.PD + c.MR + c.CQ + c.QP + c.SRQ + c.GID }

// RestoreReport says what Restore did, for the daemon's log.
type RestoreReport struct {
	// Records is the number of journal records applied; Duplicates the
	// number skipped because a checkpoint before them held them already.
	Records, Duplicates int
	// ValidBytes is the length of the journal's sound prefix: a record
	// torn by the crash (Torn) starts there. Truncate the file to it
	// before appending to it.
	ValidBytes int
	Torn       bool
	// Rebuilt counts the objects live again under the handles the guest
	// knows, with the same QPNs and keys (the QPs moved to ERR included).
	Rebuilt ObjectCounts
	// Errored is the number of QPs Restore moved to ERR, each with a
	// QP_FATAL event, its outstanding work requests flushed: RC QPs and
	// QPs on an SRQ that were past RESET (their peers' state is gone)
	// but those continued, and QPs whose replayed MODIFY_QP the device or
	// provider refused.
	Errored int
	// Continued is the number of RC QPs that kept their connection: the
	// journal ends with their transport state (SaveTransports, a planned
	// hand-over), which the provider took back, and, for a QP on an SRQ,
	// with its SRQ's receives. They stay in their state without an event;
	// their outstanding receives and the sends the old device had not
	// posted are posted.
	Continued int
	// SRQRecvs is the number of receives SRQs held in the old provider
	// that the journal ends with (SaveTransports) and that were posted
	// again.
	SRQRecvs int
	// Lost counts the objects Restore could not rebuild: the provider
	// refused them (it cannot take given QPNs or keys, or lacks
	// resources), their guest memory no longer holds what they need, or
	// they depend on a lost object. Their handles stay reserved so that
	// the guest's DESTROY succeeds; every lost QP got a QP_FATAL event,
	// CQ a CQ_ERR and SRQ an SRQ_ERR. GIDs count the bindings refused.
	Lost ObjectCounts
	// Notes say why objects were lost or errored and what was ignored (a
	// torn record); at most 32, the last one counting those left out.
	Notes []string
}

const maxNotes = 32

// Restore builds a device for a guest whose previous device died with
// the daemon, from that device's journal (the records Config.Journal
// received, or a Checkpoint followed by them): the registers and DSR,
// whose rings are adopted with the indices the guest memory holds (no
// index is reset or rewritten), then every object with exactly the handle,
// QPN and keys the guest knows, page directories read again from guest
// memory. The journal crossed a process boundary and is untrusted: every
// record is checked as the guest's command was, within the same limits
// and budgets. A torn last record is ignored (RestoreReport.Torn); any
// other damage or contradiction fails with an error wrapping ErrJournal.
//
// Afterwards RC QPs and QPs on an SRQ that were past RESET are moved to
// ERR with a QP_FATAL event and their outstanding work requests flushed,
// but for RC QPs whose transport state the journal ends with (a planned
// hand-over: SaveTransports, and no record after it but other hand-over
// records): the provider QP gets that state back (RestoreTransport) and
// the QP keeps its state and connection (RestoreReport.Continued; one the
// provider refuses goes to ERR, with a note); UD and GSI QPs keep their
// state. The receives the journal ends with for an SRQ (the hand-over's
// SRQ receive records) are posted to it again first; an RC QP on an SRQ
// continues only if they were. The outstanding work requests of the QPs that keep their state
// are posted. Objects the provider cannot take back are kept as lost (see
// RestoreReport.Lost). Every CQ is armed, and one holding unread CQEs
// notified, so that no waiter misses a notification lost in the crash.
//
// Restore does not call Config.Journal for what it replays: the caller
// writes the returned device's Checkpoint as its new journal before the
// device serves the guest, then appends the records the device emits,
// numbered after the journal's. On error nothing of the device remains.
func Restore(cfg Config, journal []byte) (*Device, RestoreReport, error) {
	var rep RestoreReport
	recs, last, err := parseJournal(journal, &rep)
	if err != nil {
		return nil, rep, fmt.Errorf("vdev: restore: %w", err)
	}
	d, err := New(cfg)
	if err != nil {
		return nil, rep, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	rp := newReplayer(d, &rep, recs)
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
			return nil, rep, fmt.Errorf("vdev: restore: record %d (number %d at byte %d): %w", i, r.seq, r.off, err)
		}
		rep.Records++
	}
	d.rp = nil
	d.seq = last
	rp.finish()
	return d, rep, nil
}

// jrec is one framed journal record.
type jrec struct {
	typ     uint8
	flags   uint16
	seq     uint64
	payload []byte
	off     int
}

// parseJournal frames and checks the records of a journal and returns
// those to apply, in order, and the number of the last one.
func parseJournal(b []byte, rep *RestoreReport) ([]jrec, uint64, error) {
	var framed []jrec
	off := 0
	for off < len(b) {
		rest := b[off:]
		if len(rest) < recHdrSize {
			rep.Torn = true
			break
		}
		h, magic := decodeRecHeader(rest)
		if !magic && allZero(rest) {
			rep.Torn = true // a tail the file system extended but never wrote
			break
		}
		switch {
		case !magic:
			return nil, 0, fmt.Errorf("byte %d: no record: %w", off, ErrJournal)
		case h.version != JournalVersion:
			return nil, 0, fmt.Errorf("byte %d: record format version %d (this is %d): %w", off, h.version, JournalVersion, ErrJournal)
		case h.length > recPayloadLimit(h.typ):
			return nil, 0, fmt.Errorf("byte %d: record of %d bytes (at most %d): %w", off, h.length, recPayloadLimit(h.typ), ErrJournal)
		}
		end := recHdrSize + int(h.length)
		if end > len(rest) {
			rep.Torn = true
			break
		}
		if recordCRC(rest[:recHdrSize], rest[recHdrSize:end]) != h.crc {
			if end == len(rest) {
				rep.Torn = true // the last record, partly written
				break
			}
			return nil, 0, fmt.Errorf("byte %d: record checksum mismatch: %w", off, ErrJournal)
		}
		framed = append(framed, jrec{typ: h.typ, flags: h.flags, seq: h.seq, payload: rest[recHdrSize:end], off: off})
		off += end
	}
	rep.ValidBytes = off
	if rep.Torn {
		rep.Notes = append(rep.Notes, fmt.Sprintf("the last record (%d bytes at byte %d) was cut short by the crash and ignored", len(b)-off, off))
	}

	var out []jrec
	var last uint64
	snapLeft := 0
	for i, r := range framed {
		switch {
		case r.typ == recCheckpoint:
			if i != 0 || r.flags != 0 || len(r.payload) != 4 {
				return nil, 0, fmt.Errorf("byte %d: misplaced or malformed checkpoint record: %w", r.off, ErrJournal)
			}
			snapLeft = int(binary.LittleEndian.Uint32(r.payload))
			last = r.seq
			continue
		case r.typ != recCommand && r.typ != recRegister && !handoverRecord(r.typ) && r.typ != recHandoverAbort:
			return nil, 0, fmt.Errorf("byte %d: record type %d: %w", r.off, r.typ, ErrJournal)
		case r.flags == recFlagSnapshot:
			if snapLeft == 0 || r.seq != last || r.typ == recHandoverAbort {
				return nil, 0, fmt.Errorf("byte %d: snapshot record outside its checkpoint: %w", r.off, ErrJournal)
			}
			snapLeft--
			out = append(out, r)
			continue
		case r.flags != 0:
			return nil, 0, fmt.Errorf("byte %d: record flags %#x: %w", r.off, r.flags, ErrJournal)
		case snapLeft > 0:
			return nil, 0, fmt.Errorf("byte %d: checkpoint ends %d records early: %w", r.off, snapLeft, ErrJournal)
		}
		switch {
		case r.seq == 0:
			return nil, 0, fmt.Errorf("byte %d: record number 0: %w", r.off, ErrJournal)
		case r.seq <= last:
			rep.Duplicates++ // a checkpoint holds it
		case r.seq != last+1:
			return nil, 0, fmt.Errorf("byte %d: record %d follows record %d: %d missing: %w", r.off, r.seq, last, r.seq-last-1, ErrJournal)
		default:
			last = r.seq
			out = append(out, r)
		}
	}
	if snapLeft > 0 {
		return nil, 0, fmt.Errorf("checkpoint lacks %d records: %w", snapLeft, ErrJournal)
	}
	return out, last, nil
}

// recPayloadLimit is the largest payload a record of type typ may have.
func recPayloadLimit(typ uint8) uint32 {
	switch typ {
	case recTransport:
		return maxTransportPayload
	case recSRQRecvs:
		return maxSRQRecPayload
	}
	return maxRecPayload
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

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
	extra     int // notes left out
}

func newReplayer(d *Device, rep *RestoreReport, recs []jrec) *replayer {
	rp := &replayer{d: d, rep: rep, cqEff: map[int]uint32{}, broken: map[uint32]error{}, gidLost: map[uint32]string{},
		transport: map[uint32][]byte{}, srqRecvs: map[uint32]*savedRecvs{}, srqKept: map[uint32]bool{}}
	// A CQ's ring runs with the size of its last RESIZE_CQ: the ring is
	// adopted with that geometry when the CQ is created (its prod_tail is
	// only valid for it), the resizes then change the provider CQ only.
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
					rp.cqEff[j] = r.CQE
				}
			case abi.CmdDestroyCQ:
				var r abi.HandleReq
				r.Decode(p)
				delete(open, r.Handle)
			}
		}
	}
	return rp
}

// note adds a line to the report.
func (rp *replayer) note(format string, args ...any) {
	if len(rp.rep.Notes) < maxNotes-1 {
		rp.rep.Notes = append(rp.rep.Notes, fmt.Sprintf(format, args...))
		return
	}
	rp.extra++
}

func (rp *replayer) apply(i int, r jrec) error {
	switch r.typ {
	case recRegister:
		return rp.register(r.payload)
	case recTransport:
		return rp.transportRecord(r.payload)
	case recSRQRecvs:
		return rp.srqRecord(r.payload)
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
	if len(p) < abi.CmdHdrSize {
		return fmt.Errorf("command record of %d bytes: %w", len(p), ErrJournal)
	}
	var hdr abi.CmdHdr
	hdr.Decode(p)
	if !journaledCmd(hdr.Cmd) {
		return fmt.Errorf("command %d in the journal: %w", hdr.Cmd, ErrJournal)
	}
	c := &commands[hdr.Cmd]
	if len(p) != c.reqSize+c.respSize {
		return fmt.Errorf("%s record of %d bytes (%d+%d): %w", c.name, len(p), c.reqSize, c.respSize, ErrJournal)
	}
	if d.dsr == nil {
		return fmt.Errorf("%s: %w", c.name, rp.noDSR())
	}
	payload := append([]byte(nil), p...)
	req, want := payload[:c.reqSize], payload[c.reqSize:]
	clear(want[:abi.RespHdrSize]) // the dispatcher's, not the command's
	rp.force, rp.lostCause = force{}, nil
	var h uint32
	var err error
	create := false
	switch hdr.Cmd {
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
		d.keep(hdr.Cmd, payload, c.reqSize)
		rp.succeeded(hdr.Cmd, req, h)
		return nil
	}
	if create {
		// What a checkpoint repeats is what the create would answer.
		canonicalResp(hdr.Cmd, req, want)
		return rp.tombstone(hdr.Cmd, req, want, payload, h, err)
	}
	return rp.failed(hdr.Cmd, req, h, fmt.Errorf("%s: %w", c.name, err))
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
			rp.note("QP %d lost: %v", h, rp.lostCause)
		}
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
	rp.note("%s %d lost: %v", kind, h, cause)
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

// finish brings the rebuilt device to where the guest can go on: lost
// objects reported to it, QPs whose peers' state died with the daemon
// moved to ERR, every CQ armed, and the rings kicked.
func (rp *replayer) finish() {
	d, rep := rp.d, rp.rep
	rep.Rebuilt.UC = d.ucs.len()
	for _, g := range d.gids {
		if g.bound {
			rep.Rebuilt.GID++
		}
	}
	rep.Lost.GID = len(rp.gidLost)
	d.pds.each(func(_ uint32, p *pd) {
		if isLost(p.hv) {
			rep.Lost.PD++
		} else {
			rep.Rebuilt.PD++
		}
	})
	d.mrs.each(func(_ uint32, m *mr) {
		if m.lost {
			rep.Lost.MR++
		} else {
			rep.Rebuilt.MR++
		}
	})
	d.cqs.each(func(h uint32, c *cq) {
		if isLost(c.hv) {
			rep.Lost.CQ++
			d.pushEvent(uint32(hostverbs.EventCQErr), h)
			return
		}
		rep.Rebuilt.CQ++
		c.arm(armNext)
	})
	d.srqs.each(func(h uint32, s *srq) {
		if isLost(s.hv) {
			rep.Lost.SRQ++
			d.pushEvent(uint32(hostverbs.EventSRQErr), h)
			return
		}
		rep.Rebuilt.SRQ++
	})
	// The receives SRQs held in the old provider, before any QP goes on
	// and before the SRQ rings' newer WQEs.
	rp.repostSRQs()
	toErr := func(h uint32, q *qp) {
		d.errorQP(q)
		d.pushEvent(uint32(hostverbs.EventQPFatal), h)
		rep.Errored++
	}
	d.qps.each(func(h uint32, q *qp) {
		st := q.State()
		switch {
		case isLost(q.hv):
			rep.Lost.QP++
			q.state.Store(uint32(hostverbs.QPStateErr))
			d.pushEvent(uint32(hostverbs.EventQPFatal), h)
			return
		case st == hostverbs.QPStateReset || st == hostverbs.QPStateErr:
		case rp.broken[h] != nil:
			rp.note("QP %d moved to ERR: %v", h, rp.broken[h])
			toErr(h, q)
		case rp.continueQP(h, q):
			rep.Continued++
		case q.typ == hostverbs.QPTypeRC || q.srq != nil:
			toErr(h, q)
		}
		rep.Rebuilt.QP++
	})
	for _, h := range slices.Sorted(maps.Keys(rp.transport)) {
		if q, ok := d.qps.get(h); ok {
			rp.note("transport state of QP %d ignored: the QP is in %v", h, q.State())
		}
	}
	// Work the guest posted that the dead device had not consumed: posted
	// now, or flushed in ERR.
	d.qps.each(func(_ uint32, q *qp) {
		if q.sq == nil {
			return
		}
		d.postRecvs(q)
		if st := q.State(); st >= hostverbs.QPStateRTS {
			d.postSends(q, false)
		}
	})
	d.srqs.each(func(_ uint32, s *srq) {
		if s.ring != nil && !isLost(s.hv) {
			d.postSRQ(s)
		}
	})
	// A notification the crash swallowed: a CQ still armed (nothing above
	// completed on it) that holds CQEs the guest has not read.
	d.cqs.each(func(h uint32, c *cq) {
		if c.ring == nil {
			return
		}
		c.mu.Lock()
		empty, err := c.ring.Empty()
		notify := err == nil && !empty && c.armed == armNext
		if notify {
			c.armed = armNone
		}
		c.mu.Unlock()
		if notify {
			d.pushCQNotify(h)
		}
	})
	if rp.extra > 0 {
		rep.Notes = append(rep.Notes, fmt.Sprintf("and %d more", rp.extra))
	}
	d.stats.restored.Add(uint64(rep.Rebuilt.Total()))
	d.stats.restoreErrored.Add(uint64(rep.Errored))
	d.stats.restoreContinued.Add(uint64(rep.Continued))
	d.stats.restoreLost.Add(uint64(rep.Lost.Total()))
	d.log.Info("pvrdma: device restored from its journal", "records", rep.Records, "torn", rep.Torn,
		"rebuilt", rep.Rebuilt.Total(), "errored_qps", rep.Errored, "continued_qps", rep.Continued, "lost", rep.Lost.Total())
}

// The handlers' side of a restore.

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

// CheckJournal reports whether this daemon can read journal: its records'
// framing, versions and types (not whether a guest's memory still supports
// them; Restore checks that). A daemon handing over to another binary asks
// it first, and keeps serving if the successor cannot read its state.
func CheckJournal(journal []byte) (RestoreReport, error) {
	var rep RestoreReport
	recs, _, err := parseJournal(journal, &rep)
	if err != nil {
		return rep, fmt.Errorf("vdev: journal: %w", err)
	}
	rep.Records = len(recs)
	return rep, nil
}

// Journal features (JournalFeatures).
const (
	featureTransport = "transport"
	featureSRQ       = "srq"
)

// JournalFeatures names what this daemon's Restore understands beyond the
// journal's version: "transport" (RC transport records of a hand-over)
// and "srq" (SRQ receive records of a hand-over). A daemon asks its
// successor (check-state) and saves only what it understands
// (SaveTransportsFor).
func JournalFeatures() []string { return []string{featureTransport, featureSRQ} }

// reqHandle is the handle a request of the HandleReq layout names.
func reqHandle(req []byte) uint32 {
	var r abi.HandleReq
	r.Decode(req)
	return r.Handle
}
