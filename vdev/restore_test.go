package vdev

import (
	"encoding/binary"
	"log/slog"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// journalBuf is a journal file in memory: the sink appends records.
type journalBuf struct {
	mu   sync.Mutex
	b    []byte
	recs []int // offset of each record
}

func (j *journalBuf) sink(rec []byte) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.recs = append(j.recs, len(j.b))
	j.b = append(j.b, rec...)
}

func (j *journalBuf) bytes() []byte {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.b)
}

// newJournaledGuest is newGuestSized with a journal sink.
func newJournaledGuest(t testing.TB, verbs hostverbs.Device, size uint64) (*guest, *journalBuf) {
	t.Helper()
	mem, raw := guestmem.NewFlat(0, size)
	g := &guest{t: t, mem: mem, raw: raw, verbs: verbs, irq: &fakeIRQ{}, next: 1 << 20}
	j := &journalBuf{}
	dev, err := New(Config{Memory: mem, Verbs: verbs, IRQ: g.irq, MAC: testMAC, Journal: j.sink,
		OnGID: func(i int, e hostverbs.GIDEntry, bound bool) { g.gotGID = append(g.gotGID, gidEvent{i, e, bound}) }})
	require.NoError(t, err)
	g.dev = dev
	t.Cleanup(func() { _ = dev.Close() })
	return g, j
}

// restart is the daemon's crash and restart as the guest sees it: its
// memory, rings and objects stay, and a device restored from journal over
// verbs takes the dead one's place (which is never used again).
func (g *guest) restart(verbs hostverbs.Device, journal []byte, sink func([]byte)) (RestoreReport, error) {
	irq := &fakeIRQ{}
	g.gotGID = nil
	d, rep, err := Restore(Config{Memory: g.mem, Verbs: verbs, IRQ: irq, MAC: testMAC, Journal: sink, Logger: slog.New(slog.DiscardHandler),
		OnGID: func(i int, e hostverbs.GIDEntry, bound bool) { g.gotGID = append(g.gotGID, gidEvent{i, e, bound}) }}, journal)
	if err != nil {
		return rep, err
	}
	g.dev, g.irq, g.verbs = d, irq, verbs
	g.t.Cleanup(func() { _ = d.Close() })
	return rep, nil
}

var gidC = hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 14: 0, 15: 3}

// world is a guest that used its device the way the kernel and a few
// applications do, with holes in every handle table, a resized CQ and
// work outstanding in its rings when the daemon dies.
type world struct {
	g                    *guest
	fv                   *fakeVerbs
	j                    *journalBuf
	uc1, uc2             uint32
	pd0, pd1             uint32
	kcq, cq1, cq2, rsz   *gcq
	mr                   *gmr
	dma, frmr            abi.CreateMRResp
	srq                  *gsrq
	rc, rcSRQ, ud, gsi   *gqp
	idle                 *gqp
	holes                map[string]uint32 // kind -> the handle freed
	rcSends, rcRecvs     []uint64          // outstanding WRIDs: flushed by the restore
	udRecvs, gsiRecvs    []uint64          // outstanding WRIDs: posted by the restore
	srqRecvs             []uint64
	unpolled             []uint64 // CQEs of rsz the guest has not read
	caps                 abi.Caps
	qpns                 map[uint32]uint32    // QP handle -> QPN
	keys                 map[uint32][2]uint32 // MR handle -> lkey, rkey
	gids                 []hostverbs.GIDEntry
	objects              map[string]int
	pdHandles, cqHandles []uint32
}

func udAV(pd uint32) abi.AV { return abi.AV{PortPD: 1<<24 | pd, DGID: gidB, HopLimit: 64} }

