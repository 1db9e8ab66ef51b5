package backend

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
)

// The daemon's own QMP monitor of each VM. QEMU connects to the VM's
// <name>.qmp socket in the socket directory as a client
// (VMSpec.QMPArgs: -chardev socket,reconnect-ms=... -mon mode=control),
// so the daemon needs no access to the VM's main monitor (libvirt owns
// it), and QEMU comes back by itself to a daemon that was restarted.
// Events go to every monitor of a QEMU; on this one the daemon:
//   - cancels migrations and snapshot jobs: QEMU 11's vfio-user-pci has no
//     migration support and adds no blocker, so a migration or snapshot
//     would complete without the device's state and without the guest
//     memory the device wrote (docs/ARCHITECTURE.md, "Migration guard");
//   - knows which QEMU it talks to: a monitor whose peer process is the
//     one connected to the VM's vfio-user socket is "verified".
//
// go-qemu's SocketMonitor only dials (or listens for one connection it
// cannot vet), so the protocol is spoken here over an admitted connection:
// one JSON object a line, commands tagged with an id, replies matched by
// it, events decoded as go-qemu's qmp.Event.

// QMPSocketPath returns the socket on which the daemon takes VM name's QMP
// monitor connection (VM sockets end in .sock, so no VM name maps here).
func QMPSocketPath(dir, name string) string { return filepath.Join(dir, name+".qmp") }

const (
	// qmpHandshake bounds the greeting and capabilities negotiation. QEMU
	// connects the chardev early but greets only once machine init is
	// done: over 10 s for a TCG guest on a loaded host. A rehearsal saw a
	// monitor closed at 10 s, then that QEMU (11.1.3) die of SIGSEGV a
	// second later, still initialising (the close is not proven to be the
	// cause). A silent peer holds one of the VM's 4 places this long.
	qmpHandshake = 60 * time.Second
	// qmpCommand bounds one command's reply.
	qmpCommand = 10 * time.Second
	// qmpMaxLine bounds one message from the peer (replies to the few
	// queries the daemon makes are small); a longer line ends the monitor.
	qmpMaxLine = 1 << 20
	// qmpMaxMonitors bounds the monitors one VM's socket keeps at once
	// (QEMU opens one; the rest are peers of the socket group).
	qmpMaxMonitors = 4
	// qmpEventQueue is how many events wait for the guard; past it they
	// are dropped and the guard re-reads the state it cares about.
	qmpEventQueue = 64
)

// Monitor states of VMStatus.QMP.
const (
	QMPNone      = "none"      // no monitor: migrations are not guarded
	QMPConnected = "connected" // a peer admitted on the socket, not (yet) the device's QEMU
	QMPVerified  = "verified"  // the QEMU connected to the device
)

// migrationActive lists the query-migrate statuses of a migration that can
// still be cancelled before it completes.
var migrationActive = map[string]bool{
	"setup": true, "active": true, "pre-switchover": true, "device": true, "wait-unplug": true,
	"postcopy-active": true, "postcopy-paused": true, "postcopy-recover-setup": true, "postcopy-recover": true,
}

// migrationEnded lists the statuses after which a new migration may
// start ("none": none ever did).
var migrationEnded = map[string]bool{"none": true, "completed": true, "failed": true, "cancelled": true}

// snapshotJobs are the job types that save or load a VM's state.
var snapshotJobs = map[string]bool{"snapshot-save": true, "snapshot-load": true}

// qmpError is an error reply of QEMU.
type qmpError struct{ Class, Desc string }

func (e *qmpError) Error() string { return e.Class + ": " + e.Desc }

// qmpMessage is anything QEMU sends: a greeting, a reply or an event.
type qmpMessage struct {
	QMP    json.RawMessage `json:"QMP"`
	Event  string          `json:"event"`
	ID     *uint64         `json:"id"`
	Return json.RawMessage `json:"return"`
	Error  *qmpError       `json:"error"`
}

type qmpReply struct {
	ret json.RawMessage
	err error
}

