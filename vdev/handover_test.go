package vdev

import (
	"bytes"
	"encoding/binary"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// hoWorld is a guest with an RC QP that has done some work and has work
// outstanding when the daemon hands over: receives in the provider, a
// send and a receive written but not rung, and an unsignaled send the
// provider completed in silence (still in the ring); beside it an RC QP
// on an SRQ whose provider holds receives (one was taken and completed,
// which fired its limit; one more is written but not rung), a UD QP and
// an RC QP in RESET.
type hoWorld struct {
	g                    *guest
	fv                   *fakeVerbs
	j                    *journalBuf
	cq                   *gcq
	mr                   *gmr
	rc, rcSRQ, ud, idle  *gqp
	srq                  *gsrq
	sendsAfter, recvsOut []uint64 // what the next process must post
	srqHeld, srqAfter    []uint64 // the SRQ's receives: held by the provider, in the ring
}

func buildHandover(t testing.TB) *hoWorld {
	fv := newFakeVerbs()
	g, j := newJournaledGuest(t, fv, 8<<20)
	w := &hoWorld{g: g, fv: fv, j: j}
	g.probe()
	g.events()
	g.bindGID(0, gidA)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	w.cq = g.createCQ(uc, 256)
	w.mr = g.regMR(pd, 0x7f0000000000, 64<<10, 0xf)
	w.rc = g.createQP(qpSpec{pd: pd, scq: w.cq, rcq: w.cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	w.rc.toRTS(0x99, gidB, 0)
	w.srq = g.createSRQ(pd, 16, 1, 4, 1)
	w.rcSRQ = g.createQP(qpSpec{pd: pd, scq: w.cq, rcq: w.cq, srq: w.srq, typ: hostverbs.QPTypeRC, sendWR: 16, sendSGE: 1, uar: 1})
	w.rcSRQ.toRTS(0x9a, gidB, 0)
	w.ud = g.createQP(qpSpec{pd: pd, scq: w.cq, rcq: w.cq, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	w.ud.udToRTS(0x11)
	w.idle = g.createQP(qpSpec{pd: pd, scq: w.cq, rcq: w.cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})

	sge := abi.SGE{Addr: w.mr.iova, Length: 64, LKey: w.mr.lkey}
	fq := fakeQPOf(t, fv, w.rc.qpn)
	for i := range uint64(3) {
		w.rc.postRecv(1+i, sge)
	}
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	require.EqualValues(t, 1, w.cq.mustPoll().WRID)
	w.rc.postSend(wqe(hostverbs.WRSend, 10, hostverbs.SendSignaled), sge)
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	require.EqualValues(t, 10, w.cq.mustPoll().WRID)
	w.rc.postSend(wqe(hostverbs.WRSend, 11, 0), sge) // unsignaled
	fq.retire(1)                                     // completed in silence
	w.rc.writeSend(wqe(hostverbs.WRSend, 12, hostverbs.SendSignaled), sge)
	w.rc.writeRecv(4, sge)
	w.sendsAfter, w.recvsOut = []uint64{12}, []uint64{2, 3, 4}
	fq.take()
	fv.mu.Lock()
	fq.xport = 0x5eed
	fv.mu.Unlock()

	for i := range uint64(4) {
		w.srq.postRecv(30+i, abi.SGE{Addr: w.mr.iova + 4096*(i+1), Length: 256, LKey: w.mr.lkey})
	}
	fs := fv.srqs[0]
	require.Equal(t, []uint64{30}, fs.takeRecvs(1))
	fakeQPOf(t, fv, w.rcSRQ.qpn).complete(true, hostverbs.WorkCompletion{WRID: 30, Opcode: hostverbs.WCRecv})
	require.EqualValues(t, 30, w.cq.mustPoll().WRID)
	fv.mu.Lock()
	fs.attr.Limit = 0 // fired as the receive was taken, and disarmed
	fv.mu.Unlock()
	w.srq.writeRecv(34, abi.SGE{Addr: w.mr.iova + 4096*5, Length: 256, LKey: w.mr.lkey})
	w.srqHeld, w.srqAfter = []uint64{31, 32, 33}, []uint64{34}
	require.EqualValues(t, 1, w.rc.sqConsumed(), "the unsignaled send holds its slot")
	g.events()
	return w
}

// guestSendIDs returns the guest's wr_ids of sends the device posted.
func guestSendIDs(q *gqp, wrs []hostverbs.SendWR) []uint64 {
	var ids []uint64
	for _, wr := range wrs {
		var h abi.SQWQEHdr
		h.Decode(q.g.raw[q.sqWQE(uint32(wr.WRID)):])
		ids = append(ids, h.WRID)
	}
	return ids
}

// recordTypes returns the types of a journal's records.
func recordTypes(b []byte) []int {
	var out []int
	for i := range countRecords(b) {
		off, _ := recordAt(b, i)
		out = append(out, int(b[off+5]))
	}
	return out
}

func lastRecordType(b []byte) int {
	off, _ := recordAt(b, countRecords(b)-1)
	return int(b[off+5])
}

// qpStates returns the device's QP states by handle.
func qpStates(d *Device) map[uint32]hostverbs.QPState {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := map[uint32]hostverbs.QPState{}
	d.qps.each(func(h uint32, q *qp) { m[h] = q.State() })
	return m
}

func (w *hoWorld) frozen(t *testing.T) bool {
	q := fakeQPOf(t, w.fv, w.rc.qpn)
	w.fv.mu.Lock()
	defer w.fv.mu.Unlock()
	return q.frozen
}

func (w *hoWorld) srqFrozen() bool {
	w.fv.mu.Lock()
	defer w.fv.mu.Unlock()
	return w.fv.srqs[0].frozen
}

// checkContinued checks a device restored over fv from a journal that
// ends with the SRQ's receives and the RC QPs' transport states.
func (w *hoWorld) checkContinued(t *testing.T, fv *fakeVerbs, rep RestoreReport) {
	t.Helper()
	g := w.g
	assert.Empty(t, rep.Notes)
	assert.Equal(t, 2, rep.Continued, "the RC QP and the RC QP on the SRQ")
	assert.Zero(t, rep.Errored)
	assert.Equal(t, len(w.srqHeld), rep.SRQRecvs)
	assert.EqualValues(t, 2, g.dev.Stats().RestoreContinuedQPs)
	assert.Empty(t, g.events(), "no QP_FATAL for the QPs that go on")
	assert.Equal(t, map[uint32]hostverbs.QPState{w.rc.handle: hostverbs.QPStateRTS, w.rcSRQ.handle: hostverbs.QPStateRTS,
		w.ud.handle: hostverbs.QPStateRTS, w.idle.handle: hostverbs.QPStateReset}, qpStates(g.dev))

	// The SRQ: the receives the old provider held, posted again first,
	// then the one in the ring; its limit as the provider had it.
	require.Len(t, fv.srqs, 1)
	fs := fv.srqs[0]
	fv.mu.Lock()
	assert.Equal(t, append(slices.Clone(w.srqHeld), w.srqAfter...), recvIDs(fs.recvs))
	for i, r := range fs.recvs {
		assert.Equal(t, []hostverbs.SGE{{Addr: w.mr.iova + 4096*uint64(i+2), Length: 256, LKey: w.mr.lkey}}, r.SGL)
	}
	assert.Zero(t, fs.attr.Limit, "the limit fired before the hand-over stays disarmed")
	fv.mu.Unlock()
	assert.Equal(t, w.srqHeld[:1], fs.takeRecvs(1))
	fakeQPOf(t, fv, w.rcSRQ.qpn).complete(true, hostverbs.WorkCompletion{WRID: w.srqHeld[0], Opcode: hostverbs.WCRecv, ByteLen: 9})
	e := w.cq.mustPoll()
	assert.Equal(t, w.srqHeld[0], e.WRID)
	assert.EqualValues(t, 9, e.ByteLen)
	assert.Equal(t, w.rcSRQ.handle, uint32(e.QP))

	fq := fakeQPOf(t, fv, w.rc.qpn)
	fv.mu.Lock()
	assert.Equal(t, hostverbs.QPStateRTS, fq.attr.State)
	assert.EqualValues(t, 0x5eed, fq.xport, "the transport state restored")
	fv.mu.Unlock()
	s, r := fq.take()
	assert.Equal(t, w.sendsAfter, guestSendIDs(w.rc, s), "the send never posted is posted; the one completed in silence is not posted again")
	assert.Equal(t, w.recvsOut, guestRecvIDs(w.rc, r), "the outstanding receives are posted again")
	// Work goes on.
	fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	e = w.cq.mustPoll()
	assert.EqualValues(t, 2, e.WRID)
	assert.EqualValues(t, hostverbs.WCSuccess, e.Status)
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	e = w.cq.mustPoll()
	assert.EqualValues(t, 12, e.WRID)
	assert.EqualValues(t, hostverbs.WCSuccess, e.Status)
	w.rc.postSend(wqe(hostverbs.WRRDMAWrite, 13, hostverbs.SendSignaled), abi.SGE{Addr: w.mr.iova, Length: 8, LKey: w.mr.lkey})
	s, _ = fq.take()
	assert.Equal(t, []uint64{13}, guestSendIDs(w.rc, s))
	cp := recordTypes(g.dev.Checkpoint())
	assert.NotContains(t, cp, recTransport, "the restored device's checkpoint holds no transport state")
	assert.NotContains(t, cp, recSRQRecvs)
}

// TestHandoverFake: with doorbells stopped, the device's sends drain;
// SaveTransports journals the receives the SRQ's provider holds and the
// connected RC QPs' transport states (not twice), freezes the provider
// SRQ and QPs and releases the send completed in silence; a device
// restored from the journal, or from a checkpoint taken then, posts the
// SRQ's receives again, gives the provider QPs their state back and keeps
// the QPs (the one on the SRQ too) in RTS without an event, posts their
// outstanding receives and the send never posted, and not the one
// completed.
func TestHandoverFake(t *testing.T) {
	w := buildHandover(t)
	g := w.g
	require.True(t, g.dev.SendsDrained())
	n := len(w.j.recs)
	rep, err := g.dev.SaveTransports()
	require.NoError(t, err)
	want := TransportReport{Saved: 2, Failed: map[uint32]error{}, SavedSRQs: 1, FailedSRQs: map[uint32]error{}}
	assert.Equal(t, want, rep)
	assert.True(t, w.frozen(t))
	assert.True(t, w.srqFrozen())
	assert.EqualValues(t, 2, w.rc.sqConsumed(), "the send completed in silence released")
	assert.Equal(t, n+3, len(w.j.recs), "one SRQ receive record, two transport records")
	rep, err = g.dev.SaveTransports()
	require.NoError(t, err)
	assert.Equal(t, want, rep)
	assert.Equal(t, n+3, len(w.j.recs), "saved once")
	journal := w.j.bytes()
	assert.Equal(t, []int{recSRQRecvs, recTransport, recTransport}, recordTypes(journal)[n:])
	cp := g.dev.Checkpoint()
	assert.Equal(t, []int{recSRQRecvs, recTransport, recTransport}, recordTypes(cp)[countRecords(cp)-3:])
	mem := slices.Clone(g.raw)

	for _, src := range []struct {
		name string
		b    []byte
	}{{"journal", journal}, {"checkpoint", cp}} {
		t.Run(src.name, func(t *testing.T) {
			copy(g.raw, mem)
			fv := newFakeVerbs()
			rep, err := g.restart(fv, src.b, nil)
			require.NoError(t, err)
			w.checkContinued(t, fv, rep)
		})
	}
}

// TestHandoverVoided: a transport record the device went on after is not
// used: the guest's next command or doorbell, or ResumeTransports, voids
// it with a record (and unfreezes the provider QP), and any record after
// it voids it in Restore; the QP then goes to ERR with QP_FATAL as after
// a crash. A hand-over tried again after an abort counts.
func TestHandoverVoided(t *testing.T) {
	for _, tc := range []struct {
		name string
		// after runs after SaveTransports and returns the journal.
		after     func(t *testing.T, w *hoWorld) []byte
		continued bool
		frozen    bool // the old provider QP stays frozen
		note      string
	}{
		{"modify", func(t *testing.T, w *hoWorld) []byte {
			w.rc.mustModify(hostverbs.AttrMinRNRTimer, abi.QPAttr{MinRNRTimer: 3})
			return w.j.bytes()
		}, false, false, ""},
		{"doorbell", func(t *testing.T, w *hoWorld) []byte {
			w.rc.postRecv(5, abi.SGE{Addr: w.mr.iova, Length: 8, LKey: w.mr.lkey})
			return w.j.bytes()
		}, false, false, ""},
		{"resumed", func(t *testing.T, w *hoWorld) []byte {
			w.g.dev.ResumeTransports()
			n := len(w.j.recs)
			w.g.dev.ResumeTransports()
			assert.Equal(t, n, len(w.j.recs), "nothing to resume")
			assert.NotEqual(t, recTransport, lastRecordType(w.g.dev.Checkpoint()))
			return w.j.bytes()
		}, false, false, ""},
		{"kick", func(t *testing.T, w *hoWorld) []byte {
			w.g.dev.KickQueues()
			return w.j.bytes()
		}, false, false, ""},
		{"record after, no abort", func(t *testing.T, w *hoWorld) []byte {
			b := w.j.bytes()
			reg := make([]byte, 8)
			put32(reg, 0, abi.RegIMR)
			return appendRecord(b, recRegister, 0, uint64(countRecords(b)+1), reg)
		}, false, true, "ignored"},
		{"checkpoint, then a command", func(t *testing.T, w *hoWorld) []byte {
			cp := w.g.dev.Checkpoint()
			n := len(w.j.recs)
			w.rc.mustModify(hostverbs.AttrMinRNRTimer, abi.QPAttr{MinRNRTimer: 3})
			w.j.mu.Lock()
			defer w.j.mu.Unlock()
			return append(cp, w.j.b[w.j.recs[n]:]...)
		}, false, false, ""},
		{"saved again after an abort", func(t *testing.T, w *hoWorld) []byte {
			w.g.dev.ResumeTransports()
			assert.False(t, w.srqFrozen())
			rep, err := w.g.dev.SaveTransports()
			require.NoError(t, err)
			assert.Equal(t, 2, rep.Saved)
			assert.Equal(t, 1, rep.SavedSRQs)
			return w.j.bytes()
		}, true, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := buildHandover(t)
			_, err := w.g.dev.SaveTransports()
			require.NoError(t, err)
			journal := tc.after(t, w)
			assert.Equal(t, tc.frozen, w.frozen(t), "the provider QP frozen while the hand-over stands")
			assert.Equal(t, tc.frozen, w.srqFrozen(), "the provider SRQ frozen while the hand-over stands")
			if !tc.continued && tc.note == "" {
				assert.Contains(t, recordTypes(journal), recHandoverAbort)
			}
			fv := newFakeVerbs()
			rep, err := w.g.restart(fv, journal, nil)
			require.NoError(t, err)
			if tc.continued {
				w.checkContinued(t, fv, rep)
				return
			}
			assert.Zero(t, rep.Continued)
			assert.Equal(t, 2, rep.Errored)
			assert.Zero(t, rep.SRQRecvs, "the SRQ's saved receives are void too")
			assert.Equal(t, hostverbs.QPStateErr, qpStates(w.g.dev)[w.rc.handle])
			assert.Contains(t, w.g.events(), abi.EQE{Type: uint32(hostverbs.EventQPFatal), Info: w.rc.handle})
			if tc.note != "" {
				require.Len(t, rep.Notes, 3, "the SRQ's receives and two transport states")
				for _, n := range rep.Notes {
					assert.Contains(t, n, tc.note)
				}
			} else {
				assert.Empty(t, rep.Notes)
			}
		})
	}
}

// TestHandoverRefused: a QP with a send in the provider is not drained
// and its state is not saved (busy; a restore errors it, while the QP on
// the SRQ goes on); once its send completes it is; a provider that cannot
// save (QPs or SRQs), a successor that cannot restore SRQ receives or
// transport states, and a device without a journal, are refused.
func TestHandoverRefused(t *testing.T) {
	w := buildHandover(t)
	g := w.g
	sge := abi.SGE{Addr: w.mr.iova, Length: 8, LKey: w.mr.lkey}
	w.rc.postSend(wqe(hostverbs.WRSend, 20, hostverbs.SendSignaled), sge) // posts 12 as well
	assert.False(t, g.dev.SendsDrained())
	rep, err := g.dev.SaveTransports()
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Saved, "the QP on the SRQ")
	assert.ErrorIs(t, rep.Failed[w.rc.handle], hostverbs.ErrBusy)
	assert.False(t, w.frozen(t))
	journal := w.j.bytes()
	assert.Equal(t, 1, slices.Index(recordTypes(journal), recTransport)-slices.Index(recordTypes(journal), recSRQRecvs))
	rrep, err := g.restart(newFakeVerbs(), journal, nil)
	require.NoError(t, err)
	assert.Equal(t, 1, rrep.Continued)
	assert.Equal(t, 1, rrep.Errored)
	assert.Equal(t, hostverbs.QPStateErr, qpStates(g.dev)[w.rc.handle])
	assert.Equal(t, hostverbs.QPStateRTS, qpStates(g.dev)[w.rcSRQ.handle])

	// Once its sends complete, it is saved.
	w2 := buildHandover(t)
	w2.rc.postSend(wqe(hostverbs.WRSend, 20, hostverbs.SendSignaled), sge)
	fq := fakeQPOf(t, w2.fv, w2.rc.qpn)
	assert.False(t, w2.g.dev.SendsDrained())
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.True(t, w2.g.dev.SendsDrained())
	rep, err = w2.g.dev.SaveTransports()
	require.NoError(t, err)
	assert.Equal(t, 2, rep.Saved)

	w3 := buildHandover(t)
	w3.fv.noTransport = true
	rep, err = w3.g.dev.SaveTransports()
	require.NoError(t, err)
	assert.Zero(t, rep.Saved)
	assert.Zero(t, rep.SavedSRQs)
	assert.ErrorIs(t, rep.Failed[w3.rc.handle], hostverbs.ErrNotSupported)
	assert.ErrorIs(t, rep.Failed[w3.rcSRQ.handle], hostverbs.ErrNotSupported)
	assert.ErrorIs(t, rep.FailedSRQs[w3.srq.handle], hostverbs.ErrNotSupported)
	assert.False(t, w3.srqFrozen())

	// The SRQ's provider fails: its QP is not saved, the other QP is.
	w4 := buildHandover(t)
	w4.fv.failNext("SaveRecvs", hostverbs.ErrClosed)
	rep, err = w4.g.dev.SaveTransports()
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Saved)
	assert.ErrorIs(t, rep.FailedSRQs[w4.srq.handle], hostverbs.ErrClosed)
	assert.ErrorIs(t, rep.Failed[w4.rcSRQ.handle], hostverbs.ErrClosed)
	assert.NotContains(t, recordTypes(w4.j.bytes()), recSRQRecvs)

	// A successor without "srq": the QP on the SRQ is not saved, nor its
	// SRQ; without "transport" nothing is.
	w5 := buildHandover(t)
	rep, err = w5.g.dev.SaveTransportsFor([]string{"transport"})
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Saved)
	assert.Zero(t, rep.SavedSRQs)
	assert.ErrorIs(t, rep.Failed[w5.rcSRQ.handle], hostverbs.ErrNotSupported)
	assert.False(t, w5.srqFrozen())
	assert.NotContains(t, recordTypes(w5.j.bytes()), recSRQRecvs)
	_, err = w5.g.dev.SaveTransportsFor([]string{"srq"})
	assert.ErrorIs(t, err, hostverbs.ErrNotSupported)

	mem4, _ := guestmem.NewFlat(0, 1<<20)
	d, err := New(Config{Memory: mem4, Verbs: newFakeVerbs(), IRQ: &fakeIRQ{}, MAC: testMAC})
	require.NoError(t, err)
	_, err = d.SaveTransports()
	require.ErrorIs(t, err, hostverbs.ErrNotSupported, "no journal")
	require.True(t, d.SendsDrained())
	require.NoError(t, d.Close())
	_, err = d.SaveTransports()
	require.ErrorIs(t, err, ErrClosed)
}

// TestHandoverHostileRecords: transport and hand-over abort records that
// are damaged, name no QP, another QP or an unknown version, or carry a
// state the provider refuses, fail the restore with ErrJournal or leave
// the QP to the crash path (ERR, QP_FATAL) with a note; never a panic.
func TestHandoverHostileRecords(t *testing.T) {
	w := buildHandover(t)
	_, err := w.g.dev.SaveTransportsFor([]string{"transport"}) // the RC QP's alone
	require.NoError(t, err)
	journal := w.j.bytes()
	cp := w.g.dev.Checkpoint()
	mem := slices.Clone(w.g.raw)
	n := countRecords(journal)
	off, _ := recordAt(journal, n-1)
	seq := binary.LittleEndian.Uint64(journal[off+8:])
	payload := slices.Clone(journal[off+recHdrSize:])
	withTransport := func(p []byte) []byte {
		return appendRecord(slices.Clone(journal[:off]), recTransport, 0, seq, p)
	}
	handle := func(h uint32) []byte {
		p := slices.Clone(payload)
		put32(p, 4, h)
		return p
	}
	errJournal := map[string][]byte{
		"short payload": withTransport(payload[:7]),
		"no such QP":    withTransport(handle(999)),
		"oversized":     withTransport(append(slices.Clone(payload[:8]), make([]byte, maxTransportPayload)...)),
		"abort payload": appendRecord(slices.Clone(journal), recHandoverAbort, 0, seq+1, []byte{1}),
		"snapshot abort": func() []byte {
			b := slices.Clone(cp)
			o, _ := recordAt(b, countRecords(b)-1)
			b[o+5] = recHandoverAbort
			reseal(b, o)
			return b
		}(),
	}
	for name, b := range errJournal {
		t.Run(name, func(t *testing.T) {
			copy(w.g.raw, mem)
			_, err := restoreWith(w, b)
			require.ErrorIs(t, err, ErrJournal)
			t.Log(err)
		})
	}
	errored := map[string]struct {
		b     []byte
		state map[uint32]hostverbs.QPState
	}{
		"version 2": {withTransport(func() []byte { p := slices.Clone(payload); p[0] = 2; return p }()), nil},
		"reserved":  {withTransport(func() []byte { p := slices.Clone(payload); p[3] = 1; return p }()), nil},
		"garbage":   {withTransport(append(slices.Clone(payload[:8]), "not a state"...)), nil},
		"large":     {withTransport(append(slices.Clone(payload[:8]), make([]byte, 3000)...)), nil},
		"UD QP":     {withTransport(handle(w.ud.handle)), map[uint32]hostverbs.QPState{w.ud.handle: hostverbs.QPStateRTS}},
		"QP in RESET": {withTransport(handle(w.idle.handle)),
			map[uint32]hostverbs.QPState{w.idle.handle: hostverbs.QPStateReset}},
		"QP on an SRQ": {withTransport(handle(w.rcSRQ.handle)), nil},
	}
	for name, tc := range errored {
		t.Run(name, func(t *testing.T) {
			copy(w.g.raw, mem)
			rep, err := restoreWith(w, tc.b)
			require.NoError(t, err)
			assert.Zero(t, rep.Continued)
			assert.Equal(t, 2, rep.Errored)
			require.Len(t, rep.Notes, 1)
			assert.True(t, strings.Contains(rep.Notes[0], "transport state"), rep.Notes[0])
			t.Log(rep.Notes[0])
			st := qpStates(w.g.dev)
			assert.Equal(t, hostverbs.QPStateErr, st[w.rc.handle])
			for h, s := range tc.state {
				assert.Equal(t, s, st[h])
			}
		})
	}
	t.Run("provider refuses", func(t *testing.T) {
		copy(w.g.raw, mem)
		fv := newFakeVerbs()
		fv.failNext("RestoreTransport", hostverbs.ErrInvalid)
		rep, err := w.g.restart(fv, journal, nil)
		require.NoError(t, err)
		assert.Zero(t, rep.Continued)
		assert.Equal(t, 2, rep.Errored)
		assert.Len(t, rep.Notes, 1)
	})
}

func restoreWith(w *hoWorld, b []byte) (RestoreReport, error) {
	return w.g.restart(newFakeVerbs(), b, nil)
}

// TestHandoverSoft hands a guest of the soft provider over to a new
// provider device, as the next process does after exec: the RC QP that
// exchanged SENDs, WRITEs, READs and atomics with a peer on the fabric
// keeps its connection (RTS, no QP_FATAL), the receive it had posted
// takes the peer's next SEND, the send written during the hand-over goes
// out, and traffic goes on both ways with correct data.
func TestHandoverSoft(t *testing.T) {
	f := newSoftFabric(t)
	peer := newSoftSide(t, f, "vm-b", gidB)
	var dev1 atomicDevice
	g, j, sd1 := newHandoverSoftGuest(t, f, "vm-a", &dev1)
	d1 := dev1.Load()
	mem := g.mem
	a := &softSide{g: g, gid: gidA}
	uc := g.createUC(1)
	a.pd = g.createPD(uc)
	a.scq, a.rcq = g.createCQ(uc, 256), g.createCQ(uc, 256)
	a.mr = g.regMR(a.pd, 0x7f0000000123, 256<<10, 0xf)
	a.qp = g.createQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeRC, sendWR: 64, recvWR: 64, sendSGE: 2, recvSGE: 2, uar: 1})
	connect(a, peer)
	g.events()

	send := func(from, to *softSide, wrid uint64, data []byte, signaled bool) {
		t.Helper()
		from.mr.write(from.g, 0, data)
		flags := hostverbs.SendFlags(0)
		if signaled {
			flags = hostverbs.SendSignaled
		}
		from.qp.postSend(wqe(hostverbs.WRSend, wrid, flags), from.sge(0, uint32(len(data))))
	}
	recv := func(s *softSide, wrid uint64, data []byte) {
		t.Helper()
		e := waitCQE(t, s.rcq)
		require.EqualValues(t, hostverbs.WCSuccess, e.Status)
		require.EqualValues(t, wrid, e.WRID)
		require.True(t, bytes.Equal(data, s.mr.read(s.g, 64<<10, uint64(len(data)))))
	}
	// Both ways: SENDs, then WRITE, READ and FETCH_ADD from each side.
	oneWay := func(from, to *softSide, base uint64) {
		t.Helper()
		for i := range uint64(3) {
			data := randBytes(1000+int(i)*3000, int64(base+i))
			to.qp.postRecv(base+i, to.sge(64<<10, 16<<10))
			send(from, to, base+10+i, data, true)
			recv(to, base+i, data)
			require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, from.scq).Status)
		}
		data := randBytes(20<<10, int64(base))
		from.mr.write(from.g, 32<<10, data)
		h := wqe(hostverbs.WRRDMAWrite, base+20, hostverbs.SendSignaled)
		abi.WRRDMA{RemoteAddr: to.mr.iova + 100<<10, RKey: to.mr.rkey}.Encode(h.WR[:])
		from.qp.postSend(h, from.sge(32<<10, 20<<10))
		require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, from.scq).Status)
		require.True(t, bytes.Equal(data, to.mr.read(to.g, 100<<10, 20<<10)))
		h = wqe(hostverbs.WRRDMARead, base+21, hostverbs.SendSignaled)
		abi.WRRDMA{RemoteAddr: to.mr.iova + 100<<10, RKey: to.mr.rkey}.Encode(h.WR[:])
		from.qp.postSend(h, from.sge(160<<10, 20<<10))
		require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, from.scq).Status)
		require.True(t, bytes.Equal(data, from.mr.read(from.g, 160<<10, 20<<10)))
		const word = 0x2dd // 8-byte aligned in the MR's IOVA
		to.mr.write(to.g, word, binary.LittleEndian.AppendUint64(nil, base))
		h = wqe(hostverbs.WRAtomicFetchAndAdd, base+22, hostverbs.SendSignaled)
		abi.WRAtomic{RemoteAddr: to.mr.iova + word, CompareAdd: 1, RKey: to.mr.rkey}.Encode(h.WR[:])
		from.qp.postSend(h, from.sge(16, 8))
		require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, from.scq).Status)
		require.EqualValues(t, base, binary.LittleEndian.Uint64(from.mr.read(from.g, 16, 8)))
		require.EqualValues(t, base+1, binary.LittleEndian.Uint64(to.mr.read(to.g, word, 8)))
	}
	oneWay(a, peer, 100)
	oneWay(peer, a, 200)
	// An unsignaled SEND completed in silence; a receive outstanding.
	unsignaled := randBytes(500, 9)
	peer.qp.postRecv(300, peer.sge(64<<10, 16<<10))
	send(a, peer, 301, unsignaled, false)
	recv(peer, 300, unsignaled)
	a.qp.postRecv(302, a.sge(64<<10, 16<<10))

	// The hand-over: doorbells stop (the send written now is the next
	// process's to post), sends drain, transport states are saved.
	during := randBytes(700, 10)
	peer.qp.postRecv(303, peer.sge(64<<10, 16<<10))
	a.mr.write(g, 0, during)
	a.qp.writeSend(wqe(hostverbs.WRSend, 304, hostverbs.SendSignaled), a.sge(0, uint32(len(during))))
	eventuallyTrue(t, d1.SendsDrained)
	rep, err := d1.SaveTransports()
	require.NoError(t, err)
	require.Equal(t, TransportReport{Saved: 1, Failed: map[uint32]error{}, FailedSRQs: map[uint32]error{}}, rep)
	// exec: the old provider device goes with the process.
	require.NoError(t, sd1.Close())
	var dev2 atomicDevice
	sd2 := openHandoverSoft(t, f, "vm-a", mem, &dev2)
	rrep, err := g.restart(sd2, j.bytes(), nil)
	require.NoError(t, err)
	dev2.Store(g.dev)
	assert.Equal(t, 1, rrep.Continued, "%q", rrep.Notes)
	assert.Zero(t, rrep.Errored)
	assert.Empty(t, rrep.Notes)
	assert.Empty(t, g.events(), "no QP_FATAL")
	assert.Equal(t, hostverbs.QPStateRTS, qpStates(g.dev)[a.qp.handle])

	// The send written during the hand-over arrives, once; the
	// unsignaled one is not sent again.
	recv(peer, 303, during)
	e := waitCQE(t, a.scq)
	require.EqualValues(t, hostverbs.WCSuccess, e.Status)
	require.EqualValues(t, 304, e.WRID)
	// The receive posted before the hand-over takes the peer's SEND.
	back := randBytes(900, 11)
	send(peer, a, 305, back, true)
	recv(a, 302, back)
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, peer.scq).Status)
	oneWay(a, peer, 400)
	oneWay(peer, a, 500)
	_, ok := peer.rcq.poll()
	assert.False(t, ok, "no CQE left over at the peer")
	_, ok = a.rcq.poll()
	assert.False(t, ok)
}

