package vdev

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// A planned hand-over to another process (an upgrade under running
// guests) keeps RC connections: the daemon stops reading the guest's
// doorbells and commands, waits until SendsDrained, calls SaveTransports,
// which journals the receives each SRQ's provider holds (handover_srq.go)
// and each connected RC QP's transport state (and freezes the provider
// SRQs and QPs, so the states stay true), and the next process rebuilds
// the device with Restore, which posts the SRQs' receives again and
// restores the transport states into the new provider QPs instead of
// moving the QPs to ERR. A hand-over abandoned before the new process runs
// ends with ResumeTransports, or by itself at the guest's next BAR write:
// either journals a record that voids the saved states.
//
// Why a transport record can be trusted: it is written while nothing else
// changes the device (no doorbell, no command), and the provider QP is
// frozen from that moment, so its state is the QP's last. Restore uses it
// only if every record after it in the journal is another hand-over
// record, transport or SRQ receives (a checkpoint puts them last): any
// command, register write, reset or hand-over abort after it means the
// device went on and the state is stale. Doorbells are not journaled,
// but the first BAR write after SaveTransports voids the states before
// it is applied.

// Transport record payload: a version byte, 3 bytes 0, the QP handle
// (u32), then the provider's blob (hostverbs.TransportSaver).
const (
	transportRecVersion = 1
	transportRecHdr     = 8
	// maxTransportPayload bounds a transport record's payload: the soft
	// provider's state with all its 128 READ/atomic resources is 4648
	// bytes.
	maxTransportPayload = 8192
)

// TransportReport says what SaveTransports did.
type TransportReport struct {
	// Saved counts the RC QPs whose transport state the journal holds for
	// the hand-over: saved by this call, or by an earlier one since the
	// last ResumeTransports.
	Saved int
	// Failed maps the handle of each connected RC QP (RTR, RTS or SQD)
	// whose state could not be saved to why: an error wrapping
	// hostverbs.ErrBusy (sends, READ responses or a message still in
	// progress: a later call may save it), hostverbs.ErrNotSupported (the
	// provider cannot, or the QP uses an SRQ whose receives could not be
	// saved), or another. A restore moves them to ERR with a QP_FATAL
	// event, as after a crash.
	Failed map[uint32]error
	// SavedSRQs counts the SRQs whose receives the journal holds for the
	// hand-over (saved by this call or an earlier one).
	SavedSRQs int
	// FailedSRQs maps the handle of each SRQ whose receives could not be
	// saved to why (the provider cannot, or another error); the
	// receives its provider holds are lost to the next process, and the
	// connected RC QPs on it are in Failed.
	FailedSRQs map[uint32]error
	// SavedFastRegs counts the valid fast registrations the journal
	// holds for the hand-over (the successor registers them again).
	SavedFastRegs int
	// UnsavedFastRegs counts the valid fast registrations not saved (yet)
	// because an RC QP of their PD is not frozen (in Failed) and could
	// still free them; a later pass that freezes those QPs saves them.
	UnsavedFastRegs int
}

// SendsDrained reports whether no QP of the device has send work in its
// provider: every send WQE posted to the provider has completed and its
// CQE is written, and no RDMA READ response is still to be sent. A QP
// whose provider cannot tell (it does not implement
// hostverbs.SendDrainer) counts as drained when no WQE of its send ring is
// posted and not completed (an unsignaled send completed in silence
// counts as not completed there). Receives may stay posted; sends still
// in the rings, never posted, are posted by the next process. The daemon
// polls it, doorbells stopped, before SaveTransports; it takes the device
// lock and asks every provider QP.
func (d *Device) SendsDrained() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	drained := true
	d.qps.each(func(_ uint32, q *qp) {
		if drained && !q.sendsDrained() {
			drained = false
		}
	})
	return drained
}