// vmMonitor is one QMP connection from a VM's QEMU.
type vmMonitor struct {
	s    *vmSession
	c    net.Conn
	pid  int32
	log  *slog.Logger
	sc   *bufio.Scanner
	done chan struct{} // closed when the reader ends

	wmu sync.Mutex // one command written at a time

	mu      sync.Mutex
	next    uint64
	pending map[uint64]chan qmpReply

	events chan qmp.Event
	resync atomic.Bool // events were dropped
	ready  atomic.Bool // past the handshake
	// cancelling is set once the guard cancelled the migration under way
	// and cleared when a migration ends: events of the same migration that
	// were already queued (setup, then active) are cancelled again but
	// counted and logged once. Only the guard goroutine uses it.
	cancelling bool
}

// serveMonitors accepts QMP connections on ln until it is closed.
func (s *vmSession) serveMonitors(ln net.Listener) {
	defer close(s.qmpDone)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.log.Error("QMP monitor socket stopped", "err", err)
			}
			return
		}
		cred, err := peerCred(c)
		if err != nil {
			_ = c.Close()
			continue
		}
		m := &vmMonitor{s: s, c: c, pid: cred.Pid, log: s.log.With("qmp_pid", cred.Pid),
			pending: map[uint64]chan qmpReply{}, events: make(chan qmp.Event, qmpEventQueue), done: make(chan struct{})}
		s.mu.Lock()
		full, closing := len(s.monitors) >= qmpMaxMonitors, s.monitors == nil
		if !full && !closing {
			s.monitors[m] = struct{}{}
		}
		s.mu.Unlock()
		if full || closing {
			if full {
				s.lim.Warn("qmp-full", "QMP monitor refused: the VM has the most monitors it may", "pid", cred.Pid, "max", qmpMaxMonitors)
			}
			_ = c.Close()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.run()
		}()
	}
}

// run serves one monitor to its end.
func (m *vmMonitor) run() {
	defer func() {
		// Out of the VM's monitors before the peer sees the close: a peer
		// that reconnects at once must find its place free.
		m.s.mu.Lock()
		delete(m.s.monitors, m)
		m.s.mu.Unlock()
		_ = m.c.Close()
	}()
	m.sc = bufio.NewScanner(m.c)
	m.sc.Buffer(make([]byte, 4096), qmpMaxLine)
	version, err := m.handshake()
	if err != nil {
		m.s.lim.Warn("qmp-handshake", "QMP monitor handshake failed", "pid", m.pid, "err", err)
		return
	}
	m.ready.Store(true)
	m.log.Info("QMP monitor connected", "qemu", version, "verified", m.s.qemuPID() == m.pid)
	go m.read()
	m.guard()
	m.log.Info("QMP monitor disconnected")
}

// handshake reads QEMU's greeting and leaves capabilities negotiation
// mode; it returns QEMU's version.
func (m *vmMonitor) handshake() (string, error) {
	_ = m.c.SetDeadline(time.Now().Add(qmpHandshake))
	defer m.c.SetDeadline(time.Time{})
	var greet struct {
		QMP *struct {
			Version qmp.Version `json:"version"`
		} `json:"QMP"`
	}
	if err := m.readLine(&greet); err != nil {
		return "", fmt.Errorf("greeting: %w", err)
	}
	if greet.QMP == nil {
		return "", errors.New("greeting: not a QMP greeting")
	}
	if _, err := fmt.Fprintln(m.c, `{"execute":"qmp_capabilities"}`); err != nil {
		return "", fmt.Errorf("qmp_capabilities: %w", err)
	}
	var r qmpMessage
	if err := m.readLine(&r); err != nil {
		return "", fmt.Errorf("qmp_capabilities: %w", err)
	}
	if r.Error != nil {
		return "", fmt.Errorf("qmp_capabilities: %w", r.Error)
	}
	return greet.QMP.Version.String(), nil
}

func (m *vmMonitor) readLine(v any) error {
	if !m.sc.Scan() {
		if err := m.sc.Err(); err != nil {
			return err
		}
		return errors.New("connection closed")
	}
	return json.Unmarshal(m.sc.Bytes(), v)
}

