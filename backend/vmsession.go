package backend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// vmSession is one registered VM: its socket, and the device of the QEMU
// connected to it (at most one at a time).
type vmSession struct {
	d      *Daemon
	name   string
	mac    net.HardwareAddr
	mode   hostverbs.GIDType // the device's one RoCE version
	socket string
	log    *slog.Logger
	srv    *vfiouser.Server
	done   chan struct{} // closed when Serve returns
	policy gidPolicy
	// lim rate-limits the log lines the guest and its QEMU can provoke.
	lim *ratelog.Limiter
	// binds rate-limits the guest's GID binds, and with them the host
	// address changes (IP mode) and GID table churn they cause.
	binds *ratelog.Bucket
	// doorbells is how the guest's UAR doorbells reach the device.
	doorbells vdev.DoorbellMode

	refusals atomic.Uint64
	locked   *vdev.Budget // the guest memory its QEMU may map and lock
	// identity is what the VM's sockets require of a peer (admit).
	identity vmIdentity

	// listeners are the VM's listening sockets (vfio-user, QMP), which a
	// hand-over passes to the successor by name (handoverListeners).
	listeners map[string]*net.UnixListener

	// The daemon's QMP monitors of the VM's QEMU (vmmonitor.go).
	qmpSocket           string
	qmpLn               net.Listener
	qmpDone             chan struct{} // closed when serveMonitors returns
	migrationsCancelled atomic.Uint64
	snapshotsCancelled  atomic.Uint64

	mu          sync.Mutex
	pending     *resumable              // a kept connection being resumed (continuity.go)
	conn        *vmConn                 // the connected QEMU, if any
	connGone    chan struct{}           // closed when conn's teardown ends
	lastRefused [2]string               // GID and reason of the latest refused bind
	admitted    admittedPeer            // the latest peer admitted on the vfio-user socket
	monitors    map[*vmMonitor]struct{} // nil once the session stops
}

// admittedPeer is a peer the vfio-user socket admitted: its PID and the
// libvirt machine through which it is the VM's QEMU ("" if none).
type admittedPeer struct {
	pid     int32
	machine string
}

// uarFileName names the UAR memory of memory doorbells among a VM
// connection's kept descriptors (the fd store's <vm>.uar).
const uarFileName = "uar"

// reconnectWait bounds how long a new QEMU connection waits for the
// previous one's teardown (a QEMU restarted at once, or a reconnect while
// the old session's device is still being closed) before it is refused;
// well below QEMU's vfio-user reply timeout (x-msg-timeout, 5 s), since the
// new QEMU's VERSION waits for it.
const reconnectWait = 2 * time.Second

// vmConn is the device stack of one QEMU connection.
type vmConn struct {
	since time.Time
	// replaying: the device is being rebuilt from its journal (checkGID).
	replaying atomic.Bool
	pid       int32 // the QEMU's process (SO_PEERCRED), 0 if unknown
	mem       *guestmem.Memory
	verbs     hostverbs.Device
	dev       *vdev.Device
	fn        *pcidev.Function
	irq       *fnIRQ
	host      *vfiouser.Host
	// keeper keeps the connection beyond the process (nil: no store),
	// journal the device's journal with it.
	keeper  *connKeeper
	journal *journalFile
	resumed bool
	// machine is the libvirt machine through which the QEMU is the VM's
	// ("" if none, or not known: VMStatus.Identity).
	machine string
	// base are the VM's counters as the predecessor left them (a live
	// upgrade carries them over); status adds them.
	base map[string]uint64

	gmu  sync.Mutex
	gids map[int]hostverbs.GIDEntry
}

