package vdev

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// srqJournal is hoWorld's hand-over journal taken apart around its SRQ
// receive record, to be put together again with other SRQ records.
type srqJournal struct {
	head    []byte   // the records before the SRQ record
	seq     uint64   // the SRQ record's number
	payload []byte   // its payload
	tail    [][]byte // the payloads of the transport records after it
}

func splitSRQJournal(t testing.TB, b []byte) srqJournal {
	t.Helper()
	var j srqJournal
	for i := range countRecords(b) {
		off, n := recordAt(b, i)
		switch typ := b[off+5]; {
		case typ == recSRQRecvs:
			require.Nil(t, j.head, "one SRQ record")
			j.head = slices.Clone(b[:off])
			j.seq = binary.LittleEndian.Uint64(b[off+8:])
			j.payload = slices.Clone(b[off+recHdrSize : off+n])
		case j.head != nil:
			require.Equal(t, recTransport, int(typ))
			j.tail = append(j.tail, slices.Clone(b[off+recHdrSize:off+n]))
		}
	}
	require.NotNil(t, j.head)
	return j
}

// with returns the journal with the SRQ record replaced by records of
// payloads ps (numbered on).
func (j srqJournal) with(ps ...[]byte) []byte {
	out := slices.Clone(j.head)
	seq := j.seq
	for _, p := range ps {
		out = appendRecord(out, recSRQRecvs, 0, seq, p)
		seq++
	}
	for _, p := range j.tail {
		out = appendRecord(out, recTransport, 0, seq, p)
		seq++
	}
	return out
}

// Offsets in hoWorld's SRQ record: three receives of one SGE.
const (
	srqRecvSize = abi.RQWQEHdrSize + abi.SGESize
	srqRecv0    = srqRecHdr
)

// srqRec builds an SRQ receive record payload of hoWorld's SRQ h: flags,
// limit, first, then the receives (each a header and its SGEs).
func srqRec(h uint32, flags uint8, limit, first uint32, recvs ...[]byte) []byte {
	p := make([]byte, srqRecHdr)
	p[0], p[1] = srqRecVersion, flags
	put32(p, 4, h)
	put32(p, 8, limit)
	put32(p, 12, first)
	put32(p, 16, uint32(len(recvs)))
	for _, r := range recvs {
		p = append(p, r...)
	}
	return p
}

