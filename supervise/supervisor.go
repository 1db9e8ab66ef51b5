package supervise

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
)

// Defaults of Config, those of the packaged unit and of systemd.
const (
	DefaultRestartDelay = 100 * time.Millisecond // the unit's RestartSec=
	DefaultBurst        = 5                      // systemd's StartLimitBurst=
	DefaultInterval     = 10 * time.Second       // systemd's StartLimitIntervalSec=
	DefaultStartTimeout = 90 * time.Second       // systemd's TimeoutStartSec=
	DefaultStopTimeout  = 30 * time.Second
)

// Config is how Run supervises its worker.
type Config struct {
	// Path is the worker's executable and Args its arguments, Args[0]
	// included. Each start runs the file now at Path (after a package
	// upgrade, the new binary), as systemd runs ExecStart=.
	Path string
	Args []string
	// Env is the worker's environment (nil: this process's), without the
	// variables the supervisor sets (NOTIFY_SOCKET, LISTEN_*, EnvSupervisor
	// and the like, which are dropped from it).
	Env []string
	// RestartDelay is how long after a worker died the next one starts.
	RestartDelay time.Duration
	// Burst and Interval are the start limit: a worker that would be
	// started more than Burst times within Interval is not, and Run
	// returns ErrCrashLoop.
	Burst    int
	Interval time.Duration
	// StartTimeout bounds how long a worker may take to say READY=1; one
	// that did not is killed (and restarted, unless it was the first).
	StartTimeout time.Duration
	// StopTimeout bounds an orderly stop: a worker that has not exited
	// that long after SIGTERM is killed.
	StopTimeout time.Duration
	// MaxFDs is the most descriptors the supervisor holds (0:
	// DefaultMaxFDs).
	MaxFDs int
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
}

// Errors of Run.
var (
	// ErrCrashLoop: the worker died too often (Config.Burst, Interval).
	ErrCrashLoop = errors.New("the worker crashes in a loop")
	// ErrNotStarted: the first worker ended before it said READY=1 (it
	// failed to start: a configuration or host problem, not a crash).
	ErrNotStarted = errors.New("the worker did not start")
)

// Run starts the worker and supervises it until ctx ends (then it stops
// the worker, SIGTERM and at most StopTimeout, and returns nil if the
// worker stopped cleanly), until the worker stops by itself cleanly (nil),
// or until it gives up (ErrCrashLoop, ErrNotStarted, or a failure of its
// own). SIGHUP stops the worker as ctx does; SIGQUIT is passed on to it
// (a Go worker prints its goroutines and exits, and is restarted);
// SIGUSR1 and SIGUSR2 are ignored. Whatever Run returns, the worker has
// ended and every descriptor held is closed.
func Run(ctx context.Context, cfg Config) error {
	s, err := newSupervisor(cfg)
	if err != nil {
		return err
	}
	defer s.close()
	return s.run(ctx)
}

// supervisor is Run's state; it lives on Run's goroutine.
type supervisor struct {
	cfg   Config
	log   *slog.Logger
	store *Store
	env   []string
	// addr is the notify socket's address, as NOTIFY_SOCKET says it, in
	// the directory dir; sock is the socket, wake a pipe signals and ctx
	// write to.
	addr  string
	dir   string
	sock  int
	wake  [2]int
	sigs  chan os.Signal // from signal.Notify
	sigq  chan os.Signal // to the loop
	spawn chan spawnReq
	// limit bounds what senders other than the worker, and a worker's
	// bad messages, make the supervisor log.
	limit *ratelog.Limiter

	// The worker: pid is 0 when none runs, pidfd -1.
	pid, pidfd int
	started    time.Time
	ready      bool // it said READY=1
	everReady  bool // a worker did, once
	reloading  bool // it said RELOADING=1 (a live upgrade) and not READY=1 since
	readyBy    time.Time
	starts     []time.Time // within cfg.Interval
	restarts   int
	lastExit   string
	died       time.Time // when the last worker's death was seen
	restartAt  time.Time // zero: no restart pending

	stopping bool
	killAt   time.Time // stopping: when the worker gets SIGKILL
	killed   bool

	buf, oob []byte
	pfds     []unix.PollFd
}