func startVM(d *Daemon, name string, mac net.HardwareAddr, pol gidPolicy, mode hostverbs.GIDType, locked *vdev.Budget, id vmIdentity, doorbells vdev.DoorbellMode) (*vmSession, error) {
	s := &vmSession{d: d, name: name, mac: mac, mode: mode, doorbells: doorbells, socket: SocketPath(d.cfg.SocketDir, name), identity: id,
		qmpSocket: QMPSocketPath(d.cfg.SocketDir, name), qmpDone: make(chan struct{}), monitors: map[*vmMonitor]struct{}{},
		log: d.log.With("vm", name), done: make(chan struct{}), policy: pol}
	s.lim = ratelog.New(s.log, 0)
	s.binds = ratelog.NewBucket(d.cfg.GIDBindRate, d.cfg.GIDBindBurst)
	s.locked = locked
	srv, err := vfioServer(s.newDevice, s.log, locked)
	if err != nil {
		return nil, fmt.Errorf("VM %s: %w", name, err)
	}
	s.listeners = map[string]*net.UnixListener{}
	ln, err := s.listen(vmListenerPrefix, s.socket)
	if err != nil {
		return nil, fmt.Errorf("VM %s: %w", name, err)
	}
	if err := d.access.openSocket(s.socket, false); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("VM %s: %w", name, err)
	}
	qln, err := s.listenMonitors()
	if err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("VM %s: %w", name, err)
	}
	s.srv, s.qmpLn = srv, qln
	go s.serveMonitors(qln)
	go func() {
		defer close(s.done)
		if err := srv.Serve(s.admit(d.access.listener(ln, "vm"), true)); err != nil && !errors.Is(err, vfiouser.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			s.log.Error("vfio-user server stopped", "err", err)
		}
	}()
	s.log.Info("VM registered", "socket", s.socket, "mac", mac.String(), "roce_mode", RoCEModeName(mode), "gid_allow", FormatGIDAllow(pol.allow),
		"doorbells", doorbells.String())
	return s, nil
}

// stop closes the socket and any connection; the connection's device is
// torn down by its Close callback.
func (s *vmSession) stop() {
	_ = s.qmpLn.Close()
	s.closeMonitors()
	<-s.qmpDone
	_ = os.Remove(s.qmpSocket)
	_ = s.srv.Close()
	<-s.done
	_ = os.Remove(s.socket)
	s.lim.Flush()
	s.log.Info("VM unregistered")
}