// TestHandoverSRQRecords: the SRQ receive records a hand-over wrote, split
// into several records or into one per receive, restore the same; records
// that are damaged, contradict each other or the SRQ (a handle that names
// no SRQ, a gap, a record after the last, more receives or SGEs than the
// SRQ takes, a limit above its depth, bytes left over, a payload above
// the bound) fail the restore with ErrJournal; one of another version,
// one whose last record is missing, or a receive whose MR is gone leave
// notes: the SRQ's receives not restored and its QP to the crash path, or
// that one receive dropped with an SRQ_ERR event. Never a panic.
func TestHandoverSRQRecords(t *testing.T) {
	w := buildHandover(t)
	_, err := w.g.dev.SaveTransports()
	require.NoError(t, err)
	mem := slices.Clone(w.g.raw)
	j := splitSRQJournal(t, w.j.bytes())
	p := j.payload
	h := w.srq.handle
	require.Equal(t, srqRecHdr+3*srqRecvSize, len(p))
	recv := func(i int) []byte { return p[srqRecv0+i*srqRecvSize : srqRecv0+(i+1)*srqRecvSize] }
	mutate := func(f func(p []byte)) []byte {
		q := slices.Clone(p)
		f(q)
		return q
	}
	restore := func(t *testing.T, b []byte) (*fakeVerbs, RestoreReport, error) {
		copy(w.g.raw, mem)
		fv := newFakeVerbs()
		rep, err := w.g.restart(fv, b, nil)
		return fv, rep, err
	}

	for name, recs := range map[string][][]byte{
		"as written": {p},
		"split":      {srqRec(h, 0, 0, 0, recv(0), recv(1)), srqRec(h, srqRecLast, 0, 2, recv(2))},
		"one each": {srqRec(h, 0, 0, 0, recv(0)), srqRec(h, 0, 0, 1, recv(1)), srqRec(h, 0, 0, 2),
			srqRec(h, srqRecLast, 0, 2, recv(2))},
	} {
		t.Run(name, func(t *testing.T) {
			fv, rep, err := restore(t, j.with(recs...))
			require.NoError(t, err)
			w.checkContinued(t, fv, rep)
		})
	}

	errJournal := map[string][][]byte{
		"short":            {p[:srqRecHdr-1]},
		"no such SRQ":      {mutate(func(q []byte) { put32(q, 4, 999) })},
		"after the last":   {p, srqRec(h, srqRecLast, 0, 3)},
		"gap":              {srqRec(h, 0, 0, 0, recv(0)), srqRec(h, srqRecLast, 0, 2, recv(2))},
		"overlap":          {srqRec(h, 0, 0, 0, recv(0), recv(1)), srqRec(h, srqRecLast, 0, 1, recv(2))},
		"limits differ":    {srqRec(h, 0, 0, 0, recv(0)), srqRec(h, srqRecLast, 2, 1, recv(1), recv(2))},
		"limit above":      {mutate(func(q []byte) { put32(q, 8, w.srq.n+1) })},
		"beyond the depth": {srqRec(h, 0, 0, 0, recv(0)), srqRec(h, srqRecLast, 0, 1, slices.Repeat(recv(1), int(w.srq.n)))},
		"SGEs above":       {mutate(func(q []byte) { put32(q, srqRecv0+8, 2) })},
		"total_len":        {mutate(func(q []byte) { put32(q, srqRecv0+12, 64) })},
		"count above":      {mutate(func(q []byte) { put32(q, 16, 4) })},
		"count below":      {mutate(func(q []byte) { put32(q, 16, 2) })},
		"SGE cut":          {p[:len(p)-1]},
		"oversized":        {append(slices.Clone(p), make([]byte, maxSRQRecPayload)...)},
	}
	for name, recs := range errJournal {
		t.Run(name, func(t *testing.T) {
			fv, _, err := restore(t, j.with(recs...))
			require.ErrorIs(t, err, ErrJournal)
			t.Log(err)
			assert.Zero(t, fv.count("srq"), "nothing left in the provider")
		})
	}

	notRestored := map[string]struct {
		recs [][]byte
		note string
	}{
		"version 2":        {[][]byte{mutate(func(q []byte) { q[0] = 2 })}, "version 2"},
		"unknown flag":     {[][]byte{mutate(func(q []byte) { q[1] |= 2 })}, "flags"},
		"reserved":         {[][]byte{mutate(func(q []byte) { q[3] = 1 })}, "ignored"},
		"last missing":     {[][]byte{mutate(func(q []byte) { q[1] = 0 })}, "last record is missing"},
		"version 2 second": {[][]byte{srqRec(h, 0, 0, 0, recv(0)), mutate(func(q []byte) { q[0] = 2 })}, "version 2"},
	}
	for name, tc := range notRestored {
		t.Run(name, func(t *testing.T) {
			fv, rep, err := restore(t, j.with(tc.recs...))
			require.NoError(t, err)
			assert.Equal(t, 1, rep.Continued, "the RC QP of its own receive queue")
			assert.Equal(t, 1, rep.Errored, "the RC QP on the SRQ")
			assert.Zero(t, rep.SRQRecvs)
			require.Len(t, rep.Notes, 2, "%q", rep.Notes)
			assert.Contains(t, rep.Notes[0], tc.note)
			assert.Contains(t, rep.Notes[1], "receives of its SRQ")
			assert.Equal(t, hostverbs.QPStateErr, qpStates(w.g.dev)[w.rcSRQ.handle])
			assert.Equal(t, w.srqAfter, recvIDs(fv.srqs[0].recvs), "only what the ring holds")
		})
	}

	t.Run("MR gone", func(t *testing.T) {
		b := j.with(mutate(func(q []byte) { put32(q, srqRecv0+srqRecvSize+abi.RQWQEHdrSize+12, 0xdead00) }))
		fv, rep, err := restore(t, b)
		require.NoError(t, err)
		assert.Equal(t, 2, rep.Continued)
		assert.Equal(t, 2, rep.SRQRecvs)
		require.Len(t, rep.Notes, 1)
		assert.Contains(t, rep.Notes[0], "not posted again")
		assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventSRQErr), Info: h}}, w.g.events())
		want := []uint64{w.srqHeld[0], w.srqHeld[2], w.srqAfter[0]}
		assert.Equal(t, want, recvIDs(fv.srqs[0].recvs))
	})
	t.Run("provider refuses", func(t *testing.T) {
		copy(w.g.raw, mem)
		fv := newFakeVerbs()
		fv.failNext("SRQPostRecv", hostverbs.ErrInvalid)
		rep, err := w.g.restart(fv, j.with(p), nil)
		require.NoError(t, err)
		assert.Equal(t, 2, rep.SRQRecvs)
		require.Len(t, rep.Notes, 1)
		assert.Contains(t, rep.Notes[0], "not posted again")
	})
}