func newSupervisor(cfg Config) (*supervisor, error) {
	if cfg.Path == "" || len(cfg.Args) == 0 {
		return nil, errors.New("supervise: no worker to run")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RestartDelay <= 0 {
		cfg.RestartDelay = DefaultRestartDelay
	}
	if cfg.Burst <= 0 {
		cfg.Burst = DefaultBurst
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = DefaultStartTimeout
	}
	if cfg.StopTimeout <= 0 {
		cfg.StopTimeout = DefaultStopTimeout
	}
	env := cfg.Env
	if env == nil {
		env = os.Environ()
	}
	log := cfg.Logger.With("component", "supervisor")
	s := &supervisor{cfg: cfg, log: log, store: NewStore(cfg.MaxFDs), env: workerEnv(env),
		sock: -1, wake: [2]int{-1, -1}, pidfd: -1,
		limit: ratelog.New(log, 0),
		buf:   make([]byte, MaxMessage), oob: make([]byte, controlSpace), pfds: make([]unix.PollFd, 0, 3)}
	if err := s.listen(); err != nil {
		s.close()
		return nil, err
	}
	if err := unix.Pipe2(s.wake[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		s.close()
		return nil, fmt.Errorf("supervisor: %w", err)
	}
	s.sigs, s.sigq = make(chan os.Signal, 8), make(chan os.Signal, 8)
	signal.Notify(s.sigs, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE)
	s.spawn = make(chan spawnReq)
	go spawner(s.spawn)
	return s, nil
}

// listen opens the notify socket, a datagram socket that takes its
// senders' credentials, in a directory of its own (0700, under
// os.TempDir()): no other user can send to it. Where that path is too
// long for a socket address, it is an abstract socket with a random name,
// which anyone in the network namespace may send to (the credentials
// still decide, as on systemd's own notify socket).
func (s *supervisor) listen() error {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("supervisor's notify socket: %w", err)
	}
	s.sock = fd
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		return fmt.Errorf("supervisor's notify socket: SO_PASSCRED: %w", err)
	}
	dir, err := os.MkdirTemp("", notifyDirPrefix)
	if err != nil {
		return fmt.Errorf("supervisor's notify socket: %w", err)
	}
	s.dir = dir
	s.addr = filepath.Join(dir, notifyFile)
	if len(s.addr) >= len(unix.RawSockaddrUnix{}.Path) {
		var nonce [8]byte
		_, _ = rand.Read(nonce[:])
		s.addr = "@pvrdma-supervisor/" + strconv.Itoa(os.Getpid()) + "/" + hex.EncodeToString(nonce[:])
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: s.addr}); err != nil {
		return fmt.Errorf("supervisor's notify socket %s: %w", s.addr, err)
	}
	return nil
}

func (s *supervisor) run(ctx context.Context) error {
	stopWatch, watcherDone := make(chan struct{}), make(chan struct{})
	defer func() {
		// The watcher writes to the wake pipe: it ends before the pipe
		// is closed.
		close(stopWatch)
		<-watcherDone
	}()
	// Signals and the end of ctx reach the loop through the wake pipe.
	go func() {
		defer close(watcherDone)
		done := ctx.Done()
		for {
			select {
			case <-done:
				done = nil
				s.poke()
			case sig := <-s.sigs:
				select {
				case s.sigq <- sig:
				default: // the loop has not taken the previous ones: this one is dropped
				}
				s.poke()
			case <-stopWatch:
				return
			}
		}
	}()
	s.log.Info("supervising the daemon's worker: not run by a service manager (no NOTIFY_SOCKET), so this process keeps "+
		"the descriptors the worker stores, and starts it again with them if it dies",
		"notify_socket", s.addr, "restart_delay", s.cfg.RestartDelay, "start_limit", fmt.Sprintf("%d in %v", s.cfg.Burst, s.cfg.Interval))
	if err := s.startWorker(); err != nil {
		return err
	}
	for {
		if ctx.Err() != nil && !s.stopping {
			if done := s.beginStop("asked to stop"); done {
				return nil
			}
		}
		s.pfds = s.pfds[:0]
		s.pfds = append(s.pfds, unix.PollFd{Fd: int32(s.sock), Events: unix.POLLIN}, unix.PollFd{Fd: int32(s.wake[0]), Events: unix.POLLIN})
		if s.pidfd >= 0 {
			s.pfds = append(s.pfds, unix.PollFd{Fd: int32(s.pidfd), Events: unix.POLLIN})
		}
		_, err := unix.Poll(s.pfds, s.pollTimeout(time.Now()))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("supervisor: poll: %w", err)
		}
		if s.pfds[1].Revents != 0 {
			s.drainWake()
			if done := s.signals(); done {
				return nil
			}
		}
		if s.pfds[0].Revents != 0 {
			s.readNotify()
		}
		if len(s.pfds) > 2 && s.pfds[2].Revents != 0 {
			// Every message the worker sent before it died is queued
			// by now (a datagram is queued when sendmsg returns): take
			// them before deciding, so that the next worker gets what
			// this one stored last.
			s.readNotify()
			if done, err := s.workerEnded(); done {
				return err
			}
		}
		if done, err := s.timers(time.Now()); done {
			return err
		}
	}
}