// read takes QEMU's messages until the connection ends: replies go to
// their commands, events to the guard (dropped, with a resync, when it
// is behind).
func (m *vmMonitor) read() {
	defer func() {
		m.mu.Lock()
		for id, ch := range m.pending {
			ch <- qmpReply{err: errors.New("qmp: monitor closed")}
			delete(m.pending, id)
		}
		m.pending = nil
		m.mu.Unlock()
		close(m.done)
	}()
	for m.sc.Scan() {
		var msg qmpMessage
		if err := json.Unmarshal(m.sc.Bytes(), &msg); err != nil {
			m.s.lim.Warn("qmp-bad", "QMP monitor: bad message; closing it", "err", err)
			return // the guard stops, and run closes the connection
		}
		switch {
		case msg.Event != "":
			var ev qmp.Event
			if err := json.Unmarshal(m.sc.Bytes(), &ev); err != nil {
				m.resync.Store(true)
				continue
			}
			select {
			case m.events <- ev:
			default:
				m.resync.Store(true)
			}
		case msg.ID != nil:
			m.mu.Lock()
			ch := m.pending[*msg.ID]
			delete(m.pending, *msg.ID)
			m.mu.Unlock()
			if ch == nil {
				continue
			}
			if msg.Error != nil {
				ch <- qmpReply{err: msg.Error}
			} else {
				ch <- qmpReply{ret: msg.Return}
			}
		}
	}
	if err := m.sc.Err(); err != nil && !errors.Is(err, net.ErrClosed) {
		m.log.Warn("QMP monitor read failed", "err", err)
	}
}

// run executes one command and returns its "return" member.
func (m *vmMonitor) command(ctx context.Context, execute string, args any) (json.RawMessage, error) {
	ch := make(chan qmpReply, 1)
	m.mu.Lock()
	if m.pending == nil {
		m.mu.Unlock()
		return nil, fmt.Errorf("qmp %s: monitor closed", execute)
	}
	m.next++
	id := m.next
	m.pending[id] = ch
	m.mu.Unlock()
	cmd, err := json.Marshal(struct {
		Execute string `json:"execute"`
		Args    any    `json:"arguments,omitempty"`
		ID      uint64 `json:"id"`
	}{execute, args, id})
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", execute, err)
	}
	m.wmu.Lock()
	_ = m.c.SetWriteDeadline(time.Now().Add(qmpCommand))
	_, err = m.c.Write(append(cmd, '\n'))
	m.wmu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", execute, err)
	}
	t := time.NewTimer(qmpCommand)
	defer t.Stop()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, fmt.Errorf("qmp %s: %w", execute, r.err)
		}
		return r.ret, nil
	case <-t.C:
	case <-ctx.Done():
	}
	m.mu.Lock()
	if m.pending != nil {
		delete(m.pending, id)
	}
	m.mu.Unlock()
	return nil, fmt.Errorf("qmp %s: no reply within %v", execute, qmpCommand)
}

// guard turns migration events on, cancels what already runs, then
// cancels each migration or snapshot job as its events arrive.
func (m *vmMonitor) guard() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-m.done
		cancel()
	}()
	// MIGRATION events need the "events" capability (libvirt sets it for
	// its own migrations; a plain `migrate` would send none without it).
	// It cannot change while a migration runs, which the query below
	// then finds.
	if _, err := m.command(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "events", "state": true}}}); err != nil {
		m.log.Debug("QMP monitor: migration events not enabled", "err", err)
	}
	m.checkMigration(ctx, "")
	m.checkJobs(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-m.events:
			switch ev.Event {
			case "MIGRATION":
				if st, ok := ev.Data["status"].(string); ok && st != "" {
					m.checkMigration(ctx, st)
				}
			case "JOB_STATUS_CHANGE":
				m.checkJobs(ctx)
			}
		}
		if m.resync.Swap(false) {
			m.checkMigration(ctx, "")
			m.checkJobs(ctx)
		}
	}
}

