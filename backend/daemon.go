package backend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"golang.org/x/sys/unix"
)

// Config parameterises the daemon.
type Config struct {
	// SocketDir holds one vfio-user socket per VM (<name>.sock) and the
	// control socket (control.sock). Created if missing.
	SocketDir string
	// Fabric selects how devices reach the network.
	Fabric FabricConfig
	// Limits are the per-VM resource quotas.
	Limits vdev.Limits
	// MemoryBudget caps what all VMs' objects (QPs, SRQs, CQs, MRs) cost
	// the daemon's memory together, in bytes; each VM also has its own
	// cap, Limits.MaxBytes. 0 means a quarter of the host's memory.
	MemoryBudget uint64
	// VMs are registered at start.
	VMs []VMRequest
	// GIDAllow is the allow list of GID prefixes for VMs registered without
	// their own (VMRequest.GIDAllow): the fabric's pool. nil means none
	// declared: an empty list, which allows each VM only its own
	// link-local GID.
	GIDAllow []netip.Prefix
	// GIDBindBurst and GIDBindRate meter each VM's GID binds (a token
	// bucket: so many at once, then so many a second); 0 means the
	// defaults, 32 and 2.
	GIDBindBurst int
	GIDBindRate  float64
	// MaxLockedMemory caps the guest memory all VMs' QEMUs may have the
	// daemon map and lock together; 0 means three quarters of the host's
	// memory. Each VM is also capped by its registered size.
	MaxLockedMemory uint64
	// VMLockedDefault caps the guest memory of a VM registered without its
	// RAM size (VMRequest.MemBytes), LockSlack included; 0 means
	// DefaultVMLocked. A VM registered with its size gets that size plus
	// LockSlack instead.
	VMLockedDefault uint64
	// SocketGroup, if set (a name or a number), owns the socket
	// directory (mode 0750) and the VM sockets (0660): the group QEMU runs
	// in. Without it only the daemon's user and root reach them.
	SocketGroup string
	// AllowUIDs and AllowGIDs are peers admitted on every socket besides
	// root, the daemon's own user and the socket group (SO_PEERCRED).
	AllowUIDs, AllowGIDs []uint32
	// StateDir holds what a restarted daemon needs to take its VMs back
	// (continuity.go); "" means <SocketDir>/state.
	StateDir string
	// FDStore, if set, keeps each VM's connection and descriptors beyond
	// the process (systemd's file descriptor store): a restart or crash of
	// the daemon then costs a VM a pause, not its device.
	FDStore *FDStore
	// Inherited are the descriptors the service manager handed back at
	// start (LISTEN_FDS, by LISTEN_FDNAMES): the connections of VMs a
	// previous process served.
	Inherited map[string]*os.File
	// KeepState keeps VMs' state for a successor (continuity.go) without a
	// descriptor store: a live upgrade (StartUpgrade) then works, a crash
	// still cuts the connections. On with an FDStore.
	KeepState bool
	// CounterCheckpoint is how often connected VMs' counters are saved
	// for a successor when state is kept (0: every 2 s): a crash loses
	// at most that much of them.
	CounterCheckpoint time.Duration
	// Executable is the daemon's binary, which a live upgrade execs by
	// default (its path: after a package upgrade it is the new binary).
	Executable string
	// Started is when the process's command began (before New), for the
	// part of a hand-over's pause the new image's start takes before it
	// (HandoverStatus.ExecMS); zero if not known.
	Started time.Time
	// OnResumed, if set, is called once the connections a previous
	// process left are resumed: their devices rebuilt, or the wait for
	// them (fabricResumeWait) over; at once if there were none.
	OnResumed func()
	// Supervisor, if set, says FDStore is the daemon's own supervisor's
	// (package supervise), not a service manager's: it exits with the
	// daemon, so an orderly stop ends the VMs' connections (as without a
	// store) instead of leaving them to it.
	Supervisor *SupervisorStatus
	// OnReady, if set, is called once the daemon serves (VMs resumed,
	// control socket listening).
	OnReady func()
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

// Daemon serves PVRDMA devices to VMs: one vfio-user socket per VM, one
// device per connected QEMU, all on one fabric.
type Daemon struct {
	cfg    Config
	log    *slog.Logger
	fabric *fabric
	budget *vdev.Budget // shared by every VM's device
	locked *vdev.Budget // guest memory mapped and locked, all VMs
	access *accessPolicy
	keep   *keeping
	ho     handover
	// owners reserves GIDs to VMs from their first bind until they are
	// unregistered.
	owners *gidOwners
	// poolDefaulted: no pool declared (Config.GIDAllow).
	poolDefaulted bool
	resMu         sync.Mutex // serialises writes of the reservations file
	// hostAddrs lists the addresses the host holds (replaced in tests).
	hostAddrs func() (map[netip.Addr]string, error)
	// metrics is the daemon's Prometheus registry (metrics.go).
	metrics *prometheus.Registry

	mu     sync.Mutex
	vms    map[string]*vmSession
	closed bool
}

// New prepares a daemon: it creates the socket directory and the fabric and
// registers cfg.VMs. Run serves it.
func New(cfg Config) (*Daemon, error) {
	if cfg.SocketDir == "" {
		return nil, errors.New("socket directory required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	access, err := newAccessPolicy(cfg, cfg.Logger)
	if err != nil {
		return nil, err
	}
	if err := access.prepareDir(cfg.SocketDir); err != nil {
		return nil, err
	}
	warnHiddenProc(cfg.Logger)
	if cfg.MemoryBudget == 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err != nil {
			return nil, fmt.Errorf("daemon memory budget from the host's memory: %w (set it explicitly)", err)
		}
		cfg.MemoryBudget = uint64(si.Totalram) * uint64(si.Unit) / 4
	}
	if cfg.MaxLockedMemory == 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err != nil {
			return nil, fmt.Errorf("locked memory cap from the host's memory: %w (set it explicitly)", err)
		}
		cfg.MaxLockedMemory = uint64(si.Totalram) * uint64(si.Unit) / 4 * 3
	}
	if cfg.VMLockedDefault == 0 {
		cfg.VMLockedDefault = DefaultVMLocked
	}
	if cfg.GIDBindBurst <= 0 {
		cfg.GIDBindBurst = gidBindBurst
	}
	if cfg.GIDBindRate <= 0 {
		cfg.GIDBindRate = gidBindRate
	}
	poolDefaulted := false
	if cfg.GIDAllow == nil {
		// Addresses are assigned, not claimed (issue 23): a guest's GID
		// captures the fabric's traffic for that address (in process,
		// before the wire) and in IP mode becomes a host address, so
		// without a declared pool a VM has only its own link-local GID.
		cfg.GIDAllow, poolDefaulted = []netip.Prefix{}, true
		cfg.Logger.Info("no GID pool declared: VMs registered without their own gid-allow bind only their link-local GID; assign addresses per VM (--vm NAME,gid-allow=PREFIX, qemu-args --gid-allow, the control API) or declare the fabric's pool with --gid-allow")
	}
	if cfg.StateDir == "" {
		cfg.StateDir = filepath.Join(cfg.SocketDir, "state")
	}
	keep, err := newKeeping(cfg.StateDir, cfg.FDStore, cfg.KeepState, cfg.Inherited, cfg.Logger)
	if err != nil {
		return nil, err
	}
	fab, err := newFabric(cfg.Fabric, keep.takeFabric(), cfg.Logger)
	if err != nil {
		return nil, err
	}
	keep.storeFabric(fab.sockets())
	d := &Daemon{cfg: cfg, log: cfg.Logger, fabric: fab, vms: map[string]*vmSession{}, keep: keep,
		budget: vdev.NewBudget(cfg.MemoryBudget, nil), locked: vdev.NewBudget(cfg.MaxLockedMemory, nil), owners: newGIDOwners(), hostAddrs: hostAddrs, access: access,
		poolDefaulted: poolDefaulted}
	d.metrics = newMetricsRegistry(d)
	d.adoptAddrs()
	d.adoptReservations()
	keep.takeHandoverState()
	saved, savedErr := keep.savedVMs() // before AddVM: it need not write what is recorded
	for _, vm := range cfg.VMs {
		if _, err := d.AddVM(vm); err != nil {
			d.close()
			return nil, err
		}
	}
	d.restore(saved, savedErr)
	return d, nil
}

// restore registers the VMs a previous process had (their kept
// registrations reqs, or err reading them) and resumes the connections
// it left in the store.
func (d *Daemon) restore(reqs []VMRequest, err error) {
	if err != nil {
		d.log.Warn("cannot read the kept state: VMs registered before are not registered again", "dir", d.keep.dir, "err", err)
	}
	registered := 0
	for _, req := range reqs {
		d.mu.Lock()
		_, ok := d.vms[req.Name]
		d.mu.Unlock()
		if ok {
			continue
		}
		if _, err := d.AddVM(req); err != nil {
			d.log.Warn("cannot register a VM a previous daemon had", "vm", req.Name, "err", err)
			continue
		}
		registered++
	}
	d.keep.mu.Lock()
	d.keep.recorded = nil // later registrations check the files
	d.keep.mu.Unlock()
	d.mu.Lock()
	sessions := make([]*vmSession, 0, len(d.vms))
	for _, s := range d.vms {
		sessions = append(sessions, s)
	}
	d.mu.Unlock()
	// The VMs whose connections were kept, counted before any is
	// resumed: the hand-over bookkeeping must know how many resume before
	// the first of them is rebuilt. Each then reads its state and is
	// rebuilt on a goroutine of its own.
	type todo struct {
		s   *vmSession
		fds map[string]*os.File
	}
	var todos []todo
	for _, s := range sessions {
		if fds := d.keep.takeInherited(s.name); len(fds) > 0 {
			todos = append(todos, todo{s, fds})
		} else {
			d.keep.forgetConn(s.name)
		}
	}
	resumed := len(todos)
	d.ho.fromEnv(resumed, d.cfg.Started)
	servers := make([]*vfiouser.Server, 0, len(todos))
	for _, t := range todos {
		servers = append(servers, t.s.srv)
	}
	d.ho.holdResumes(servers)
	var devices sync.WaitGroup // resumed devices rebuilt (their GIDs bound again)
	for _, t := range todos {
		devices.Add(1)
		go func() {
			r, err := d.keep.loadResumable(t.s.name, t.fds)
			if err != nil {
				d.log.Error("cannot resume the VM's connection: its QEMU sees it close", "vm", t.s.name, "err", err)
				t.s.forgetStored(nil)
				d.ho.resumed(0, 0, 0)
				devices.Done()
				return
			}
			t.s.resume(r, devices.Done)
		}()
	}
	// A fabric that took its sockets over receives again once the QPs
	// their queued packets are for are back (bounded: a VM whose device
	// takes long must not keep the others' packets waiting).
	go func() {
		rebuilt := make(chan struct{})
		go func() { devices.Wait(); close(rebuilt) }()
		select {
		case <-rebuilt:
		case <-time.After(fabricResumeWait):
			d.log.Warn("the fabric receives again before every VM's device is rebuilt", "waited", fabricResumeWait)
		}
		d.fabric.resumeReceive()
		d.persistHanded()
		if d.cfg.OnResumed != nil {
			d.cfg.OnResumed()
		}
	}()
	if am := d.fabric.addrs; am != nil {
		go func() {
			devices.Wait()
			am.DropUnreferenced()
			d.saveAddrs()
		}()
	}
	d.keep.dropInherited()
	d.dropOrphanReservations()
	if registered > 0 || resumed > 0 {
		d.log.Info("took over from a previous daemon", "registered", registered, "connections_resumed", resumed)
	}
}

// fabricResumeWait bounds how long a fabric that took its sockets over
// waits for the resumed devices before it receives again.
const fabricResumeWait = 2 * time.Second

// Run serves the control socket until ctx ends, then shuts everything down:
// VMs' connections are closed (their QEMUs see EOF), sockets removed,
// GID addresses withdrawn.
func (d *Daemon) Run(ctx context.Context) error {
	ln, err := ListenControl(controlSocket(d.cfg.SocketDir))
	if err != nil {
		d.close()
		return err
	}
	ln = d.access.listener(ln, "control")
	srv := &http.Server{Handler: controlHandler(d, d.log), ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	go d.checkpointCounters(ctx)
	d.log.Info("serving", "socket_dir", d.cfg.SocketDir, "fabric", d.fabric.status().Mode, "vms", len(d.cfg.VMs),
		"fd_store", d.keep.store != nil)
	if d.cfg.OnReady != nil {
		d.cfg.OnReady()
	}
	select {
	case <-ctx.Done():
	case err = <-errc:
		err = fmt.Errorf("control socket: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	_ = os.Remove(controlSocket(d.cfg.SocketDir))
	d.close()
	d.log.Info("stopped")
	return err
}

func controlSocket(dir string) string { return dir + "/control.sock" }

func (d *Daemon) close() {
	d.mu.Lock()
	d.closed = true
	vms := make([]*vmSession, 0, len(d.vms))
	for _, s := range d.vms {
		vms = append(vms, s)
	}
	d.vms = map[string]*vmSession{}
	d.mu.Unlock()
	var exposed []string
	for _, s := range vms {
		if s.qemuConnected() {
			exposed = append(exposed, s.name)
		}
	}
	if d.keep.store != nil && d.cfg.Supervisor == nil {
		// The service manager holds every connection: leave them to it,
		// with their state, for the next daemon.
		for _, s := range vms {
			s.leaveToStore()
		}
		if len(exposed) > 0 {
			sort.Strings(exposed)
			d.log.Info("leaving connected VMs to systemd's fd store: the next daemon takes them back", "vms", exposed)
		}
		exposed = nil
	} else {
		_ = os.RemoveAll(d.keep.dir)
	}
	if len(exposed) > 0 {
		sort.Strings(exposed)
		d.log.Warn("stopping with connected VMs: their QEMUs see EOF, and each device stays dead until its QEMU is restarted "+
			"(QEMU's vfio-user client does not reconnect; a QEMU with a request in flight may abort)", "vms", exposed)
	}
	for _, s := range vms {
		s.stop()
	}
	// An orderly stop takes guests' GID addresses off the netdev, even when
	// a successor takes the VMs (it adds them again as their GIDs are
	// replayed): a stop cannot tell a restart from a stop. A crash or a
	// hand-over (exec) leaves them for the successor to adopt.
	if err := d.fabric.close(false); err != nil {
		d.log.Warn("closing fabric", "err", err)
	}
}

// AddVM registers a VM: it creates the VM's socket and starts serving it.
func (d *Daemon) AddVM(req VMRequest) (VMStatus, error) {
	if err := CheckVMName(req.Name); err != nil {
		return VMStatus{}, err
	}
	mac := DefaultMAC(req.Name)
	if req.MAC != "" {
		m, err := net.ParseMAC(req.MAC)
		if err != nil || len(m) != 6 {
			return VMStatus{}, fmt.Errorf("VM %s: MAC %q: %w", req.Name, req.MAC, ErrBadMAC)
		}
		mac = m
	}
	allow, err := ParseGIDAllow(req.GIDAllow...)
	if err != nil {
		return VMStatus{}, fmt.Errorf("VM %s: gid_allow: %w", req.Name, err)
	}
	mode, err := ParseRoCEMode(req.RoCEMode)
	if err != nil {
		return VMStatus{}, fmt.Errorf("VM %s: roce_mode: %w", req.Name, err)
	}
	doorbells, err := vdev.ParseDoorbellMode(req.Doorbells)
	if err != nil {
		return VMStatus{}, fmt.Errorf("VM %s: %w", req.Name, err)
	}
	if req.QEMUCgroup != "" {
		if err := CheckCgroupPath(req.QEMUCgroup); err != nil {
			return VMStatus{}, fmt.Errorf("VM %s: qemu_cgroup: %w", req.Name, err)
		}
	}
	if mode == 0 {
		mode = d.cfg.Fabric.RoCEMode
	}
	if mode == 0 {
		mode = hostverbs.GIDTypeRoCEv2
	}
	if err := d.cfg.Fabric.checkRoCEMode(mode); err != nil {
		return VMStatus{}, fmt.Errorf("VM %s: %w", req.Name, err)
	}
	defaulted := false
	if allow == nil {
		allow, defaulted = d.cfg.GIDAllow, d.poolDefaulted
	}
	// A VM on the default (no pool declared) keeps the GIDs it
	// had reserved under an earlier daemon's default: an upgrade must not
	// take a running guest's addresses away.
	pol := gidPolicy{allow: allow, linkLocal: linkLocalGID(mac), keepReserved: defaulted}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return VMStatus{}, errors.New("daemon is shutting down")
	}
	if _, ok := d.vms[req.Name]; ok {
		return VMStatus{}, fmt.Errorf("VM %s: %w", req.Name, ErrVMExists)
	}
	lockLimit := min(d.cfg.MaxLockedMemory, d.cfg.VMLockedDefault)
	if req.MemBytes > 0 {
		lockLimit = min(d.cfg.MaxLockedMemory, req.MemBytes+LockSlack)
	}
	for other := range d.vms {
		if libvirtNamesCollide(req.Name, other) {
			d.log.Warn("libvirt gives this VM's QEMU the machine cgroup it gives another VM's (the names differ only in "+
				"characters libvirt drops): QEMUs in that cgroup are refused on both VMs' sockets; rename one",
				"vm", req.Name, "other_vm", other)
		}
	}
	s, err := startVM(d, req.Name, mac, pol, mode, vdev.NewBudget(lockLimit, d.locked), vmIdentity{uid: req.QEMUUID, cgroup: req.QEMUCgroup}, doorbells)
	if err != nil {
		return VMStatus{}, err
	}
	d.vms[req.Name] = s
	d.keep.saveVM(req)
	return s.status(), nil
}

// machineTwin returns a registered VM other than vm whose QEMU libvirt
// would give machine name machine too, or "".
func (d *Daemon) machineTwin(vm, machine string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name := range d.vms {
		if name != vm && machineNames(machine, name) {
			return name
		}
	}
	return ""
}

// RemoveVM unregisters a VM, disconnecting its QEMU if connected.
func (d *Daemon) RemoveVM(name string) error {
	d.mu.Lock()
	s, ok := d.vms[name]
	delete(d.vms, name)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("VM %s: %w", name, ErrNoVM)
	}
	s.stop()
	if d.owners.release(name) {
		d.saveReservations()
	}
	d.keep.forgetVM(name)
	return nil
}

// hostHolds returns why a guest may not bind a because the host holds
// it, or "": one of its interface addresses, the network or broadcast
// address of one of its IPv4 subnets, or (IP mode) of a subnet routed on
// the fabric netdev, or an address in use on the fabric (a neighbour, a
// gateway, an answer to an ARP probe). Addresses the daemon added for guests' GIDs are not
// the host's (their ownership is the GID reservations'). An error means
// the host's addresses could not be listed; the bind is then refused.
func (d *Daemon) hostHolds(a netip.Addr) (string, error) {
	addrs, err := d.hostAddrs()
	if err != nil {
		return "", err
	}
	am := d.fabric.addrs
	if r, ok := addrs[a]; ok && (r != reasonHostAddr || am == nil || !am.Owns(a)) {
		return r, nil
	}
	if am != nil && a.Is4() {
		edges, err := am.SubnetEdges()
		if err != nil {
			return "", err
		}
		if _, ok := edges[a]; ok {
			return "the network or broadcast address of a subnet on the fabric netdev", nil
		}
	}
	if am != nil {
		// Becoming a host address would take it from its holder for the
		// whole host (neighbour_linux.go).
		switch err := am.InUse(a); {
		case errors.Is(err, ErrAddrInUse):
			return err.Error(), nil
		case err != nil:
			return "", err
		}
	}
	return "", nil
}

// Status reports the daemon's state.
func (d *Daemon) Status() Status {
	vms := d.sessions()
	st := Status{Transport: d.cfg.Fabric.Transport(), SocketDir: d.cfg.SocketDir, Fabric: d.fabric.status(), Counters: d.fabric.counters()}
	if st.Counters == nil {
		st.Counters = map[string]uint64{}
	}
	st.Counters["refused_peers"] = d.access.refused.Load()
	for _, s := range vms {
		st.VMs = append(st.VMs, s.status())
	}
	st.KeepsState, st.PID = d.keep.active(), os.Getpid()
	if sv := d.cfg.Supervisor; sv != nil {
		c := *sv
		st.Supervisor = &c
	}
	if h := d.ho.snapshot(); h.Generation > 0 || h.Error != "" {
		st.Handover = &h
	}
	return st
}

// sessions returns the registered VMs, by name.
func (d *Daemon) sessions() []*vmSession {
	d.mu.Lock()
	vms := make([]*vmSession, 0, len(d.vms))
	for _, s := range d.vms {
		vms = append(vms, s)
	}
	d.mu.Unlock()
	sort.Slice(vms, func(i, j int) bool { return vms[i].name < vms[j].name })
	return vms
}

// SocketPath returns the vfio-user socket of a registered VM.
func (d *Daemon) SocketPath(name string) string { return SocketPath(d.cfg.SocketDir, name) }

// QMPSocketPath returns the socket where a registered VM's QEMU connects
// the daemon's QMP monitor (VMSpec.QMPArgs).
func (d *Daemon) QMPSocketPath(name string) string { return QMPSocketPath(d.cfg.SocketDir, name) }

// vfioServer returns a vfio-user server whose connections get devices from
// newDevice.
func vfioServer(newDevice vfiouser.NewDeviceFunc, log *slog.Logger, locked vfiouser.LockBudget) (*vfiouser.Server, error) {
	return vfiouser.NewServer(vfiouser.Config{NewDevice: newDevice, Logger: log, LockBudget: locked})
}

// LockSlack is what a VM's QEMU may map beyond its registered RAM size:
// firmware and option ROM maps.
const LockSlack = 16 << 20

// DefaultVMLocked is the guest memory a VM registered without its RAM size
// may have the daemon map and lock (serve --vm-locked-default): enough for
// a 1 GiB guest. Register a larger VM with its size (qemu-args --mem,
// --vm NAME,mem=SIZE, the control API's mem_bytes); without a bound of its
// own a VM could otherwise lock most of the host's memory.
const DefaultVMLocked = 1<<30 + LockSlack