// poke wakes the loop up.
func (s *supervisor) poke() { _, _ = unix.Write(s.wake[1], []byte{0}) }

func (s *supervisor) drainWake() {
	var b [64]byte
	for {
		if n, err := unix.Read(s.wake[0], b[:]); n <= 0 || err != nil {
			return
		}
	}
}

// pollTimeout is the time until the next deadline, in milliseconds (-1:
// none).
func (s *supervisor) pollTimeout(now time.Time) int {
	var next time.Time
	earlier := func(t time.Time) {
		if !t.IsZero() && (next.IsZero() || t.Before(next)) {
			next = t
		}
	}
	earlier(s.restartAt)
	if s.pid != 0 && !s.ready && !s.killed {
		earlier(s.readyBy)
	}
	if s.stopping && s.pid != 0 && !s.killed {
		earlier(s.killAt)
	}
	if next.IsZero() {
		return -1
	}
	ms := next.Sub(now).Milliseconds() + 1
	return int(max(0, min(ms, 60_000)))
}

// signals handles the signals and the stop request that woke the loop;
// done means Run returns nil.
func (s *supervisor) signals() bool {
	for {
		var sig os.Signal
		select {
		case sig = <-s.sigq:
		default:
			return false
		}
		switch sig {
		case unix.SIGHUP:
			if !s.stopping && s.beginStop("SIGHUP") {
				return true
			}
		case unix.SIGQUIT:
			if s.pid != 0 {
				s.log.Info("passing SIGQUIT on to the worker (a Go worker prints its goroutines and exits; it is restarted)", "pid", s.pid)
				_ = unix.Kill(s.pid, unix.SIGQUIT)
			}
		case unix.SIGUSR1, unix.SIGUSR2:
			s.log.Info("ignoring the signal: the daemon uses none", "signal", sig)
		case unix.SIGPIPE:
			// A write to a closed standard output or error: nothing to
			// do (caught so that it does not end the supervisor).
		}
	}
}

// beginStop starts an orderly stop; done means there is no worker to wait
// for.
func (s *supervisor) beginStop(reason string) (done bool) {
	s.stopping = true
	s.restartAt = time.Time{}
	if s.pid == 0 {
		s.log.Info("stopping; no worker runs", "reason", reason, "descriptors_closed", s.store.Len())
		return true
	}
	s.log.Info("stopping the worker", "reason", reason, "pid", s.pid)
	_ = unix.Kill(s.pid, unix.SIGTERM)
	s.killAt = time.Now().Add(s.cfg.StopTimeout)
	return false
}

// timers acts on the deadlines that passed.
func (s *supervisor) timers(now time.Time) (bool, error) {
	if s.pid == 0 && !s.restartAt.IsZero() && !now.Before(s.restartAt) {
		s.restartAt = time.Time{}
		if err := s.startWorker(); err != nil {
			return true, err
		}
	}
	if s.pid != 0 && !s.killed && s.stopping && !now.Before(s.killAt) {
		s.log.Warn("the worker did not stop in time: killing it", "pid", s.pid, "waited", s.cfg.StopTimeout)
		_ = unix.Kill(s.pid, unix.SIGKILL)
		s.killed = true
	}
	if s.pid != 0 && !s.killed && !s.ready && !now.Before(s.readyBy) {
		s.log.Error("the worker did not say it serves (READY=1) in time: killing it", "pid", s.pid, "waited", s.cfg.StartTimeout)
		_ = unix.Kill(s.pid, unix.SIGKILL)
		s.killed = true
	}
	return false, nil
}