// newDevice builds the device stack for a new QEMU connection: a provider
// device on the fabric, the PVRDMA model over it, and the PCI function that
// presents it to vfio-user.
func (s *vmSession) newDevice(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != nil {
		// The previous connection may be on its way out: wait for its
		// teardown, bounded, rather than refuse a restarted QEMU.
		old, gone := s.conn, s.connGone
		s.mu.Unlock()
		t := time.NewTimer(reconnectWait)
		select {
		case <-gone:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
		s.mu.Lock()
		if s.conn != nil {
			return nil, fmt.Errorf("VM %s already has a connected QEMU (since %s)", s.name, old.since.Format(time.RFC3339))
		}
	}
	var pending *resumable
	if h.Resumed {
		pending, s.pending = s.pending, nil
	}
	c := &vmConn{since: time.Now(), pid: h.PeerPID, mem: h.Memory, gids: map[int]hostverbs.GIDEntry{}, host: h, resumed: pending != nil,
		machine: s.peerMachine(h)}
	if s.d.keep.active() {
		c.keeper = &connKeeper{k: s.d.keep, vm: s.name}
		if pending != nil {
			c.keeper.session, c.keeper.stored = pending.sessionRaw, pending.stored
		}
		h.Keeper = c.keeper
	}
	var mac [6]byte
	copy(mac[:], s.mac)
	var events eventRelay
	// The provider sizes its key table by its MR limit: the device's
	// (it never registers more), not the provider's own maximum.
	maxMR := s.d.cfg.Limits.MaxMR
	if maxMR <= 0 {
		maxMR = vdev.DefaultLimits().MaxMR
	}
	verbs, err := s.d.fabric.provider.Open(hostverbs.DeviceConfig{
		Name: s.name, Memory: h.Memory, NodeGUID: NodeGUID(s.mac), MAC: mac, RoCEMode: s.mode,
		Events: events.deliver, Logger: h.Logger, Limits: hostverbs.Limits{MaxMR: maxMR},
	})
	if err != nil {
		return nil, fmt.Errorf("VM %s: open fabric device: %w", s.name, err)
	}
	irq := newFnIRQ()
	vcfg := vdev.Config{
		Memory: h.Memory, Verbs: verbs, IRQ: irq, MAC: mac, Limits: s.d.cfg.Limits, Budget: s.d.budget, Logger: h.Logger,
		OnGID:    func(index int, e hostverbs.GIDEntry, bound bool) { s.gidChanged(c, index, e, bound) },
		CheckGID: func(index int, e hostverbs.GIDEntry) error { return s.checkGID(c, e) },
		// The histograms of GET /metrics (metrics.go).
		Distributions: true,
		Doorbells:     s.doorbells,
	}
	var dev *vdev.Device
	if c.keeper != nil {
		// The device's journal: what a restarted daemon rebuilds it from.
		vcfg.Journal = func(rec []byte) {
			if j := c.journal; j != nil {
				j.append(rec, func() { j.rotate(dev.Checkpoint) })
			}
		}
	}
	if pending != nil && pending.uarFile >= 0 {
		// The UAR memory the guest's mapping names (memory doorbells):
		// the device maps a duplicate.
		if s.doorbells == vdev.DoorbellsMemory {
			vcfg.UARFile = pending.uarFile
		}
		defer func() { _ = unix.Close(pending.uarFile) }()
	}
	if pending != nil {
		// The hand-over's pause ends for this VM once its device serves
		// (newDevice returns), or cannot.
		var continued, errored, lost int
		defer func() { s.d.ho.resumed(continued, errored, lost) }()
		c.replaying.Store(true)
		dev, err = s.restoreDevice(vcfg, pending.journal)
		c.replaying.Store(false)
		if err == nil {
			st := dev.Stats()
			continued, errored, lost = int(st.RestoreContinuedQPs), int(st.RestoreErroredQPs), int(st.RestoreLostObjects)
		}
		pending.rebuilt()
	} else {
		dev, err = vdev.New(vcfg)
	}
	if err != nil {
		irq.stop()
		verbs.Close()
		return nil, fmt.Errorf("VM %s: %w", s.name, err)
	}
	if c.keeper != nil {
		var first []byte
		if pending != nil {
			first = dev.Checkpoint() // the journal starts again from what was rebuilt
		}
		if c.journal, err = createJournal(s.d.keep.vmDir(s.name), first, s.log); err != nil {
			s.log.Error("no device journal: a restart will not rebuild this VM's device", "err", err)
		}
	}
	if fd, _, _, ok := dev.UARMmap(); ok && c.keeper != nil {
		// Memory doorbells: the guest's mapping of the UAR pages outlives
		// this process; a successor must watch the same memory.
		if err := c.keeper.Keep(uarFileName, fd); err != nil {
			s.log.Warn("the UAR memory is not kept: after a restart, user-space doorbells of this VM go unseen", "err", err)
		}
	}
	events.set(dev)
	pcfg := pciConfig(dev, func() error { return s.disconnected(c) })
	var fn *pcidev.Function
	if c.keeper != nil {
		pcfg.StateChanged = func() { c.keeper.savePCI(fn.SaveState()) }
	}
	fn, err = pcidev.New(h, pcfg)
	if err != nil {
		irq.stop()
		dev.Close()
		verbs.Close()
		return nil, fmt.Errorf("VM %s: %w", s.name, err)
	}
	if pending != nil {
		c.base = pending.counters
	}
	if pending != nil && len(pending.pci) > 0 {
		if err := fn.RestoreState(pending.pci); err != nil {
			s.log.Error("the kept PCI state does not load: the guest's device starts from power-on state", "err", err)
		}
	}
	irq.setFn(fn)
	c.verbs, c.dev, c.fn, c.irq = verbs, dev, fn, irq
	s.conn, s.connGone = c, make(chan struct{})
	if pending != nil {
		s.log.Info("QEMU connection resumed from the previous daemon", "conn", h.Name, "qemu_pid", h.PeerPID)
	} else {
		s.lim.Info("connect", "QEMU connected", "conn", h.Name)
	}
	return fn, nil
}

// peerMachine returns the libvirt machine through which a new
// connection's QEMU is the VM's: what admit found for it, or, for a
// connection a previous daemon admitted (resumed), what its process's
// cgroups say now (for status only: it is not admitted again). s.mu is
// held.
func (s *vmSession) peerMachine(h *vfiouser.Host) string {
	if h.PeerPID > 0 && s.admitted.pid == h.PeerPID {
		return s.admitted.machine
	}
	if !h.Resumed || h.PeerPID <= 0 || s.identity.cgroup != "" {
		return ""
	}
	p, err := readProcess(int(h.PeerPID), -1)
	if err != nil {
		return ""
	}
	m, err := s.identity.admitCgroups(s.name, p.cgroups, func(string) string { return "" })
	if err != nil {
		s.lim.Warn("peer-identity-resumed", "the resumed QEMU connection's process is not this VM's (it was admitted by the previous daemon)",
			"qemu_pid", h.PeerPID, "err", err)
		return ""
	}
	return m
}

// resume serves a connection a previous daemon left in the store.
func (s *vmSession) resume(r *resumable, rebuilt func()) {
	var once sync.Once
	r.rebuilt = func() { once.Do(rebuilt) }
	s.mu.Lock()
	s.pending = r
	s.mu.Unlock()
	names := append(r.session.FileNames(), vfiouser.ConnName)
	r.uarFile = -1
	if fd, ok := r.files[uarFileName]; ok {
		// The device's, not the session's: newDevice maps it again.
		r.uarFile = fd
		delete(r.files, uarFileName)
		names = append(names, uarFileName)
	}
	go func() {
		err := s.srv.Resume(r.conn, s.socket, &r.session, r.files)
		s.mu.Lock()
		failed := s.pending == r // the device was never made
		s.pending = nil
		s.mu.Unlock()
		if failed && r.uarFile >= 0 {
			_ = unix.Close(r.uarFile)
		}
		if failed {
			s.d.ho.resumed(0, 0, 0)
			r.rebuilt()
		}
		if failed && !errors.Is(err, vfiouser.ErrServerClosed) {
			s.log.Error("cannot resume the VM's connection: its QEMU sees it close", "err", err)
			s.forgetStored(names)
		}
	}()
}

// forgetStored removes a VM's descriptors from the store and its
// connection's state (a connection that cannot be resumed).
func (s *vmSession) forgetStored(names []string) {
	if st := s.d.keep.store; st != nil {
		for _, n := range names {
			_ = st.Remove(s.name + "." + n)
		}
	}
	s.d.keep.forgetConn(s.name)
}

// leaveToStore detaches the VM's connection from the daemon before it
// stops: the store keeps the connection and the state files stay.
func (s *vmSession) leaveToStore() {
	s.mu.Lock()
	c := s.conn
	s.mu.Unlock()
	if c != nil && c.keeper != nil {
		c.keeper.leaving.Store(true)
		if c.journal != nil {
			c.journal.off.Store(true)
		}
		c.host.StopKeeping()
	}
}

// restoreDevice rebuilds the device a previous daemon served from its
// journal. A journal that does not restore leaves the guest a device in
// its power-on state (the guest's driver then fails its commands): said
// loudly, since the guest needs a reboot or a driver reload.
func (s *vmSession) restoreDevice(cfg vdev.Config, journal []byte) (*vdev.Device, error) {
	start := time.Now()
	dev, rep, err := vdev.Restore(cfg, journal)
	if err != nil {
		s.log.Error("the device journal does not restore: the guest's device starts from power-on state; "+
			"reload vmw_pvrdma in the guest or reboot it", "err", err, "notes", rep.Notes)
		return vdev.New(cfg)
	}
	s.log.Info("device rebuilt from its journal", "took", time.Since(start).Round(time.Microsecond),
		"records", rep.Records, "rebuilt", fmt.Sprintf("%+v", rep.Rebuilt), "qps_continued", rep.Continued, "qps_errored", rep.Errored,
		"srq_recvs_restored", rep.SRQRecvs, "lost", fmt.Sprintf("%+v", rep.Lost), "torn", rep.Torn)
	for _, n := range rep.Notes {
		s.log.Warn("device restore", "note", n)
	}
	return dev, nil
}

// disconnected tears down a connection's device stack (pcidev Close
// callback, after the last access).
func (s *vmSession) disconnected(c *vmConn) error {
	err := c.dev.Close()
	c.irq.stop()
	c.gmu.Lock()
	for i, e := range c.gids {
		if gerr := s.d.fabric.gidBound(e, false); gerr != nil {
			s.lim.Warn("gid-withdraw", "withdraw GID", "index", i, "gid", e.GID, "err", gerr)
		}
	}
	c.gids = nil
	c.gmu.Unlock()
	if verr := c.verbs.Close(); err == nil {
		err = verr
	}
	s.mu.Lock()
	if s.conn == c {
		s.conn = nil
		close(s.connGone)
	}
	s.mu.Unlock()
	if c.journal != nil {
		c.journal.close()
	}
	if c.keeper != nil && !c.keeper.leaving.Load() {
		c.keeper.Forget(uarFileName)
		s.d.keep.forgetConn(s.name)
	}
	s.lim.Info("disconnect", "QEMU disconnected", "stats", fmt.Sprintf("%+v", c.dev.Stats()))
	return err
}

// The guest's GID binds are rate-limited per VM (a token bucket kept
// across reconnects): the stock driver binds each of its addresses once
// when its netdev comes up (2-4 at boot), so a burst of gidBindBurst
// covers many addresses and reboots, while a guest binding in a loop gets
// gidBindRate binds a second. An excess bind fails with EAGAIN rather than
// being deferred: the guest's GID table then says what the fabric does
// (a deferred bind would report an address the host does not yet serve),
// ib_core logs the failure, and nothing queues in the daemon.
const (
	gidBindBurst = 32
	gidBindRate  = 2.0
)

// checkGID applies the VM's GID policy to a CREATE_BIND: the static rules
// and allowed prefixes, the host's own addresses, and the reservations of
// other VMs; an accepted GID is reserved to this VM until it is
// unregistered.
func (s *vmSession) checkGID(c *vmConn, e hostverbs.GIDEntry) error {
	a := e.GID.Addr()
	// The static rules cost nothing; the rest lists the host's addresses
	// (netlink) and may lead to a host address change, so it is metered.
	err := s.policy.check(a)
	// A VM on the default (no pool) keeps the GIDs it had: those reserved
	// to it, and those its device journal binds again (a predecessor
	// accepted them under its own default).
	if errors.Is(err, errNotAssigned) && s.policy.keepReserved && (c.replaying.Load() || s.d.owners.holds(s.name, a)) {
		s.lim.Warn("gid-grandfathered", "GID kept: reserved to the VM before the default changed (no addresses without a declared pool); declare it with --gid-allow or the VM's gid-allow",
			"gid", a)
		err = nil
	}
	if err == nil && !s.binds.Allow() {
		err = fmt.Errorf("%v: more than %d GID binds at once or %v a second: %w (%w)", a, s.d.cfg.GIDBindBurst, s.d.cfg.GIDBindRate,
			ErrGIDRefused, syscall.EAGAIN)
	}
	if err == nil {
		var why string
		why, err = s.d.hostHolds(a)
		switch {
		case err != nil:
			err = fmt.Errorf("%v: %w: %w", a, ErrGIDRefused, err)
		case why != "":
			err = fmt.Errorf("%v: %s: %w", a, why, ErrGIDRefused)
		}
	}
	if err == nil {
		var changed bool
		if changed, err = s.d.owners.reserve(s.name, a, c.holds); changed {
			s.d.saveReservations()
		}
	}
	if err != nil {
		s.refusals.Add(1)
		s.mu.Lock()
		s.lastRefused = [2]string{e.GID.String(), err.Error()}
		s.mu.Unlock()
		s.lim.Warn("gid-refused", "GID bind refused", "gid", e.GID, "err", err)
	}
	return err
}

// holds reports whether the connection's guest has a bound.
func (c *vmConn) holds(a netip.Addr) bool {
	c.gmu.Lock()
	defer c.gmu.Unlock()
	for _, e := range c.gids {
		if e.GID.Addr() == a {
			return true
		}
	}
	return false
}

// gidChanged mirrors the guest's GID table onto the fabric attachment.
func (s *vmSession) gidChanged(c *vmConn, index int, e hostverbs.GIDEntry, bound bool) {
	c.gmu.Lock()
	defer c.gmu.Unlock()
	if c.gids == nil {
		return
	}
	if bound {
		if old, ok := c.gids[index]; ok {
			_ = s.d.fabric.gidBound(old, false)
		}
		c.gids[index] = e
	} else {
		delete(c.gids, index)
	}
	if err := s.d.fabric.gidBound(e, bound); err != nil {
		s.lim.Warn("gid-netdev", "GID on fabric netdev", "index", index, "gid", e.GID, "bound", bound, "err", err)
		return
	}
	s.d.saveAddrs()
	s.lim.Info(fmt.Sprintf("gid/%d", index), "GID", "index", index, "gid", e.GID, "type", e.Type, "bound", bound)
}

func (s *vmSession) status() VMStatus {
	st := VMStatus{Name: s.name, Socket: s.socket, MAC: s.mac.String(),
		GIDAllow: FormatGIDAllow(s.policy.allow), RoCEMode: RoCEModeName(s.mode), Doorbells: s.doorbells.String(), GIDRefusals: s.refusals.Load(), LockedLimit: s.locked.Limit(),
		QMPSocket: s.qmpSocket, QEMUUID: s.identity.uid, QEMUCgroup: s.identity.cgroup, QMP: s.monitorState(), MigrationsCancelled: s.migrationsCancelled.Load(), SnapshotsCancelled: s.snapshotsCancelled.Load()}
	for _, a := range s.d.owners.reserved(s.name) {
		st.ReservedGIDs = append(st.ReservedGIDs, a.String())
	}
	sort.Strings(st.ReservedGIDs)
	s.mu.Lock()
	c := s.conn
	st.LastRefusedGID, st.LastRefusedReason = s.lastRefused[0], s.lastRefused[1]
	s.mu.Unlock()
	machine := ""
	if c != nil {
		machine = c.machine
	}
	st.Identity = s.identity.describe(machine)
	if c == nil {
		return st
	}
	st.Connected, st.Since, st.LockedBytes = true, c.since, c.mem.LockedBytes()
	for i, e := range c.dev.GIDs() {
		if !e.GID.IsZero() {
			st.GIDs = append(st.GIDs, GIDStatus{Index: i, GID: e.GID.String(), Type: e.Type.String()})
		}
	}
	st.Resources = c.dev.Objects()
	if err := c.dev.Fault(); err != nil {
		st.Fault = err.Error()
	}
	ds := c.dev.Stats()
	st.Counters = map[string]uint64{
		"commands": ds.Commands, "command_errors": ds.CommandErrors,
		"doorbells": ds.Doorbells, "poll_doorbells": ds.PollDoorbells, "bad_doorbells": ds.BadDoorbells,
		"send_wqes": ds.SendWQEs, "recv_wqes": ds.RecvWQEs, "bad_wqes": ds.BadWQEs,
		"flushed_wqes": ds.FlushedWQEs, "stalled_posts": ds.StalledPosts,
		"completions": ds.Completions, "stale_completions": ds.StaleCompletions, "cq_overflows": ds.CQOverflows,
		"cq_notifications": ds.CQNotifications, "notify_dropped": ds.NotifyDropped,
		"async_events": ds.AsyncEvents, "async_dropped": ds.AsyncDropped,
		"gid_refusals": ds.GIDRefusals,
		"fast_regs":    ds.FastRegs, "fast_reg_refused": ds.FastRegRefused,
		"local_invs": ds.LocalInvs, "local_inv_refused": ds.LocalInvRefused, "frmr_refused": ds.FRMRRefused,
		"error_cqes": ds.ErrorCQEs, "flush_cqes": ds.FlushCQEs,
		"interrupts": ds.Interrupts, "masked_interrupts": ds.MaskedInterrupts, "bad_bar_accesses": ds.BadBARAccesses,
		// Doorbells by kind: trapped (a region write each, an exit on a
		// KVM host) against seen in memory (memory doorbells).
		"trapped_qp_doorbells": ds.TrappedDoorbells.QP, "trapped_cq_poll_doorbells": ds.TrappedDoorbells.CQPoll,
		"trapped_cq_arm_doorbells": ds.TrappedDoorbells.CQArm, "trapped_srq_doorbells": ds.TrappedDoorbells.SRQ,
		"memory_qp_doorbells": ds.MemoryDoorbells.QP, "memory_cq_poll_doorbells": ds.MemoryDoorbells.CQPoll,
		"memory_cq_arm_doorbells": ds.MemoryDoorbells.CQArm, "memory_srq_doorbells": ds.MemoryDoorbells.SRQ,
		"memory_bad_doorbells": ds.MemoryBadDoorbells, "doorbell_passes": ds.DoorbellPasses,
		"arm_safety_nets": ds.ArmSafetyNets,
		// Command completions QEMU had taken (read the eventfd) when the
		// REQUEST write was answered, and those still pending then (all
		// of them under TCG: docs/ARCHITECTURE.md).
		"command_irq_taken": c.irq.syncTaken.Load(), "command_irq_pending": c.irq.syncPending.Load(),
	}
	// The provider's own statistics for this VM (the soft transport's
	// packets, drops by reason, CNPs), prefixed so that they cannot be
	// confused with the device model's.
	if pc, ok := c.verbs.(interface{ Counters() map[string]uint64 }); ok {
		for k, v := range pc.Counters() {
			if v != 0 {
				st.Counters["transport_"+k] = v
			}
		}
	}
	// Counted by the daemons this one took over from (a live upgrade).
	for k, v := range c.base {
		st.Counters[k] += v
	}
	return st
}

// pciConfig presents a PVRDMA device as a PCI function.
func pciConfig(dev *vdev.Device, onClose func() error) pcidev.Config {
	info := vdev.PCI()
	cfg := pcidev.Config{
		VendorID: info.VendorID, DeviceID: info.DeviceID,
		SubVendorID: info.SubVendorID, SubDeviceID: info.SubDeviceID,
		Revision: info.Revision, ClassCode: info.ClassCode, IntPin: info.IntPin,
		MSIX: &pcidev.MSIX{Vectors: info.MSIX.Vectors, BAR: info.MSIX.BAR,
			TableOffset: uint32(info.MSIX.TableOffset), PBAOffset: uint32(info.MSIX.PBAOffset)},
		RequireSharedMemory: true,
		Reset:               func(vfiouser.ResetReason) { dev.Reset() },
		Close:               onClose,
		INTxLevel:           dev.InterruptPending,
	}
	for i, b := range info.BARs {
		if b.Size == 0 {
			continue
		}
		var mmap *vfiouser.RegionMmap
		if fd, off, size, ok := dev.UARMmap(); ok && i == abi.UARBAR {
			// Memory doorbells: QEMU maps the user contexts' UAR pages
			// into the guest; page 0 (the kernel's) stays trapped.
			mmap = &vfiouser.RegionMmap{FD: fd, Areas: []vfiouser.MmapArea{{Offset: off, Size: size}}}
		}
		bar := i
		cfg.BARs[i] = pcidev.BAR{
			Size: b.Size, Type: pcidev.BARMem32, Prefetchable: b.Prefetchable,
			Read:  func(off uint64, p []byte) error { return dev.ReadBAR(bar, off, p) },
			Write: func(off uint64, p []byte) error { return dev.WriteBAR(bar, off, p) },
			Mmap:  mmap,
		}
		if b.Is64Bit {
			cfg.BARs[i].Type = pcidev.BARMem64
		}
	}
	return cfg
}

// fnIRQ raises a device's interrupts through its PCI function (MSI-X, or
// INTx when the guest runs without MSI-X). The function is set once it
// exists; provider goroutines may trigger concurrently.
//
// The interrupts of one connection are signalled by that connection's own
// goroutine (run), never by the goroutine that produced them: a CQ's
// completion comes from whoever moved the data (another VM's command path,
// the fabric's receive loop), and signalling means writing to an eventfd
// the VM's QEMU controls, so a QEMU that makes its eventfds block stalls
// only its own interrupts. Trigger sets the vector's bit and wakes the
// signaller; the vectors raised between two wake-ups go out once each
// (coalesced, as an eventfd counts but an interrupt is pending or not).
type fnIRQ struct {
	fn      atomic.Pointer[pcidev.Function]
	pending atomic.Uint64 // vectors to signal
	wake    chan struct{}
	done    chan struct{}
	stopped chan struct{}

	// Command completions QEMU had taken (read the eventfd) when
	// TriggerSync returned, and those still pending then.
	syncTaken, syncPending atomic.Uint64
}

// syncIRQBound is how long TriggerSync waits for QEMU to take the
// interrupt it signalled before the REQUEST write is answered: not at all,
// it looks once. Under KVM with an irqfd the kernel injects the MSI
// within our eventfd write, so it is taken before we look. Under TCG it
// cannot be taken before the reply: the vCPU thread holds QEMU's BQL for
// the whole round trip of the region access (accel/tcg/cputlb.c
// do_st_mmio_leN, hw/vfio-user/proxy.c vfio_user_send_wait), and the main
// loop needs it to read the eventfd (util/main-loop.c
// os_host_main_loop_wait, hw/vfio/pci.c vfio_msi_interrupt); a 2 ms wait
// was measured to run out at every command (docs/ARCHITECTURE.md).
const syncIRQBound = 0

func newFnIRQ() *fnIRQ {
	i := &fnIRQ{wake: make(chan struct{}, 1), done: make(chan struct{}), stopped: make(chan struct{})}
	go i.run()
	return i
}

func (i *fnIRQ) Trigger(vector int) {
	if vector < 0 || vector >= 64 {
		return
	}
	i.pending.Or(1 << vector)
	select {
	case i.wake <- struct{}{}:
	default: // a wake-up is pending and will see the bit
	}
}

// run is the connection's interrupt signaller.
func (i *fnIRQ) run() {
	defer close(i.stopped)
	for {
		select {
		case <-i.done:
			return
		case <-i.wake:
		}
		fn := i.fn.Load()
		if fn == nil {
			continue // kept until the function exists (setFn wakes us)
		}
		bits := i.pending.Swap(0)
		for v := 0; bits != 0; v++ {
			if bits&(1<<v) != 0 {
				bits &^= 1 << v
				fn.Trigger(v)
			}
		}
	}
}

// TriggerSync signals vector on the calling goroutine before it returns
// (vdev.SyncIRQ): the device's command completion, raised on the
// goroutine that answers the guest's REQUEST write, so that QEMU has the
// interrupt before the write's reply. Signalling does not block (a full
// eventfd means an interrupt is pending anyway), and that goroutine is the
// VM's own. It then counts whether QEMU has already taken the interrupt
// (syncIRQBound). Before the function exists it is left to the signaller.
func (i *fnIRQ) TriggerSync(vector int) {
	fn := i.fn.Load()
	if fn == nil || vector < 0 || vector >= 64 {
		i.Trigger(vector)
		return
	}
	fn.Trigger(vector)
	if taken, err := fn.AwaitConsumed(vector, syncIRQBound); taken && err == nil {
		i.syncTaken.Add(1)
	} else {
		i.syncPending.Add(1) // a failed poll counts as pending
	}
}

// setFn gives the signaller its function and signals what was raised
// before it existed (a device rebuilt from its journal raises
// notifications and events while it is rebuilt: none may be lost).
func (i *fnIRQ) setFn(fn *pcidev.Function) {
	i.fn.Store(fn)
	select {
	case i.wake <- struct{}{}:
	default:
	}
}

// stop ends the signaller (the connection is gone) and waits for it.
func (i *fnIRQ) stop() {
	close(i.done)
	<-i.stopped
}

// eventRelay forwards provider async events to the device once it exists.
type eventRelay struct {
	mu  sync.Mutex
	dev *vdev.Device
}

func (r *eventRelay) set(d *vdev.Device) { r.mu.Lock(); r.dev = d; r.mu.Unlock() }

func (r *eventRelay) deliver(ev hostverbs.AsyncEvent) {
	r.mu.Lock()
	d := r.dev
	r.mu.Unlock()
	if d != nil {
		d.HandleEvent(ev)
	}
}