func buildWorld(t testing.TB, size uint64) *world {
	fv := newFakeVerbs()
	g, j := newJournaledGuest(t, fv, size)
	w := &world{g: g, fv: fv, j: j, holes: map[string]uint32{}}
	g.probe()
	g.events()
	g.bindGID(0, gidA)
	g.bindGID(1, gidC)
	g.bindGID(2, gidB)
	g.mustCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 2, DestGID: gidB})

	w.uc1 = g.createUC(1)
	ucX := g.createUC(3)
	w.uc2 = g.createUC(2)
	g.mustCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: ucX})

	w.holes["pd"] = g.createPD(0)
	w.pd0, w.pd1 = g.createPD(0), g.createPD(w.uc1)

	cqX := g.createCQ(0, 16)
	w.holes["cq"] = cqX.handle
	w.kcq, w.cq1, w.cq2 = g.createCQ(0, 256), g.createCQ(w.uc1, 256), g.createCQ(w.uc1, 64)
	// A CQ created with 64 CQEs in the pages of 256, then resized: its
	// prod_tail ends past what 64 CQEs allow.
	w.rsz = &gcq{g: g, n: 64, uar: w.uc1, pages: g.pages(int(cqRingPages(256)))}
	var cr abi.CreateCQResp
	cr.Decode(g.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: g.pdir(w.rsz.pages), CtxHandle: w.uc1, CQE: 64, NChunks: uint32(len(w.rsz.pages))}))
	w.rsz.handle = cr.CQHandle
	g.mustCmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: w.rsz.handle, CQE: 256})
	w.rsz.n = 256

	mrX := g.regMR(w.pd1, 0x10000, 8192, 1)
	w.holes["mr"] = mrX.handle
	w.mr = g.regMR(w.pd1, 0x7f0000000123, 64<<10, 0xf)
	w.dma.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: w.pd0, AccessFlags: 1, Flags: abi.MRFlagDMA}))
	w.frmr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: w.pd0, AccessFlags: 1, Flags: abi.MRFlagFRMR, NChunks: 16}))
	g.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: mrX.handle})

	w.srq = g.createSRQ(w.pd1, 64, 2, 8, 1)
	g.mustCmd(abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: w.srq.handle, AttrMask: srqAttrLimit, Attrs: abi.SRQAttr{SRQLimit: 16}})

	qpX := g.createQP(qpSpec{pd: w.pd0, scq: w.kcq, rcq: w.kcq, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	w.holes["qp"] = qpX.handle
	w.rc = g.createQP(qpSpec{pd: w.pd1, scq: w.cq1, rcq: w.cq1, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 2, recvSGE: 2, uar: 1})
	w.rc.toRTS(0x99, gidB, 0)
	w.rcSRQ = g.createQP(qpSpec{pd: w.pd1, scq: w.cq2, rcq: w.cq2, srq: w.srq, typ: hostverbs.QPTypeRC, sendWR: 16, sendSGE: 1, uar: 1})
	w.rcSRQ.toRTS(0x9a, gidB, 1)
	w.ud = g.createQP(qpSpec{pd: w.pd1, scq: w.rsz, rcq: w.cq2, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	w.ud.udToRTS(0x1234)
	w.ud.mustModify(hostverbs.AttrQKey, abi.QPAttr{QKey: 0x5678}) // RTS -> RTS
	w.gsi = g.createQP(qpSpec{pd: w.pd0, scq: w.kcq, rcq: w.kcq, typ: hostverbs.QPTypeGSI, sendWR: 16, recvWR: 16, sendSGE: 2, recvSGE: 1, sigAll: true})
	w.gsi.mustModify(0x51, abi.QPAttr{State: 1, QKey: 0x80010000})
	w.gsi.mustModify(0x1, abi.QPAttr{State: 2})
	w.gsi.mustModify(0x10001, abi.QPAttr{State: 3})
	w.idle = g.createQP(qpSpec{pd: w.pd1, scq: w.cq1, rcq: w.cq1, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
	g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: qpX.handle})
	g.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: cqX.handle})
	g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: w.holes["pd"]})

	// Traffic: 150 UD sends complete on the resized CQ; the guest reads
	// all but the last 3.
	fq := fakeQPOf(t, fv, w.ud.qpn)
	for i := range 150 {
		h := wqe(hostverbs.WRSend, uint64(1000+i), hostverbs.SendSignaled)
		abi.WRUD{RemoteQPN: 7, RemoteQKey: 0x5678, AV: udAV(w.pd1)}.Encode(h.WR[:])
		w.ud.postSend(h, abi.SGE{Addr: w.mr.iova, Length: 64, LKey: w.mr.lkey})
		fq.take()
		fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
		if i < 147 {
			require.EqualValues(t, 1000+i, w.rsz.mustPoll().WRID)
		} else {
			w.unpolled = append(w.unpolled, uint64(1000+i))
		}
	}
	require.EqualValues(t, 150, w.rsz.tail())

	// The RC QP: receives in flight in the provider, one completed; then
	// sends and receives written but not rung.
	sge := abi.SGE{Addr: w.mr.iova, Length: 128, LKey: w.mr.lkey}
	for i := range 3 {
		w.rc.postRecv(uint64(200+i), sge)
	}
	// 201 and 202 stay in the provider: the ring still holds them, and
	// the restore flushes them.
	w.rcRecvs = []uint64{201, 202}
	fakeQPOf(t, fv, w.rc.qpn).finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	require.EqualValues(t, 200, w.cq1.mustPoll().WRID)
	for i := range 2 {
		w.rc.writeSend(wqe(hostverbs.WRSend, uint64(300+i), hostverbs.SendSignaled), sge)
		w.rcSends = append(w.rcSends, uint64(300+i))
		w.rc.writeRecv(uint64(400+i), sge)
		w.rcRecvs = append(w.rcRecvs, uint64(400+i))
	}
	// UD, GSI and SRQ receives written but not rung.
	for i := range 2 {
		w.ud.writeRecv(uint64(500+i), sge)
		w.udRecvs = append(w.udRecvs, uint64(500+i))
	}
	ksge := abi.SGE{Addr: 0x200000, Length: 256, LKey: w.dma.LKey}
	for i := range 4 {
		w.gsi.postRecv(uint64(600+i), ksge)
		w.gsiRecvs = append(w.gsiRecvs, uint64(600+i)) // in the dead provider: posted again
	}
	for i := range 2 {
		w.gsi.writeRecv(uint64(700+i), ksge)
		w.gsiRecvs = append(w.gsiRecvs, uint64(700+i))
	}
	w.srq.postRecv(800, sge)
	w.srqRecvs = []uint64{801}
	w.srq.writeRecv(801, sge)
	g.events()
	g.notifications()

	// What the guest knows.
	w.caps = g.dev.Caps()
	w.qpns, w.keys = map[uint32]uint32{}, map[uint32][2]uint32{}
	d := g.dev
	d.mu.Lock()
	d.qps.each(func(h uint32, q *qp) { w.qpns[h] = q.hv.QPN() })
	d.mrs.each(func(h uint32, m *mr) { w.keys[h] = [2]uint32{m.lkey, m.rkey} })
	d.pds.each(func(h uint32, _ *pd) { w.pdHandles = append(w.pdHandles, h) })
	d.cqs.each(func(h uint32, _ *cq) { w.cqHandles = append(w.cqHandles, h) })
	d.mu.Unlock()
	w.gids = d.GIDs()
	w.objects = d.Objects()
	return w
}

func fakeQPOf(t testing.TB, fv *fakeVerbs, qpn uint32) *fakeQP {
	t.Helper()
	fv.mu.Lock()
	defer fv.mu.Unlock()
	for i := len(fv.qps) - 1; i >= 0; i-- {
		if q := fv.qps[i]; !q.dead && q.qpn == qpn {
			return q
		}
	}
	t.Fatalf("no fake QP %#x", qpn)
	return nil
}

func recvIDs(rs []hostverbs.RecvWR) []uint64 {
	var out []uint64
	for _, r := range rs {
		out = append(out, r.WRID)
	}
	return out
}

