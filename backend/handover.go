package backend

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// Live upgrade: the daemon hands its VMs to a new binary by exec'ing it
// in its own process (the PID, and with it systemd's view of the service,
// stays). The old image stops taking messages from every VM at a message
// boundary (vfiouser.Server.Hold: QEMU's requests wait in the sockets),
// waits (bounded) until every QP's sends are drained, journals the
// receives each SRQ's provider holds and each RC QP's transport state
// (vdev SaveTransportsFor, limited to the journal features the new binary
// says it restores), keeps the connections' descriptors open across exec
// and names them in EnvHandoverFDs. The new image takes them as a
// restarted daemon takes them from systemd's store (continuity.go),
// rebuilds every device from its journal (RC QPs whose transport state was
// saved keep their connections, on an SRQ or not) and serves. If the exec
// fails, the old image releases its VMs and serves on.

// Environment of a daemon exec'd by its predecessor.
const (
	// EnvHandoverFDs lists the descriptors it inherits: name=fd, comma
	// separated (names as in the file descriptor store).
	EnvHandoverFDs = "PVRDMA_HANDOVER_FDS"
	// EnvHandoverStart is when the predecessor began to stop taking
	// messages (Unix nanoseconds), for the pause the new daemon reports.
	EnvHandoverStart = "PVRDMA_HANDOVER_START"
	// EnvHandoverExec is when the predecessor exec'd this binary (Unix
	// nanoseconds): with EnvHandoverStart it splits the pause.
	EnvHandoverExec = "PVRDMA_HANDOVER_EXEC"
	// EnvHandoverMarks splits the predecessor's part of the pause further:
	// key=value pairs, comma separated, of Unix nanoseconds (held: every
	// VM held; drained: their sends drained) and of the process's CPU
	// time in nanoseconds (cpu_start at EnvHandoverStart, cpu_exec at
	// EnvHandoverExec). Keys a binary does not know are ignored.
	EnvHandoverMarks = "PVRDMA_HANDOVER_MARKS"
	// EnvGeneration counts the hand-overs since the service started.
	EnvGeneration = "PVRDMA_GENERATION"
)

// drainWait bounds how long a hand-over waits for QPs' sends to drain
// (their peers acknowledge them); QPs still busy then come back in ERR.
const drainWait = 2 * time.Second

// ErrNoContinuity: the daemon keeps no state for a successor.
var ErrNoContinuity = errors.New("the daemon keeps no state for a successor: run it as the packaged service (systemd's file descriptor store) or with --keep-state")

// HandoverStatus reports the last hand-over, as the new daemon saw it.
type HandoverStatus struct {
	Generation int    `json:"generation"`
	Binary     string `json:"binary,omitempty"`
	// PauseMS is from the predecessor beginning to hold its VMs to the
	// last VM's device served again here.
	PauseMS float64 `json:"pause_ms,omitempty"`
	// The pause's parts: the predecessor saving (hold to exec), this
	// binary starting (exec to its daemon set up, fabric and VMs
	// registered), and the VMs' devices rebuilt (to the last served).
	SaveMS   float64 `json:"save_ms,omitempty"`
	StartMS  float64 `json:"start_ms,omitempty"`
	ResumeMS float64 `json:"resume_ms,omitempty"`
	// Saving begins with holding every VM (HoldMS) and draining their
	// sends (DrainMS); the rest journals transport state and saves PCI
	// state and counters. Starting begins with the exec and the new
	// image's runtime and package initialisation, up to its command
	// running (ExecMS; Config.Started).
	HoldMS  float64 `json:"hold_ms,omitempty"`
	DrainMS float64 `json:"drain_ms,omitempty"`
	ExecMS  float64 `json:"exec_ms,omitempty"`
	// The CPU time the process spent in each part, all its threads
	// together: a part CPU-bound on n cores takes up to n times its
	// length.
	SaveCPUMS   float64 `json:"save_cpu_ms,omitempty"`
	StartCPUMS  float64 `json:"start_cpu_ms,omitempty"`
	ResumeCPUMS float64 `json:"resume_cpu_ms,omitempty"`
	VMs         int     `json:"vms,omitempty"`
	Continued   int     `json:"qps_continued,omitempty"`
	Errored     int     `json:"qps_errored,omitempty"`
	Lost        int     `json:"objects_lost,omitempty"`
	Error       string  `json:"error,omitempty"` // the last failed attempt, if it failed
	FailedAtMS  float64 `json:"-"`
}