// startWorker starts a worker with the descriptors held.
func (s *supervisor) startWorker() error {
	fds, listenEnv := s.store.Listen()
	env := make([]string, 0, len(s.env)+8)
	env = append(env, s.env...)
	env = append(env, "NOTIFY_SOCKET="+s.addr, EnvSupervisor+"="+strconv.Itoa(os.Getpid()), EnvRestarts+"="+strconv.Itoa(s.restarts))
	if s.lastExit != "" {
		env = append(env, EnvLastExit+"="+s.lastExit)
	}
	env = append(env, listenEnv...)
	files := make([]uintptr, 0, 3+len(fds))
	files = append(files, 0, 1, 2)
	for _, fd := range fds {
		files = append(files, uintptr(fd))
	}
	pidfd := -1
	attr := &syscall.ProcAttr{Env: env, Files: files, Sys: &syscall.SysProcAttr{
		// A supervisor that dies (kill -9) takes its worker with it,
		// in an orderly stop: nobody would keep its descriptors.
		Pdeathsig: syscall.SIGTERM,
		PidFD:     &pidfd,
	}}
	res := make(chan spawnRes, 1)
	s.spawn <- spawnReq{path: s.cfg.Path, argv: s.cfg.Args, attr: attr, res: res}
	r := <-res
	if r.err != nil {
		return fmt.Errorf("supervisor: start the worker %s: %w", s.cfg.Path, r.err)
	}
	if pidfd < 0 {
		var err error
		if pidfd, err = unix.PidfdOpen(r.pid, 0); err != nil {
			_ = unix.Kill(r.pid, unix.SIGKILL)
			var ws unix.WaitStatus
			_, _ = unix.Wait4(r.pid, &ws, 0, nil)
			return fmt.Errorf("supervisor: a pidfd for the worker (Linux 5.3 or later): %w", err)
		}
	}
	now := time.Now()
	s.pid, s.pidfd, s.started = r.pid, pidfd, now
	s.ready, s.reloading, s.killed = false, false, false
	s.readyBy = now.Add(s.cfg.StartTimeout)
	s.starts = append(s.starts, now)
	if s.restarts == 0 {
		s.log.Info("worker started", "pid", s.pid, "path", s.cfg.Path)
	} else {
		s.log.Warn("worker restarted", "pid", s.pid, "restarts", s.restarts, "previous_ended", s.lastExit,
			"descriptors_handed_back", len(fds), "after", now.Sub(s.died).Round(time.Millisecond))
	}
	return nil
}

// workerEnded reaps the worker and decides: done with the error Run
// returns, or a restart scheduled.
func (s *supervisor) workerEnded() (bool, error) {
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(s.pid, &ws, 0, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return true, fmt.Errorf("supervisor: wait for the worker: %w", err)
		}
		break
	}
	pid := s.pid
	_ = unix.Close(s.pidfd)
	s.pid, s.pidfd = 0, -1
	now := time.Now()
	s.died = now
	how := ExitString(ws)
	clean := cleanExit(ws)
	switch {
	case s.stopping:
		s.log.Info("worker stopped", "pid", pid, "ended", how, "descriptors_closed", s.store.Len())
		if clean {
			return true, nil
		}
		return true, fmt.Errorf("the worker %s while it stopped", how)
	case !s.everReady:
		return true, fmt.Errorf("%w (%s before it served): not restarted", ErrNotStarted, how)
	case clean:
		s.log.Info("the worker stopped by itself; stopping with it", "pid", pid, "ended", how, "descriptors_closed", s.store.Len())
		return true, nil
	}
	s.lastExit = how
	s.log.Error("worker died", "pid", pid, "ended", how, "ran", now.Sub(s.started).Round(time.Millisecond),
		"descriptors_held", s.store.Len())
	kept := s.starts[:0]
	for _, t := range s.starts {
		if now.Sub(t) < s.cfg.Interval {
			kept = append(kept, t)
		}
	}
	s.starts = kept
	if len(s.starts) >= s.cfg.Burst {
		return true, fmt.Errorf("%w: it was started %d times within %v and died each time (the last %s); giving up: "+
			"the %d descriptors it kept are closed, so the VMs it served lose their devices until their QEMUs restart",
			ErrCrashLoop, len(s.starts), s.cfg.Interval, how, s.store.Len())
	}
	s.restarts++
	s.restartAt = now.Add(s.cfg.RestartDelay)
	s.log.Info("restarting the worker with the descriptors it kept", "in", s.cfg.RestartDelay, "descriptors", s.store.Len())
	return false, nil
}

