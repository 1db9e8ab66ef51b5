package backend

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// The hand-over's own state: what the predecessor saves at the hold
// beside the device journals, each VM's PCI function state (MSI-X
// pending bits change without a client write, so the kept file may be
// older) and its counters, reaches a successor that lists
// FeatureHandoverState in one sealed memfd it inherits (handoverStateFD)
// instead of two files per VM written, renamed and read during the pause.
// The successor writes those files itself once the devices are rebuilt
// (persistHanded), so that a crash after it finds them as fresh as
// before.

// FeatureHandoverState: the binary takes the VMs' PCI state and counters
// from a predecessor's hand-over state (handoverStateFD).
const FeatureHandoverState = "handover-state"

// handoverStateFD names the hand-over state's memfd among the descriptors
// passed. No VM name starts with '+'.
const handoverStateFD = "+handover.state"

// handoverStateVersion is the hand-over state's format.
const handoverStateVersion = 1

// maxHandoverState bounds what a successor reads of it.
const maxHandoverState = 64 << 20

// handoverState is the memfd's content.
type handoverState struct {
	Version int                 `json:"version"`
	VMs     map[string]handedVM `json:"vms"`
}

// handedVM is one VM's part of it.
type handedVM struct {
	PCI      []byte            `json:"pci,omitempty"`
	Counters map[string]uint64 `json:"counters,omitempty"`
}

// writeHandoverState puts st in a new sealed memfd and returns its
// descriptor (close-on-exec set, as every descriptor the daemon opens).
func writeHandoverState(st handoverState) (int, error) {
	st.Version = handoverStateVersion
	b, err := json.Marshal(st)
	if err != nil {
		return -1, err
	}
	fd, err := unix.MemfdCreate("pvrdma-handover-state", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("hand-over state: %w", err)
	}
	for off := 0; off < len(b) && err == nil; {
		var n int
		n, err = unix.Write(fd, b[off:])
		off += n
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE|unix.F_SEAL_SEAL)
	}
	if err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("hand-over state: %w", err)
	}
	return fd, nil
}

// readHandoverState reads the hand-over state a predecessor passed, as
// any input that crosses a process boundary: bounded, versioned; the PCI
// states are checked where they are restored (pcidev RestoreState).
func readHandoverState(f *os.File) (handoverState, error) {
	var st handoverState
	b, err := io.ReadAll(io.NewSectionReader(f, 0, maxHandoverState+1))
	switch {
	case err != nil:
		return st, fmt.Errorf("hand-over state: %w", err)
	case len(b) > maxHandoverState:
		return st, fmt.Errorf("hand-over state: more than %d bytes", maxHandoverState)
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return handoverState{}, fmt.Errorf("hand-over state: %w", err)
	}
	if st.Version != handoverStateVersion {
		return handoverState{}, fmt.Errorf("hand-over state version %d, this daemon reads %d", st.Version, handoverStateVersion)
	}
	return st, nil
}

// takeHandoverState takes the hand-over state out of the inherited
// descriptors, if a predecessor passed one: the VMs' PCI states and
// counters come from it (handedPCI, takeCounters) instead of their files.
func (k *keeping) takeHandoverState() {
	k.mu.Lock()
	f, ok := k.inherited[handoverStateFD]
	delete(k.inherited, handoverStateFD)
	k.mu.Unlock()
	if !ok {
		return
	}
	defer f.Close()
	st, err := readHandoverState(f)
	if err != nil {
		k.log.Warn("the predecessor's hand-over state does not load: the VMs' PCI states and counters come from their files (older)", "err", err)
		return
	}
	k.mu.Lock()
	k.handed = st.VMs
	k.mu.Unlock()
}

// handed returns what the hand-over state holds of vm.
func (k *keeping) handedVM(vm string) (handedVM, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	h, ok := k.handed[vm]
	return h, ok
}

// persistHanded writes, once the devices are rebuilt, the PCI states and
// counters of the VMs that took them from the hand-over state, as their
// predecessor would have written them at the hold.
func (d *Daemon) persistHanded() {
	d.keep.mu.Lock()
	handed := d.keep.handed
	d.keep.handed = nil
	d.keep.mu.Unlock()
	for _, s := range d.sessions() {
		if _, ok := handed[s.name]; !ok {
			continue
		}
		s.mu.Lock()
		c := s.conn
		s.mu.Unlock()
		if c == nil || c.keeper == nil {
			continue
		}
		c.keeper.savePCI(c.fn.SaveState())
		if st := s.status(); st.Connected {
			d.keep.saveCounters(s.name, st.Counters)
		}
	}
}
