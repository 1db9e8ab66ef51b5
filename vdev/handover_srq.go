package vdev

import (
	"encoding/binary"
	"fmt"
	"maps"
	"slices"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// An SRQ's receives in a hand-over. Unlike a QP's queues, whose guest
// rings keep every WQE until it completes (wq.go), an SRQ ring is released
// at post: its receives complete out of order, in whichever QP takes them,
// so cons_head cannot wait for them, and the receives the provider holds
// exist nowhere else. SaveTransports therefore asks each SRQ's provider
// for them (hostverbs.SRQSaver, which freezes the SRQ: no QP takes a
// receive from it afterwards) and journals them in SRQ receive records,
// before it saves the transport state of the RC QPs on it; Restore posts
// them again to the new provider SRQ, oldest first, checked as the guest's
// WQEs are, before the SRQ's ring is drained and before any QP goes on. An
// RC QP on an SRQ continues only if its SRQ's receives were restored.
// Every receive is thus in exactly one place: completed by the old
// process before the freeze, or posted again by the new one.
//
// A crash saves nothing: the receives the dead provider held are lost
// and the RC QPs on an SRQ come back in ERR (see restore.go). Keeping the
// SRQ ring until completion instead would not make the crash exact: with
// out-of-order completions cons_head can only pass a completed prefix,
// and a restart would post again the receives completed beyond it.
//
// SRQ receive record payload (little-endian):
//
//	offset size
//	 0     1    version (srqRecVersion)
//	 1     1    flags: bit 0 the SRQ's last record
//	 2     2    0
//	 4     4    SRQ handle
//	 8     4    the SRQ's limit as armed in the provider (0: disarmed)
//	12     4    index of the record's first receive among the SRQ's
//	16     4    n, the receives in the record
//	20     ...  n receives, oldest first, each as the guest writes it in
//	            the ring: a pvrdma_rq_wqe_hdr (wr_id, num_sge, total_len
//	            0) and num_sge pvrdma_sge with the guest's keys
//
// An SRQ's receives take one record or more (each up to
// maxSRQRecPayload), numbered consecutively; an SRQ that held none has one
// record with n 0. Like transport records they count only if nothing but
// hand-over records follows them in the journal.
const (
	srqRecVersion = 1
	srqRecHdr     = 20
	srqRecLast    = 1
	// maxSRQRecPayload bounds an SRQ receive record's payload: 64 KiB
	// hold at least 124 receives of the most SGEs a WQE may have.
	maxSRQRecPayload = 64 << 10
)

// saveSRQ journals, for the hand-over, the receives SRQ s's provider
// holds, and leaves it frozen. An SRQ saved already is not saved again.
// mu held.
func (d *Device) saveSRQ(h uint32, s *srq) error {
	if s.saved != nil {
		return nil
	}
	sv, ok := s.hv.(hostverbs.SRQSaver)
	if !ok {
		return fmt.Errorf("SRQ %d: the provider cannot save its receives: %w", h, hostverbs.ErrNotSupported)
	}
	wrs, err := sv.SaveRecvs()
	if err != nil {
		return fmt.Errorf("SRQ %d: %w", h, err)
	}
	recs, err := d.encodeSRQRecvs(h, s, wrs)
	if err != nil {
		sv.ResumeRecvs()
		return fmt.Errorf("SRQ %d: %w", h, err)
	}
	d.handover = true
	for _, rec := range recs {
		s.saved = append(s.saved, rec[recHdrSize:])
		d.emit(rec, recSRQRecvs)
	}
	return nil
}

// encodeSRQRecvs builds the SRQ receive records (headers left for emit)
// of the receives wrs of SRQ s, with the guest's keys. mu held.
func (d *Device) encodeSRQRecvs(h uint32, s *srq, wrs []hostverbs.RecvWR) ([][]byte, error) {
	a, err := s.hv.Query()
	if err != nil {
		return nil, fmt.Errorf("query: %w", err)
	}
	if len(wrs) > int(s.maxWR) || a.Limit > s.maxWR {
		return nil, fmt.Errorf("the provider holds %d receives, limit %d (at most %d): %w",
			len(wrs), a.Limit, s.maxWR, hostverbs.ErrInvalid)
	}
	var recs [][]byte
	start := func(first int) []byte {
		rec := make([]byte, recHdrSize+srqRecHdr, recHdrSize+min(maxSRQRecPayload, srqRecHdr+64*len(wrs)))
		p := rec[recHdrSize:]
		p[0] = srqRecVersion
		binary.LittleEndian.PutUint32(p[4:], h)
		binary.LittleEndian.PutUint32(p[8:], a.Limit)
		binary.LittleEndian.PutUint32(p[12:], uint32(first))
		return rec
	}
	end := func(rec []byte, first, next int) {
		binary.LittleEndian.PutUint32(rec[recHdrSize+16:], uint32(next-first))
		recs = append(recs, rec)
	}
	rec, first := start(0), 0
	var b [abi.RQWQEHdrSize]byte
	for i, wr := range wrs {
		if len(wr.SGL) > int(s.maxSGE) {
			return nil, fmt.Errorf("receive %d of %d SGEs (at most %d): %w", i, len(wr.SGL), s.maxSGE, hostverbs.ErrInvalid)
		}
		if len(rec)-recHdrSize+abi.RQWQEHdrSize+abi.SGESize*len(wr.SGL) > maxSRQRecPayload {
			end(rec, first, i)
			rec, first = start(i), i
		}
		abi.RQWQEHdr{WRID: wr.WRID, NumSGE: uint32(len(wr.SGL))}.Encode(b[:])
		rec = append(rec, b[:]...)
		for _, sg := range wr.SGL {
			lkey, ok := d.guestLKey(s.pd, sg.LKey)
			if !ok {
				return nil, fmt.Errorf("receive %#x names lkey %#x, which no MR of the SRQ's PD has: %w",
					wr.WRID, sg.LKey, hostverbs.ErrNotSupported)
			}
			var e [abi.SGESize]byte
			abi.SGE{Addr: sg.Addr, Length: sg.Length, LKey: lkey}.Encode(e[:])
			rec = append(rec, e[:]...)
		}
	}
	end(rec, first, len(wrs))
	recs[len(recs)-1][recHdrSize+1] = srqRecLast
	return recs, nil
}

// guestLKey returns the key the guest uses for the provider lkey hv of an
// MR of PD p: the same (a fast-reg MR's key is the provider's too).
func (d *Device) guestLKey(p *pd, hv uint32) (uint32, bool) {
	if m := d.keys[hv]; m != nil && m.pd == p {
		return hv, true
	}
	if m := d.frmrs[hv>>8]; m != nil && m.pd == p {
		return hv, true
	}
	return 0, false
}

// resumeSRQs unfreezes the SRQs saved for a hand-over abandoned. mu held.
func (d *Device) resumeSRQs() {
	d.srqs.each(func(_ uint32, s *srq) {
		if s.saved == nil {
			return
		}
		s.saved = nil
		if sv, ok := s.hv.(hostverbs.SRQSaver); ok {
			sv.ResumeRecvs()
		}
	})
}

// Restore's side.

// savedRecvs is what the SRQ receive records of one SRQ hold so far.
type savedRecvs struct {
	limit   uint32
	recvs   []savedRecv
	last    bool // the SRQ's last record came
	ignored bool // a record of a version this daemon does not know
}

// savedRecv is one receive an SRQ record holds.
type savedRecv struct {
	wrid uint64
	sgl  []abi.SGE
}

// srqRecord checks an SRQ receive record and keeps its receives for the
// end of the replay.
func (rp *replayer) srqRecord(p []byte) error {
	if len(p) < srqRecHdr {
		return fmt.Errorf("SRQ receive record of %d bytes: %w", len(p), ErrJournal)
	}
	le := binary.LittleEndian
	h := le.Uint32(p[4:])
	s, ok := rp.d.srqs.get(h)
	if !ok {
		return fmt.Errorf("SRQ receive record: SRQ %d does not exist: %w", h, ErrJournal)
	}
	sr := rp.srqRecvs[h]
	if sr == nil {
		sr = &savedRecvs{limit: le.Uint32(p[8:])}
		rp.srqRecvs[h] = sr
	}
	switch {
	case sr.ignored:
		return nil
	case p[0] != srqRecVersion || p[1]&^srqRecLast != 0 || p[2]|p[3] != 0:
		rp.note("receives of SRQ %d ignored: record version %d, flags %#x", h, p[0], p[1])
		sr.ignored = true
		return nil
	}
	limit, first, n := le.Uint32(p[8:]), le.Uint32(p[12:]), le.Uint32(p[16:])
	switch {
	case sr.last:
		return fmt.Errorf("SRQ %d: a receive record after its last: %w", h, ErrJournal)
	case first != uint32(len(sr.recvs)):
		return fmt.Errorf("SRQ %d: record from receive %d after %d receives: %w", h, first, len(sr.recvs), ErrJournal)
	case limit != sr.limit || limit > s.maxWR:
		return fmt.Errorf("SRQ %d: limit %d (first record %d, at most %d): %w", h, limit, sr.limit, s.maxWR, ErrJournal)
	case uint64(first)+uint64(n) > uint64(s.maxWR):
		return fmt.Errorf("SRQ %d: %d receives in an SRQ of %d: %w", h, uint64(first)+uint64(n), s.maxWR, ErrJournal)
	}
	b := p[srqRecHdr:]
	for i := range n {
		if len(b) < abi.RQWQEHdrSize {
			return fmt.Errorf("SRQ %d: receive %d cut short: %w", h, first+i, ErrJournal)
		}
		var hdr abi.RQWQEHdr
		hdr.Decode(b)
		if hdr.NumSGE > s.maxSGE || hdr.TotalLen != 0 || len(b)-abi.RQWQEHdrSize < int(hdr.NumSGE)*abi.SGESize {
			return fmt.Errorf("SRQ %d: receive %d of %d SGEs (at most %d), %d bytes left: %w",
				h, first+i, hdr.NumSGE, s.maxSGE, len(b), ErrJournal)
		}
		b = b[abi.RQWQEHdrSize:]
		r := savedRecv{wrid: hdr.WRID, sgl: make([]abi.SGE, hdr.NumSGE)}
		for j := range r.sgl {
			r.sgl[j].Decode(b)
			b = b[abi.SGESize:]
		}
		sr.recvs = append(sr.recvs, r)
	}
	if len(b) != 0 {
		return fmt.Errorf("SRQ %d: %d bytes after %d receives: %w", h, len(b), n, ErrJournal)
	}
	sr.last = p[1]&srqRecLast != 0
	return nil
}

// repostSRQs posts again the receives each SRQ held when the hand-over
// saved it, checked as the guest's WQEs are (a receive that fails, its MR
// gone, is dropped with an SRQ_ERR event as postSRQ drops a bad WQE), and
// gives the SRQ its limit back. It runs before any QP continues and
// before the SRQ rings are drained (their WQEs are newer). mu held.
func (rp *replayer) repostSRQs() {
	d := rp.d
	for _, h := range slices.Sorted(maps.Keys(rp.srqRecvs)) {
		sr := rp.srqRecvs[h]
		s, _ := d.srqs.get(h)
		switch {
		case sr.ignored:
			continue
		case !sr.last:
			rp.note("receives of SRQ %d not restored: their last record is missing", h)
			continue
		case isLost(s.hv):
			rp.note("receives of SRQ %d not restored: the SRQ is lost", h)
			continue
		}
		for _, r := range sr.recvs {
			if err := rp.repost(s, r); err != nil {
				d.stats.badWQEs.Add(1)
				d.pushEvent(uint32(hostverbs.EventSRQErr), h)
				rp.note("SRQ %d: receive %#x not posted again: %v", h, r.wrid, err)
				continue
			}
			d.stats.recvWQEs.Add(1)
			rp.rep.SRQRecvs++
		}
		if err := s.hv.Modify(hostverbs.SRQAttr{Limit: sr.limit}, hostverbs.SRQAttrLimit); err != nil {
			rp.note("SRQ %d: limit %d not restored: %v", h, sr.limit, err)
		}
		rp.srqKept[h] = true
	}
}

// repost posts one saved receive to SRQ s. mu held.
func (rp *replayer) repost(s *srq, r savedRecv) error {
	d := rp.d
	for i := range r.sgl {
		lkey, st := d.checkSGE(&r.sgl[i], s.pd, true)
		if st != hostverbs.WCSuccess {
			return fmt.Errorf("SGE %d (lkey %#x): %v", i, r.sgl[i].LKey, st)
		}
		d.sgl[i] = hostverbs.SGE{Addr: r.sgl[i].Addr, Length: r.sgl[i].Length, LKey: lkey}
	}
	d.rwr = hostverbs.RecvWR{WRID: r.wrid, SGL: d.sgl[:len(r.sgl)]}
	return s.hv.PostRecv(&d.rwr)
}