// checkRestored checks a world's device after a restore over fv.
func (w *world) checkRestored(t *testing.T, fv *fakeVerbs, rep RestoreReport) {
	g, d := w.g, w.g.dev
	assert.False(t, rep.Torn)
	assert.Empty(t, rep.Notes)
	assert.Equal(t, ObjectCounts{UC: 2, PD: 2, MR: 3, CQ: 4, QP: 5, SRQ: 1, GID: 2}, rep.Rebuilt)
	assert.Equal(t, ObjectCounts{}, rep.Lost)
	assert.Equal(t, 2, rep.Errored, "the RC QP and the SRQ QP")
	assert.Equal(t, w.caps, d.Caps())
	assert.Equal(t, w.gids, d.GIDs())
	// The daemon hears of the GIDs (from a journal, of those bound and
	// unbound since as well).
	final := map[int]hostverbs.GID{}
	for _, e := range g.gotGID {
		if delete(final, e.index); e.bound {
			final[e.index] = e.e.GID
		}
	}
	assert.Equal(t, map[int]hostverbs.GID{0: gidA, 1: gidC}, final, "OnGID for the daemon")
	assert.Equal(t, w.objects, d.Objects(), "same objects, same MR bytes and costs")
	st := d.Stats()
	assert.EqualValues(t, 19, st.RestoredObjects)
	assert.EqualValues(t, 2, st.RestoreErroredQPs)
	assert.Zero(t, st.RestoreLostObjects)

	d.mu.Lock()
	qpns, keys := map[uint32]uint32{}, map[uint32][2]uint32{}
	states := map[uint32]hostverbs.QPState{}
	d.qps.each(func(h uint32, q *qp) { qpns[h], states[h] = q.hv.QPN(), q.State() })
	d.mrs.each(func(h uint32, m *mr) { keys[h] = [2]uint32{m.lkey, m.rkey} })
	for h, k := range w.keys {
		if h != w.frmr.MRHandle {
			assert.Same(t, d.keys[k[0]], d.mrs.items[h], "lkey %#x resolves to MR %d", k[0], h)
		}
	}
	d.mu.Unlock()
	assert.Equal(t, w.qpns, qpns, "QP handles and QPNs")
	assert.Equal(t, w.keys, keys, "MR handles and keys")
	assert.Equal(t, map[uint32]hostverbs.QPState{
		w.rc.handle: hostverbs.QPStateErr, w.rcSRQ.handle: hostverbs.QPStateErr,
		w.ud.handle: hostverbs.QPStateRTS, w.gsi.handle: hostverbs.QPStateRTS, w.idle.handle: hostverbs.QPStateReset,
	}, states)
	for h, qpn := range w.qpns {
		q := fakeQPOf(t, fv, qpn)
		assert.Equal(t, states[h], q.attr.State, "provider QP %#x", qpn)
	}
	assert.EqualValues(t, 0x5678, fakeQPOf(t, fv, w.ud.qpn).attr.QKey)
	assert.EqualValues(t, 0x80010000, fakeQPOf(t, fv, 1).attr.QKey)
	fv.mu.Lock()
	assert.EqualValues(t, 16, fv.srqs[0].attr.Limit)
	assert.Equal(t, w.srqRecvs, recvIDs(fv.srqs[0].recvs), "the SRQ's outstanding receive posted")
	fv.mu.Unlock()

	// QP_FATAL for the RC QPs, nothing else.
	assert.ElementsMatch(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: w.rc.handle},
		{Type: uint32(hostverbs.EventQPFatal), Info: w.rcSRQ.handle}}, g.events())
	// The RC QP's outstanding work flushed; what was in flight in the
	// dead provider is gone.
	var flushed []uint64
	for {
		e, ok := w.cq1.poll()
		if !ok {
			break
		}
		assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
		assert.EqualValues(t, w.rc.handle, e.QP)
		flushed = append(flushed, e.WRID)
	}
	assert.ElementsMatch(t, append(slices.Clone(w.rcSends), w.rcRecvs...), flushed)
	assert.Equal(t, w.rc.sqConsumed(), g.u32(w.rc.sqState()))
	assert.Equal(t, w.rc.rqConsumed(), g.u32(w.rc.rqState()))
	// UD and GSI receives written before the crash are posted now.
	_, udr := fakeQPOf(t, fv, w.ud.qpn).take()
	assert.Equal(t, w.udRecvs, guestRecvIDs(w.ud, udr))
	_, gsir := fakeQPOf(t, fv, 1).take()
	assert.Equal(t, w.gsiRecvs, guestRecvIDs(w.gsi, gsir))
	// The resized CQ continues at its prod_tail: the unread CQEs, then a
	// new one in the next slot.
	assert.EqualValues(t, 150, w.rsz.tail())
	for _, id := range w.unpolled {
		assert.EqualValues(t, id, w.rsz.mustPoll().WRID)
	}
	h := wqe(hostverbs.WRSend, 2000, hostverbs.SendSignaled)
	abi.WRUD{RemoteQPN: 7, RemoteQKey: 0x5678, AV: udAV(w.pd1)}.Encode(h.WR[:])
	w.ud.postSend(h, abi.SGE{Addr: w.mr.iova, Length: 64, LKey: w.mr.lkey})
	uq := fakeQPOf(t, fv, w.ud.qpn)
	s, _ := uq.take()
	require.Len(t, s, 1)
	uq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	assert.EqualValues(t, 2000, w.rsz.mustPoll().WRID)
	assert.EqualValues(t, 151, w.rsz.tail())
	// Notifications: the CQ with the flushes and the one with unread CQEs.
	assert.Subset(t, g.notifications(), []uint32{w.cq1.handle, w.rsz.handle})
}

// destroyAll tears the world down the way the guest would, after a restore.
func (w *world) destroyAll(t *testing.T, fv *fakeVerbs) {
	g := w.g
	for _, q := range []*gqp{w.rc, w.rcSRQ, w.ud, w.gsi, w.idle} {
		g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: q.handle})
	}
	g.mustCmd(abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: w.srq.handle})
	for h := range w.keys {
		g.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: h})
	}
	for _, h := range w.cqHandles {
		g.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: h})
	}
	for _, h := range w.pdHandles {
		g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: h})
	}
	g.mustCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: w.uc1})
	g.mustCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: w.uc2})
	g.mustCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 0, DestGID: gidA})
	g.mustCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 1, DestGID: gidC})
	for _, k := range []string{"pd", "mr", "cq", "qp", "srq"} {
		assert.Zero(t, fv.count(k), "provider %ss left", k)
	}
	for k, n := range g.dev.Objects() {
		assert.Zero(t, n, k)
	}
}

