package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/ibverbs"
)

// Check statuses, from best to worst.
const (
	statusOK   = "OK"
	statusWarn = "WARN"
	statusFail = "FAIL"
)

// checkResult is one line of `doctor`.
type checkResult struct {
	Name   string `json:"name"`
	Status string `json:"status"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

func ok(name, format string, args ...any) checkResult {
	return checkResult{Name: name, Status: statusOK, Detail: fmt.Sprintf(format, args...)}
}

func warn(name, fix, format string, args ...any) checkResult {
	return checkResult{Name: name, Status: statusWarn, Detail: fmt.Sprintf(format, args...), Fix: fix}
}

func fail(name, fix, format string, args ...any) checkResult {
	return checkResult{Name: name, Status: statusFail, Detail: fmt.Sprintf(format, args...), Fix: fix}
}

// doctorOpts are what the daemon would be run with.
type doctorOpts struct {
	qemu, socketDir, netdev, bridge, transport, ibdev, socketGroup string
	createRXE                                                      string
	maxLocked                                                      uint64
}

// hostEnv is the host as the checks see it; tests point it at fake trees.
type hostEnv struct {
	proc, sys, dev, modules string // /proc, /sys, /dev, /lib/modules
	etc                     string // /etc
	libDirs                 []string
	lookPath                func(string) (string, error)
	run                     func(ctx context.Context, name string, args ...string) ([]byte, error)
	memlock                 func() (unix.Rlimit, error)
	kernel                  string // uname -r
}

func realHost() hostEnv {
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	return hostEnv{
		proc: "/proc", sys: "/sys", dev: "/dev", modules: "/lib/modules", etc: "/etc",
		libDirs:  []string{"/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"},
		lookPath: exec.LookPath,
		run: func(ctx context.Context, name string, args ...string) ([]byte, error) {
			return exec.CommandContext(ctx, name, args...).CombinedOutput()
		},
		memlock: func() (unix.Rlimit, error) {
			var l unix.Rlimit
			err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &l)
			return l, err
		},
		kernel: unix.ByteSliceToString(uts.Release[:]),
	}
}

func runDoctor(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("doctor", "[flags]", stderr)
	var o doctorOpts
	fs.StringVar(&o.qemu, "qemu", "", "QEMU binary the VMs use (default: qemu-system-x86_64 on PATH)")
	fs.StringVar(&o.socketDir, "socket-dir", defaultSocketDir, "the daemon's socket directory")
	fs.StringVar(&o.netdev, "fabric-netdev", "", "IP mode: the fabric netdev")
	fs.StringVar(&o.bridge, "fabric-bridge", "", "L2 mode: the fabric bridge")
	fs.StringVar(&o.transport, "transport", "soft", "host verbs provider: soft or ibverbs")
	fs.StringVar(&o.ibdev, "ibdev", "", "ibverbs: the RDMA device to relay to")
	fs.StringVar(&o.createRXE, "create-rxe", "", "ibverbs: the netdev serve --create-rxe makes a Soft-RoCE link over")
	fs.StringVar(&o.socketGroup, "socket-group", "", "the daemon's --socket-group (QEMU's user must be in it; default for that check: "+serviceUser+", the package's)")
	var maxLocked sizeFlag
	fs.Var(&maxLocked, "max-locked-memory", "the daemon's --max-locked-memory (checked against RLIMIT_MEMLOCK)")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	o.maxLocked = uint64(maxLocked)
	res := doctor(ctx, realHost(), o)
	if err := printChecks(stdout, res, *asJSON); err != nil {
		return err
	}
	n := 0
	for _, r := range res {
		if r.Status == statusFail {
			n++
		}
	}
	if n > 0 {
		return fmt.Errorf("%d of %d checks failed", n, len(res))
	}
	return nil
}

func printChecks(w io.Writer, res []checkResult, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, r := range res {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", r.Status, r.Name, r.Detail)
		if r.Fix != "" {
			fmt.Fprintf(tw, "\t\tfix: %s\n", r.Fix)
		}
	}
	return tw.Flush()
}

// doctor runs every check that applies to o.
func doctor(ctx context.Context, h hostEnv, o doctorOpts) []checkResult {
	res := []checkResult{checkQEMU(ctx, h, o.qemu), checkMemlock(h, o.maxLocked), checkMemfdSeal(),
		checkSocketDir(o.socketDir, o.socketGroup)}
	switch {
	case o.netdev != "" && o.bridge != "":
		res = append(res, fail("fabric", "give one of them", "--fabric-netdev and --fabric-bridge are exclusive"))
	case o.netdev != "":
		res = append(res, checkNetdev(h, o.netdev, false), checkARPIgnore(h, o.netdev), checkNetCaps(h, true))
	case o.bridge != "":
		res = append(res, checkNetdev(h, o.bridge, true), checkNetCaps(h, false))
	default:
		res = append(res, ok("fabric", "none given: VMs of this daemon reach each other in process only"))
	}
	res = append(res, checkUDP4791(h, o.netdev != ""))
	switch o.transport {
	case "soft":
		res = append(res, ok("transport", "soft: needs no RDMA hardware or rdma-core"))
	case "ibverbs":
		if !ibverbs.Built {
			res = append(res, fail("transport", "use a binary built with cgo (make bin), or --transport soft",
				"ibverbs: this binary was built without cgo and has no relay"))
		} else {
			res = append(res, ok("transport", "ibverbs: the relay loads libibverbs at start"))
		}
		res = append(res, checkLibibverbs(h))
		if o.createRXE != "" {
			r := checkRXE(h)
			if r.Status != statusOK {
				r.Status = statusFail
			}
			res = append(res, r)
			if o.netdev == "" && o.bridge == "" {
				res = append(res, checkNetdev(h, o.createRXE, false), checkNetCaps(h, true))
			}
		} else {
			res = append(res, checkIBDev(h, o.ibdev))
		}
	default:
		res = append(res, fail("transport", "--transport soft or ibverbs", "unknown transport %q", o.transport))
	}
	if o.createRXE == "" {
		res = append(res, checkRXE(h))
	}
	res = append(res, checkKVM(h), checkLibvirtHook(h), checkQEMUGroup(h, o.socketGroup, pinnedUIDs(ctx, o.socketDir)),
		checkAppArmor(h, o.socketDir), checkVMs(ctx, o.socketDir))
	return res
}

// pinnedUIDs are the QEMU users the running daemon's VMs are pinned to
// (--vm NAME,uid=N, qemu-args --qemu-uid); none without a daemon.
func pinnedUIDs(ctx context.Context, socketDir string) []uint32 {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := backend.NewControlClient(controlPath(socketDir)).Status(ctx)
	if err != nil {
		return nil
	}
	var uids []uint32
	for _, v := range st.VMs {
		if v.QEMUUID != 0 {
			uids = append(uids, v.QEMUUID)
		}
	}
	return uids
}

// identified reports whether a VM's sockets know its QEMU: by its uid, its
// cgroup, or (the default) the libvirt machine cgroup its connected QEMU
// was admitted through. A daemon from before identities says only the uid.
func identified(v backend.VMStatus) bool {
	return v.QEMUUID != 0 || v.QEMUCgroup != "" || strings.Contains(v.Identity, backend.IdentityLibvirtMachine)
}

// checkVMs asks the running daemon (if any) which connected VMs are
// exposed: without a verified QMP monitor of their QEMU (a migration or
// snapshot would drop the device unnoticed) or admitting any QEMU of the
// socket group (no --qemu-uid or --qemu-cgroup, and not admitted through
// its libvirt machine cgroup). Every connected VM's device dies with the
// daemon until its QEMU is restarted: that is said once.
func checkVMs(ctx context.Context, socketDir string) checkResult {
	const name = "vms"
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := backend.NewControlClient(controlPath(socketDir)).Status(ctx)
	if err != nil {
		return ok(name, "no daemon answers on %s: nothing to check", controlPath(socketDir))
	}
	var connected []string
	var exposed []string
	for _, v := range st.VMs {
		if !v.Connected {
			continue
		}
		connected = append(connected, v.Name)
		var why []string
		if v.QMP != backend.QMPVerified {
			why = append(why, "no QMP monitor of its QEMU (migrations and snapshots unguarded)")
		}
		if !identified(v) {
			why = append(why, "any QEMU of the socket group may connect as it (no --qemu-uid or --qemu-cgroup, and its QEMU is in no libvirt machine cgroup)")
		}
		if len(why) > 0 {
			exposed = append(exposed, v.Name+": "+strings.Join(why, ", "))
		}
	}
	if len(connected) == 0 {
		return ok(name, "the daemon serves %d VMs, none connected now", len(st.VMs))
	}
	restart := "a daemon restart, upgrade (systemctl reload) or crash keeps them (its state and their connections are kept)"
	switch {
	case st.Supervisor != nil:
		restart = fmt.Sprintf("a crash or live upgrade of the daemon keeps them (its supervisor, pid %d, holds their connections); stopping the supervisor ends them", st.Supervisor.PID)
	case !st.KeepsState:
		restart = "a daemon stop, restart or crash leaves every connected VM's device dead until its QEMU is restarted " +
			"(run the daemon as the packaged service, or serve without --no-supervisor)"
	}
	if len(exposed) > 0 {
		return warn(name, "start the VMs with the arguments qemu-args or libvirt-xml print (--qmp-monitor; --qemu-uid or --qemu-cgroup unless libvirt places the QEMU in a machine cgroup)",
			"%d VMs connected; exposed: %s; %s", len(connected), strings.Join(exposed, "; "), restart)
	}
	if !st.KeepsState {
		return warn(name, "run the daemon as the packaged service (systemd keeps its VMs' connections), or serve without --no-supervisor (its own supervisor keeps them)",
			"%d VMs connected, each with a verified QMP monitor and an identity of its own (uid, cgroup or libvirt machine); %s", len(connected), restart)
	}
	return ok(name, "%d VMs connected, each with a verified QMP monitor and an identity of its own (uid, cgroup or libvirt machine); %s", len(connected), restart)
}

var qemuVersionRE = regexp.MustCompile(`QEMU emulator version (\d+)\.(\d+)(?:\.(\d+))?`)

// checkQEMU: the QEMU the VMs will use has the vfio-user-pci client (>= 10.1)
// and memfd memory backends.
func checkQEMU(ctx context.Context, h hostEnv, path string) checkResult {
	const name = "qemu"
	const install = "install QEMU >= 10.1 with vfio-user-pci (Debian 13: qemu-system-x86 from trixie-backports; trixie's own 10.0 lacks it and Debian 12 cannot install it), or pass --qemu PATH"
	if path == "" {
		p, err := h.lookPath("qemu-system-x86_64")
		if err != nil {
			return fail(name, install, "no qemu-system-x86_64 on PATH")
		}
		path = p
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := h.run(ctx, path, "--version")
	if err != nil {
		return fail(name, install, "%s --version: %v: %s", path, err, firstLine(out))
	}
	m := qemuVersionRE.FindStringSubmatch(string(out))
	if m == nil {
		return fail(name, install, "%s: not a QEMU version line: %q", path, firstLine(out))
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	version := strings.TrimPrefix(m[0], "QEMU emulator version ")
	devs, err := h.run(ctx, path, "-device", "help")
	if err != nil {
		return fail(name, install, "QEMU %s at %s: -device help: %v", version, path, err)
	}
	if !bytes.Contains(devs, []byte(`"vfio-user-pci"`)) {
		why := "built without vfio-user"
		if major < 10 || major == 10 && minor < 1 {
			why = "older than 10.1"
		}
		return fail(name, install, "QEMU %s at %s has no vfio-user-pci device (%s)", version, path, why)
	}
	if !bytes.Contains(devs, []byte(`"vmxnet3"`)) {
		return fail(name, install, "QEMU %s at %s has no vmxnet3 device (the NIC the PVRDMA function pairs with)", version, path)
	}
	objs, err := h.run(ctx, path, "-object", "help")
	if err != nil || !bytes.Contains(objs, []byte("memory-backend-memfd")) {
		return fail(name, install, "QEMU %s at %s has no memory-backend-memfd (guest RAM must be a shared memfd)", version, path)
	}
	return ok(name, "QEMU %s at %s, with vfio-user-pci, vmxnet3 and memory-backend-memfd", version, path)
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return s
}

// Capability bits of /proc/PID/status CapEff.
const (
	capIPCLock     = 14
	capSysResource = 24
)

// checkMemlock: this process may lock the guest RAM the daemon maps: an
// unlimited or large enough RLIMIT_MEMLOCK, or CAP_IPC_LOCK (mlock is then not
// bound by the limit), or CAP_SYS_RESOURCE (serve raises the limit itself).
func checkMemlock(h hostEnv, want uint64) checkResult {
	const name = "memlock"
	const fix = "run the daemon with CAP_IPC_LOCK (the package's unit grants it as an ambient capability)"
	lim, err := h.memlock()
	if err != nil {
		return fail(name, fix, "getrlimit: %v", err)
	}
	limit := "unlimited"
	if lim.Cur != unix.RLIM_INFINITY {
		limit = fmt.Sprintf("%d MiB", lim.Cur>>20)
	}
	caps, err := effectiveCaps(h)
	if err != nil {
		return fail(name, fix, "RLIMIT_MEMLOCK %s; capabilities unknown: %v", limit, err)
	}
	switch {
	case caps&(1<<capIPCLock) != 0:
		return ok(name, "CAP_IPC_LOCK (locking is not bound by RLIMIT_MEMLOCK, here %s)", limit)
	case lim.Cur == unix.RLIM_INFINITY:
		return ok(name, "RLIMIT_MEMLOCK unlimited")
	case caps&(1<<capSysResource) != 0:
		return ok(name, "CAP_SYS_RESOURCE: serve raises RLIMIT_MEMLOCK (%s now) to --max-locked-memory", limit)
	case want > 0 && lim.Cur >= want:
		return ok(name, "RLIMIT_MEMLOCK %s covers --max-locked-memory", limit)
	}
	return fail(name, fix, "RLIMIT_MEMLOCK %s and neither CAP_IPC_LOCK nor CAP_SYS_RESOURCE: guests' RAM cannot be locked", limit)
}

func effectiveCaps(h hostEnv) (uint64, error) {
	f, err := os.Open(filepath.Join(h.proc, "self/status"))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, found := strings.CutPrefix(sc.Text(), "CapEff:"); found {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	return 0, errors.New("no CapEff in status")
}

// Capability bits the fabric needs.
const (
	capNetAdmin = 12
	capNetRaw   = 13
)

// checkNetCaps: the fabric's sockets need CAP_NET_RAW (raw and packet
// sockets, SO_BINDTODEVICE), IP mode also CAP_NET_ADMIN (guests' GIDs as
// addresses on the netdev).
func checkNetCaps(h hostEnv, ipMode bool) checkResult {
	const name = "net-caps"
	const fix = "run the daemon as root or with CAP_NET_RAW and CAP_NET_ADMIN (the package's unit has both)"
	caps, err := effectiveCaps(h)
	if err != nil {
		return fail(name, fix, "capabilities unknown: %v", err)
	}
	var missing []string
	if caps&(1<<capNetRaw) == 0 {
		missing = append(missing, "CAP_NET_RAW")
	}
	if ipMode && caps&(1<<capNetAdmin) == 0 {
		missing = append(missing, "CAP_NET_ADMIN")
	}
	if len(missing) > 0 {
		return fail(name, fix, "this process lacks %s: the fabric cannot start", strings.Join(missing, " and "))
	}
	return ok(name, "this process has the capabilities the fabric needs")
}

// checkMemfdSeal: the kernel seals memfds against shrinking, which the daemon
// requires of guest RAM (a truncated RAM file would crash it with SIGBUS).
func checkMemfdSeal() checkResult {
	const name = "memfd-seal"
	const fix = "a Linux kernel >= 3.17 with memfd_create and file sealing"
	fd, err := unix.MemfdCreate("pvrdma-doctor", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return fail(name, fix, "memfd_create: %v", err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 4096); err != nil {
		return fail(name, fix, "ftruncate: %v", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		return fail(name, fix, "F_ADD_SEALS: %v", err)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return fail(name, fix, "F_GET_SEALS: %#x, %v", seals, err)
	}
	return ok(name, "memfds can be sealed against shrinking")
}

// checkSocketDir: the socket directory is one the daemon accepts (not
// writable by others, owned by root or this user), or can be created.
func checkSocketDir(dir, group string) checkResult {
	const name = "socket-dir"
	var gid = -1
	if group != "" {
		g, err := lookupGroup(group)
		if err != nil {
			return fail(name, "create it (groupadd --system "+group+"; the package creates pvrdma) or pass another --socket-group",
				"--socket-group %s: %v", group, err)
		}
		gid = g
	}
	st, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		// serve creates the directory and any missing parents.
		parent := filepath.Dir(dir)
		for {
			if _, err := os.Stat(parent); err == nil || parent == filepath.Dir(parent) {
				break
			}
			parent = filepath.Dir(parent)
		}
		if unix.Access(parent, unix.W_OK|unix.X_OK) != nil {
			return fail(name, "create "+dir+" (mode 0750) or pass --socket-dir", "%s is missing and %s is not writable", dir, parent)
		}
		return ok(name, "%s does not exist yet; serve creates it (0750) in %s", dir, parent)
	}
	if err != nil {
		return fail(name, "pass a --socket-dir the daemon can use", "%s: %v", dir, err)
	}
	if !st.IsDir() {
		return fail(name, "remove it or pass another --socket-dir", "%s is not a directory", dir)
	}
	sys := st.Sys().(*syscall.Stat_t)
	mode := st.Mode().Perm()
	desc := fmt.Sprintf("%s: mode %04o, owner %s, group %s", dir, mode, userName(sys.Uid), groupName(sys.Gid))
	if mode&0o002 != 0 {
		return fail(name, "chmod o-w "+dir+" (serve makes it 0750)", "%s: other users may write to it; serve refuses it", desc)
	}
	if sys.Uid != 0 && int(sys.Uid) != os.Geteuid() && userName(sys.Uid) != serviceUser {
		return fail(name, "chown root "+dir+" (or "+serviceUser+", the packaged service's user)", "%s: owned by another user; serve refuses it", desc)
	}
	if gid >= 0 && int(sys.Gid) != gid {
		return warn(name, "serve gives it to "+group+" at start", "%s, not --socket-group %s", desc, group)
	}
	return ok(name, "%s", desc)
}

// serviceUser is the user the packaged unit runs the daemon as
// (packaging/pvrdma-backend.service, User=): a socket directory it owns
// is the service's.
const serviceUser = "pvrdma"

func lookupGroup(name string) (int, error) {
	if n, err := strconv.Atoi(name); err == nil {
		return n, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(g.Gid)
}

func userName(uid uint32) string {
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
		return u.Username
	}
	return strconv.FormatUint(uint64(uid), 10)
}

func groupName(gid uint32) string {
	if g, err := user.LookupGroupId(strconv.FormatUint(uint64(gid), 10)); err == nil {
		return g.Name
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// checkNetdev: the fabric netdev (IP mode) or bridge (L2 mode) exists and is up.
func checkNetdev(h hostEnv, name string, bridge bool) checkResult {
	check := "fabric-netdev"
	if bridge {
		check = "fabric-bridge"
	}
	ifi, err := net.InterfaceByName(name)
	if err != nil {
		return fail(check, "create it or name an existing interface", "%s: %v", name, err)
	}
	if bridge {
		if _, err := os.Stat(filepath.Join(h.sys, "class/net", name, "bridge")); err != nil {
			return warn(check, "give the bridge the VMs' NICs are on", "%s is not a bridge: L2 mode sees only the frames that reach it", name)
		}
	}
	addrs, _ := ifi.Addrs()
	var list []string
	for _, a := range addrs {
		list = append(list, a.String())
	}
	desc := fmt.Sprintf("%s (MTU %d), addresses: %s", name, ifi.MTU, strings.Join(list, ", "))
	if len(list) == 0 {
		desc = fmt.Sprintf("%s (MTU %d), no addresses", name, ifi.MTU)
	}
	if ifi.Flags&net.FlagUp == 0 {
		return warn(check, "ip link set "+name+" up", "%s; it is down", desc)
	}
	if ifi.MTU < 1500 {
		return warn(check, "raise its MTU (RoCE's 1024-byte path MTU needs 1082 bytes of IP, 4096 needs 4154)", "%s", desc)
	}
	return ok(check, "%s", desc)
}

// checkARPIgnore: in IP mode guests' GIDs become addresses on the netdev.
// The kernel answers ARP for a local address on whichever interface the
// request arrives, unless that interface's arp_ignore (the larger of its
// own and "all") is at least 1: so every interface but the netdev (and lo)
// needs it, "default" too for interfaces made later; "all" covers them all.
func checkARPIgnore(h hostEnv, netdev string) checkResult {
	const name = "arp-ignore"
	const fix = "sysctl -w net.ipv4.conf.all.arp_ignore=1 (and in /etc/sysctl.d)"
	dir := filepath.Join(h.proc, "sys/net/ipv4/conf")
	read := func(dev string) (int, error) {
		b, err := os.ReadFile(filepath.Join(dir, dev, "arp_ignore"))
		if err != nil {
			return 0, err
		}
		return strconv.Atoi(strings.TrimSpace(string(b)))
	}
	all, err := read("all")
	if err != nil {
		return warn(name, fix, "net.ipv4.conf.all.arp_ignore: %v", err)
	}
	if all >= 1 {
		return ok(name, "net.ipv4.conf.all.arp_ignore is %d", all)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return warn(name, fix, "%s: %v", dir, err)
	}
	var answering []string
	for _, e := range ents {
		if n := e.Name(); n != "all" && n != "lo" && n != netdev {
			if v, err := read(n); err == nil && v < 1 {
				answering = append(answering, n)
			}
		}
	}
	if len(answering) > 0 {
		return warn(name, fix, "arp_ignore is 0 on %s: the host answers ARP there for guests' GIDs (addresses on %s)",
			strings.Join(answering, ", "), netdev)
	}
	return ok(name, "arp_ignore >= 1 on every interface but %s", netdev)
}

// checkUDP4791: who else has RoCE v2's port. In IP mode the daemon binds a
// socket per GID on it; kernel rxe or another stack on the same addresses would
// take the packets.
func checkUDP4791(h hostEnv, ipMode bool) checkResult {
	const name = "udp-4791"
	n := 0
	for _, f := range []string{"net/udp", "net/udp6"} {
		b, err := os.ReadFile(filepath.Join(h.proc, f))
		if err != nil {
			continue
		}
		n += countUDPPort(b, 4791)
	}
	var rdma []string
	if ents, err := os.ReadDir(filepath.Join(h.sys, "class/infiniband")); err == nil {
		for _, e := range ents {
			rdma = append(rdma, e.Name())
		}
	}
	desc := fmt.Sprintf("%d sockets bound to UDP 4791", n)
	if len(rdma) > 0 {
		desc += "; RDMA devices: " + strings.Join(rdma, ", ")
	}
	if n > 0 && ipMode {
		return fail(name, "stop what holds it (kernel rxe on this host? another pvrdma-backend?)",
			"%s: IP mode binds UDP 4791 on the wildcard address and cannot start while another socket holds it", desc)
	}
	return ok(name, "%s", desc)
}

// countUDPPort counts the sockets of a /proc/net/udp{,6} table bound to port.
func countUDPPort(table []byte, port int) int {
	want := fmt.Sprintf(":%04X", port)
	n := 0
	sc := bufio.NewScanner(bytes.NewReader(table))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 2 && f[0] != "sl" && strings.HasSuffix(f[1], want) {
			n++
		}
	}
	return n
}

// checkLibibverbs: rdma-core's verbs library is installed (the relay's).
func checkLibibverbs(h hostEnv) checkResult {
	const name = "libibverbs"
	for _, d := range h.libDirs {
		p := filepath.Join(d, "libibverbs.so.1")
		if _, err := os.Stat(p); err == nil {
			return ok(name, "%s", p)
		}
	}
	return fail(name, "apt install libibverbs1 ibverbs-providers", "libibverbs.so.1 not found in %s", strings.Join(h.libDirs, ", "))
}

// checkIBDev: the RDMA device to relay to exists; its port 1 state.
func checkIBDev(h hostEnv, dev string) checkResult {
	const name = "rdma-device"
	if dev == "" {
		return fail(name, "pass --ibdev NAME (rdma link show lists them)", "no --ibdev given")
	}
	dir := filepath.Join(h.sys, "class/infiniband", dev)
	if _, err := os.Stat(dir); err != nil {
		return fail(name, "rdma link add rxe0 type rxe netdev IFACE, or load the HCA's driver", "no RDMA device %s", dev)
	}
	state, err := os.ReadFile(filepath.Join(dir, "ports/1/state"))
	if err != nil {
		return warn(name, "", "%s: port 1: %v", dev, err)
	}
	s := strings.TrimSpace(string(state))
	if !strings.Contains(s, "ACTIVE") {
		return warn(name, "bring its netdev up (ip link set IFACE up)", "%s port 1 is %s", dev, s)
	}
	return ok(name, "%s port 1 %s", dev, s)
}

// checkRXE: Soft-RoCE, for the relay over rxe, is loaded or loadable.
func checkRXE(h hostEnv) checkResult {
	const name = "rxe"
	if _, err := os.Stat(filepath.Join(h.sys, "module/rdma_rxe")); err == nil {
		return ok(name, "rdma_rxe is loaded")
	}
	found := ""
	_ = filepath.WalkDir(filepath.Join(h.modules, h.kernel), func(p string, d fs.DirEntry, err error) error {
		if err != nil || found != "" {
			return fs.SkipDir
		}
		if strings.HasPrefix(d.Name(), "rdma_rxe.ko") {
			found = p
			return fs.SkipAll
		}
		return nil
	})
	if found != "" {
		return ok(name, "rdma_rxe is available (%s): modprobe rdma_rxe", found)
	}
	return warn(name, "a kernel with CONFIG_RDMA_RXE (Debian's has it)",
		"no rdma_rxe module for kernel %s: no Soft-RoCE on this host (the soft transport does not need it)", h.kernel)
}

// checkKVM: without /dev/kvm QEMU emulates the CPU (TCG), slowly.
func checkKVM(h hostEnv) checkResult {
	const name = "kvm"
	p := filepath.Join(h.dev, "kvm")
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		return warn(name, "enable virtualization (VT-x/AMD-V) and load kvm_intel or kvm_amd", "%s: %v: VMs run under TCG, slowly", p, err)
	}
	f.Close()
	return ok(name, "%s opens (QEMU can use KVM where the CPU allows it)", p)
}

// checkLibvirtHook: where libvirt is installed, its qemu hook refuses
// migrate and restore of domains with the device (packaging/libvirt-hook).
func checkLibvirtHook(h hostEnv) checkResult {
	const name = "libvirt-hook"
	_, errd := h.lookPath("libvirtd")
	_, errq := h.lookPath("virtqemud")
	if _, err := os.Stat(filepath.Join(h.etc, "libvirt")); err != nil && errd != nil && errq != nil {
		return ok(name, "libvirt is not installed: no hook needed")
	}
	p := filepath.Join(h.etc, strings.TrimPrefix(LibvirtHookPath, "/etc/"))
	const fix = "reinstall the package, or install packaging/libvirt-hook as " + LibvirtHookPath + " (mode 0755); then restart libvirtd"
	fi, err := os.Stat(p)
	if err != nil {
		return fail(name, fix, "%s: %v: libvirt would migrate, save and restore VMs with the device, which drops it", p, err)
	}
	b, err := os.ReadFile(p)
	switch {
	case err != nil:
		return fail(name, fix, "%s: %v", p, err)
	case !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0:
		return fail(name, fix, "%s is not an executable file (mode %v): libvirt skips it", p, fi.Mode())
	case !strings.Contains(string(b), "pvrdma-backend libvirt-hook"):
		return fail(name, fix, "%s does not run `pvrdma-backend libvirt-hook`", p)
	}
	return ok(name, "%s refuses migrate and restore of domains with the device (libvirtd loads hooks when it starts)", p)
}

// libvirtQEMUConf is what doctor reads of libvirt's qemu.conf: the user and
// group it runs QEMU as and its security driver.
type libvirtQEMUConf struct {
	found           bool   // qemu.conf exists
	user, group     string // "" where not set
	securityDrivers []string
	securitySet     bool // security_driver is set
}

var qemuConfRE = regexp.MustCompile(`^\s*(user|group|security_driver)\s*=\s*(.*?)\s*$`)

// readLibvirtQEMUConf parses the settings doctor needs from
// <etc>/libvirt/qemu.conf (a missing file: libvirt's defaults).
func readLibvirtQEMUConf(h hostEnv) libvirtQEMUConf {
	var c libvirtQEMUConf
	b, err := os.ReadFile(filepath.Join(h.etc, "libvirt/qemu.conf"))
	if err != nil {
		return c
	}
	c.found = true
	for _, l := range strings.Split(string(b), "\n") {
		m := qemuConfRE.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		val := m[2]
		if i := strings.Index(val, "#"); i >= 0 && strings.Count(val[:i], `"`)%2 == 0 {
			val = strings.TrimSpace(val[:i])
		}
		var words []string
		for _, w := range strings.FieldsFunc(strings.Trim(val, "[] "), func(r rune) bool { return r == ',' }) {
			words = append(words, strings.Trim(strings.TrimSpace(w), `"'`))
		}
		switch m[1] {
		case "user":
			c.user = strings.Trim(val, `"'`)
		case "group":
			c.group = strings.Trim(val, `"'`)
		case "security_driver":
			c.securitySet, c.securityDrivers = true, words
		}
	}
	return c
}

