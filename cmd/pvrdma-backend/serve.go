package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/supervise"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// vmList collects repeated --vm NAME[=MAC][,gid-allow=PREFIX...][,cgroup=PATH...] flags.
type vmList []backend.VMRequest

func (l *vmList) String() string { return fmt.Sprint(*l) }

func (l *vmList) Set(v string) error {
	req, err := backend.ParseVMFlag(v)
	if err != nil {
		return err
	}
	*l = append(*l, req)
	return nil
}

// idList collects comma-separated numeric IDs.
type idList []uint32

func (l *idList) String() string {
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.FormatUint(uint64(v), 10)
	}
	return strings.Join(s, ",")
}

func (l *idList) Set(v string) error {
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.ParseUint(strings.TrimSpace(f), 10, 32)
		if err != nil {
			return fmt.Errorf("bad ID %q: %w", f, err)
		}
		*l = append(*l, uint32(n))
	}
	return nil
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	started := time.Now()
	fs := newFlags("serve", "[flags]", stderr)
	socketDir := fs.String("socket-dir", defaultSocketDir, "directory for the per-VM vfio-user sockets and control.sock")
	netdev := fs.String("fabric-netdev", "", "IP mode: add bound guest GIDs as addresses on this netdev and use UDP 4791 through it")
	wireQueues := fs.Int("wire-queues", 1, "IP mode, soft transport, UDP wire: port 4791 receive sockets per family (1-64), each with a receive goroutine, each QP's packets steered to one; more than one helps bulk streams between QPs of this daemon and costs their ping-pongs a wake-up per message")
	ipWire := fs.String("ip-wire", "udp", "IP mode, soft transport: how RoCE packets cross the kernel: udp (UDP sockets with segmentation offload, UDP_SEGMENT and UDP_GRO) or raw (raw IP sockets, one packet per slot of each system call)")
	bridge := fs.String("fabric-bridge", "", "L2 mode: carry RoCE as frames with the VMs' own MACs on this bridge (the VMs' NICs are on it)")
	vlan := fs.Uint("fabric-vlan", 0, "L2 mode: the 802.1Q VLAN ID (1-4094) the fabric's frames carry and the only one it takes in; 0: untagged")
	pcp := fs.String("pcp", "auto", "L2 mode with --fabric-vlan: the 802.1Q priority of RoCE frames, 0-7, or auto (each frame's traffic class >> 5, i.e. DSCP >> 3)")
	dcqcn := fs.String("dcqcn", "on", "soft transport congestion control: on (DCQCN with its default parameters), off, or KEY=VALUE,... over the defaults (line-rate, min-rate, ai-rate, hai-rate, cnp-interval, alpha-period, rate-timer, reduction-period, cnp-window, byte-counter, g, f)")
	roceMode := fs.String("roce-mode", "v2", "RoCE version of VMs registered without their own (--vm NAME,roce=v1): v2 (UDP 4791, routable) or v1 (Ethertype 0x8915; L2 mode or VMs of this daemon only); a VM's device offers exactly one")
	tos := fs.Uint("default-tos", 0, "IP TOS of RoCE packets whose traffic class is 0 (default_roce_tos)")
	transport := fs.String("transport", "soft", "host verbs provider: soft (pure-Go RoCE v2) or ibverbs (relay to a host RDMA device through libibverbs)")
	ibdev := fs.String("ibdev", "", "ibverbs: the host RDMA device (ibv_devices; e.g. mlx5_0, rxe0)")
	ibPort := fs.Uint("ib-port", 1, "ibverbs: the device's port")
	ibBusy := fs.Duration("ibverbs-busy-poll", 0, "ibverbs: keep polling CQs that just completed work this long (e.g. 50us) before waiting for the next completion event: lower latency for that much CPU after each burst; 0: off")
	createRXE := fs.String("create-rxe", "", "ibverbs: create a Soft-RoCE link over this netdev (rdma link add rxe_NETDEV type rxe netdev NETDEV), relay to it, remove it at shutdown")
	var vms vmList
	fs.Var(&vms, "vm", "register a VM at start: NAME or NAME=MAC, optionally followed by ,gid-allow=PREFIX (its own GID allow list; both repeatable), ,mem=SIZE, ,roce=v1|v2, ,doorbells=trapped|memory (memory: user-space doorbells are stores to memory shared with QEMU that the daemon polls, no round trip; docs/ARCHITECTURE.md \"Doorbells in memory\"), ,uid=N (its QEMU's user: the VM's sockets admit only it and root) and ,cgroup=PATH (its QEMU's cgroup, as /proc/PID/cgroup shows it: the VM's sockets admit only peers in it or below; without it, a QEMU in another libvirt domain's machine cgroup is refused)")
	gidAllow := fs.String("gid-allow", "",
		"the fabric's GID pool: prefixes (CIDR, comma-separated; \"none\": only each VM's own link-local GID) VMs registered without their own gid-allow may bind (default: none; a guest's GID captures the fabric's traffic to that address and, in IP mode, becomes a host address)")
	lim := vdev.DefaultLimits()
	fs.IntVar(&lim.MaxQP, "max-qp", lim.MaxQP, "QPs per VM")
	fs.IntVar(&lim.MaxCQ, "max-cq", lim.MaxCQ, "CQs per VM")
	fs.IntVar(&lim.MaxMR, "max-mr", lim.MaxMR, "MRs per VM")
	fs.IntVar(&lim.MaxPD, "max-pd", lim.MaxPD, "PDs per VM")
	fs.IntVar(&lim.MaxSRQ, "max-srq", lim.MaxSRQ, "SRQs per VM")
	fs.Uint64Var(&lim.MaxMRBytes, "max-mr-bytes", lim.MaxMRBytes, "registered memory bytes per VM")
	vmBudget := sizeFlag(lim.MaxBytes)
	fs.Var(&vmBudget, "vm-memory-budget", "daemon memory one VM's QPs, SRQs, CQs and MRs may cost (e.g. 256M)")
	var maxLocked sizeFlag
	fs.Var(&maxLocked, "max-locked-memory", "guest memory all VMs may have the daemon map and lock, and RLIMIT_MEMLOCK (default: three quarters of the host's memory)")
	vmLocked := sizeFlag(backend.DefaultVMLocked)
	fs.Var(&vmLocked, "vm-locked-default", "guest memory a VM registered without its RAM size (--vm NAME,mem=SIZE, qemu-args --mem) may have the daemon map and lock")
	var daemonBudget sizeFlag
	fs.Var(&daemonBudget, "daemon-memory-budget", "daemon memory all VMs' objects may cost together (default: a quarter of the host's memory)")
	socketGroup := fs.String("socket-group", "", "group (name or number) owning the socket directory (0750) and the VM sockets (0660): the group QEMU runs in")
	keepState := fs.Bool("keep-state", false, "with --no-supervisor: keep VMs' state in <socket-dir>/state for a live upgrade (pvrdma-backend upgrade); under systemd's file descriptor store or the supervisor it is kept anyway, with the VMs' connections, and a crash costs them only the work in flight")
	noSupervisor := fs.Bool("no-supervisor", false, "not run by systemd (no NOTIFY_SOCKET), serve in this process instead of under the supervisor that otherwise holds the VMs' descriptors and restarts the daemon's process if it dies: for running it under another supervisor (a crash then cuts every connected VM's device)")
	restartDelay := fs.Duration("restart-delay", supervise.DefaultRestartDelay, "supervisor: wait this long after the daemon's process died before starting it again (QEMU waits 5 s for each reply)")
	restartBurst := fs.Int("restart-burst", supervise.DefaultBurst, "supervisor: a daemon process started more than this many times within --restart-interval is not started again: the supervisor exits with an error and its VMs lose their devices")
	restartInterval := fs.Duration("restart-interval", supervise.DefaultInterval, "supervisor: the interval of --restart-burst")
	var allowUIDs, allowGIDs idList
	fs.Var(&allowUIDs, "allow-uid", "also admit peers with these user IDs on the sockets (comma-separated; root, the daemon's user and --socket-group always are)")
	fs.Var(&allowGIDs, "allow-gid", "also admit peers with these group IDs on the sockets (comma-separated)")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	jsonLogs := fs.Bool("log-json", false, "log JSON instead of text")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *wireQueues < 1 || *wireQueues > 64 {
		return fmt.Errorf("--wire-queues %d: want 1 to 64", *wireQueues)
	}
	if *wireQueues > 1 && (*netdev == "" || *transport != "soft" || *ipWire != "udp") {
		return errors.New("--wire-queues needs IP mode (--fabric-netdev) on the soft transport's UDP wire")
	}
	switch *ipWire {
	case "udp":
	case "raw":
		if *netdev == "" || *transport != "soft" {
			return errors.New("--ip-wire raw needs IP mode (--fabric-netdev) on the soft transport")
		}
	default:
		return fmt.Errorf("--ip-wire %s: want udp or raw", *ipWire)
	}
	switch *transport {
	case "soft":
		if *ibdev != "" || *createRXE != "" || *ibBusy != 0 {
			return errors.New("--ibdev, --create-rxe and --ibverbs-busy-poll need --transport ibverbs")
		}
	case "ibverbs":
		if *ibdev == "" && *createRXE == "" {
			return errors.New("--transport ibverbs needs --ibdev NAME or --create-rxe NETDEV")
		}
		if *ibPort == 0 || *ibPort > 255 {
			return fmt.Errorf("--ib-port %d: must be 1..255", *ibPort)
		}
	default:
		return fmt.Errorf("--transport %s: want soft or ibverbs", *transport)
	}
	cc, err := backend.ParseCongestion(*dcqcn)
	if err != nil {
		return fmt.Errorf("--dcqcn: %w", err)
	}
	mode, err := backend.ParseRoCEMode(*roceMode)
	if err != nil {
		return fmt.Errorf("--roce-mode: %w", err)
	}
	if *vlan > 4094 {
		return fmt.Errorf("--fabric-vlan %d: want 1-4094 (0: untagged)", *vlan)
	}
	fixedPCP, pcpVal := false, uint64(0)
	if *pcp != "auto" {
		pcpVal, err = strconv.ParseUint(*pcp, 10, 8)
		if err != nil || pcpVal > 7 {
			return fmt.Errorf("--pcp %q: want 0-7 or auto", *pcp)
		}
		fixedPCP = true
	}
	if (*vlan != 0 || fixedPCP) && *bridge == "" {
		return errors.New("--fabric-vlan and --pcp need L2 mode (--fabric-bridge)")
	}
	if *tos > 255 {
		return fmt.Errorf("--default-tos %d: must be 0..255", *tos)
	}
	if *restartDelay <= 0 || *restartBurst < 1 || *restartInterval <= 0 {
		return errors.New("--restart-delay and --restart-interval must be above 0, --restart-burst at least 1")
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	hopts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(stderr, hopts)
	if *jsonLogs {
		h = slog.NewJSONHandler(stderr, hopts)
	}
	log := slog.New(h)
	lim.MaxBytes = uint64(vmBudget)
	if lim.MaxBytes == 0 {
		return errors.New("--vm-memory-budget must be above 0")
	}
	var allow []netip.Prefix // nil: none declared (backend.Config.GIDAllow)
	if *gidAllow != "" {
		if allow, err = backend.ParseGIDAllow(*gidAllow); err != nil {
			return fmt.Errorf("--gid-allow: %w", err)
		}
		if allow == nil {
			allow = []netip.Prefix{}
		}
	}
	if maxLocked == 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err != nil {
			return fmt.Errorf("--max-locked-memory: no default from the host's memory: %w", err)
		}
		maxLocked = sizeFlag(uint64(si.Totalram) * uint64(si.Unit) / 4 * 3)
	}
	// The binary by the path it was started from (after a package
	// upgrade, the new one): a live upgrade's default, and what the
	// supervisor starts.
	exe := os.Args[0]
	if p, err := exec.LookPath(exe); err == nil {
		if abs, err := filepath.Abs(p); err == nil {
			exe = abs
		}
	} else if p, err := os.Executable(); err == nil {
		exe = p
	}
	// Started by the supervisor: takes the descriptors it hands back.
	worker, supervised := supervise.Worker()
	if !supervised && !*noSupervisor && os.Getenv("NOTIFY_SOCKET") == "" && !handedOver() {
		// No service manager keeps the VMs' descriptors: the supervisor
		// does, and runs this daemon as its worker.
		return supervise.Run(ctx, supervise.Config{
			Path: exe, Args: append([]string{exe, "serve"}, args...),
			RestartDelay: *restartDelay, Burst: *restartBurst, Interval: *restartInterval,
			Logger: log,
		})
	}
	setMemlock(log, uint64(maxLocked))
	// Sockets and files are created private and opened up deliberately
	// (backend: the socket group's sockets 0660, the control socket 0600).
	unix.Umask(0o077)
	// Run by systemd (Type=notify): keep VMs' connections in its file
	// descriptor store and take back those a previous process left there.
	var store *backend.FDStore
	var inherited map[string]*os.File
	if ns := os.Getenv("NOTIFY_SOCKET"); ns != "" {
		if store, err = backend.OpenFDStore(ns); err != nil {
			return fmt.Errorf("systemd's file descriptor store: %w", err)
		}
		defer store.Close()
		inherited = map[string]*os.File{}
		for name, files := range activation.FilesWithNames() {
			for i, f := range files {
				if i > 0 {
					_ = f.Close() // one descriptor per name is ours
					continue
				}
				inherited[name] = f
			}
		}
		if len(inherited) > 0 {
			from := "systemd"
			if supervised {
				from = "the supervisor"
			}
			log.Info("descriptors handed back by "+from, "count", len(inherited))
		}
	}
	// Exec'd by a predecessor (a live upgrade): its VMs' descriptors.
	if hf := backend.HandoverFiles(); len(hf) > 0 {
		if inherited == nil {
			inherited = map[string]*os.File{}
		}
		for name, f := range hf {
			inherited[name] = f
		}
		log.Info("descriptors handed over by the previous daemon", "count", len(hf))
	}
	var sup *backend.SupervisorStatus
	if supervised && store != nil {
		sup = &backend.SupervisorStatus{PID: worker.SupervisorPID, Restarts: worker.Restarts, LastExit: worker.LastExit}
	}
	// Taking VMs over (after a crash, a restart or a live upgrade), the
	// process rebuilds their devices: what it allocates then is what they
	// hold, not garbage, so no collection runs until they are rebuilt
	// (it would only lengthen their pause).
	var onResumed func()
	if len(inherited) > 0 {
		gc := debug.SetGCPercent(-1)
		onResumed = func() { debug.SetGCPercent(gc) }
	}
	d, err := backend.New(backend.Config{
		FDStore:    store,
		Supervisor: sup,
		Inherited:  inherited,
		KeepState:  *keepState,
		Executable: exe,
		Started:    started,
		OnResumed:  onResumed,
		OnReady: func() {
			if store != nil {
				_, _ = daemon.SdNotify(false, daemon.SdNotifyReady)
			}
		},
		GIDAllow:  allow,
		SocketDir: *socketDir,
		Fabric: backend.FabricConfig{Netdev: *netdev, RawWire: *ipWire == "raw", WireQueues: *wireQueues, Bridge: *bridge, DefaultTOS: uint8(*tos), RoCEMode: mode,
			VLAN: uint16(*vlan), PCP: uint8(pcpVal), FixedPCP: fixedPCP, Congestion: cc,
			IBDevice: *ibdev, IBPort: uint8(*ibPort), IBBusyPoll: *ibBusy, CreateRXE: *createRXE},
		Limits:          lim,
		MemoryBudget:    uint64(daemonBudget),
		MaxLockedMemory: uint64(maxLocked),
		VMLockedDefault: uint64(vmLocked),
		SocketGroup:     *socketGroup,
		AllowUIDs:       allowUIDs,
		AllowGIDs:       allowGIDs,
		VMs:             vms,
		Logger:          log,
	})
	if err != nil {
		return err
	}
	err = d.Run(ctx)
	if store != nil {
		_, _ = daemon.SdNotify(false, daemon.SdNotifyStopping)
	}
	if supervised {
		supervise.WorkerDone(worker)
	}
	return err
}

// handedOver reports whether this process was exec'd by a daemon handing
// its VMs over (a live upgrade): it serves in that process, whatever ran
// it; a supervisor of its own would take the process from under its VMs.
func handedOver() bool {
	_, ok := os.LookupEnv(backend.EnvGeneration)
	return ok
}

// setMemlock sets RLIMIT_MEMLOCK to the daemon's locked-memory cap (finite:
// the daemon also enforces it, and per VM, itself). Raising it needs
// CAP_SYS_RESOURCE; without it CAP_IPC_LOCK still allows mlock, and
// without either, DMA_MAP reports the mlock failure to the VM's QEMU.
func setMemlock(log *slog.Logger, n uint64) {
	lim := unix.Rlimit{Cur: n, Max: n}
	if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		var cur unix.Rlimit
		_ = unix.Getrlimit(unix.RLIMIT_MEMLOCK, &cur)
		log.Debug("RLIMIT_MEMLOCK unchanged (CAP_IPC_LOCK still allows locking guest RAM)", "err", err, "cur", cur.Cur)
	}
}
