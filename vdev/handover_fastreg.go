package vdev

import (
	"encoding/binary"
	"fmt"
	"maps"
	"slices"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
)

// A planned hand-over keeps fast registrations too. A kernel consumer
// (nvme-rdma, xprtrdma) registers memory per I/O and gives the key to its
// peer, which reads or writes through it a moment later, possibly after
// the hand-over, in the next process: that process must resolve the key as
// this one does. The registration is the provider's (hostverbs.FastRegMR)
// and no journaled command records it (REG_MR is a work request), so
// SaveTransports writes one fast-reg record per valid fast-reg MR, after
// every QP that could free one with a SEND with invalidate is frozen (see
// saveFastRegs), and Restore registers them again, before any QP goes on. The records follow
// the transport records' rules: they count only at the end of the journal,
// and a successor that does not name the "fastreg" feature gets none (its
// registrations are lost: the peer's access fails with a remote access
// error, and the consumer recovers its connection as after a crash).

// Fast-reg record payload: a version byte, 3 bytes 0, the MR handle, the
// key, the access flags (u32 each), the IOVA, the length (u64 each), the
// page count (u32), then the pages' guest-physical addresses (u64 each).
const (
	fastRegRecVersion = 1
	fastRegRecHdr     = 36
	maxFastRegPayload = fastRegRecHdr + 8*ringbuf.MaxFastRegPages
)

// saveFastRegs writes a fast-reg record for each valid fast-reg MR whose
// state can no longer change, and returns how many the hand-over holds.
// Doorbells and commands are stopped, so no REG_MR or LOCAL_INV runs; what
// can still free a registration is a SEND with invalidate arriving on an
// RC QP of its PD that is not frozen (busy at this pass, or one the
// successor cannot restore). A registration is therefore read and saved
// only once every such QP of its PD is frozen: its record is then true
// until the end, and a later pass keeps it. A PD that still has one gets
// no record: a registration saved while such a QP runs could be freed
// after it (the guest told, its pages reused) and brought back by the
// successor. If the hand-over ends with such a QP, it comes back in ERR
// and its PD's registrations are gone, as after a crash: the consumer
// reconnects. unsaved counts the valid registrations left out. mu held.
func (d *Device) saveFastRegs() (saved, unsaved int) {
	running := d.invalidatingPDs()
	for _, idx := range slices.Sorted(maps.Keys(d.frmrs)) {
		m := d.frmrs[idx]
		if m.fr == nil {
			continue
		}
		if m.saved != nil {
			saved++
			continue
		}
		st, reg := m.fr.Registration()
		if st != hostverbs.MRValid || len(reg.Pages.Pages) > ringbuf.MaxFastRegPages {
			continue
		}
		if running[m.pd] {
			unsaved++
			continue
		}
		rec := make([]byte, recHdrSize+fastRegRecHdr+8*len(reg.Pages.Pages))
		p := rec[recHdrSize:]
		p[0] = fastRegRecVersion
		binary.LittleEndian.PutUint32(p[4:], m.handle)
		binary.LittleEndian.PutUint32(p[8:], reg.Key)
		binary.LittleEndian.PutUint32(p[12:], uint32(reg.Access))
		binary.LittleEndian.PutUint64(p[16:], reg.Pages.IOVA)
		binary.LittleEndian.PutUint64(p[24:], reg.Pages.Length)
		binary.LittleEndian.PutUint32(p[32:], uint32(len(reg.Pages.Pages)))
		for i, g := range reg.Pages.Pages {
			binary.LittleEndian.PutUint64(p[fastRegRecHdr+8*i:], uint64(g))
		}
		m.saved = p
		d.handover = true
		d.emit(rec, recFastReg)
		saved++
	}
	return saved, unsaved
}