// TestRestoreRoundTrip: a device restored from its journal, and from its
// checkpoint, onto a new provider device over the same guest memory has
// the guest's handles, QPNs, keys, GIDs and capabilities; RC QPs are in
// ERR with a QP_FATAL event and their outstanding work flushed, UD and GSI
// QPs in RTS with their outstanding receives posted; new objects get free
// handles and the old ones can be destroyed.
func TestRestoreRoundTrip(t *testing.T) {
	w := buildWorld(t, guestRAMSize)
	journal := w.j.bytes()
	cp := w.g.dev.Checkpoint()
	assert.Less(t, len(cp), len(journal), "the checkpoint holds neither destroyed objects nor superseded modifies")
	mem := slices.Clone(w.g.raw)

	for _, src := range []struct {
		name string
		b    []byte
	}{{"journal", journal}, {"checkpoint", cp}} {
		t.Run(src.name, func(t *testing.T) {
			copy(w.g.raw, mem)
			fv := newFakeVerbs()
			j2 := &journalBuf{}
			rep, err := w.g.restart(fv, src.b, j2.sink)
			require.NoError(t, err)
			assert.Positive(t, rep.Records)
			assert.Equal(t, len(src.b), rep.ValidBytes)
			w.checkRestored(t, fv, rep)

			// New objects get the lowest free handles, never a live one,
			// and QPNs of their own.
			assert.Equal(t, w.holes["pd"], w.g.createPD(0))
			q := w.g.createQP(qpSpec{pd: w.pd1, scq: w.cq1, rcq: w.cq1, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
			assert.Equal(t, w.holes["qp"], q.handle)
			for _, qpn := range w.qpns {
				assert.NotEqual(t, qpn, q.qpn)
			}
			m := w.g.regMR(w.pd1, 0x30000, 4096, 1)
			assert.Equal(t, w.holes["mr"], m.handle)
			// The restored device journals on, numbered after the journal.
			seq := binary.LittleEndian.Uint64(j2.b[8:])
			assert.Greater(t, seq, uint64(1))
			w.g.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: m.handle})
			w.g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: q.handle})
			w.g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: w.holes["pd"]})
			w.destroyAll(t, fv)
		})
	}
}

// TestRestoreJournalContinues: a restored device's checkpoint, followed by
// the records it journals afterwards (some of them written twice, as a
// daemon rotating its file may), restores again; a second restart keeps
// everything the first rebuilt.
func TestRestoreJournalContinues(t *testing.T) {
	w := buildWorld(t, guestRAMSize)
	fv := newFakeVerbs()
	j2 := &journalBuf{}
	_, err := w.g.restart(fv, w.j.bytes(), j2.sink)
	require.NoError(t, err)
	w.g.events()
	w.g.notifications()
	for {
		if _, ok := w.cq1.poll(); !ok {
			break
		}
	}
	// The daemon rotates: records emitted before the checkpoint was
	// taken are in it; the file gets the checkpoint and then every
	// record from the moment Checkpoint was called.
	w.g.bindGID(2, gidB)
	cp := w.g.dev.Checkpoint()
	pd := w.g.createPD(w.uc2)
	w.ud.mustModify(hostverbs.AttrQKey, abi.QPAttr{QKey: 0x7777})
	w.rc.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	j2.mu.Lock()
	last := j2.recs[len(j2.recs)-4] // the bind, which the checkpoint holds
	file := append(slices.Clone(cp), j2.b[last:]...)
	j2.mu.Unlock()

	fv3 := newFakeVerbs()
	rep, err := w.g.restart(fv3, file, nil)
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Duplicates)
	assert.Equal(t, 0, rep.Errored, "the RC QPs were already in ERR or RESET")
	assert.Equal(t, hostverbs.GIDEntry{GID: gidB, Type: hostverbs.GIDTypeRoCEv2}, w.g.dev.GIDs()[2])
	d := w.g.dev
	d.mu.Lock()
	p, ok := d.pds.get(pd)
	require.True(t, ok)
	assert.EqualValues(t, w.uc2, p.uar)
	rc, _ := d.qps.get(w.rc.handle)
	assert.Equal(t, hostverbs.QPStateReset, rc.State())
	rcSRQ, _ := d.qps.get(w.rcSRQ.handle)
	assert.Equal(t, hostverbs.QPStateErr, rcSRQ.State(), "in ERR by the first restore")
	d.mu.Unlock()
	assert.EqualValues(t, 0x7777, fakeQPOf(t, fv3, w.ud.qpn).attr.QKey)
	assert.Empty(t, w.g.events(), "no second QP_FATAL for QPs already in ERR")
}

// restoreErr restores journal over a fresh fake and returns the error.
func restoreErr(t *testing.T, w *world, journal []byte) (RestoreReport, error) {
	t.Helper()
	return w.g.restart(newFakeVerbs(), journal, nil)
}

// recordAt returns the offset and length of record i of a journal.
func recordAt(b []byte, i int) (int, int) {
	off := 0
	for ; i > 0; i-- {
		off += recHdrSize + int(binary.LittleEndian.Uint32(b[off+16:]))
	}
	return off, recHdrSize + int(binary.LittleEndian.Uint32(b[off+16:]))
}

func countRecords(b []byte) int {
	n := 0
	for off := 0; off < len(b); n++ {
		off += recHdrSize + int(binary.LittleEndian.Uint32(b[off+16:]))
	}
	return n
}

// reseal recomputes the checksum of the record at off.
func reseal(b []byte, off int) {
	n := int(binary.LittleEndian.Uint32(b[off+16:]))
	binary.LittleEndian.PutUint32(b[off+20:], recordCRC(b[off:off+recHdrSize], b[off+recHdrSize:off+recHdrSize+n]))
}