// sendsDrained reports whether q's provider holds no send work.
func (q *qp) sendsDrained() bool {
	if q.sq == nil || isLost(q.hv) {
		return true
	}
	if s, ok := q.hv.(hostverbs.SendDrainer); ok {
		return s.SendsDrained()
	}
	w := q.sq
	w.cq.mu.Lock()
	defer w.cq.mu.Unlock()
	return w.ring.Outstanding() == 0
}

// SaveTransports journals, for the hand-over, the receives every SRQ's
// provider holds (hostverbs.SRQSaver; SRQ receive records, see
// handover_srq.go) and the transport state of every RC QP in RTR, RTS or
// SQD whose provider implements hostverbs.TransportSaver, one transport
// record per QP, and leaves those provider SRQs and QPs frozen (they drop
// what they receive, or what needs a receive of the SRQ: the peer resends
// it to the next process). An RC QP on an SRQ is saved only if its SRQ
// is. The send WQEs of every QP whose provider reports its sends drained
// are released from the ring (an unsignaled send that completed in
// silence would otherwise be posted again by the next process). QPs of other types or states need no transport state; those
// that fail are listed in the report. Call it with doorbells and commands
// stopped, after SendsDrained, and again for the QPs that were busy if
// time allows (a QP or SRQ saved already is not saved twice). The error
// is for a device that cannot hand over at all (closed, or without a
// journal). It is SaveTransportsFor(JournalFeatures()).
func (d *Device) SaveTransports() (TransportReport, error) {
	return d.SaveTransportsFor(JournalFeatures())
}

// SaveTransportsFor is SaveTransports for a successor whose Restore
// understands only the journal features named (JournalFeatures of its
// binary, as its check-state accepts them): without "transport" nothing
// is saved and it fails with ErrNotSupported; without "srq" no SRQ's
// receives are saved, and the RC QPs on an SRQ are not saved either
// (Failed: ErrNotSupported), so they come back in ERR as that successor
// would bring them back.
func (d *Device) SaveTransportsFor(features []string) (TransportReport, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rep := TransportReport{Failed: map[uint32]error{}, FailedSRQs: map[uint32]error{}}
	switch {
	case d.closed:
		return rep, fmt.Errorf("vdev: save transports: %w", ErrClosed)
	case d.journal == nil:
		return rep, fmt.Errorf("vdev: save transports: the device has no journal: %w", hostverbs.ErrNotSupported)
	case !slices.Contains(features, featureTransport):
		return rep, fmt.Errorf("vdev: save transports: the successor cannot restore transport records: %w", hostverbs.ErrNotSupported)
	}
	withSRQ := slices.Contains(features, featureSRQ)
	if withSRQ {
		// SRQs first: a frozen SRQ gives no receive, so a busy QP on it
		// finishes the message it has and then stays quiescent.
		d.srqs.each(func(h uint32, s *srq) {
			if isLost(s.hv) {
				return
			}
			if err := d.saveSRQ(h, s); err != nil {
				rep.FailedSRQs[h] = err
				return
			}
			rep.SavedSRQs++
		})
	}
	d.qps.each(func(h uint32, q *qp) {
		if q.sq == nil || isLost(q.hv) {
			return
		}
		saved, err := d.saveTransport(h, q, withSRQ, rep.FailedSRQs)
		switch {
		case saved:
			rep.Saved++
		case err != nil:
			rep.Failed[h] = err
		}
		if s, ok := q.hv.(hostverbs.SendDrainer); saved || (ok && s.SendsDrained()) {
			q.sq.retireSilent(q)
		}
	})
	if slices.Contains(features, featureFastReg) {
		// After the QPs: frozen, they free no registration any more.
		rep.SavedFastRegs, rep.UnsavedFastRegs = d.saveFastRegs()
	}
	return rep, nil
}

