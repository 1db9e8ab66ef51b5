package backend

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"
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
	// EnvHandoverStart is when the predecessor stopped taking messages
	// (Unix nanoseconds), for the pause the new daemon reports.
	EnvHandoverStart = "PVRDMA_HANDOVER_START"
	// EnvHandoverExec is when the predecessor exec'd this binary (Unix
	// nanoseconds): with EnvHandoverStart it splits the pause.
	EnvHandoverExec = "PVRDMA_HANDOVER_EXEC"
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
	// PauseMS is from the predecessor holding its VMs to the last VM's
	// device served again here.
	PauseMS float64 `json:"pause_ms,omitempty"`
	// The pause's parts: the predecessor saving (hold to exec), this
	// binary starting (exec to its daemon set up, fabric and VMs
	// registered), and the VMs' devices rebuilt (to the last served).
	SaveMS     float64 `json:"save_ms,omitempty"`
	StartMS    float64 `json:"start_ms,omitempty"`
	ResumeMS   float64 `json:"resume_ms,omitempty"`
	VMs        int     `json:"vms,omitempty"`
	Continued  int     `json:"qps_continued,omitempty"`
	Errored    int     `json:"qps_errored,omitempty"`
	Lost       int     `json:"objects_lost,omitempty"`
	Error      string  `json:"error,omitempty"` // the last failed attempt, if it failed
	FailedAtMS float64 `json:"-"`
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
	started       time.Time // when this image's daemon was set up
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

// upgrade runs a hand-over; it returns only if it failed.
func (d *Daemon) upgrade(binary string) error {
	start := time.Now()
	d.mu.Lock()
	vms := make([]*vmSession, 0, len(d.vms))
	for _, s := range d.vms {
		vms = append(vms, s)
	}
	d.mu.Unlock()
	sort.Slice(vms, func(i, j int) bool { return vms[i].name < vms[j].name })

	// Ask the new binary first whether it can take the state (formats,
	// versions, hand-over records): if not, nothing is held or changed.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	features, err := d.successorFeatures(ctx, binary)
	if err != nil {
		return err
	}
	// What else the successor takes (older binaries say nothing of it).
	takesFabric := slices.Contains(features, FeatureFabricSockets)
	release := func() {
		for _, s := range vms {
			s.srv.Release()
		}
	}
	for _, s := range vms {
		if err := s.srv.Hold(ctx); err != nil {
			release()
			return fmt.Errorf("VM %s: %w", s.name, err)
		}
	}
	held := time.Now()

	// Drain: sends posted before the hold complete (peers acknowledge).
	var conns []*vmConn
	for _, s := range vms {
		s.mu.Lock()
		if c := s.conn; c != nil {
			conns = append(conns, c)
		}
		s.mu.Unlock()
	}
	// Drain: with every guest held no send starts; those under way
	// complete as their peers (alive, not frozen) acknowledge them. Only
	// then is any QP's transport state saved: a saved QP freezes (drops
	// what it receives until the next image restores it), so saving one
	// while a peer still sends to it would keep that peer from draining.
	deadline := time.Now().Add(drainWait)
	for {
		busy := 0
		for _, c := range conns {
			if !c.dev.SendsDrained() {
				busy++
			}
		}
		if busy == 0 {
			break
		}
		if time.Now().After(deadline) {
			d.log.Warn("hand-over: sends of some VMs did not drain; their busy RC QPs come back in the error state", "vms", busy)
			break
		}
		time.Sleep(time.Millisecond)
	}
	// Save; a QP still busy (a remote peer sending to it) is tried again
	// for a moment, then comes back in the error state.
	saved := 0
	retryUntil := time.Now().Add(200 * time.Millisecond)
	pending := conns
	for len(pending) > 0 {
		var again []*vmConn
		for _, c := range pending {
			rep, err := c.dev.SaveTransportsFor(features)
			saved += rep.Saved
			if err != nil {
				d.log.Warn("hand-over: no transport state saved; the VM's RC QPs come back in the error state", "err", err)
				continue
			}
			if len(rep.Failed) == 0 && len(rep.FailedSRQs) == 0 {
				continue
			}
			if time.Now().Before(retryUntil) {
				again = append(again, c)
				continue
			}
			for h, ferr := range rep.FailedSRQs {
				d.log.Warn("hand-over: the receives an SRQ's provider holds are lost", "srq_handle", h, "err", ferr)
			}
			for h, ferr := range rep.Failed {
				d.log.Warn("hand-over: an RC QP comes back in the error state", "qp_handle", h, "err", ferr)
			}
		}
		pending = again
		if len(pending) > 0 {
			time.Sleep(time.Millisecond)
		}
	}
	// The fabric's sockets: a successor that takes them gets what
	// arrives from now on, queued in the kernel; for one that does not,
	// they leave the store (its copy would keep port 4791 bound, or the
	// bridge promiscuous with a packet socket queueing for nobody).
	var fabricPairs []string
	var fabricFDs []int
	fabricUnstored := false
	if socks := d.fabric.sockets(); len(socks) > 0 {
		switch {
		case takesFabric:
			d.fabric.pauseReceive()
			for name, fd := range socks {
				fabricPairs = append(fabricPairs, fabricFDPrefix+name+"="+strconv.Itoa(fd))
				fabricFDs = append(fabricFDs, fd)
			}
		case d.keep.store != nil:
			for name := range socks {
				_ = d.keep.store.Remove(fabricFDPrefix + name)
			}
			if err := d.keep.store.Barrier(time.Second); err != nil {
				d.log.Warn("hand-over: the fd store may still hold the fabric's sockets", "err", err)
			}
			fabricUnstored = true
		}
	}
	abort := func() {
		d.fabric.resumeReceive()
		if fabricUnstored {
			d.keep.storeFabric(d.fabric.sockets())
		}
		for _, c := range conns {
			c.dev.ResumeTransports()
		}
		release()
	}

	// The PCI functions' state as of now (MSI-X pending bits change
	// without a client write, so the kept copy may be older).
	for _, c := range conns {
		if c.keeper != nil {
			c.keeper.savePCI(c.fn.SaveState())
		}
	}
	// The VMs' counters carry over.
	for _, s := range vms {
		if st := s.status(); st.Connected {
			s.d.keep.saveCounters(s.name, st.Counters)
		}
	}

	// The descriptors the new image takes.
	var pairs []string
	var fds []int
	for _, s := range vms {
		s.mu.Lock()
		c := s.conn
		s.mu.Unlock()
		if c == nil || c.keeper == nil {
			continue
		}
		for name, fd := range c.keeper.held() {
			pairs = append(pairs, s.name+"."+name+"="+strconv.Itoa(fd))
			fds = append(fds, fd)
		}
	}
	pairs = append(pairs, fabricPairs...)
	fds = append(fds, fabricFDs...)
	for _, fd := range fds {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, 0); err != nil {
			setCloexec(fds)
			abort()
			return fmt.Errorf("keep descriptor %d across exec: %w", fd, err)
		}
	}
	env := handoverEnv(os.Environ(), map[string]string{
		EnvHandoverFDs:   strings.Join(pairs, ","),
		EnvHandoverStart: strconv.FormatInt(held.UnixNano(), 10),
		EnvHandoverExec:  "", // set just before the exec
		EnvGeneration:    strconv.Itoa(d.ho.status.Generation + 1),
	})
	if d.keep.store != nil {
		_, _ = daemon.SdNotify(false, daemon.SdNotifyReloading)
	}
	d.log.Info("handing over", "binary", binary, "vms", len(conns), "descriptors", len(fds), "rc_qps_saved", saved,
		"fabric_sockets", len(fabricFDs), "hold_and_drain", time.Since(start).Round(time.Microsecond))
	for i, kv := range env {
		if strings.HasPrefix(kv, EnvHandoverExec+"=") {
			env[i] = EnvHandoverExec + "=" + strconv.FormatInt(time.Now().UnixNano(), 10)
		}
	}
	err = syscall.Exec(binary, os.Args, env)
	// Still here: the exec failed. Serve on.
	for _, s := range vms {
		s.d.keep.takeCounters(s.name)
	}
	setCloexec(fds)
	abort()
	if d.keep.store != nil {
		_, _ = daemon.SdNotify(false, daemon.SdNotifyReady)
	}
	return fmt.Errorf("exec %s: %w", binary, err)
}