// TestRestoreTornAndCorrupt: a torn last record is ignored with a note
// and the sound length reported; damage anywhere else, a foreign version,
// a gap, and records that contradict the journal fail with ErrJournal,
// leaving nothing behind in the provider.
func TestRestoreTornAndCorrupt(t *testing.T) {
	w := buildWorld(t, 8<<20)
	journal := w.j.bytes()
	mem := slices.Clone(w.g.raw)
	n := countRecords(journal)
	lastOff, _ := recordAt(journal, n-1)

	torn := map[string][]byte{
		"cut in the payload": journal[:len(journal)-3],
		"cut in the header":  journal[:lastOff+10],
		"zero tail":          append(slices.Clone(journal), make([]byte, 100)...),
		"bad checksum": func() []byte {
			b := slices.Clone(journal)
			b[len(b)-1] ^= 0xff
			return b
		}(),
	}
	for name, b := range torn {
		t.Run(name, func(t *testing.T) {
			copy(w.g.raw, mem)
			rep, err := restoreErr(t, w, b)
			require.NoError(t, err)
			assert.True(t, rep.Torn)
			assert.Len(t, rep.Notes, 1)
			if name == "zero tail" {
				assert.Equal(t, len(journal), rep.ValidBytes)
			} else {
				assert.Equal(t, lastOff, rep.ValidBytes)
			}
		})
	}

	mid, midLen := recordAt(journal, n/2)
	corrupt := map[string]func([]byte) []byte{
		"flipped byte mid-journal": func(b []byte) []byte { b[mid+recHdrSize+1] ^= 1; return b },
		"wrong version": func(b []byte) []byte {
			b[4] = JournalVersion + 1
			reseal(b, 0)
			return b
		},
		"oversized record": func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[mid+16:], maxRecPayload+1)
			return b
		},
		"gap":          func(b []byte) []byte { return append(b[:mid:mid], b[mid+midLen:]...) },
		"garbage":      func(b []byte) []byte { return append(b, []byte("not a record at all, but long enough")...) },
		"unknown type": func(b []byte) []byte { b[mid+5] = 9; reseal(b, mid); return b },
		"duplicate handle": func(b []byte) []byte {
			// Replay the PD create that follows again, renumbered.
			i := findCmd(t, b, abi.CmdCreatePD, 1)
			off, l := recordAt(b, i)
			rec := slices.Clone(b[off : off+l])
			binary.LittleEndian.PutUint64(rec[8:], uint64(countRecords(b)+1))
			reseal(rec, 0)
			return append(b, rec...)
		},
		"handle out of range": func(b []byte) []byte {
			i := findCmd(t, b, abi.CmdCreatePD, 0)
			off, _ := recordAt(b, i)
			put32(b[off+recHdrSize+abi.CreatePDSize:], abi.RespHdrSize, 1<<20)
			reseal(b, off)
			return b
		},
		"QP names a missing CQ": func(b []byte) []byte {
			i := findCmd(t, b, abi.CmdCreateQP, 1)
			off, _ := recordAt(b, i)
			put32(b[off+recHdrSize:], abi.CreateQPSendCQOffset, 77)
			reseal(b, off)
			return b
		},
		"response differs": func(b []byte) []byte {
			i := findCmd(t, b, abi.CmdCreateQP, 1)
			off, _ := recordAt(b, i)
			put32(b[off+recHdrSize+abi.CreateQPSize:], 24, 7) // max_send_wr
			reseal(b, off)
			return b
		},
		"destroy of a PD in use": func(b []byte) []byte {
			req := make([]byte, abi.DestroyPDSize+abi.RespHdrSize)
			abi.CmdHdr{Cmd: abi.CmdDestroyPD}.Encode(req)
			abi.DestroyPD{PDHandle: w.pd1}.Encode(req)
			return appendRecord(b, recCommand, 0, uint64(countRecords(b)+1), req)
		},
		"query in the journal": func(b []byte) []byte {
			req := make([]byte, abi.QueryPKeySize+abi.QueryPKeyRespSize)
			abi.CmdHdr{Cmd: abi.CmdQueryPKey}.Encode(req)
			return appendRecord(b, recCommand, 0, uint64(countRecords(b)+1), req)
		},
		"request register": func(b []byte) []byte {
			reg := make([]byte, 8)
			put32(reg, 0, abi.RegRequest)
			return appendRecord(b, recRegister, 0, uint64(countRecords(b)+1), reg)
		},
		"no start": func(b []byte) []byte { off, l := recordAt(b, 0); return b[off+l:] },
	}
	for name, mutate := range corrupt {
		t.Run(name, func(t *testing.T) {
			copy(w.g.raw, mem)
			fv := newFakeVerbs()
			_, err := w.g.restart(fv, mutate(slices.Clone(journal)), nil)
			require.ErrorIs(t, err, ErrJournal)
			t.Log(err)
			for _, k := range []string{"pd", "mr", "cq", "qp", "srq"} {
				assert.Zero(t, fv.count(k), "%ss left in the provider", k)
			}
		})
	}

	t.Run("DSR ring gone", func(t *testing.T) {
		copy(w.g.raw, mem)
		w.g.put32(w.g.async[0]+8, 0xffffffff) // the device's prod_tail of the event ring
		fv := newFakeVerbs()
		_, err := w.g.restart(fv, journal, nil)
		require.ErrorIs(t, err, ringbuf.ErrIndex, "the guest memory, not the journal")
		require.NotErrorIs(t, err, ErrJournal)
		assert.Zero(t, fv.count("qp"))
	})

	t.Run("checkpoint cut short", func(t *testing.T) {
		copy(w.g.raw, mem)
		cp := w.g.dev.Checkpoint()
		off, _ := recordAt(cp, countRecords(cp)-1)
		_, err := restoreErr(t, w, cp[:off])
		require.ErrorIs(t, err, ErrJournal, "a checkpoint missing its last records is not a torn journal")
	})
}

// findCmd returns the index of the k-th command record with code c.
func findCmd(t *testing.T, b []byte, c uint32, k int) int {
	for i, off := 0, 0; off < len(b); i++ {
		n := int(binary.LittleEndian.Uint32(b[off+16:]))
		if b[off+5] == recCommand && binary.LittleEndian.Uint32(b[off+recHdrSize+abi.CmdHdrCmdOffset:]) == c {
			if k == 0 {
				return i
			}
			k--
		}
		off += recHdrSize + n
	}
	t.Fatalf("no command %d", c)
	return 0
}