// TestHandoverSRQMany: an SRQ of 4096 receives, on no QP, is handed over
// in several records (none above the bound), from the journal and from a
// checkpoint, and comes back with every receive, in order.
func TestHandoverSRQMany(t *testing.T) {
	fv := newFakeVerbs()
	g, j := newJournaledGuest(t, fv, 8<<20)
	g.probe()
	uc := g.createUC(1)
	pd := g.createPD(uc)
	mr := g.regMR(pd, 0x7f0000000000, 64<<10, 0xf)
	s := g.createSRQ(pd, 4096, 2, 0, 1)
	var want []uint64
	for i := range uint64(4096) {
		sges := []abi.SGE{{Addr: mr.iova + i, Length: 1, LKey: mr.lkey}}
		if i%2 == 1 {
			sges = append(sges, abi.SGE{Addr: mr.iova + 8192, Length: 7, LKey: mr.lkey})
		}
		s.writeRecv(i<<20, sges...)
		want = append(want, i<<20)
	}
	g.doorbell(s.uar, abi.UARSRQOffset, abi.UARSRQRecv|s.handle)
	require.Len(t, fv.srqs[0].recvs, 4096)
	n := countRecords(j.bytes())
	rep, err := g.dev.SaveTransports()
	require.NoError(t, err)
	assert.Equal(t, TransportReport{Failed: map[uint32]error{}, SavedSRQs: 1, FailedSRQs: map[uint32]error{}}, rep)
	journal := j.bytes()
	recs := countRecords(journal) - n
	assert.Equal(t, 3, recs, "4096 receives of 40 bytes on average in 64 KiB records")
	for i := n; i < n+recs; i++ {
		off, size := recordAt(journal, i)
		assert.Equal(t, recSRQRecvs, int(journal[off+5]))
		assert.LessOrEqual(t, size-recHdrSize, maxSRQRecPayload)
	}
	cp := g.dev.Checkpoint()
	mem := slices.Clone(g.raw)
	for name, b := range map[string][]byte{"journal": journal, "checkpoint": cp} {
		t.Run(name, func(t *testing.T) {
			copy(g.raw, mem)
			fv2 := newFakeVerbs()
			rep, err := g.restart(fv2, b, nil)
			require.NoError(t, err)
			assert.Empty(t, rep.Notes)
			assert.Equal(t, 4096, rep.SRQRecvs)
			got := fv2.srqs[0].recvs
			assert.Equal(t, want, recvIDs(got))
			assert.Equal(t, fv.srqs[0].recvs, got, "the same SGEs")
		})
	}
}

// srqRecordSeeds are SRQ receive record payloads for FuzzSRQRecord: the
// one hoWorld's hand-over writes, split, empty and damaged.
func srqRecordSeeds(t testing.TB, w *hoWorld) map[string][]byte {
	_, err := w.g.dev.SaveTransports()
	require.NoError(t, err)
	p := splitSRQJournal(t, w.j.bytes()).payload
	h := w.srq.handle
	return map[string][]byte{
		"as-written": p,
		"first-two":  srqRec(h, 0, 0, 0, p[srqRecv0:srqRecv0+2*srqRecvSize]),
		"empty":      srqRec(h, srqRecLast, 0, 0),
		"short":      p[:srqRecHdr+3],
		"version-2":  append([]byte{2}, p[1:]...),
	}
}

// FuzzSRQRecord feeds Restore hoWorld's hand-over journal with an
// arbitrary SRQ receive record in place of the one written: it must fail
// with an error wrapping ErrJournal or rebuild a device, never panic; a
// device it rebuilds holds in the provider SRQ at most the SRQ's depth,
// and its checkpoint restores again.
func FuzzSRQRecord(f *testing.F) {
	w := buildHandover(f)
	for _, p := range srqRecordSeeds(f, w) {
		f.Add(p)
	}
	mem := slices.Clone(w.g.raw)
	j := splitSRQJournal(f, w.j.bytes())
	quiet := slog.New(slog.DiscardHandler)
	restore := func(t *testing.T, b []byte) (*Device, *fakeVerbs, error) {
		copy(w.g.raw, mem)
		fv := newFakeVerbs()
		d, _, err := Restore(Config{Memory: w.g.mem, Verbs: fv, IRQ: &fakeIRQ{}, MAC: testMAC, Logger: quiet}, b)
		return d, fv, err
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		d, fv, err := restore(t, j.with(p))
		if err != nil {
			require.True(t, errors.Is(err, ErrJournal), "%v", err)
			require.Zero(t, fv.count("srq"))
			return
		}
		require.LessOrEqual(t, len(fv.srqs[0].recvs), int(w.srq.n))
		cp := d.Checkpoint()
		require.NoError(t, d.Close())
		d2, _, err := restore(t, cp)
		require.NoError(t, err)
		require.NoError(t, d2.Close())
	})
}

// TestSRQRecordSeeds writes testdata/fuzz/FuzzSRQRecord when
// PVRDMA_UPDATE_SEEDS is set (after buildHandover changed).
func TestSRQRecordSeeds(t *testing.T) {
	if os.Getenv("PVRDMA_UPDATE_SEEDS") == "" {
		t.Skip("PVRDMA_UPDATE_SEEDS=1 rewrites the seeds")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzSRQRecord")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for name, p := range srqRecordSeeds(t, buildHandover(t)) {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%s)\n", strconv.Quote(string(p)))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
}