// cleanExit: an exit the unit's Restart=on-failure does not restart.
func cleanExit(ws unix.WaitStatus) bool {
	switch {
	case ws.Exited():
		return ws.ExitStatus() == 0
	case ws.Signaled():
		switch ws.Signal() {
		case unix.SIGHUP, unix.SIGINT, unix.SIGTERM, unix.SIGPIPE:
			return true
		}
	}
	return false
}

// ExitString says how a process ended: "exit status 1", "killed by signal
// SIGKILL" (with " (core dumped)").
func ExitString(ws unix.WaitStatus) string {
	switch {
	case ws.Exited():
		return "exit status " + strconv.Itoa(ws.ExitStatus())
	case ws.Signaled():
		name := unix.SignalName(ws.Signal())
		if name == "" {
			name = strconv.Itoa(int(ws.Signal()))
		}
		s := "killed by signal " + name
		if ws.CoreDump() {
			s += " (core dumped)"
		}
		return s
	}
	return fmt.Sprintf("wait status %#x", uint32(ws))
}

// readNotify handles every datagram queued on the notify socket.
func (s *supervisor) readNotify() {
	for {
		n, oobn, flags, _, err := unix.Recvmsg(s.sock, s.buf, s.oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return
		case err != nil:
			s.limit.Log(context.Background(), slog.LevelWarn, "recv", "cannot read the notify socket", "err", err)
			return
		}
		s.handle(s.buf[:n], s.oob[:oobn], flags)
	}
}

// handle acts on one datagram; descriptors it does not store are closed.
func (s *supervisor) handle(data, oob []byte, flags int) {
	fds, cred, err := ParseControl(oob)
	defer func() {
		for _, fd := range fds {
			if fd >= 0 {
				_ = unix.Close(fd)
			}
		}
	}()
	ctx := context.Background()
	switch {
	case flags&unix.MSG_CTRUNC != 0:
		s.limit.Log(ctx, slog.LevelWarn, "ctrunc", "a notify message carried more descriptors than a message can: dropped")
		return
	case flags&unix.MSG_TRUNC != 0:
		s.limit.Log(ctx, slog.LevelWarn, "trunc", "a notify message longer than the protocol allows: dropped", "max", MaxMessage)
		return
	case err != nil:
		s.limit.Log(ctx, slog.LevelWarn, "control", "a notify message's control data does not parse: dropped", "err", err)
		return
	case cred == nil:
		s.limit.Log(ctx, slog.LevelWarn, "nocred", "a notify message without the sender's credentials: dropped")
		return
	case s.pid == 0 || int(cred.Pid) != s.pid:
		// Only the worker's own messages count (NotifyAccess=main).
		s.limit.Log(ctx, slog.LevelWarn, "foreign", "a notify message from another process than the worker: dropped",
			"sender_pid", cred.Pid, "sender_uid", cred.Uid, "worker_pid", s.pid)
		return
	}
	m, err := ParseMessage(data)
	if err != nil {
		s.limit.Log(ctx, slog.LevelWarn, "parse", "a notify message from the worker does not parse: dropped", "err", err)
		return
	}
	if m.Barrier {
		return // its descriptor is closed now: everything before it was handled
	}
	s.apply(m, fds)
}