// TestRestoreLostObjects: an MR whose page directory the guest no longer
// holds, and everything of a provider that cannot choose QPNs and keys
// (the relay), are lost: handles kept, QP_FATAL and CQ_ERR raised, work
// on them flushed or refused, DESTROY succeeding; the rest is rebuilt.
func TestRestoreLostObjects(t *testing.T) {
	w := buildWorld(t, guestRAMSize)
	journal := w.j.bytes()
	mem := slices.Clone(w.g.raw)

	t.Run("page directory gone", func(t *testing.T) {
		copy(w.g.raw, mem)
		// The guest reused the page directory of its MR (a bug of its).
		d := w.g.dev
		d.mu.Lock()
		m, _ := d.mrs.get(w.mr.handle)
		var r abi.CreateMR
		r.Decode(m.rec)
		d.mu.Unlock()
		w.g.put64(r.PDirDMA, 0xdead0000000)
		// A CQ whose ring state the guest overwrote.
		w.g.put32(w.cq2.pages[0]+8, 0xffffffff)
		fv := newFakeVerbs()
		rep, err := w.g.restart(fv, journal, nil)
		require.NoError(t, err)
		assert.Equal(t, ObjectCounts{MR: 1, CQ: 1, QP: 2}, rep.Lost, "the QPs on the lost CQ go with it: %q", rep.Notes)
		assert.Len(t, rep.Notes, 4, "why each was lost")
		ev := w.g.events()
		assert.Contains(t, ev, abi.EQE{Type: uint32(hostverbs.EventCQErr), Info: w.cq2.handle})
		assert.Contains(t, ev, abi.EQE{Type: uint32(hostverbs.EventQPFatal), Info: w.ud.handle})
		assert.Contains(t, ev, abi.EQE{Type: uint32(hostverbs.EventQPFatal), Info: w.rcSRQ.handle})
		// The lost MR's key no longer works: a receive using it fails.
		// Its completion comes after those of the receives the restore
		// posted again (a queue completes in order): the provider
		// delivers them first.
		gq := fakeQPOf(t, fv, 1)
		for gq.outstanding(true) > 0 {
			gq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
		}
		w.gsi.postRecv(1, abi.SGE{Addr: w.mr.iova, Length: 8, LKey: w.mr.lkey})
		for range w.gsiRecvs {
			assert.EqualValues(t, hostverbs.WCSuccess, w.kcq.mustPoll().Status)
		}
		// (a kernel QP in another PD: LOC_PROT_ERR either way)
		e := w.kcq.mustPoll()
		assert.EqualValues(t, hostverbs.WCLocProtErr, e.Status)
		errReg, _ := w.g.cmd(abi.CmdModifyQP, abi.ModifyQP{QPHandle: w.ud.handle, AttrMask: uint32(hostverbs.AttrQKey), Attrs: abi.QPAttr{QKey: 1}})
		assert.NotZero(t, errReg, "commands on a lost QP fail")
		errReg, _ = w.g.cmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: w.cq2.handle, CQE: 32})
		assert.NotZero(t, errReg)
		w.ud.postRecv(9, abi.SGE{Addr: w.mr.iova, Length: 8, LKey: w.mr.lkey}) // a doorbell of a lost QP: flushed to its (lost) CQ: nothing
		w.destroyAll(t, fv)
	})

	t.Run("relay", func(t *testing.T) {
		copy(w.g.raw, mem)
		fv := newFakeVerbs()
		fv.noForce = true
		rep, err := w.g.restart(fv, journal, nil)
		require.NoError(t, err)
		assert.Equal(t, ObjectCounts{MR: 3, QP: 5}, rep.Lost, "%q", rep.Notes)
		assert.Equal(t, ObjectCounts{UC: 2, PD: 2, CQ: 4, SRQ: 1, GID: 2}, rep.Rebuilt,
			"the fast-reg MR's key is the provider's: it cannot be taken back either")
		assert.EqualValues(t, 8, w.g.dev.Stats().RestoreLostObjects)
		var fatal []uint32
		for _, e := range w.g.events() {
			if e.Type == uint32(hostverbs.EventSRQErr) {
				// The SRQ's outstanding receive names the lost MR.
				assert.Equal(t, w.srq.handle, e.Info)
				continue
			}
			require.EqualValues(t, hostverbs.EventQPFatal, e.Type)
			fatal = append(fatal, e.Info)
		}
		assert.ElementsMatch(t, []uint32{w.rc.handle, w.rcSRQ.handle, w.ud.handle, w.gsi.handle, w.idle.handle}, fatal)
		// The lost RC QP's rings were adopted: its outstanding work is
		// flushed, and so is what the guest posts next.
		var flushed []uint64
		for {
			e, ok := w.cq1.poll()
			if !ok {
				break
			}
			assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
			flushed = append(flushed, e.WRID)
		}
		assert.ElementsMatch(t, append(slices.Clone(w.rcSends), w.rcRecvs...), flushed)
		w.rc.postSend(wqe(hostverbs.WRSend, 77, hostverbs.SendSignaled), abi.SGE{Addr: w.mr.iova, Length: 8, LKey: w.mr.lkey})
		e := w.cq1.mustPoll()
		assert.EqualValues(t, 77, e.WRID)
		assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
		// ib_drain_qp's move to ERR works; anything else fails.
		w.rc.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
		errReg, _ := w.rc.modify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
		assert.NotZero(t, errReg)
		errReg, _ = w.g.cmd(abi.CmdQueryQP, abi.QueryQP{QPHandle: w.rc.handle})
		assert.NotZero(t, errReg)
		// New QPs cannot be created on this provider with given numbers,
		// but with its own they can.
		q := w.g.createQP(qpSpec{pd: w.pd1, scq: w.cq1, rcq: w.cq1, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
		assert.Equal(t, w.holes["qp"], q.handle)
		w.g.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: q.handle})
		// A checkpoint of the degraded device keeps the lost objects: a
		// provider that can take them back rebuilds them (the QPs in ERR,
		// as the guest knows them).
		cp := w.g.dev.Checkpoint()
		w.destroyAll(t, fv)
		copy(w.g.raw, mem)
		fv2 := newFakeVerbs()
		rep, err = w.g.restart(fv2, cp, nil)
		require.NoError(t, err)
		assert.Equal(t, ObjectCounts{}, rep.Lost, "%q", rep.Notes)
		assert.Equal(t, 5, rep.Rebuilt.QP)
		assert.Zero(t, rep.Errored, "already in ERR")
		w.destroyAll(t, fv2)
	})

	t.Run("garbage in a response header", func(t *testing.T) {
		// A lost object's record goes into checkpoints as the device
		// would have answered its create.
		copy(w.g.raw, mem)
		b := slices.Clone(journal)
		i := findCmd(t, b, abi.CmdCreateMR, 1)
		off, _ := recordAt(b, i)
		copy(b[off+recHdrSize+abi.CreateMRSize:], "garbage!")
		reseal(b, off)
		fv := newFakeVerbs()
		fv.noForce = true
		_, err := w.g.restart(fv, b, nil)
		require.NoError(t, err)
		cp := w.g.dev.Checkpoint()
		copy(w.g.raw, mem)
		rep, err := w.g.restart(newFakeVerbs(), cp, nil)
		require.NoError(t, err)
		assert.Equal(t, ObjectCounts{}, rep.Lost, "%q", rep.Notes)
	})
}

