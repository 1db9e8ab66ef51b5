package vdev

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
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
	// RestoredFastRegs is the number of fast registrations the journal
	// ends with (SaveTransports) that the new provider took back: their
	// keys work as before the hand-over.
	RestoredFastRegs int
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
// continues only if they were. The outstanding work requests of the QPs
// that keep their state are posted. Objects the provider cannot take back
// are kept as lost (see RestoreReport.Lost). Every CQ is armed, and one
// holding unread CQEs notified, so that no waiter misses a notification
// lost in the crash.
//
// The stages, each a function of its own: read the journal
// (parseJournal, restore_journal.go), replay its records
// (replayer.replay, restore_replay.go, with the command handlers' side
// in restore_hooks.go), and settle the result (replayer.finish, below).
//
// Restore does not call Config.Journal for what it replays: the caller
// writes the returned device's Checkpoint as its new journal before the
// device serves the guest, then appends the records the device emits,
// numbered after the journal's. On error nothing of the device remains.
func Restore(cfg Config, journal []byte) (*Device, RestoreReport, error) {
	var rep RestoreReport
	// Read the journal: frame its records and check their numbering.
	recs, last, err := parseJournal(journal, &rep)
	if err != nil {
		return nil, rep, fmt.Errorf("vdev: restore: %w", err)
	}
	// A new device, and what the replay must know ahead: each CQ's last
	// size.
	d, err := New(cfg)
	if err != nil {
		return nil, rep, err
	}
	restored := false
	defer func() {
		if !restored {
			d.releaseUARMemory() // (after the unlock below: the poller takes mu)
		}
	}()
	d.mu.Lock()
	defer d.mu.Unlock()
	rp := newReplayer(d, &rep, recs)
	// Replay the records in order: registers (the DSR loaded, its rings
	// adopted) and commands (every object rebuilt under its handle, QPN
	// and keys, its rings adopted), and the hand-over's records.
	if err := rp.replay(recs); err != nil {
		return nil, rep, err
	}
	d.seq = last
	// Settle what the replay rebuilt, so that the guest can go on.
	rp.finish()
	restored = true
	return d, rep, nil
}

// finish brings the rebuilt device to where the guest can go on, in
// stages: objects counted, lost ones reported to the guest, QPs whose
// peers' state died with the daemon moved to ERR, the work the guest
// posted resumed, every CQ armed and notified, the restore reported.
func (rp *replayer) finish() {
	rp.countObjects()
	rp.settleCQs()
	rp.settleSRQs()
	// The fast registrations a hand-over kept, before any QP goes on
	// (a peer's access may arrive at once) and before the SRQs' receives,
	// which may name them.
	rp.restoreFastRegs()
	// The receives SRQs held in the old provider, before any QP goes on
	// and before the SRQ rings' newer WQEs.
	rp.repostSRQs()
	rp.settleQPs()
	rp.noteUnusedTransports()
	rp.resumeWork()
	rp.notifyCQs()
	rp.report()
}

// countObjects counts the contexts, GIDs, PDs and MRs rebuilt and lost.
func (rp *replayer) countObjects() {
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
}

// settleCQs reports each lost CQ to the guest (CQ_ERR) and arms every
// other, so that no waiter misses a notification lost in the crash.
func (rp *replayer) settleCQs() {
	d, rep := rp.d, rp.rep
	d.cqs.each(func(h uint32, c *cq) {
		if isLost(c.hv) {
			rep.Lost.CQ++
			d.pushEvent(uint32(hostverbs.EventCQErr), h)
			return
		}
		rep.Rebuilt.CQ++
		c.arm(armNext)
	})
}

// settleSRQs reports each lost SRQ to the guest (SRQ_ERR).
func (rp *replayer) settleSRQs() {
	d, rep := rp.d, rp.rep
	d.srqs.each(func(h uint32, s *srq) {
		if isLost(s.hv) {
			rep.Lost.SRQ++
			d.pushEvent(uint32(hostverbs.EventSRQErr), h)
			return
		}
		rep.Rebuilt.SRQ++
	})
}

// settleQPs decides each QP's fate: a lost one gets QP_FATAL; one whose
// replayed MODIFY_QP failed, and an RC QP or a QP on an SRQ past RESET
// that does not continue its connection (continueQP), goes to ERR with
// QP_FATAL; the others keep their state.
func (rp *replayer) settleQPs() {
	d, rep := rp.d, rp.rep
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
}

// noteUnusedTransports notes the transport states no QP took back.
func (rp *replayer) noteUnusedTransports() {
	for _, h := range slices.Sorted(maps.Keys(rp.transport)) {
		if q, ok := rp.d.qps.get(h); ok {
			rp.note("transport state of QP %d ignored: the QP is in %v", h, q.State())
		}
	}
}

// resumeWork posts the work the guest posted that the dead device had not
// consumed (flushed for QPs in ERR): each QP's receives, the sends of QPs
// in RTS or later, and each SRQ's receives.
func (rp *replayer) resumeWork() {
	d := rp.d
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
}

// notifyCQs sends the notification the crash may have swallowed: for each
// CQ still armed (nothing above completed on it) that holds CQEs the guest
// has not read.
func (rp *replayer) notifyCQs() {
	d := rp.d
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
}

// report closes the notes, counts the restore in the device's metrics and
// logs it.
func (rp *replayer) report() {
	d, rep := rp.d, rp.rep
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
