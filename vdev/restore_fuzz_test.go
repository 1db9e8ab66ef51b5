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

	"github.com/stretchr/testify/require"
)

// fuzzWorldSize is the guest memory of FuzzRestore's world: the seeds in
// testdata/fuzz/FuzzRestore name its guest addresses (buildWorld is
// deterministic over the fake provider).
const fuzzWorldSize = 8 << 20

// restoreSeeds are journals of the fuzz world: whole, compacted, torn and
// damaged.
func restoreSeeds(w *world) map[string][]byte {
	journal := w.j.bytes()
	cp := w.g.dev.Checkpoint()
	wrongVersion := slices.Clone(cp)
	wrongVersion[4]++
	reseal(wrongVersion, 0)
	midOff, _ := recordAt(journal, countRecords(journal)/2)
	seeds := map[string][]byte{
		"journal":        journal,
		"checkpoint":     cp,
		"torn":           journal[:len(journal)-5],
		"head":           journal[:midOff],
		"checkpoint-cut": cp[:len(cp)/2],
		"wrong-version":  wrongVersion,
	}
	// A hand-over: the RC QP's transport state ends the journal and the
	// checkpoint (the world's device then goes on).
	if _, err := w.g.dev.SaveTransports(); err == nil {
		seeds["handover"] = w.j.bytes()
		seeds["handover-checkpoint"] = w.g.dev.Checkpoint()
		w.g.dev.ResumeTransports()
		seeds["handover-aborted"] = w.j.bytes()
	}
	return seeds
}

// FuzzRestore feeds Restore arbitrary journals over the guest memory of a
// device that really ran: it must fail with an error or rebuild a device,
// never panic; a device it rebuilds must checkpoint into a journal that
// restores again, and leave nothing in the provider when closed.
func FuzzRestore(f *testing.F) {
	w := buildWorld(f, fuzzWorldSize)
	used := w.g.next
	mem := slices.Clone(w.g.raw[:used])
	for _, b := range restoreSeeds(w) {
		f.Add(b, false)
		f.Add(b, true)
	}
	quiet := slog.New(slog.DiscardHandler)
	restore := func(t *testing.T, b []byte) (*Device, *fakeVerbs, error) {
		fv := newFakeVerbs()
		d, _, err := Restore(Config{Memory: w.g.mem, Verbs: fv, IRQ: &fakeIRQ{}, MAC: testMAC, Logger: quiet}, b)
		if err != nil {
			for _, k := range []string{"pd", "mr", "cq", "qp", "srq"} {
				require.Zero(t, fv.count(k), "a failed restore leaves %ss in the provider", k)
			}
		}
		return d, fv, err
	}
	closeClean := func(t *testing.T, d *Device, fv *fakeVerbs) {
		require.NoError(t, d.Close())
		for _, k := range []string{"pd", "mr", "cq", "qp", "srq"} {
			require.Zero(t, fv.count(k), "%ss left in the provider after Close", k)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte, fix bool) {
		if fix {
			// Let mutations of payloads and headers reach the replay
			// rather than the checksum.
			resealAll(b)
		}
		copy(w.g.raw, mem)
		clear(w.g.raw[used:])
		d, fv, err := restore(t, b)
		if err != nil {
			return
		}
		d.mu.Lock()
		d.qps.each(func(h uint32, q *qp) {
			require.Less(t, h, d.caps.MaxQP)
			require.Equal(t, h, q.handle)
			require.Same(t, q, d.live[h].Load())
		})
		d.mu.Unlock()
		cp := d.Checkpoint()
		closeClean(t, d, fv)
		// The checkpoint of what was rebuilt restores again (over the
		// memory the first restore left).
		d2, fv2, err := restore(t, cp)
		require.False(t, errors.Is(err, ErrJournal), "a device's own checkpoint is refused: %v", err)
		if err == nil {
			closeClean(t, d2, fv2)
		}
	})
}

// resealAll numbers the whole records of b as a daemon would have (a
// checkpoint's number on its snapshot, one up for each other record) and
// recomputes their checksums.
func resealAll(b []byte) {
	var seq uint64
	for off := 0; off+recHdrSize <= len(b); {
		n := int(binary.LittleEndian.Uint32(b[off+16:]))
		if n > maxRecPayload || off+recHdrSize+n > len(b) {
			return
		}
		switch {
		case b[off+5] == recCheckpoint:
			seq = binary.LittleEndian.Uint64(b[off+8:])
		case binary.LittleEndian.Uint16(b[off+6:]) == recFlagSnapshot:
			binary.LittleEndian.PutUint64(b[off+8:], seq)
		default:
			seq++
			binary.LittleEndian.PutUint64(b[off+8:], seq)
		}
		reseal(b, off)
		off += recHdrSize + n
	}
}

// TestRestoreSeeds writes testdata/fuzz/FuzzRestore from buildWorld when
// PVRDMA_UPDATE_SEEDS is set (after buildWorld changed).
func TestRestoreSeeds(t *testing.T) {
	if os.Getenv("PVRDMA_UPDATE_SEEDS") == "" {
		t.Skip("PVRDMA_UPDATE_SEEDS=1 rewrites the seeds")
	}
	w := buildWorld(t, fuzzWorldSize)
	dir := filepath.Join("testdata", "fuzz", "FuzzRestore")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for name, b := range restoreSeeds(w) {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%s)\nbool(true)\n", strconv.Quote(string(b)))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
}