// handover is the daemon's hand-over bookkeeping.
type handover struct {
	mu      sync.Mutex
	running bool
	status  HandoverStatus
	// resumePending counts the VMs a new image still resumes, and start
	// is the predecessor's hold time (EnvHandoverStart).
	resumePending int
	start         time.Time
	started       time.Time     // when this image's daemon was set up
	startedCPU    time.Duration // the process's CPU time then
	// gated are the servers of the VMs being resumed, held until every
	// one's device serves (holdResumes).
	gated []*vfiouser.Server
}

// resumeGateWait bounds how long the VMs resumed after a hand-over wait
// for the slowest one's device before they serve.
const resumeGateWait = 2 * time.Second

// holdResumes holds the servers of the VMs a hand-over's new image
// resumes until the last one's device serves (resumed), at most
// resumeGateWait: the devices are rebuilt with the process's CPUs to
// themselves, not beside the traffic of the VMs rebuilt first, so that the
// last one, whose wait is the pause, is not held up by the others.
func (h *handover) holdResumes(servers []*vfiouser.Server) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.start.IsZero() || h.resumePending <= 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for _, s := range servers {
		_ = s.Hold(ctx) // nothing to wait for but a QEMU connecting just now
	}
	h.gated = servers
	time.AfterFunc(resumeGateWait, h.releaseResumes)
}

// releaseResumes lets the resumed VMs' connections take messages.
func (h *handover) releaseResumes() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.releaseLocked()
}

func (h *handover) releaseLocked() {
	for _, s := range h.gated {
		s.Release()
	}
	h.gated = nil
}

// StartUpgrade hands the daemon over to binary (the daemon's own path if
// empty) in the background; the caller watches Status().Handover.
func (d *Daemon) StartUpgrade(binary string) error {
	if !d.keep.active() {
		return ErrNoContinuity
	}
	if binary == "" {
		binary = d.cfg.Executable
	}
	if binary == "" {
		return errors.New("no binary to hand over to")
	}
	st, err := os.Stat(binary)
	if err != nil || !st.Mode().IsRegular() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("hand-over to %s: not an executable file (%v)", binary, err)
	}
	d.ho.mu.Lock()
	if d.ho.running {
		d.ho.mu.Unlock()
		return errors.New("a hand-over is under way")
	}
	d.ho.running = true
	d.ho.mu.Unlock()
	go func() {
		// Let the control reply go out before the process is replaced.
		time.Sleep(50 * time.Millisecond)
		err := d.upgrade(binary)
		d.ho.mu.Lock()
		d.ho.running = false
		if err != nil {
			d.ho.status.Error = err.Error()
		}
		d.ho.mu.Unlock()
		if err != nil {
			d.log.Error("hand-over failed; serving on", "binary", binary, "err", err)
		}
	}()
	return nil
}

// upgrade hands the daemon over to binary: each stage below is a method
// of upgrading, in the order they run. It returns only if the hand-over
// did not happen; the daemon then serves on (abort undoes what the stages
// did, and the VMs' guests carry on where they were held).
func (d *Daemon) upgrade(binary string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	u := &upgrading{d: d, binary: binary, begun: time.Now(), vms: d.sessions(), stateFD: -1}
	if err := u.askSuccessor(ctx); err != nil { // nothing held yet
		return err
	}
	if err := u.hold(ctx); err != nil {
		u.abort()
		return err
	}
	u.drain()
	u.saveTransports()
	u.handFabric()
	u.saveDevices()
	if err := u.keepDescriptors(); err != nil {
		u.abort()
		return err
	}
	err := u.exec() // returns only if the exec failed
	u.abort()
	return err
}