// invalidatingPDs returns the PDs that have an RC QP able to receive (RTR,
// RTS, SQD or SQE) whose transport state is not saved, so not frozen: a
// SEND with invalidate it receives can free a registration of its PD.
// mu held.
func (d *Device) invalidatingPDs() map[*pd]bool {
	out := map[*pd]bool{}
	d.qps.each(func(_ uint32, q *qp) {
		if q.typ != hostverbs.QPTypeRC || q.transport != nil || q.sq == nil || isLost(q.hv) {
			return
		}
		switch q.State() {
		case hostverbs.QPStateRTR, hostverbs.QPStateRTS, hostverbs.QPStateSQD, hostverbs.QPStateSQE:
			out[q.pd] = true
		}
	})
	return out
}

// forgetFastRegs drops the fast-reg records of a hand-over abandoned. mu
// held.
func (d *Device) forgetFastRegs() {
	for _, m := range d.frmrs {
		m.saved = nil
	}
}

// Restore's side.

// fastRegRecord checks a fast-reg record and keeps its registration for
// the end of the replay.
func (rp *replayer) fastRegRecord(p []byte) error {
	if len(p) < fastRegRecHdr {
		return fmt.Errorf("fast-reg record of %d bytes: %w", len(p), ErrJournal)
	}
	h := binary.LittleEndian.Uint32(p[4:])
	m, ok := rp.d.mrs.get(h)
	if !ok || !m.frmr {
		return fmt.Errorf("fast-reg record for MR %d, which is no fast-reg MR: %w", h, ErrJournal)
	}
	if p[0] != fastRegRecVersion || p[1]|p[2]|p[3] != 0 {
		rp.note("fast registration of MR %d ignored: record version %d", h, p[0])
		return nil
	}
	n := binary.LittleEndian.Uint32(p[32:])
	if n == 0 || n > ringbuf.MaxFastRegPages || len(p) != fastRegRecHdr+8*int(n) {
		return fmt.Errorf("fast-reg record of MR %d: %d pages in %d bytes: %w", h, n, len(p), ErrJournal)
	}
	pages := make([]guestmem.GPA, n)
	for i := range pages {
		pages[i] = guestmem.GPA(binary.LittleEndian.Uint64(p[fastRegRecHdr+8*i:]))
	}
	pl, err := guestmem.NewPageList(binary.LittleEndian.Uint64(p[16:]), binary.LittleEndian.Uint64(p[24:]), pages)
	if err != nil {
		return fmt.Errorf("fast-reg record of MR %d: %w: %w", h, err, ErrJournal)
	}
	acc, err := validAccess(binary.LittleEndian.Uint32(p[12:]))
	if err != nil {
		return fmt.Errorf("fast-reg record of MR %d: %w: %w", h, err, ErrJournal)
	}
	rp.fastRegs[h] = hostverbs.FastReg{Pages: pl, Access: acc, Key: binary.LittleEndian.Uint32(p[8:])}
	return nil
}

// restoreFastRegs registers again the fast-reg MRs a hand-over saved,
// before any QP goes on: a peer's access through a key it was given before
// the hand-over resolves in the new provider.
func (rp *replayer) restoreFastRegs() {
	for _, h := range slices.Sorted(maps.Keys(rp.fastRegs)) {
		reg := rp.fastRegs[h]
		delete(rp.fastRegs, h)
		m, ok := rp.d.mrs.get(h)
		var err error
		switch {
		case !ok || !m.frmr:
			err = fmt.Errorf("not a fast-reg MR")
		case m.fr == nil:
			err = fmt.Errorf("the MR was lost")
		default:
			// Charged as the predecessor charged it (a successor with a
			// lower max-mr-bytes refuses REG_MRs until under it).
			if err = m.fr.Register(reg); err == nil {
				d := rp.d
				d.fastRegRelease(m)
				m.regBytes = reg.Pages.Length
				d.mrBytes += m.regBytes
			}
		}
		if err != nil {
			rp.note("MR %d: fast registration under key %#x not restored: %v", h, reg.Key, err)
			continue
		}
		rp.rep.RestoredFastRegs++
	}
}