// TestRestoreEmptyAndUnprobed: an empty journal and that of a device the
// guest never probed give a fresh device.
func TestRestoreEmptyAndUnprobed(t *testing.T) {
	g, j := newJournaledGuest(t, newFakeVerbs(), 4<<20)
	require.NoError(t, g.writeReg(abi.RegIMR, 0))
	for _, b := range [][]byte{nil, j.bytes(), g.dev.Checkpoint()} {
		rep, err := g.restart(newFakeVerbs(), b, nil)
		require.NoError(t, err)
		assert.Equal(t, ObjectCounts{}, rep.Rebuilt)
		assert.EqualValues(t, 0xFFFF, g.readReg(abi.RegErr))
		g.probe()
	}
}

// TestCheckpointCompacts: a checkpoint stays the size of the live objects
// however many commands made them: a QP's modifies are compacted to its
// path from RESET.
func TestCheckpointCompacts(t *testing.T) {
	g, _ := newJournaledGuest(t, newFakeVerbs(), 8<<20)
	g.probe()
	g.bindGID(0, gidA)
	pd := g.createPD(0)
	cq := g.createCQ(0, 64)
	q := g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	q.toRTS(9, gidB, 0)
	base := len(g.dev.Checkpoint())
	for i := range 100 {
		q.mustModify(hostverbs.AttrMinRNRTimer, abi.QPAttr{MinRNRTimer: uint8(i % 31)})
		g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: g.createPD(0)})
	}
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateSQD)})
	q.mustModify(hostverbs.AttrState|hostverbs.AttrTimeout, abi.QPAttr{State: uint32(hostverbs.QPStateSQD), Timeout: 3})
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateRTS)})
	assert.Equal(t, base, len(g.dev.Checkpoint()), "RTS->RTS and RTS->SQD->RTS merge into the RTR->RTS entry")
	d := g.dev
	d.mu.Lock()
	qq, _ := d.qps.get(q.handle)
	require.Len(t, qq.mods, 3)
	var m abi.ModifyQP
	m.Decode(qq.mods[2].rec)
	d.mu.Unlock()
	assert.EqualValues(t, 99%31, m.Attrs.MinRNRTimer, "the last one set")
	assert.EqualValues(t, hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|hostverbs.AttrRNRRetry|
		hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic|hostverbs.AttrMinRNRTimer, m.AttrMask)
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	d.mu.Lock()
	assert.Empty(t, qq.mods)
	d.mu.Unlock()
}

// TestJournalRecordOrder: a command's record reaches the sink before its
// response reaches the guest, and a failed command leaves none.
func TestJournalRecordOrder(t *testing.T) {
	var g *guest
	var seen []uint32
	sink := func(rec []byte) {
		if rec[5] != recCommand {
			return
		}
		// The response slot still holds what the guest's driver put
		// there before the command (0xEE): not answered yet.
		seen = append(seen, binary.LittleEndian.Uint32(rec[recHdrSize+abi.CmdHdrCmdOffset:]))
		require.Equal(t, byte(0xEE), g.raw[g.rspGPA])
	}
	fv := newFakeVerbs()
	mem, raw := guestmem.NewFlat(0, 4<<20)
	g = &guest{t: t, mem: mem, raw: raw, verbs: fv, irq: &fakeIRQ{}, next: 1 << 20}
	d, err := New(Config{Memory: mem, Verbs: fv, IRQ: g.irq, MAC: testMAC, Journal: sink})
	require.NoError(t, err)
	g.dev = d
	t.Cleanup(func() { _ = d.Close() })
	g.probe()
	pd := g.createPD(0)
	errReg, _ := g.cmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd + 1})
	require.NotZero(t, errReg)
	g.cmd(abi.CmdQueryPKey, abi.QueryPKey{PortNum: 1})
	fv.failNext("AllocPD", hostverbs.ErrNoResources)
	errReg, _ = g.cmd(abi.CmdCreatePD, abi.CreatePD{})
	require.NotZero(t, errReg)
	assert.Equal(t, []uint32{abi.CmdCreatePD}, seen)
	assert.EqualValues(t, 1+4, d.Stats().JournalRecords, "DSRLOW, DSRHIGH, IMR, ACTIVATE and the PD")
}