func eventuallyTrue(t *testing.T, cond func() bool) {
	t.Helper()
	for range 10000 {
		if cond() {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("condition not met in 10 s")
}

// TestHandoverSoftSRQ hands over a guest of the soft provider whose RC QP
// receives through an SRQ, as the next process does after exec: the
// receives the old provider's SRQ held are posted again in the new one,
// before those written in the ring during the hand-over; a SEND the
// frozen QP dropped arrives after it; and every SEND of the stream
// arrives exactly once, in order, in the SRQ's next receive, with its
// data, the QP staying in RTS without an event.
func TestHandoverSoftSRQ(t *testing.T) {
	f := newSoftFabric(t)
	peer := newSoftSide(t, f, "vm-b", gidB)
	var dev1 atomicDevice
	g, j, sd1 := newHandoverSoftGuest(t, f, "vm-a", &dev1)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	scq, rcq := g.createCQ(uc, 256), g.createCQ(uc, 256)
	mr := g.regMR(pd, 0x7f0000000123, 256<<10, 0xf)
	srq := g.createSRQ(pd, 32, 1, 0, 1)
	qa := g.createQP(qpSpec{pd: pd, scq: scq, rcq: rcq, srq: srq, typ: hostverbs.QPTypeRC, sendWR: 16, sendSGE: 1, uar: 1})
	qa.toRTS(peer.qp.qpn, peer.gid, 0)
	peer.qp.toRTS(qa.qpn, gidA, 0)
	g.events()

	// Receive k takes message k into its own 4 KiB of the MR.
	const recvBase = 1000
	recvSGE := func(k int) abi.SGE { return abi.SGE{Addr: mr.iova + uint64(k)*4096, Length: 4096, LKey: mr.lkey} }
	msg := func(k int) []byte { return randBytes(100+k*251, int64(k)) }
	sent := 0
	send := func() {
		t.Helper()
		data := msg(sent)
		peer.mr.write(peer.g, uint64(sent)*4096, data)
		peer.qp.postSend(wqe(hostverbs.WRSend, uint64(sent), hostverbs.SendSignaled), peer.sge(uint64(sent)*4096, uint32(len(data))))
		sent++
	}
	got := 0
	arrives := func() {
		t.Helper()
		e := waitCQE(t, rcq)
		require.EqualValues(t, hostverbs.WCSuccess, e.Status, "message %d", got)
		require.EqualValues(t, recvBase+got, e.WRID, "message %d in the SRQ's next receive", got)
		require.Equal(t, qa.handle, uint32(e.QP))
		data := msg(got)
		require.EqualValues(t, len(data), e.ByteLen)
		require.True(t, bytes.Equal(data, mr.read(g, uint64(got)*4096, uint64(len(data)))), "message %d's data", got)
		got++
	}
	for k := range 8 {
		srq.postRecv(recvBase+uint64(k), recvSGE(k))
	}
	for range 3 {
		send()
		arrives()
	}
	// The hand-over: doorbells stop (the receives written now are the
	// next process's to post), sends drain, states are saved.
	srq.writeRecv(recvBase+8, recvSGE(8))
	srq.writeRecv(recvBase+9, recvSGE(9))
	eventuallyTrue(t, dev1.Load().SendsDrained)
	rep, err := dev1.Load().SaveTransports()
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Saved)
	assert.Empty(t, rep.Failed)
	// The peer goes on: the frozen QP drops its SEND.
	send()
	// exec: the old provider device goes with the process.
	require.NoError(t, sd1.Close())
	var dev2 atomicDevice
	sd2 := openHandoverSoft(t, f, "vm-a", g.mem, &dev2)
	rrep, err := g.restart(sd2, j.bytes(), nil)
	require.NoError(t, err)
	dev2.Store(g.dev)
	assert.Equal(t, 1, rrep.Continued, "%q", rrep.Notes)
	assert.Zero(t, rrep.Errored)
	assert.Empty(t, rrep.Notes)
	assert.Empty(t, g.events(), "no QP_FATAL")
	assert.Equal(t, hostverbs.QPStateRTS, qpStates(g.dev)[qa.handle])

	// The dropped SEND arrives, once, in the first receive the old SRQ
	// held; the stream goes on through the rest, the receives written
	// during the hand-over and new ones.
	arrives()
	for k := 10; k < 14; k++ {
		srq.postRecv(recvBase+uint64(k), recvSGE(k))
	}
	for sent < 14 {
		send()
		arrives()
	}
	for range sent {
		e := waitCQE(t, peer.scq)
		require.EqualValues(t, hostverbs.WCSuccess, e.Status)
	}
	_, ok := rcq.poll()
	assert.False(t, ok, "no CQE left over")
	_, ok = peer.scq.poll()
	assert.False(t, ok)
	assert.Equal(t, hostverbs.QPStateRTS, qpStates(g.dev)[qa.handle])
	assert.Empty(t, g.events())
}

// openHandoverSoft opens a soft provider device for guest memory mem
// whose events go to the device in dev.
func openHandoverSoft(t *testing.T, f *soft.Fabric, name string, mem *guestmem.Memory, dev *atomicDevice) hostverbs.Device {
	t.Helper()
	sd, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: mem, MAC: testMAC,
		Events: func(ev hostverbs.AsyncEvent) {
			if d := dev.Load(); d != nil {
				d.HandleEvent(ev)
			}
		}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sd.Close() })
	return sd
}

// newHandoverSoftGuest is a probed guest (GID gidA) of a journaled device
// over a soft provider device of f, as a daemon that can hand over has.
func newHandoverSoftGuest(t *testing.T, f *soft.Fabric, name string, dev *atomicDevice) (*guest, *journalBuf, hostverbs.Device) {
	t.Helper()
	mem, raw := guestmem.NewFlat(0, guestRAMSize)
	sd := openHandoverSoft(t, f, name, mem, dev)
	g := &guest{t: t, mem: mem, raw: raw, verbs: sd, irq: &fakeIRQ{}, next: 1 << 20}
	j := &journalBuf{}
	d, err := New(Config{Memory: mem, Verbs: sd, IRQ: g.irq, MAC: testMAC, Journal: j.sink})
	require.NoError(t, err)
	dev.Store(d)
	g.dev = d
	g.probe()
	g.bindGID(0, gidA)
	return g, j, sd
}