// saveTransport saves one QP's transport state, if it has one to save.
// A QP on an SRQ needs its SRQ saved (withSRQ; srqErr says why one is
// not). mu held.
func (d *Device) saveTransport(h uint32, q *qp, withSRQ bool, srqErr map[uint32]error) (bool, error) {
	if q.typ != hostverbs.QPTypeRC {
		return false, nil
	}
	switch q.State() {
	case hostverbs.QPStateRTR, hostverbs.QPStateRTS, hostverbs.QPStateSQD:
	default:
		return false, nil
	}
	if q.transport != nil {
		return true, nil
	}
	switch {
	case q.srq == nil:
	case !withSRQ:
		return false, fmt.Errorf("QP %d uses an SRQ, whose receives the successor cannot restore: %w", h, hostverbs.ErrNotSupported)
	case srqErr[q.srq.handle] != nil:
		return false, fmt.Errorf("QP %d: its SRQ's receives not saved: %w", h, srqErr[q.srq.handle])
	case q.srq.saved == nil:
		return false, fmt.Errorf("QP %d: its SRQ %d is lost: %w", h, q.srq.handle, hostverbs.ErrNotSupported)
	}
	ts, ok := q.hv.(hostverbs.TransportSaver)
	if !ok {
		return false, fmt.Errorf("QP %d: the provider cannot save transport state: %w", h, hostverbs.ErrNotSupported)
	}
	blob, err := ts.SaveTransport()
	if err != nil {
		return false, fmt.Errorf("QP %d: %w", h, err)
	}
	if len(blob) > maxTransportPayload-transportRecHdr {
		ts.ResumeTransport()
		return false, fmt.Errorf("QP %d: transport state of %d bytes (at most %d): %w", h, len(blob),
			maxTransportPayload-transportRecHdr, hostverbs.ErrNoResources)
	}
	rec := make([]byte, recHdrSize+transportRecHdr+len(blob))
	p := rec[recHdrSize:]
	p[0] = transportRecVersion
	binary.LittleEndian.PutUint32(p[4:], h)
	copy(p[transportRecHdr:], blob)
	q.transport = p
	d.handover = true
	d.emit(rec, recTransport)
	return true, nil
}

// HoldDoorbells stops taking the doorbells a guest stores in memory
// (DoorbellsMemory; nothing to do in trapped mode, where holding the
// connection holds them): a hand-over holds the guest before it drains
// and saves transport states, and a doorbell taken meanwhile would post
// new work (the sends would not drain) or, after SaveTransports, void the
// saved states (the guest went on: the RC QPs would come back in ERR).
// The words stay in memory: the successor, which maps the same memory,
// takes them, or this device after ReleaseDoorbells. It waits for a pass
// under way to end.
func (d *Device) HoldDoorbells() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dbHeld = true
}

// ReleaseDoorbells undoes HoldDoorbells (a hand-over abandoned) and wakes
// the poller.
func (d *Device) ReleaseDoorbells() {
	d.mu.Lock()
	d.dbHeld = false
	d.mu.Unlock()
	d.kickUAR()
}

// ResumeTransports abandons a hand-over: the QPs and SRQs SaveTransports
// froze process packets and give receives again (what they dropped
// meanwhile is resent by their peers) and a record voiding their saved
// states is journaled. The
// guest's next BAR write does the same by itself; call it when the
// daemon resumes the guest without handing over. It does nothing if no
// state is saved.
func (d *Device) ResumeTransports() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.resumeTransportsLocked()
}

// resumeTransportsLocked ends a pending hand-over. mu held.
func (d *Device) resumeTransportsLocked() {
	if !d.handover {
		return
	}
	d.handover = false
	d.qps.each(func(_ uint32, q *qp) {
		if q.transport == nil {
			return
		}
		q.transport = nil
		if ts, ok := q.hv.(hostverbs.TransportSaver); ok {
			ts.ResumeTransport()
		}
	})
	d.resumeSRQs()
	d.forgetFastRegs()
	d.emit(make([]byte, recHdrSize), recHandoverAbort)
}

