package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// sizeFlag parses sizes like 512M, 1G, 1073741824.
type sizeFlag uint64

func (s *sizeFlag) String() string { return strconv.FormatUint(uint64(*s), 10) }

func (s *sizeFlag) Set(v string) error {
	n, err := backend.ParseSize(v)
	if err != nil || n > 1<<46 {
		return fmt.Errorf("bad size %q (want e.g. 512M or 1G)", v)
	}
	*s = sizeFlag(n)
	return nil
}

type vmFlags struct {
	name, mac, netdev, socketDir, bus string
	gidAllow, roceMode, doorbells     string
	slot                              int
	mem                               sizeFlag
	qmp                               bool
	qemuUID                           uint
	qemuGroup                         string
	qemuCgroup                        string
}

func (v *vmFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&v.name, "vm", "", "VM name (names its socket <socket-dir>/<vm>.sock); required")
	fs.StringVar(&v.mac, "mac", "", "vmxnet3 MAC (default: derived from the VM name)")
	fs.StringVar(&v.netdev, "netdev", "net0", "id of the -netdev the vmxnet3 attaches to")
	fs.StringVar(&v.socketDir, "socket-dir", defaultSocketDir, "daemon socket directory")
	fs.StringVar(&v.gidAllow, "gid-allow", "", "GID prefixes the VM may bind (CIDR, comma-separated; \"none\": only its own link-local GID); default: the daemon's --gid-allow")
	fs.StringVar(&v.roceMode, "roce-mode", "", "the VM's RoCE version, v1 or v2 (its device offers one); default: the daemon's --roce-mode")
	fs.StringVar(&v.doorbells, "doorbells", "", "how the guest's user-space doorbells reach the daemon: trapped (each a VM exit and a round trip to the daemon) or memory (stores to memory shared with QEMU that the daemon polls: for busy-polling applications; README \"Doorbells\"); default trapped")
	v.mem = 1 << 30
	fs.Var(&v.mem, "mem", "guest RAM size, backed by a shared memfd")
	fs.UintVar(&v.qemuUID, "qemu-uid", 0, "the user ID the VM's QEMU runs as, if it has one of its own: the VM's sockets then admit only it (and root); libvirt-xml gives the domain that DAC label")
	fs.StringVar(&v.qemuCgroup, "qemu-cgroup", "", "the cgroup the VM's QEMU runs in, if its manager gives it one of its own (a systemd scope, say /machine.slice/vm1.scope; as /proc/PID/cgroup shows it): the VM's sockets then admit only peers in it or below it. Without it, a QEMU in another libvirt domain's machine cgroup is refused")
	fs.StringVar(&v.qemuGroup, "qemu-group", "pvrdma", "with --qemu-uid: the group of the QEMU libvirt-xml's DAC label sets (the socket group)")
}

// registerBoot adds the flags of the commands that print a VM's start-up
// configuration (qemu-args, libvirt-xml): its PCI slot and the daemon's QMP
// monitor. attach has neither: a root port has one slot, and a running
// QEMU cannot be given a monitor.
func (v *vmFlags) registerBoot(fs *flag.FlagSet) {
	fs.IntVar(&v.slot, "slot", 5, "PCI slot: vmxnet3 at <slot>.0, PVRDMA at <slot>.1")
	fs.BoolVar(&v.qmp, "qmp-monitor", true, "give the daemon a QMP monitor of its own on the VM (QEMU connects to <socket-dir>/<vm>.qmp): it cancels migrations and snapshots, which QEMU would complete without the device's state")
}