// checkMigration cancels a migration in progress; status is the one an
// event reported ("": ask QEMU).
func (m *vmMonitor) checkMigration(ctx context.Context, status string) {
	if status == "" {
		ret, err := m.command(ctx, "query-migrate", nil)
		if err != nil {
			m.log.Warn("QMP monitor: query-migrate failed", "err", err)
			return
		}
		var q struct {
			Status string `json:"status"`
		}
		if err := json.Unmarshal(ret, &q); err != nil {
			m.log.Warn("QMP monitor: bad query-migrate reply", "err", err)
			return
		}
		status = q.Status
	}
	if !migrationActive[status] {
		if migrationEnded[status] {
			m.cancelling = false
		}
		return
	}
	_, err := m.command(ctx, "migrate_cancel", nil)
	if err != nil {
		m.log.Error("migration of a VM with a PVRDMA device could not be cancelled", "status", status, "err", err)
		return
	}
	if m.cancelling {
		return // the migration already cancelled, seen again in a queued event
	}
	m.cancelling = true
	m.s.migrationsCancelled.Add(1)
	m.log.Warn("migration cancelled: QEMU's vfio-user-pci does not migrate the PVRDMA device "+
		"(its state and the guest memory it writes would be lost); the VM keeps running here",
		"status", status)
}

// checkJobs cancels snapshot jobs (snapshot-save, snapshot-load).
func (m *vmMonitor) checkJobs(ctx context.Context) {
	ret, err := m.command(ctx, "query-jobs", nil)
	if err != nil {
		m.log.Warn("QMP monitor: query-jobs failed", "err", err)
		return
	}
	var jobs []struct {
		ID     string `json:"id"`
		Type   string `json:"type"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal(ret, &jobs); err != nil {
		m.log.Warn("QMP monitor: bad query-jobs reply", "err", err)
		return
	}
	for _, j := range jobs {
		switch {
		case !snapshotJobs[j.Type]:
		case j.Status == "concluded" || j.Status == "null" || j.Status == "aborting":
		default:
			if _, err := m.command(ctx, "job-cancel", map[string]any{"id": j.ID}); err != nil {
				m.log.Error("snapshot job of a VM with a PVRDMA device could not be cancelled", "job", j.ID, "type", j.Type, "err", err)
				continue
			}
			m.s.snapshotsCancelled.Add(1)
			m.log.Warn("snapshot job cancelled: QEMU's vfio-user-pci does not save the PVRDMA device's state", "job", j.ID, "type", j.Type)
		}
	}
}

// qemuPID is the process of the QEMU connected to the VM's device (0: none).
func (s *vmSession) qemuPID() int32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil {
		return 0
	}
	return s.conn.pid
}

// qemuConnected reports whether a QEMU is connected to the VM's device.
func (s *vmSession) qemuConnected() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn != nil
}

// monitorState says which monitor the daemon holds of the VM's QEMU.
func (s *vmSession) monitorState() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := QMPNone
	for m := range s.monitors {
		if !m.ready.Load() {
			continue
		}
		if s.conn != nil && s.conn.pid != 0 && m.pid == s.conn.pid {
			return QMPVerified
		}
		st = QMPConnected
	}
	return st
}

// listenMonitors opens the VM's QMP socket with the VM socket's access.
func (s *vmSession) listenMonitors() (net.Listener, error) {
	ln, err := s.listen(qmpListenerPrefix, s.qmpSocket)
	if err != nil {
		return nil, fmt.Errorf("QMP socket: %w", err)
	}
	if err := s.d.access.openSocket(s.qmpSocket, false); err != nil {
		_ = ln.Close()
		return nil, err
	}
	return s.admit(s.d.access.listener(ln, "qmp"), false), nil
}

// closeMonitors ends every monitor connection and refuses new ones (the
// listener is closed by the caller).
func (s *vmSession) closeMonitors() {
	s.mu.Lock()
	for m := range s.monitors {
		_ = m.c.Close()
	}
	s.monitors = nil
	s.mu.Unlock()
}