// retireSilent releases the send WQEs posted to a provider that reports
// its sends drained: each has completed, and those still in the ring
// completed unsignaled, in silence. Anything else in the ring (a WQE whose
// completion is owed) leaves it as it is. cq.mu taken.
func (w *workQueue) retireSilent(q *qp) {
	w.cq.mu.Lock()
	defer w.cq.mu.Unlock()
	geo := w.ring.Geometry()
	end := w.ring.NextIndex()
	for i := w.ring.HeadIndex(); i != end; i = geo.Inc(i) {
		if s := &w.slots[geo.Slot(i)]; s.state != slotPosted || s.signaled {
			return
		}
	}
	for i := w.ring.HeadIndex(); i != end; i = geo.Inc(i) {
		w.slots[geo.Slot(i)].state = slotFree
	}
	w.release(q, end)
}

// Restore's side.

// transportRecord checks a transport record and keeps its state for the
// end of the replay.
func (rp *replayer) transportRecord(p []byte) error {
	if len(p) < transportRecHdr {
		return fmt.Errorf("transport record of %d bytes: %w", len(p), ErrJournal)
	}
	h := binary.LittleEndian.Uint32(p[4:])
	if err := checkLive(&rp.d.qps, h, "QP"); err != nil {
		return fmt.Errorf("transport record: %w", err)
	}
	if p[0] != transportRecVersion || p[1]|p[2]|p[3] != 0 {
		rp.note("transport state of QP %d ignored: record version %d", h, p[0])
		return nil
	}
	rp.transport[h] = append([]byte(nil), p[transportRecHdr:]...)
	return nil
}

// handoverRecord reports whether records of type typ are a hand-over's
// saved state, which only other such records may follow.
func handoverRecord(typ uint8) bool {
	return typ == recTransport || typ == recSRQRecvs || typ == recFastReg
}

// handoverPending reports whether the replay keeps hand-over states.
func (rp *replayer) handoverPending() bool {
	return len(rp.transport) > 0 || len(rp.srqRecvs) > 0 || len(rp.fastRegs) > 0
}

// voidTransports drops the transport states and SRQ receives kept so
// far: record r follows them, so the device went on after they were
// saved.
func (rp *replayer) voidTransports(r jrec) {
	if r.typ != recHandoverAbort {
		for _, h := range slices.Sorted(maps.Keys(rp.srqRecvs)) {
			if !rp.srqRecvs[h].ignored {
				rp.note("receives of SRQ %d ignored: record %d follows them", h, r.seq)
			}
		}
		for _, h := range slices.Sorted(maps.Keys(rp.transport)) {
			rp.note("transport state of QP %d ignored: record %d follows it", h, r.seq)
		}
		for _, h := range slices.Sorted(maps.Keys(rp.fastRegs)) {
			rp.note("fast registration of MR %d ignored: record %d follows it", h, r.seq)
		}
	}
	clear(rp.transport)
	clear(rp.srqRecvs)
	clear(rp.fastRegs)
}

// continueQP restores the transport state the journal ends with into a
// connected RC QP rebuilt by the replay, which then keeps its state. A QP
// on an SRQ needs the SRQ's receives restored (repostSRQs).
func (rp *replayer) continueQP(h uint32, q *qp) bool {
	blob, ok := rp.transport[h]
	if !ok {
		return false
	}
	delete(rp.transport, h)
	var err error
	ts, isSaver := q.hv.(hostverbs.TransportSaver)
	switch st := q.State(); {
	case q.typ != hostverbs.QPTypeRC:
		err = errors.New("not an RC QP")
	case q.srq != nil && !rp.srqKept[q.srq.handle]:
		err = fmt.Errorf("the receives of its SRQ %d were not restored", q.srq.handle)
	case st != hostverbs.QPStateRTR && st != hostverbs.QPStateRTS && st != hostverbs.QPStateSQD:
		err = fmt.Errorf("in %v", st)
	case !isSaver:
		err = fmt.Errorf("the provider cannot restore transport state: %w", hostverbs.ErrNotSupported)
	default:
		err = ts.RestoreTransport(blob)
	}
	if err != nil {
		rp.note("QP %d: transport state not restored: %v", h, err)
		return false
	}
	return true
}