// TestRestoreSoft restores a guest of the soft provider onto a new soft
// device of the same fabric: UD traffic with a peer resumes with the same
// QPN and keys, and the RC QP reports its error.
func TestRestoreSoft(t *testing.T) {
	f := newSoftFabric(t)
	peer := newSoftSide(t, f, "vm-b", gidB)
	open := func(name string, mem *guestmem.Memory, dev *atomicDevice) hostverbs.Device {
		sd, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: mem, MAC: testMAC,
			Events: func(ev hostverbs.AsyncEvent) {
				if d := dev.Load(); d != nil {
					d.HandleEvent(ev)
				}
			}})
		require.NoError(t, err)
		return sd
	}
	var dev1 atomicDevice
	mem, raw := guestmem.NewFlat(0, guestRAMSize)
	sd1 := open("vm-a", mem, &dev1)
	g := &guest{t: t, mem: mem, raw: raw, verbs: sd1, irq: &fakeIRQ{}, next: 1 << 20}
	j := &journalBuf{}
	d1, err := New(Config{Memory: mem, Verbs: sd1, IRQ: g.irq, MAC: testMAC, Journal: j.sink})
	require.NoError(t, err)
	dev1.Store(d1)
	g.dev = d1
	g.probe()
	g.bindGID(0, gidA)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	scq, rcq := g.createCQ(uc, 64), g.createCQ(uc, 64)
	mr := g.regMR(pd, 0x7f0000001000, 64<<10, 0xf)
	rc := g.createQP(qpSpec{pd: pd, scq: scq, rcq: rcq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	rc.toRTS(peer.qp.qpn, gidB, 0)
	ud := g.createQP(qpSpec{pd: pd, scq: scq, rcq: rcq, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	ud.udToRTS(0x1111)
	qb := peer.g.createQP(qpSpec{pd: peer.pd, scq: peer.scq, rcq: peer.rcq, typ: hostverbs.QPTypeUD, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	qb.udToRTS(0x1111)
	g.events()
	// A receive in the ring the dead device never saw.
	ud.writeRecv(42, abi.SGE{Addr: mr.iova, Length: 40 + 512, LKey: mr.lkey})

	// kill -9: the provider device goes with the daemon (its GIDs are
	// released); the guest memory stays.
	require.NoError(t, sd1.Close())
	var dev2 atomicDevice
	sd2 := open("vm-a", mem, &dev2)
	t.Cleanup(func() { _ = sd2.Close() })
	rep, err := g.restart(sd2, j.bytes(), nil)
	require.NoError(t, err)
	dev2.Store(g.dev)
	assert.Equal(t, ObjectCounts{UC: 1, PD: 1, MR: 1, CQ: 2, QP: 2, GID: 1}, rep.Rebuilt, "%q", rep.Notes)
	assert.Equal(t, 1, rep.Errored)
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: rc.handle}}, g.events())
	d := g.dev
	d.mu.Lock()
	m, _ := d.mrs.get(mr.handle)
	assert.Equal(t, [2]uint32{mr.lkey, mr.rkey}, [2]uint32{m.hv.LKey(), m.hv.RKey()}, "the soft provider took the keys back")
	q, _ := d.qps.get(ud.handle)
	assert.Equal(t, ud.qpn, q.hv.QPN())
	d.mu.Unlock()

	// The peer sends to the restored UD QP by its old QPN: the receive
	// posted by the restore takes it.
	payload := randBytes(512, 5)
	peer.mr.write(peer.g, 0, payload)
	h := wqe(hostverbs.WRSend, 6, hostverbs.SendSignaled)
	abi.WRUD{RemoteQPN: ud.qpn, RemoteQKey: 0x1111, AV: abi.AV{PortPD: 1<<24 | peer.pd, DGID: gidA, HopLimit: 1}}.Encode(h.WR[:])
	qb.postSend(h, peer.sge(0, 512))
	r := waitCQE(t, rcq)
	require.EqualValues(t, hostverbs.WCSuccess, r.Status)
	assert.EqualValues(t, 42, r.WRID)
	assert.EqualValues(t, qb.qpn, r.SrcQP)
	assert.Equal(t, payload, mr.read(g, 40, 512))
	// And back, with the restored MR's key.
	qb.postRecv(7, peer.sge(4096, 40+512))
	h = wqe(hostverbs.WRSend, 8, hostverbs.SendSignaled)
	abi.WRUD{RemoteQPN: qb.qpn, RemoteQKey: 0x1111, AV: abi.AV{PortPD: 1<<24 | pd, DGID: gidB, HopLimit: 1}}.Encode(h.WR[:])
	ud.postSend(h, abi.SGE{Addr: mr.iova + 40, Length: 512, LKey: mr.lkey})
	assert.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, peer.rcq).Status)
	assert.Equal(t, payload, peer.mr.read(peer.g, 4096+40, 512))
	// The RC QP is usable again after the guest resets it.
	rc.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	rc.toRTS(peer.qp.qpn, gidB, 0)
}

type atomicDevice struct {
	mu sync.Mutex
	d  *Device
}

func (a *atomicDevice) Load() *Device {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.d
}

func (a *atomicDevice) Store(d *Device) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.d = d
}

// guestRecvIDs returns the guest's wr_ids of receives the device posted to
// the provider: a provider WRID names the receive's ring index.
func guestRecvIDs(q *gqp, wrs []hostverbs.RecvWR) []uint64 {
	var ids []uint64
	for _, wr := range wrs {
		var h abi.RQWQEHdr
		h.Decode(q.g.raw[q.rqWQE(uint32(wr.WRID)):])
		ids = append(ids, h.WRID)
	}
	return ids
}

// TestRestoreDestroyedNotLost: an MR the guest destroyed before the crash
// whose page directory it has since reused cannot be registered again when
// the journal is replayed, but it is gone, not lost: the report neither
// counts it nor says it was lost.
func TestRestoreDestroyedNotLost(t *testing.T) {
	w := buildWorld(t, guestRAMSize)
	journal := w.j.bytes()
	// The first MR of the world (mrX) was created and destroyed.
	off, _ := recordAt(journal, findCmd(t, journal, abi.CmdCreateMR, 0))
	var r abi.CreateMR
	r.Decode(journal[off+recHdrSize:])
	var resp abi.CreateMRResp
	resp.Decode(journal[off+recHdrSize+abi.CreateMRSize:])
	require.Equal(t, w.holes["mr"], resp.MRHandle, "the record is mrX's")
	w.g.put64(r.PDirDMA, 0xdead0000123) // reused: not a page address
	rep, err := w.g.restart(newFakeVerbs(), journal, nil)
	require.NoError(t, err)
	assert.Equal(t, ObjectCounts{}, rep.Lost, "%q", rep.Notes)
	for _, n := range rep.Notes {
		assert.NotContains(t, n, "lost", "no note calls an object lost when none is")
	}
	w.destroyAll(t, w.g.verbs.(*fakeVerbs))
}