// FeatureFabricSockets: the binary takes over the fabric's sockets a
// predecessor hands it (fabricFDPrefix).
const FeatureFabricSockets = "fabric-sockets"

// HandoverFeatures are what this binary takes from a predecessor beyond
// the journal's features; `check-state` prints them on a line of its own
// (featuresLine), which binaries without any do not print.
func HandoverFeatures() []string { return []string{FeatureFabricSockets} }

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

// handoverFromEnv sets up the bookkeeping of a daemon exec'd by its
// predecessor.
func (h *handover) fromEnv(vms int) {
	gen, _ := strconv.Atoi(os.Getenv(EnvGeneration))
	h.status.Generation = gen
	if ns, err := strconv.ParseInt(os.Getenv(EnvHandoverStart), 10, 64); err == nil && ns > 0 {
		h.start = time.Unix(0, ns)
		h.started = time.Now()
		h.resumePending = vms
		h.status.VMs = vms
		if ex, err := strconv.ParseInt(os.Getenv(EnvHandoverExec), 10, 64); err == nil && ex >= ns {
			h.status.SaveMS = ms(time.Unix(0, ex).Sub(h.start))
			h.status.StartMS = ms(h.started.Sub(time.Unix(0, ex)))
		}
	}
	_ = os.Unsetenv(EnvHandoverStart)
	_ = os.Unsetenv(EnvHandoverExec)
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
		h.status.PauseMS = ms(time.Since(h.start))
		h.status.ResumeMS = ms(time.Since(h.started))
		h.start = time.Time{}
	}
}

// snapshot returns the hand-over status.
func (h *handover) snapshot() HandoverStatus {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.status
}