// upgrading is one hand-over under way: what its stages found and did,
// so that the next stage, or abort, can use it.
type upgrading struct {
	d      *Daemon
	binary string
	begun  time.Time
	vms    []*vmSession // by name
	// features are what the successor restores (askSuccessor).
	features []string
	// The pause's marks: holding began (holdAt, the process's CPU time
	// then cpuAtHold), every VM held, their sends drained.
	holdAt, heldAt, drainedAt time.Time
	cpuAtHold                 time.Duration
	conns                     []*vmConn // the held VMs' connected devices
	saved                     int       // RC QPs whose transport state is journaled
	// The fabric's sockets (handFabric done: fabricReady), handed over
	// (fabricPairs) or taken out of the store (fabricUnstored) for a
	// successor that binds its own.
	fabricReady    bool
	fabricPairs    []string
	fabricFDs      []int
	fabricUnstored bool
	countersSaved  bool
	stateFD        int  // the hand-over state's memfd, -1 if none
	reloading      bool // systemd was told (RELOADING=1)
	// pairs name the descriptors the successor takes (name=fd) and fds
	// are those descriptors, kept open across the exec.
	pairs []string
	fds   []int
}

// askSuccessor asks the new binary (check-state) whether it can take the
// daemon's state, and what it restores (successorFeatures): a binary that
// cannot is refused before anything is held or changed.
func (u *upgrading) askSuccessor(ctx context.Context) error {
	f, err := u.d.successorFeatures(ctx, u.binary)
	u.features = f
	return err
}