func (v *vmFlags) spec() (backend.VMSpec, error) {
	if v.name == "" {
		return backend.VMSpec{}, fmt.Errorf("--vm is required: %w", errUsage)
	}
	spec := backend.VMSpec{Name: v.name, Slot: v.slot, Bus: v.bus, MemBytes: uint64(v.mem), Netdev: v.netdev,
		Socket: backend.SocketPath(v.socketDir, v.name)}
	if v.qmp {
		spec.QMPSocket = backend.QMPSocketPath(v.socketDir, v.name)
	}
	if v.qemuUID > 0 {
		if v.qemuUID > 1<<32-1 {
			return spec, fmt.Errorf("--qemu-uid %d: not a user ID", v.qemuUID)
		}
		gid, err := lookupGroup(v.qemuGroup)
		if err != nil {
			return spec, fmt.Errorf("--qemu-group %s: %w", v.qemuGroup, err)
		}
		spec.QEMUUID, spec.QEMUGID = uint32(v.qemuUID), uint32(gid)
	}
	if v.qemuCgroup != "" {
		if err := backend.CheckCgroupPath(v.qemuCgroup); err != nil {
			return spec, fmt.Errorf("--qemu-cgroup: %w", err)
		}
		spec.QEMUCgroup = v.qemuCgroup
	}
	if v.mac != "" {
		mac, err := net.ParseMAC(v.mac)
		if err != nil || len(mac) != 6 {
			return spec, fmt.Errorf("--mac %q: not a 48-bit MAC", v.mac)
		}
		spec.MAC = mac
	}
	if v.gidAllow != "" {
		allow, err := backend.ParseGIDAllow(v.gidAllow)
		if err != nil {
			return spec, fmt.Errorf("--gid-allow: %w", err)
		}
		spec.GIDAllow = backend.FormatGIDAllow(allow)
	}
	if v.doorbells != "" {
		m, err := vdev.ParseDoorbellMode(v.doorbells)
		if err != nil {
			return spec, fmt.Errorf("--doorbells: %w", err)
		}
		spec.Doorbells = m.String()
	}
	if v.roceMode != "" {
		m, err := backend.ParseRoCEMode(v.roceMode)
		if err != nil {
			return spec, fmt.Errorf("--roce-mode: %w", err)
		}
		spec.RoCEMode = backend.RoCEModeName(m)
	}
	return spec, backend.CheckVMName(v.name)
}

func controlPath(socketDir string) string { return filepath.Join(socketDir, "control.sock") }

// registerVM makes sure the daemon serves the VM with the MAC the QEMU
// arguments give its vmxnet3: an existing registration is accepted only if
// its MAC agrees, since the device's node GUID is derived from it.
func registerVM(ctx context.Context, socketDir string, spec backend.VMSpec) error {
	mac := backend.DefaultMAC(spec.Name)
	if spec.MAC != nil {
		mac = spec.MAC
	}
	c := backend.NewControlClient(controlPath(socketDir))
	_, err := c.AddVM(ctx, backend.VMRequest{Name: spec.Name, MAC: mac.String(), GIDAllow: spec.GIDAllow, MemBytes: spec.MemBytes,
		RoCEMode: spec.RoCEMode, QEMUUID: spec.QEMUUID, QEMUCgroup: spec.QEMUCgroup, Doorbells: spec.Doorbells})
	if err == nil {
		return nil
	}
	if !strings.Contains(err.Error(), "already registered") {
		return fmt.Errorf("register %s: %w", spec.Name, err)
	}
	st, serr := c.Status(ctx)
	if serr != nil {
		return fmt.Errorf("register %s: %w", spec.Name, serr)
	}
	for _, vm := range st.VMs {
		if vm.Name == spec.Name && vm.MAC != mac.String() {
			return fmt.Errorf("VM %s is registered with MAC %s, not %s: %s (or pass --mac %s)",
				spec.Name, vm.MAC, mac, unregisterFirst(socketDir, spec.Name), vm.MAC)
		}
		if vm.Name == spec.Name && spec.GIDAllow != nil && strings.Join(vm.GIDAllow, ",") != strings.Join(spec.GIDAllow, ",") {
			return fmt.Errorf("VM %s is registered with --gid-allow %s, not %s: %s",
				spec.Name, strings.Join(vm.GIDAllow, ","), strings.Join(spec.GIDAllow, ","), unregisterFirst(socketDir, spec.Name))
		}
		if vm.Name == spec.Name && vm.QEMUUID != spec.QEMUUID {
			return fmt.Errorf("VM %s is registered for QEMU uid %d, not %d (--qemu-uid; 0: any QEMU of the socket group): %s",
				spec.Name, vm.QEMUUID, spec.QEMUUID, unregisterFirst(socketDir, spec.Name))
		}
		if vm.Name == spec.Name && vm.QEMUCgroup != spec.QEMUCgroup {
			return fmt.Errorf("VM %s is registered for QEMU cgroup %q, not %q (--qemu-cgroup; empty: the libvirt machine rule): %s",
				spec.Name, vm.QEMUCgroup, spec.QEMUCgroup, unregisterFirst(socketDir, spec.Name))
		}
		if vm.Name == spec.Name && spec.Doorbells != "" && vm.Doorbells != spec.Doorbells {
			return fmt.Errorf("VM %s is registered with doorbells %s, not %s: %s", spec.Name, vm.Doorbells, spec.Doorbells,
				unregisterFirst(socketDir, spec.Name))
		}
		if vm.Name == spec.Name && spec.RoCEMode != "" && vm.RoCEMode != spec.RoCEMode {
			return fmt.Errorf("VM %s is registered as RoCE %s, not %s: %s", spec.Name, vm.RoCEMode, spec.RoCEMode,
				unregisterFirst(socketDir, spec.Name))
		}
	}
	return nil
}