// libvirtInstalled reports whether libvirt's QEMU driver is on this host.
func libvirtInstalled(h hostEnv) bool {
	_, errd := h.lookPath("libvirtd")
	_, errq := h.lookPath("virtqemud")
	_, errc := os.Stat(filepath.Join(h.etc, "libvirt/qemu.conf"))
	return errd == nil || errq == nil || errc == nil
}

// accountDB is the host's users and groups as its /etc/passwd and
// /etc/group list them.
type accountDB struct {
	users  map[string]account // by name
	uids   map[uint32]string
	groups map[string]group // by name
	gids   map[uint32]string
}

type account struct {
	uid, gid uint32
}

type group struct {
	gid     uint32
	members []string
}

func readAccounts(h hostEnv) (accountDB, error) {
	db := accountDB{users: map[string]account{}, uids: map[uint32]string{}, groups: map[string]group{}, gids: map[uint32]string{}}
	pw, err := os.ReadFile(filepath.Join(h.etc, "passwd"))
	if err != nil {
		return db, err
	}
	for _, l := range strings.Split(string(pw), "\n") {
		f := strings.Split(l, ":")
		if len(f) < 4 {
			continue
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		db.users[f[0]] = account{uid: uint32(uid), gid: uint32(gid)}
		if _, dup := db.uids[uint32(uid)]; !dup {
			db.uids[uint32(uid)] = f[0]
		}
	}
	gr, err := os.ReadFile(filepath.Join(h.etc, "group"))
	if err != nil {
		return db, err
	}
	for _, l := range strings.Split(string(gr), "\n") {
		f := strings.Split(l, ":")
		if len(f) < 4 {
			continue
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			continue
		}
		var members []string
		if f[3] != "" {
			members = strings.Split(f[3], ",")
		}
		db.groups[f[0]] = group{gid: uint32(gid), members: members}
		if _, dup := db.gids[uint32(gid)]; !dup {
			db.gids[uint32(gid)] = f[0]
		}
	}
	return db, nil
}

// inGroup reports whether user is in group g: as a member or by its
// primary group.
func (db accountDB) inGroup(user string, g group) bool {
	if a, ok := db.users[user]; ok && a.gid == g.gid {
		return true
	}
	for _, m := range g.members {
		if m == user {
			return true
		}
	}
	return false
}

// resolveUser turns a libvirt qemu.conf user ("name", or "+UID") into a
// user name; "" if it names none.
func (db accountDB) resolveUser(u string) string {
	if n, found := strings.CutPrefix(u, "+"); found {
		uid, err := strconv.ParseUint(n, 10, 32)
		if err != nil {
			return ""
		}
		return db.uids[uint32(uid)]
	}
	if _, ok := db.users[u]; ok {
		return u
	}
	return ""
}

// defaultLibvirtQEMUUser is the user Debian's libvirt runs QEMU as where
// qemu.conf does not say.
const defaultLibvirtQEMUUser = "libvirt-qemu"

// checkQEMUGroup: the sockets (mode 0660, group socketGroup) admit only
// root, the daemon and the group, so the user libvirt runs QEMU as (and
// the user any VM is pinned to, pinned) must be in it, or QEMU cannot
// connect and the VM does not start. Without libvirt, plain QEMU's user is
// the operator's to put in the group.
func checkQEMUGroup(h hostEnv, socketGroup string, pinned []uint32) checkResult {
	const name = "qemu-group"
	if socketGroup == "" {
		socketGroup = serviceUser
	}
	db, err := readAccounts(h)
	if err != nil {
		return warn(name, "", "cannot read the host's users and groups: %v", err)
	}
	g, found := db.groups[socketGroup]
	if !found {
		return fail(name, "install the package (it creates the group "+serviceUser+") or groupadd --system "+socketGroup,
			"no group %s: QEMU cannot be admitted to the sockets", socketGroup)
	}
	type who struct{ user, why string }
	var users []who
	if libvirtInstalled(h) {
		c := readLibvirtQEMUConf(h)
		u := c.user
		if u == "" {
			u = defaultLibvirtQEMUUser
		}
		switch {
		case u == "root" || u == "+0":
			// root is admitted to every socket.
		case c.group != "" && (strings.Trim(c.group, "+") == socketGroup || c.group == "+"+strconv.FormatUint(uint64(g.gid), 10)):
			// libvirt runs QEMU with the socket group as its group.
		default:
			n := db.resolveUser(u)
			if n == "" {
				return warn(name, "", "libvirt runs QEMU as %s (%s), which is not in %s", u, filepath.Join(h.etc, "libvirt/qemu.conf"), filepath.Join(h.etc, "passwd"))
			}
			users = append(users, who{n, "libvirt's QEMU user"})
		}
	}
	for _, uid := range pinned {
		if uid == 0 {
			continue
		}
		n, known := db.uids[uid]
		if !known {
			continue // a uid of no local user: only its QEMU's own group can say
		}
		users = append(users, who{n, fmt.Sprintf("the user a VM is pinned to (uid %d)", uid)})
	}
	var missing, fixes, fine []string
	seen := map[string]bool{}
	for _, u := range users {
		if seen[u.user] {
			continue
		}
		seen[u.user] = true
		if db.inGroup(u.user, g) {
			fine = append(fine, u.user+" ("+u.why+")")
			continue
		}
		missing = append(missing, u.user+" ("+u.why+")")
		fixes = append(fixes, "usermod -aG "+socketGroup+" "+u.user)
	}
	if len(missing) > 0 {
		return fail(name, strings.Join(fixes, "; ")+"; then restart libvirtd (or virtqemud) and the VMs",
			"%s not in group %s: QEMU cannot open the VMs' sockets (mode 0660, group %s)", strings.Join(missing, ", "), socketGroup, socketGroup)
	}
	if len(fine) == 0 {
		if libvirtInstalled(h) {
			return ok(name, "libvirt runs QEMU as root or with group %s: it may open the sockets", socketGroup)
		}
		return ok(name, "libvirt is not installed: a plain QEMU must run as root or in group %s (usermod -aG %s USER)", socketGroup, socketGroup)
	}
	return ok(name, "%s in group %s: QEMU may open the sockets", strings.Join(fine, ", "), socketGroup)
}

// appArmorRule is the line README gives for the libvirt-qemu abstraction.
func appArmorRule(socketDir string) string {
	return fmt.Sprintf("%s/*.sock rw,\n%s/*.qmp rw,\n", socketDir, socketDir)
}

// checkAppArmor: where AppArmor is on and libvirt confines QEMU with it,
// each domain's profile (built on the libvirt-qemu abstraction) must let
// QEMU read and write the VM's vfio-user socket and the daemon's QMP
// socket, or QEMU fails to connect with EACCES.
func checkAppArmor(h hostEnv, socketDir string) checkResult {
	const name = "apparmor"
	if _, err := os.Stat(filepath.Join(h.sys, "kernel/security/apparmor")); err != nil {
		return ok(name, "AppArmor is not enabled: it confines no QEMU")
	}
	if !libvirtInstalled(h) {
		return ok(name, "libvirt is not installed: AppArmor confines no QEMU of libvirt's (a plain QEMU runs unconfined)")
	}
	c := readLibvirtQEMUConf(h)
	if c.securitySet {
		apparmor := false
		for _, d := range c.securityDrivers {
			apparmor = apparmor || d == "apparmor"
		}
		if !apparmor {
			return ok(name, "libvirt's security_driver is %s: AppArmor does not confine its QEMU", strings.Join(c.securityDrivers, ","))
		}
	}
	dir := filepath.Clean(socketDir)
	sock, qmp := dir+"/vm.sock", dir+"/vm.qmp"
	files := []string{filepath.Join(h.etc, "apparmor.d/local/abstractions/libvirt-qemu"), filepath.Join(h.etc, "apparmor.d/abstractions/libvirt-qemu")}
	var haveSock, haveQMP bool
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			path, perms, isRule := parseAppArmorRule(l)
			if !isRule || !strings.Contains(perms, "r") || !strings.Contains(perms, "w") {
				continue
			}
			re, err := appArmorGlob(path)
			if err != nil {
				continue
			}
			haveSock = haveSock || re.MatchString(sock)
			haveQMP = haveQMP || re.MatchString(qmp)
		}
	}
	if haveSock && haveQMP {
		return ok(name, "libvirt's QEMU profile (the libvirt-qemu abstraction) allows %s/*.sock and *.qmp", dir)
	}
	fix := fmt.Sprintf("printf '%s' >> %s; then restart libvirtd (or virtqemud) and start the VMs again",
		strings.ReplaceAll(appArmorRule(dir), "\n", `\n`), "/etc/apparmor.d/local/abstractions/libvirt-qemu")
	return fail(name, fix, "AppArmor confines libvirt's QEMU and the libvirt-qemu abstraction (%s) does not allow %s/*.sock and %s/*.qmp rw: QEMU cannot connect",
		strings.Join(files, ", "), dir, dir)
}