// hold stops every VM's connection at a message boundary
// (vfiouser.Server.Hold), all VMs at once: QEMU's requests wait in the
// sockets, and no guest starts new work.
func (u *upgrading) hold(ctx context.Context) error {
	u.holdAt, u.cpuAtHold = time.Now(), processCPU()
	errs := make([]error, len(u.vms))
	var wg sync.WaitGroup
	for i, s := range u.vms {
		wg.Go(func() {
			if err := s.srv.Hold(ctx); err != nil {
				errs[i] = fmt.Errorf("VM %s: %w", s.name, err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, s := range u.vms {
		s.mu.Lock()
		if c := s.conn; c != nil {
			u.conns = append(u.conns, c)
		}
		s.mu.Unlock()
	}
	for _, c := range u.conns {
		// Doorbells in memory are plain stores: holding the connection
		// does not hold them.
		c.dev.HoldDoorbells()
	}
	u.heldAt = time.Now()
	return nil
}

// drain waits (at most drainWait) until the sends under way complete:
// with every guest held no send starts, and those posted complete as
// their peers (alive, not frozen) acknowledge them. Only then is any
// QP's transport state saved: a saved QP freezes (drops what it receives
// until the next image restores it), so saving one while a peer still
// sends to it would keep that peer from draining. QPs still busy at the
// deadline come back in the error state.
func (u *upgrading) drain() {
	defer func() { u.drainedAt = time.Now() }()
	deadline := time.Now().Add(drainWait)
	for {
		busy := 0
		for _, c := range u.conns {
			if !c.dev.SendsDrained() {
				busy++
			}
		}
		if busy == 0 {
			return
		}
		if time.Now().After(deadline) {
			u.d.log.Warn("hand-over: sends of some VMs did not drain; their busy RC QPs come back in the error state", "vms", busy)
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// saveTransports journals each RC QP's transport state and the receives
// each SRQ's provider holds (vdev SaveTransportsFor, limited to what the
// successor restores), every VM's device on a goroutine of its own.
func (u *upgrading) saveTransports() {
	retryUntil := time.Now().Add(200 * time.Millisecond)
	var saved atomic.Int64
	var wg sync.WaitGroup
	for _, c := range u.conns {
		wg.Go(func() { saved.Add(int64(u.saveTransportsOf(c, retryUntil))) })
	}
	wg.Wait()
	u.saved = int(saved.Load())
}

// saveTransportsOf saves one VM's transport states and SRQ receives and
// returns how many RC QPs it saved. A QP still busy (a remote peer
// sending to it) is tried again until retryUntil, then comes back in the
// error state.
func (u *upgrading) saveTransportsOf(c *vmConn, retryUntil time.Time) int {
	for {
		rep, err := c.dev.SaveTransportsFor(u.features)
		switch {
		case err != nil:
			u.d.log.Warn("hand-over: no transport state saved; the VM's RC QPs come back in the error state", "err", err)
			return rep.Saved
		case len(rep.Failed) == 0 && len(rep.FailedSRQs) == 0:
			return rep.Saved
		case time.Now().Before(retryUntil):
			time.Sleep(time.Millisecond)
			continue
		}
		for h, ferr := range rep.FailedSRQs {
			u.d.log.Warn("hand-over: the receives an SRQ's provider holds are lost", "srq_handle", h, "err", ferr)
		}
		for h, ferr := range rep.Failed {
			u.d.log.Warn("hand-over: an RC QP comes back in the error state", "qp_handle", h, "err", ferr)
		}
		if rep.UnsavedFastRegs > 0 {
			// A running QP of their PD could still free them.
			u.d.log.Warn("hand-over: fast registrations of a PD with a busy RC QP are not kept", "registrations", rep.UnsavedFastRegs)
		}
		return rep.Saved
	}
}

// handFabric readies the fabric's sockets for the successor: one that
// takes them (FeatureFabricSockets) gets what arrives from now on,
// queued in the kernel; for one that does not, they leave the store (its
// copy would keep port 4791 bound, or the bridge promiscuous with a
// packet socket queueing for nobody).
func (u *upgrading) handFabric() {
	d := u.d
	u.fabricReady = true
	socks := d.fabric.sockets()
	switch {
	case len(socks) == 0:
	case slices.Contains(u.features, FeatureFabricSockets):
		d.fabric.pauseReceive()
		for name, fd := range socks {
			u.fabricPairs = append(u.fabricPairs, fabricFDPrefix+name+"="+strconv.Itoa(fd))
			u.fabricFDs = append(u.fabricFDs, fd)
		}
	case d.keep.store != nil:
		for name := range socks {
			_ = d.keep.store.Remove(fabricFDPrefix + name)
		}
		if err := d.keep.store.Barrier(time.Second); err != nil {
			d.log.Warn("hand-over: the fd store may still hold the fabric's sockets", "err", err)
		}
		u.fabricUnstored = true
	}
}

// saveDevices records what the successor rebuilds beside the journals:
// each PCI function's state as of now (MSI-X pending bits change without
// a client write, so the kept copy may be older) and each VM's counters,
// which carry over; in one memfd for a successor that takes it
// (FeatureHandoverState), else in the VMs' state files.
func (u *upgrading) saveDevices() {
	devs := u.deviceStates()
	if slices.Contains(u.features, FeatureHandoverState) {
		fd, err := writeHandoverState(handoverState{VMs: devs})
		if err == nil {
			u.stateFD = fd
			u.pairs, u.fds = append(u.pairs, handoverStateFD+"="+strconv.Itoa(fd)), append(u.fds, fd)
			return
		}
		u.d.log.Warn("hand-over: the PCI states and counters go to the VMs' files", "err", err)
	}
	var wg sync.WaitGroup
	for _, s := range u.vms {
		h, ok := devs[s.name]
		if !ok {
			continue
		}
		wg.Go(func() {
			s.mu.Lock()
			c := s.conn
			s.mu.Unlock()
			c.keeper.savePCI(h.PCI)
			if h.Counters != nil {
				u.d.keep.saveCounters(s.name, h.Counters)
			}
		})
	}
	wg.Wait()
	u.countersSaved = true
}

// deviceStates returns the PCI state and counters of every held VM whose
// connection is kept, each VM's taken on a goroutine of its own.
func (u *upgrading) deviceStates() map[string]handedVM {
	states := make([]*handedVM, len(u.vms))
	var wg sync.WaitGroup
	for i, s := range u.vms {
		wg.Go(func() {
			s.mu.Lock()
			c := s.conn
			s.mu.Unlock()
			if c == nil || c.keeper == nil {
				return
			}
			h := handedVM{PCI: c.fn.SaveState()}
			if vs := s.status(); vs.Connected {
				h.Counters = vs.Counters
			}
			states[i] = &h
		})
	}
	wg.Wait()
	out := make(map[string]handedVM, len(u.vms))
	for i, h := range states {
		if h != nil {
			out[u.vms[i].name] = *h
		}
	}
	return out
}

// keepDescriptors lists the descriptors the successor takes (each VM's
// connection, guest memory files and interrupt eventfds; the fabric's
// sockets and the VMs' listening sockets if it takes them) and keeps them
// open across the exec.
func (u *upgrading) keepDescriptors() error {
	listeners := slices.Contains(u.features, FeatureVMListeners)
	for _, s := range u.vms {
		if listeners {
			pairs, fds := s.handoverListeners()
			u.pairs, u.fds = append(u.pairs, pairs...), append(u.fds, fds...)
		}
		s.mu.Lock()
		c := s.conn
		s.mu.Unlock()
		if c == nil || c.keeper == nil {
			continue
		}
		for name, fd := range c.keeper.held() {
			u.pairs = append(u.pairs, s.name+"."+name+"="+strconv.Itoa(fd))
			u.fds = append(u.fds, fd)
		}
	}
	u.pairs = append(u.pairs, u.fabricPairs...)
	u.fds = append(u.fds, u.fabricFDs...)
	for _, fd := range u.fds {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, 0); err != nil {
			return fmt.Errorf("keep descriptor %d across exec: %w", fd, err)
		}
	}
	return nil
}

// exec replaces the process's image with the successor's, which finds
// the descriptors and the pause's start in its environment (the PID, and
// with it systemd's view of the service, stays: a reload). It returns
// only if the exec failed.
func (u *upgrading) exec() error {
	d := u.d
	env := handoverEnv(os.Environ(), map[string]string{
		EnvHandoverFDs:   strings.Join(u.pairs, ","),
		EnvHandoverStart: strconv.FormatInt(u.holdAt.UnixNano(), 10),
		EnvHandoverExec:  "", // these two set just before the exec
		EnvHandoverMarks: "",
		EnvGeneration:    strconv.Itoa(d.ho.status.Generation + 1),
	})
	if d.keep.store != nil {
		_, _ = daemon.SdNotify(false, daemon.SdNotifyReloading)
		u.reloading = true
	}
	d.log.Info("handing over", "binary", u.binary, "vms", len(u.conns), "descriptors", len(u.fds), "rc_qps_saved", u.saved,
		"fabric_sockets", len(u.fabricFDs), "hold_and_drain", time.Since(u.begun).Round(time.Microsecond))
	now, cpu := time.Now(), processCPU()
	marks := fmt.Sprintf("held=%d,drained=%d,cpu_start=%d,cpu_exec=%d", u.heldAt.UnixNano(), u.drainedAt.UnixNano(),
		u.cpuAtHold.Nanoseconds(), cpu.Nanoseconds())
	for i, kv := range env {
		switch k, _, _ := strings.Cut(kv, "="); k {
		case EnvHandoverExec:
			env[i] = EnvHandoverExec + "=" + strconv.FormatInt(now.UnixNano(), 10)
		case EnvHandoverMarks:
			env[i] = EnvHandoverMarks + "=" + marks
		}
	}
	err := syscall.Exec(u.binary, os.Args, env)
	return fmt.Errorf("exec %s: %w", u.binary, err) // still here: the exec failed
}

// abort undoes what the stages did, so that the daemon serves on: the
// counters saved for the successor are taken back, the descriptors close
// at a later exec again, the fabric receives (and its sockets go back to
// the store), the frozen QPs and SRQs resume (their peers resend what
// they dropped), the VMs are released, and systemd hears that the daemon
// is ready again.
func (u *upgrading) abort() {
	d := u.d
	if u.countersSaved {
		for _, s := range u.vms {
			d.keep.takeCounters(s.name)
		}
	}
	setCloexec(u.fds)
	if u.stateFD >= 0 {
		_ = unix.Close(u.stateFD)
	}
	if u.fabricReady {
		d.fabric.resumeReceive()
	}
	if u.fabricUnstored {
		d.keep.storeFabric(d.fabric.sockets())
	}
	for _, c := range u.conns {
		c.dev.ResumeTransports()
		c.dev.ReleaseDoorbells()
	}
	for _, s := range u.vms {
		s.srv.Release() // a server not held is left as it is
	}
	if u.reloading {
		_, _ = daemon.SdNotify(false, daemon.SdNotifyReady)
	}
}

// FeatureFabricSockets: the binary takes over the fabric's sockets a
// predecessor hands it (fabricFDPrefix).
const FeatureFabricSockets = "fabric-sockets"

// HandoverFeatures are what this binary takes from a predecessor beyond
// the journal's features; `check-state` prints them on a line of its own
// (featuresLine), which binaries without any do not print.
func HandoverFeatures() []string {
	return []string{FeatureFabricSockets, FeatureVMListeners, FeatureHandoverState}
}

// featuresLine starts check-state's line of hand-over features.
const featuresLine = "handover features:"

// FeaturesLine is check-state's line listing HandoverFeatures.
func FeaturesLine() string { return featuresLine + " " + strings.Join(HandoverFeatures(), " ") }

// featuresIn reads the features line of a successor's check-state output
// (none if it printed none).
func featuresIn(out string) []string {
	for _, line := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), featuresLine); ok {
			return strings.Fields(rest)
		}
	}
	return nil
}

// successorFeatures asks binary (check-state) whether it can take this
// daemon's state and which hand-over records it restores: transport
// states and SRQ receives, or transport states alone (an older binary: its
// RC QPs on an SRQ then come back in the error state, as it would bring
// them back); and what else it takes (HandoverFeatures, from its output).
// An error says why it cannot take the state at all.
func (d *Daemon) successorFeatures(ctx context.Context, binary string) ([]string, error) {
	check := func(features []string) ([]byte, error) {
		return exec.CommandContext(ctx, binary, "check-state", "--state-dir", d.keep.dir,
			"--need", strings.Join(features, ",")).CombinedOutput()
	}
	all := []string{"transport", "srq"}
	out, err := check(all)
	if err == nil {
		return append(all, featuresIn(string(out))...), nil
	}
	out2, err2 := check(all[:1])
	if err2 != nil {
		return nil, fmt.Errorf("%s cannot take this daemon's state (%v): %s", binary, err, strings.TrimSpace(string(out)))
	}
	d.log.Warn("hand-over: the new binary cannot restore SRQ receives; RC QPs on an SRQ come back in the error state",
		"binary", binary, "reason", strings.TrimSpace(string(out)))
	return append(all[:1:1], featuresIn(string(out2))...), nil
}

func setCloexec(fds []int) {
	for _, fd := range fds {
		_, _ = unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC)
	}
}

// handoverEnv replaces or adds set in env and drops systemd's socket
// activation variables (they were for the first image).
func handoverEnv(env []string, set map[string]string) []string {
	out := env[:0:0]
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if _, ok := set[k]; ok || k == "LISTEN_FDS" || k == "LISTEN_FDNAMES" || k == "LISTEN_PID" {
			continue
		}
		out = append(out, kv)
	}
	for k, v := range set {
		out = append(out, k+"="+v)
	}
	return out
}

// HandoverFiles reads the descriptors a predecessor left (EnvHandoverFDs)
// and clears the variable; names map to files. Descriptors that are not
// open are skipped.
func HandoverFiles() map[string]*os.File {
	v := os.Getenv(EnvHandoverFDs)
	_ = os.Unsetenv(EnvHandoverFDs)
	if v == "" {
		return nil
	}
	out := map[string]*os.File{}
	for _, p := range strings.Split(v, ",") {
		name, n, ok := strings.Cut(p, "=")
		fd, err := strconv.Atoi(n)
		if !ok || err != nil || fd < 3 || checkFDName(name) != nil {
			continue
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			continue
		}
		unix.CloseOnExec(fd)
		out[name] = os.NewFile(uintptr(fd), name)
	}
	return out
}

// fromEnv sets up the bookkeeping of a daemon exec'd by its predecessor
// (to resume vms VMs; image is when its command began, zero if not
// known).
func (h *handover) fromEnv(vms int, image time.Time) {
	gen, _ := strconv.Atoi(os.Getenv(EnvGeneration))
	h.status.Generation = gen
	if ns, err := strconv.ParseInt(os.Getenv(EnvHandoverStart), 10, 64); err == nil && ns > 0 {
		h.start = time.Unix(0, ns)
		h.started, h.startedCPU = time.Now(), processCPU()
		h.resumePending = vms
		h.status.VMs = vms
		if ex, err := strconv.ParseInt(os.Getenv(EnvHandoverExec), 10, 64); err == nil && ex >= ns {
			h.status.SaveMS = ms(time.Unix(0, ex).Sub(h.start))
			h.status.StartMS = ms(h.started.Sub(time.Unix(0, ex)))
			if image.UnixNano() >= ex {
				h.status.ExecMS = ms(image.Sub(time.Unix(0, ex)))
			}
			h.markParts(ns, parseMarks(os.Getenv(EnvHandoverMarks)))
		}
	}
	for _, k := range []string{EnvHandoverStart, EnvHandoverExec, EnvHandoverMarks} {
		_ = os.Unsetenv(k)
	}
}

// markParts fills in the parts of the predecessor's saving that its marks
// (EnvHandoverMarks) give; start is EnvHandoverStart.
func (h *handover) markParts(start int64, m map[string]int64) {
	held, okHeld := m["held"]
	if okHeld && held >= start {
		h.status.HoldMS = ms(time.Duration(held - start))
	}
	if drained, ok := m["drained"]; ok && okHeld && drained >= held {
		h.status.DrainMS = ms(time.Duration(drained - held))
	}
	c0, ok0 := m["cpu_start"]
	c1, ok1 := m["cpu_exec"]
	if ok0 && ok1 && c1 >= c0 && h.startedCPU.Nanoseconds() >= c1 {
		h.status.SaveCPUMS = ms(time.Duration(c1 - c0))
		h.status.StartCPUMS = ms(h.startedCPU - time.Duration(c1))
	}
}

// parseMarks reads EnvHandoverMarks: key=integer pairs, comma separated;
// malformed pairs are skipped.
func parseMarks(v string) map[string]int64 {
	out := map[string]int64{}
	for _, p := range strings.Split(v, ",") {
		k, n, ok := strings.Cut(p, "=")
		if x, err := strconv.ParseInt(n, 10, 64); ok && err == nil && x >= 0 {
			out[k] = x
		}
	}
	return out
}

// processCPU is the CPU time the process has spent, all threads, user
// and system (it carries over an exec).
func processCPU() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ms is d in milliseconds, to the microsecond.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// resumed records a VM's device served again after a hand-over.
func (h *handover) resumed(continued, errored, lost int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.start.IsZero() {
		return
	}
	h.status.Continued += continued
	h.status.Errored += errored
	h.status.Lost += lost
	if h.resumePending--; h.resumePending <= 0 {
		h.releaseLocked()
		h.status.PauseMS = ms(time.Since(h.start))
		h.status.ResumeMS = ms(time.Since(h.started))
		if h.startedCPU > 0 {
			h.status.ResumeCPUMS = ms(processCPU() - h.startedCPU)
		}
		h.start = time.Time{}
	}
}

// snapshot returns the hand-over status.
func (h *handover) snapshot() HandoverStatus {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.status
}

// FeatureVMListeners: the binary takes over the VMs' listening sockets a
// predecessor hands it (vmListenerPrefix, qmpListenerPrefix), instead of
// binding them again: no socket file is created at a hand-over, and a
// QEMU that connects meanwhile waits in the backlog instead of being
// refused.
const FeatureVMListeners = "vm-listeners"

// A VM's listening sockets in a hand-over: "+listen.<vm>" (its vfio-user
// socket) and "+qmp-listen.<vm>" (the socket its QMP monitors connect to).
// No VM name starts with '+'.
const (
	vmListenerPrefix  = "+listen."
	qmpListenerPrefix = "+qmp-listen."
)

// listen returns the VM's listening socket at path: the one a
// predecessor handed over under prefix+<vm> if it is that socket, else a
// new one. The session keeps it for the next hand-over.
func (s *vmSession) listen(prefix, path string) (*net.UnixListener, error) {
	ln := s.d.keep.takeListener(prefix+s.name, path)
	if ln == nil {
		var err error
		if ln, err = vfiouser.Listen(path); err != nil {
			return nil, err
		}
	}
	s.listeners[prefix] = ln
	return ln, nil
}

// takeListener removes the inherited descriptor name and returns it as a
// listener if it is a listening unix stream socket bound to path; any
// other descriptor is closed (the caller binds its own).
func (k *keeping) takeListener(name, path string) *net.UnixListener {
	k.mu.Lock()
	f, ok := k.inherited[name]
	delete(k.inherited, name)
	k.mu.Unlock()
	if !ok {
		return nil
	}
	defer f.Close()
	if err := checkListener(f, path); err != nil {
		k.log.Warn("a handed-over listening socket is not the VM's: binding a new one", "name", name, "err", err)
		return nil
	}
	l, err := net.FileListener(f)
	if err != nil {
		k.log.Warn("a handed-over listening socket does not serve: binding a new one", "name", name, "err", err)
		return nil
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		_ = l.Close()
		return nil
	}
	return ul
}

// checkListener checks that f is a listening unix stream socket bound to
// path.
func checkListener(f *os.File, path string) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var cerr error
	err = rc.Control(func(fd uintptr) {
		var typ, acc int
		var sa unix.Sockaddr
		if typ, cerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TYPE); cerr != nil {
			return
		}
		if acc, cerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ACCEPTCONN); cerr != nil {
			return
		}
		if sa, cerr = unix.Getsockname(int(fd)); cerr != nil {
			return
		}
		ua, ok := sa.(*unix.SockaddrUnix)
		switch {
		case typ != unix.SOCK_STREAM || acc != 1:
			cerr = errors.New("not a listening stream socket")
		case !ok || ua.Name != path:
			cerr = fmt.Errorf("bound to %v, not %s", sa, path)
		}
	})
	if err != nil {
		return err
	}
	return cerr
}

// handoverListeners names the VM's listening sockets for a successor
// (name=fd, fd) and keeps nothing else about them: the descriptors stay
// the listeners' own.
func (s *vmSession) handoverListeners() (pairs []string, fds []int) {
	for prefix, ln := range s.listeners {
		rc, err := ln.SyscallConn()
		if err != nil {
			continue
		}
		_ = rc.Control(func(fd uintptr) {
			pairs = append(pairs, prefix+s.name+"="+strconv.Itoa(int(fd)))
			fds = append(fds, int(fd))
		})
	}
	return pairs, fds
}