// apply acts on a parsed message from the worker, in systemd's order;
// the descriptors it stores are set to -1 in fds.
func (s *supervisor) apply(m Message, fds []int) {
	ctx := context.Background()
	if m.MainPID != 0 && m.MainPID != s.pid {
		s.limit.Log(ctx, slog.LevelWarn, "mainpid", "ignoring MAINPID: the supervisor watches its own child (a live upgrade keeps the PID)",
			"mainpid", m.MainPID, "worker_pid", s.pid)
	}
	if m.Reloading {
		s.reloading = true
		s.log.Info("the worker hands over to a new binary in its process (live upgrade)", "pid", s.pid)
	}
	if m.Ready {
		switch {
		case s.reloading:
			s.reloading = false
			s.log.Info("the worker serves again after the hand-over", "pid", s.pid)
		case !s.ready && s.restarts > 0:
			s.log.Warn("the restarted worker serves", "pid", s.pid, "restarts", s.restarts,
				"since_death", time.Since(s.died).Round(time.Millisecond), "descriptors_held", s.store.Len())
		case !s.ready:
			s.log.Info("the worker serves", "pid", s.pid)
		}
		s.ready, s.everReady = true, true
	}
	if m.Stopping {
		s.log.Info("the worker is stopping", "pid", s.pid)
	}
	if m.HasStatus {
		s.log.Debug("worker status", "status", m.Status)
	}
	if m.Errno != 0 {
		s.log.Warn("the worker reports an error", "errno", m.Errno, "error", syscall.Errno(m.Errno).Error())
	}
	if m.BadFDName {
		s.limit.Log(ctx, slog.LevelWarn, "fdname", "ignoring an invalid FDNAME")
	}
	if m.FDStoreRemove {
		if m.HasFDName {
			n := s.store.Remove(m.FDName)
			s.log.Debug("descriptors removed", "name", m.FDName, "closed", n, "held", s.store.Len())
		} else {
			s.limit.Log(ctx, slog.LevelWarn, "removename", "FDSTOREREMOVE without a valid FDNAME: ignored")
		}
	}
	if m.FDStore {
		name := DefaultFDName
		if m.HasFDName {
			name = m.FDName
		}
		for i, fd := range fds {
			fds[i] = -1 // Add takes it, stored or closed
			stored, err := s.store.Add(name, fd)
			switch {
			case err != nil:
				s.limit.Log(ctx, slog.LevelWarn, "store", "cannot keep a descriptor the worker stored: a crash will lose it", "name", name, "err", err)
			case stored:
				s.log.Debug("descriptor stored", "name", name, "held", s.store.Len())
			}
		}
	}
}

// close ends whatever is left: a worker still running (Run failed),
// the descriptors held, the socket.
func (s *supervisor) close() {
	if s.pid != 0 {
		s.log.Warn("the supervisor ends with its worker running: stopping it", "pid", s.pid)
		_ = unix.Kill(s.pid, unix.SIGTERM)
		pfd := []unix.PollFd{{Fd: int32(s.pidfd), Events: unix.POLLIN}}
		deadline := time.Now().Add(s.cfg.StopTimeout)
		for time.Now().Before(deadline) {
			if n, _ := unix.Poll(pfd, 100); n > 0 {
				break
			}
		}
		_ = unix.Kill(s.pid, unix.SIGKILL)
		var ws unix.WaitStatus
		_, _ = unix.Wait4(s.pid, &ws, 0, nil)
		_ = unix.Close(s.pidfd)
		s.pid, s.pidfd = 0, -1
	}
	if s.spawn != nil {
		close(s.spawn)
		s.spawn = nil
	}
	if s.sigs != nil {
		signal.Stop(s.sigs)
	}
	s.store.Close()
	for _, fd := range []int{s.sock, s.wake[0], s.wake[1]} {
		if fd >= 0 {
			_ = unix.Close(fd)
		}
	}
	s.sock, s.wake = -1, [2]int{-1, -1}
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
		s.dir = ""
	}
	s.limit.Flush()
}

// spawnReq asks the spawner to start a process.
type spawnReq struct {
	path string
	argv []string
	attr *syscall.ProcAttr
	res  chan<- spawnRes
}

type spawnRes struct {
	pid int
	err error
}

// spawner starts the workers from one thread, locked to it, which lives
// until the supervisor is done: the kernel sends a child its parent-death
// signal (Pdeathsig) when the thread that started it ends, and the Go
// runtime ends threads only when a goroutine locked to one returns.
func spawner(reqs <-chan spawnReq) {
	runtime.LockOSThread()
	for r := range reqs {
		pid, err := syscall.ForkExec(r.path, r.argv, r.attr)
		r.res <- spawnRes{pid: pid, err: err}
	}
}