// parseAppArmorRule splits a file rule ("[owner] PATH PERMS,") into its
// path and permissions.
func parseAppArmorRule(l string) (path, perms string, ok bool) {
	l = strings.TrimSpace(l)
	if i := strings.Index(l, "#"); i >= 0 {
		l = strings.TrimSpace(l[:i])
	}
	l, found := strings.CutSuffix(l, ",")
	if !found {
		return "", "", false
	}
	f := strings.Fields(l)
	if len(f) > 0 && (f[0] == "owner" || f[0] == "allow" || f[0] == "audit") {
		f = f[1:]
	}
	if len(f) != 2 || !strings.HasPrefix(f[0], "/") && !strings.HasPrefix(f[0], `"/`) {
		return "", "", false
	}
	return strings.Trim(f[0], `"`), f[1], true
}

// appArmorGlob compiles an AppArmor path glob: ** crosses directories,
// * and ? do not, {a,b} is an alternation, [...] a class.
func appArmorGlob(g string) (*regexp.Regexp, error) {
	var b strings.Builder
	b.WriteString("^")
	depth := 0
	for i := 0; i < len(g); i++ {
		switch c := g[i]; {
		case c == '*' && i+1 < len(g) && g[i+1] == '*':
			b.WriteString(".*")
			i++
		case c == '*':
			b.WriteString("[^/]*")
		case c == '?':
			b.WriteString("[^/]")
		case c == '{':
			b.WriteString("(?:")
			depth++
		case c == '}' && depth > 0:
			b.WriteString(")")
			depth--
		case c == ',' && depth > 0:
			b.WriteString("|")
		case c == '[':
			j := strings.IndexByte(g[i:], ']')
			if j < 0 {
				return nil, fmt.Errorf("unclosed [ in %q", g)
			}
			b.WriteString(g[i : i+j+1])
			i += j
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	b.WriteString("$")
	return regexp.Compile(b.String())
}