func runQEMUArgs(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("qemu-args", "--vm NAME [flags]", stderr)
	var v vmFlags
	v.register(fs)
	v.registerBoot(fs)
	register := fs.Bool("register", true, "register the VM with the running daemon so its socket exists before QEMU starts")
	shell := fs.Bool("shell", true, "print shell-quoted arguments on one line (false: one argument per line)")
	if err := parse(fs, args); err != nil {
		return err
	}
	spec, err := v.spec()
	if err != nil {
		return err
	}
	qargs, err := spec.QEMUArgs()
	if err != nil {
		return err
	}
	if *register {
		if err := registerVM(ctx, v.socketDir, spec); err != nil {
			return err
		}
	}
	if !*shell {
		for _, a := range qargs {
			fmt.Fprintln(stdout, a)
		}
		return nil
	}
	q := make([]string, len(qargs))
	for i, a := range qargs {
		q[i] = shellQuote(a)
	}
	fmt.Fprintln(stdout, strings.Join(q, " "))
	return nil
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_=,./:+@", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func runAttach(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("attach", "--qmp SOCKET --vm NAME --bus PORT [--netdev ID] [flags]", stderr)
	var v vmFlags
	v.register(fs)
	// The vmxnet3 needs a -netdev of its own, which the running VM must
	// already have and no other NIC uses (QMP's netdev_add could make one,
	// but what it should be is the host's network configuration).
	fs.Lookup("netdev").Usage = "id of a spare -netdev of the running VM (one no NIC uses: the hot-plugged vmxnet3 takes it)"
	qmpPath := fs.String("qmp", "", "QMP unix socket of the running VM; required")
	fs.StringVar(&v.bus, "bus", "", "empty hot-pluggable bus (a pcie-root-port id); required")
	timeout := fs.Duration("timeout", 10*time.Second, "QMP timeout")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *qmpPath == "" || v.bus == "" {
		fs.Usage()
		return errUsage
	}
	v.slot = 0
	spec, err := v.spec()
	if err != nil {
		return err
	}
	if err := registerVM(ctx, v.socketDir, spec); err != nil {
		return err
	}
	q, err := backend.DialQMP(ctx, *qmpPath, *timeout)
	if err != nil {
		return err
	}
	defer q.Close()
	if err := backend.Attach(ctx, q, spec); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "attached PVRDMA (%s) and vmxnet3 to %s on bus %s\n", spec.Socket, spec.Name, spec.Bus)
	return nil
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("status", "[flags]", stderr)
	socketDir := fs.String("socket-dir", defaultSocketDir, "daemon socket directory")
	asJSON := fs.Bool("json", false, "print JSON")
	metrics := fs.Bool("metrics", false, "print the Prometheus metrics")
	if err := parse(fs, args); err != nil {
		return err
	}
	c := backend.NewControlClient(controlPath(*socketDir))
	if *metrics {
		m, err := c.Metrics(ctx)
		if err != nil {
			return err
		}
		_, err = io.WriteString(stdout, m)
		return err
	}
	st, err := c.Status(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	fmt.Fprintf(stdout, "transport %s, fabric %s%s, sockets in %s\n", st.Transport, st.Fabric.Mode, strings.TrimSuffix(" "+st.Fabric.Netdev, " "), st.SocketDir)
	if sv := st.Supervisor; sv != nil {
		fmt.Fprintf(stdout, "daemon pid %d under its supervisor (pid %d), which holds the VMs' descriptors; restarts: %d", st.PID, sv.PID, sv.Restarts)
		if sv.LastExit != "" {
			fmt.Fprintf(stdout, " (the previous process: %s)", sv.LastExit)
		}
		fmt.Fprintln(stdout)
	}
	fab := "RoCE " + st.Fabric.RoCEMode + " by default"
	if st.Fabric.VLAN != 0 {
		fab += fmt.Sprintf(", VLAN %d PCP %s", st.Fabric.VLAN, st.Fabric.PCP)
	}
	if st.Fabric.Congestion != "" {
		fab += ", congestion control " + st.Fabric.Congestion
	}
	fmt.Fprintf(stdout, "%s; CNPs sent %d received %d, CE-marked packets received %d, RoCE version mismatches dropped %d\n", fab,
		st.Counters["tx_cnp"], st.Counters["rx_cnp"], st.Counters["rx_ecn_ce_marked"], st.Counters["drop_roce_version_mismatch"])
	for _, q := range st.Fabric.QPRates {
		fmt.Fprintf(stdout, "  %s qp %d: rate %.1f Mb/s (target %.1f, alpha %.3f, %d CNPs)\n", q.VM, q.QPN, q.RateMbps, q.TargetMbps, q.Alpha, q.CNPs)
	}
	if h := st.Fabric.HostDevice; h != nil {
		created := ""
		if h.CreatedRXE {
			created = " (created by the daemon)"
		}
		fmt.Fprintf(stdout, "host device %s%s port %d: %s%s\n", h.Name, created, h.Port, h.State, h.Error)
		for _, g := range h.GIDs {
			fmt.Fprintf(stdout, "  gid %s\n", g)
		}
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VM\tCONNECTED\tQMP\tMAC\tROCE\tGIDS\tQPS\tMRS\tLOCKED")
	for _, vm := range st.VMs {
		gids := make([]string, 0, len(vm.GIDs))
		for _, g := range vm.GIDs {
			gids = append(gids, fmt.Sprintf("%d:%s", g.Index, g.GID))
		}
		fmt.Fprintf(tw, "%s\t%v\t%s\t%s\t%s\t%s\t%d\t%d\t%dM\n", vm.Name, vm.Connected, vm.QMP, vm.MAC, vm.RoCEMode, strings.Join(gids, ","),
			vm.Resources["qp"], vm.Resources["mr"], vm.LockedBytes>>20)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, vm := range st.VMs {
		if vm.GIDRefusals > 0 {
			fmt.Fprintf(stdout, "%s: %d GID binds refused, last %s (%s)\n", vm.Name, vm.GIDRefusals, vm.LastRefusedGID, vm.LastRefusedReason)
		}
		if vm.Fault != "" {
			fmt.Fprintf(stdout, "%s: device fault: %s\n", vm.Name, vm.Fault)
		}
		if vm.MigrationsCancelled+vm.SnapshotsCancelled > 0 {
			fmt.Fprintf(stdout, "%s: %d migrations and %d snapshot jobs cancelled (QEMU's vfio-user-pci would drop the device)\n",
				vm.Name, vm.MigrationsCancelled, vm.SnapshotsCancelled)
		}
		switch {
		case vm.Identity == backend.IdentitySocketGroup || vm.Identity == "" && vm.QEMUUID == 0:
			fmt.Fprintf(stdout, "%s: identity: socket group: any QEMU of the socket group outside libvirt machine cgroups "+
				"may connect as this VM (no --qemu-uid or --qemu-cgroup, and its QEMU, if connected, is in no libvirt machine cgroup)\n", vm.Name)
		case vm.Identity != "":
			fmt.Fprintf(stdout, "%s: identity: %s\n", vm.Name, vm.Identity)
		}
		if vm.Connected && vm.QMP != backend.QMPVerified {
			fmt.Fprintf(stdout, "%s: exposed: the daemon has no QMP monitor of this VM's QEMU (qemu-args --qmp-monitor): "+
				"a migration or snapshot would drop its device unnoticed\n", vm.Name)
		}
	}
	return nil
}

func runLibvirtXML(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("libvirt-xml", "--vm NAME [flags] | --domain FILE [flags]", stderr)
	var v vmFlags
	v.register(fs)
	v.registerBoot(fs)
	var o backend.LibvirtOptions
	fs.StringVar(&o.DomainType, "domain-type", "kvm", "libvirt domain type: kvm, or qemu (TCG)")
	fs.IntVar(&o.VCPUs, "vcpus", 1, "vCPUs")
	fs.StringVar(&o.NIC, "nic", "network:default", "the vmxnet3's network: network:NAME, bridge:NAME or user")
	fs.StringVar(&o.Emulator, "emulator", "", "QEMU binary for <emulator> (>= 10.1, with vfio-user-pci); default: libvirt's")
	lock := fs.Bool("lock", true, "<locked/>: QEMU locks guest RAM too (libvirt raises its RLIMIT_MEMLOCK, which needs CAP_SYS_RESOURCE); the daemon locks what it maps either way")
	register := fs.Bool("register", true, "register the VM with the running daemon so its socket exists before libvirt starts QEMU")
	domain := fs.String("domain", "", "an existing domain's XML (virsh dumpxml NAME > FILE; - for standard input): print it with the device added "+
		"(its RAM a shared memfd, no balloon, the vmxnet3 and the PVRDMA function), its disks and NICs kept; --vm and --mem default to the domain's name and RAM; "+
		"--domain-type, --vcpus and --emulator are a new domain's")
	if err := parse(fs, args); err != nil {
		return err
	}
	o.NoLock = !*lock
	var existing string
	if *domain != "" {
		b, err := readFileOrStdin(*domain)
		if err != nil {
			return fmt.Errorf("--domain: %w", err)
		}
		existing = string(b)
		d, err := backend.ReadLibvirtDomain(existing)
		if err != nil {
			return fmt.Errorf("--domain %s: %w", *domain, err)
		}
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["vm"] {
			v.name = d.Name
		}
		if !set["mem"] {
			v.mem = sizeFlag(d.MemBytes)
		}
	}
	spec, err := v.spec()
	if err != nil {
		return err
	}
	var x string
	if existing != "" {
		x, err = spec.AddToLibvirtDomain(existing, o)
	} else {
		x, err = spec.LibvirtDomainXML(o)
	}
	if err != nil {
		return err
	}
	if *register {
		if err := registerVM(ctx, v.socketDir, spec); err != nil {
			return err
		}
	}
	_, err = io.WriteString(stdout, x)
	return err
}

// readFileOrStdin reads path, or standard input for "-".
func readFileOrStdin(path string) ([]byte, error) {
	if path == "-" {
		return io.ReadAll(os.Stdin)
	}
	return os.ReadFile(path)
}
