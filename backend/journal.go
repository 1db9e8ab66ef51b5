package backend

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
)

// journalFile is a VM device's journal in the state directory
// (device.journal): vdev's records appended one write(2) each, so that a
// kill -9 loses at most the record being written (vdev.Restore ignores a
// torn last record). When it grows past rotateAt it is replaced by a
// checkpoint of the device (vdev.Device.Checkpoint) followed by the
// records that arrived meanwhile (rotate).
type journalFile struct {
	path string
	log  *slog.Logger

	mu   sync.Mutex
	f    *os.File
	size int64
	// capture, while a rotation runs, collects the records appended
	// since it started, for the new file.
	capture   [][]byte
	capturing bool
	// rotateAt is the size that starts a rotation: 4 times the last
	// checkpoint, at least minRotate.
	rotateAt int64
	rotating atomic.Bool
	failed   atomic.Bool // a write failed: the journal is incomplete
	off      atomic.Bool // the daemon let go of the connection (leaving)
}

const minRotate = 1 << 20

// createJournal starts a VM device's journal with its first content (a
// checkpoint, or nothing for a new device), replacing any old one.
func createJournal(dir string, first []byte, log *slog.Logger) (*journalFile, error) {
	j := &journalFile{path: filepath.Join(dir, stateJournal), log: log}
	f, err := j.writeNew(first, nil)
	if err != nil {
		return nil, err
	}
	j.f, j.size = f, int64(len(first))
	j.rotateAt = max(4*int64(len(first)), minRotate)
	return j, nil
}

// writeNew writes first and more to a temporary file and renames it over
// the journal; it returns the file, open for appending.
func (j *journalFile) writeNew(first []byte, more [][]byte) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(j.path), 0o700); err != nil {
		return nil, fmt.Errorf("device journal: %w", err)
	}
	tmp := j.path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("device journal: %w", err)
	}
	if _, err = f.Write(first); err == nil {
		for _, r := range more {
			if _, err = f.Write(r); err != nil {
				break
			}
		}
	}
	if err == nil {
		err = os.Rename(tmp, j.path)
	}
	if err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return nil, fmt.Errorf("device journal: %w", err)
	}
	return f, nil
}

// append is vdev's journal sink: it runs under the device's lock, so it
// only writes; a rotation it calls for runs on its own goroutine.
func (j *journalFile) append(rec []byte, rotate func()) {
	if j.off.Load() {
		return
	}
	j.mu.Lock()
	if j.f == nil {
		j.mu.Unlock()
		return
	}
	n, err := j.f.Write(rec)
	j.size += int64(n)
	if j.capturing {
		j.capture = append(j.capture, append([]byte(nil), rec...))
	}
	big := j.size > j.rotateAt
	j.mu.Unlock()
	if err != nil && !j.failed.Swap(true) {
		j.log.Error("cannot write the device journal: a restart will not rebuild this VM's device", "path", j.path, "err", err)
	}
	if big && rotate != nil && j.rotating.CompareAndSwap(false, true) {
		go rotate()
	}
}

// rotate replaces the journal by checkpoint() and the records appended
// since the rotation began (Restore skips those the checkpoint holds).
func (j *journalFile) rotate(checkpoint func() []byte) {
	defer j.rotating.Store(false)
	j.mu.Lock()
	j.capturing, j.capture = true, nil
	j.mu.Unlock()
	cp := checkpoint()
	j.mu.Lock()
	defer j.mu.Unlock()
	j.capturing = false
	if j.f == nil || j.off.Load() {
		return
	}
	f, err := j.writeNew(cp, j.capture)
	j.capture = nil
	if err != nil {
		j.log.Warn("device journal rotation failed; appending to the old one", "err", err)
		j.rotateAt *= 2
		return
	}
	_ = j.f.Close()
	j.f = f
	j.size, _ = f.Seek(0, 2)
	j.rotateAt = max(4*int64(len(cp)), minRotate)
}

// close stops the journal (the file stays, for a restart, or is removed
// by the caller).
func (j *journalFile) close() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f != nil {
		_ = j.f.Close()
		j.f = nil
	}
}
