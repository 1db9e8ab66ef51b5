package backend

import (
	"errors"
	"fmt"
	"math"
	"path"
	"slices"
	"strconv"
	"strings"
)

// A VM's identity by cgroup (issue 23 item 2): the socket group admits
// every QEMU of the group, and under libvirt all QEMUs share one user, so
// the daemon also looks at the cgroups of the process that connects
// (/proc/PID/cgroup, read as peerproc_linux.go describes).
//
//   - By default, a peer in a libvirt QEMU machine's cgroup, on any
//     hierarchy, is admitted only on the sockets of the VM that machine
//     names: libvirt puts each domain's QEMU, before it runs, in a cgroup
//     of its own that only root may move processes into or out of, so
//     another domain's QEMU cannot take it. A peer in no such cgroup (a
//     QEMU started by hand, by a script, by another manager) is admitted
//     as before: by the socket group, or by its uid if the VM has one.
//   - A VM registered with a cgroup (VMRequest.QEMUCgroup) admits only
//     peers in that cgroup or below it, whoever placed them there.
//
// libvirt names the cgroups (privileged daemon, QEMU driver):
//
//	machine-qemu\x2d<id>\x2d<name>.scope     systemd-machined (virSystemdMakeScopeName)
//	qemu-<id>-<name>.libvirt-qemu            libvirt's own layout (virCgroupNewDomainPartition)
//
// where "qemu-<id>-<name>" is the machine name
// (virDomainDriverGenerateMachineName), the scope its systemd escape
// ('-' is \x2d), and sub-groups (libvirt, emulator, vcpuN, iothreadN)
// may follow.

// Bounds of /proc/PID/cgroup: the kernel prints one line per hierarchy
// (a dozen at most in practice), each path at most PATH_MAX.
const (
	maxProcCgroupBytes = 64 << 10
	maxCgroupLines     = 64
	maxCgroupPathLen   = 4096
	// maxQEMUCgroupLen bounds a VM's registered cgroup path.
	maxQEMUCgroupLen = 1024
)

// libvirtMachineMax is the longest machine name libvirt makes
// (virDomainMachineNameAppendValid stops at 64 bytes).
const libvirtMachineMax = 64

// errBadProcCgroup: /proc/PID/cgroup is not what the kernel writes.
var errBadProcCgroup = errors.New("malformed /proc/PID/cgroup")

// errNotThisVM: the peer is not this VM's QEMU (another VM's, or outside
// the VM's cgroup).
var errNotThisVM = errors.New("not this VM's QEMU")

// ErrBadCgroup: a VM's cgroup path is not one the daemon can compare.
var ErrBadCgroup = errors.New("cgroup must be an absolute, clean path below / (no '.' or '..' components, no ',' or control characters, at most 1024 bytes)")

// cgroupLine is one line of /proc/PID/cgroup: the hierarchy's ID (0 for
// the unified, v2, hierarchy), its controllers ("" on v2, "cpu,cpuacct",
// "name=systemd") and the process's path in it, relative to the
// reader's cgroup namespace.
type cgroupLine struct {
	ID          int
	Controllers string
	Path        string
}

// parseProcCgroup parses /proc/PID/cgroup. The kernel writes the path
// unescaped, but refuses cgroup names with a newline (cgroup_mkdir), so
// every line is one hierarchy; a repeated hierarchy, a line that is not
// ID:CONTROLLERS:/PATH, or more than the bounds is an error rather than a
// guess. An empty file is no hierarchy: a kernel on which no cgroup file
// system was ever mounted (cgroup2's line appears once one was) lists none,
// as in the test bed's guests, which run the daemon under a busybox init.
func parseProcCgroup(b []byte) ([]cgroupLine, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if len(b) > maxProcCgroupBytes {
		return nil, fmt.Errorf("%d bytes: %w", len(b), errBadProcCgroup)
	}
	if b[len(b)-1] != '\n' {
		return nil, fmt.Errorf("no final newline (truncated?): %w", errBadProcCgroup)
	}
	raw := strings.Split(string(b[:len(b)-1]), "\n")
	if len(raw) > maxCgroupLines {
		return nil, fmt.Errorf("%d lines: %w", len(raw), errBadProcCgroup)
	}
	lines := make([]cgroupLine, 0, len(raw))
	for i, l := range raw {
		id, rest, ok := strings.Cut(l, ":")
		if !ok {
			return nil, fmt.Errorf("line %d: no ':': %w", i+1, errBadProcCgroup)
		}
		ctrl, p, ok := strings.Cut(rest, ":")
		if !ok {
			return nil, fmt.Errorf("line %d: one ':': %w", i+1, errBadProcCgroup)
		}
		n, err := parseHierarchyID(id)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", i+1, err)
		}
		if !validControllers(ctrl) || (n == 0) != (ctrl == "") {
			return nil, fmt.Errorf("line %d: controllers %q of hierarchy %d: %w", i+1, ctrl, n, errBadProcCgroup)
		}
		if !strings.HasPrefix(p, "/") || len(p) > maxCgroupPathLen || strings.IndexByte(p, 0) >= 0 {
			return nil, fmt.Errorf("line %d: path of %d bytes: %w", i+1, len(p), errBadProcCgroup)
		}
		if slices.ContainsFunc(lines, func(o cgroupLine) bool { return o.ID == n }) {
			return nil, fmt.Errorf("line %d: hierarchy %d twice: %w", i+1, n, errBadProcCgroup)
		}
		lines = append(lines, cgroupLine{ID: n, Controllers: ctrl, Path: p})
	}
	return lines, nil
}

// parseHierarchyID parses a hierarchy ID as the kernel prints it (%d,
// never negative).
func parseHierarchyID(s string) (int, error) {
	if s == "" || len(s) > 10 || (len(s) > 1 && s[0] == '0') {
		return 0, fmt.Errorf("hierarchy ID %q: %w", s, errBadProcCgroup)
	}
	n, err := strconv.ParseUint(s, 10, 31)
	if err != nil {
		return 0, fmt.Errorf("hierarchy ID %q: %w", s, errBadProcCgroup)
	}
	return int(n), nil
}

// validControllers reports whether s is a v1 controller list as the
// kernel prints it (controller names, "name=" and a named hierarchy's
// name, which cgroup1_parse_param limits to [A-Za-z0-9_.-]), or "".
func validControllers(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !isAlnum(c) && c != '_' && c != '.' && c != '-' && c != ',' && c != '=' {
			return false
		}
	}
	return len(s) <= 256
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// unifiedCgroup returns the path a VM's registered cgroup is compared
// with: the unified (v2) hierarchy's, which every process has once
// cgroup2 is mounted anywhere (unified and hybrid hosts; on a hybrid host
// systemd keeps it in step with name=systemd), else systemd's named v1
// hierarchy (legacy hosts without cgroup2).
func unifiedCgroup(lines []cgroupLine) (string, bool) {
	for _, l := range lines {
		if l.ID == 0 {
			return l.Path, true
		}
	}
	for _, l := range lines {
		if slices.Contains(strings.Split(l.Controllers, ","), "name=systemd") {
			return l.Path, true
		}
	}
	return "", false
}

// CheckCgroupPath validates a VM's cgroup (VMRequest.QEMUCgroup): an
// absolute path as /proc/PID/cgroup shows it to the daemon, clean (so that
// "is it below" is a string prefix), not the root (which would admit
// everyone), without ',' (the --vm option separator) or control
// characters, components at most NAME_MAX.
func CheckCgroupPath(p string) error {
	if p == "" || p[0] != '/' || p == "/" || len(p) > maxQEMUCgroupLen || path.Clean(p) != p {
		return fmt.Errorf("cgroup %q: %w", p, ErrBadCgroup)
	}
	for _, c := range strings.Split(p[1:], "/") {
		if c == "." || c == ".." || len(c) > 255 {
			return fmt.Errorf("cgroup %q: %w", p, ErrBadCgroup)
		}
	}
	for i := 0; i < len(p); i++ {
		if p[i] < 0x20 || p[i] == 0x7f || p[i] == ',' {
			return fmt.Errorf("cgroup %q: %w", p, ErrBadCgroup)
		}
	}
	return nil
}

// inCgroup reports whether a peer's path p is root or below it. root has
// passed CheckCgroupPath; p is compared as the kernel wrote it, and one
// that is not clean (a "/../" prefix: a cgroup outside the daemon's cgroup
// namespace) is below nothing.
func inCgroup(p, root string) bool {
	if path.Clean(p) != p {
		return false
	}
	return p == root || strings.HasPrefix(p, root+"/")
}

// libvirtMachineName is the machine name a privileged libvirtd gives QEMU
// domain name started with id (virDomainDriverGenerateMachineName and
// virDomainMachineNameAppendValid): "qemu-<id>-", then the name's bytes in
// [A-Za-z0-9-.], each run of '-' and '.' kept as its first byte and
// leading ones dropped, until the whole is 64 bytes; trailing '-' and '.'
// trimmed (those of "qemu-<id>-" too, for a name with nothing kept).
func libvirtMachineName(id int, name string) string {
	b := make([]byte, 0, libvirtMachineMax+1)
	b = append(b, "qemu-"...)
	b = strconv.AppendInt(b, int64(id), 10)
	b = append(b, '-')
	skip := true
	for i := 0; i < len(name) && len(b) < libvirtMachineMax; i++ {
		switch c := name[i]; {
		case c == '-' || c == '.':
			if !skip {
				b = append(b, c)
				skip = true
			}
		case isAlnum(c):
			b = append(b, c)
			skip = false
		}
	}
	return strings.TrimRight(string(b), "-.")
}

// Shapes of a libvirt QEMU machine's cgroup (path component).
const (
	machineScopePrefix = `machine-qemu\x2d` // systemd: machine-<escaped "qemu-...">.scope
	machineScopeSuffix = ".scope"
	machinePartSuffix  = ".libvirt-qemu" // libvirt's own: qemu-....libvirt-qemu
)

// libvirtMachine reports whether a cgroup path component is a libvirt
// QEMU machine's cgroup, in either shape, and the machine name in it.
// The name is "" if it cannot be one libvirt makes (an escape other than
// \x2d, a byte outside [A-Za-z0-9-.], too long): such a cgroup names no
// VM, so a peer in it is admitted by none (fail closed).
func libvirtMachine(c string) (machine string, ok bool) {
	switch {
	case strings.HasPrefix(c, machineScopePrefix) && strings.HasSuffix(c, machineScopeSuffix) &&
		len(c) >= len(machineScopePrefix)+len(machineScopeSuffix):
		esc := c[len("machine-") : len(c)-len(machineScopeSuffix)]
		var b strings.Builder
		for i := 0; i < len(esc); i++ {
			switch ch := esc[i]; {
			case ch == '\\':
				if !strings.HasPrefix(esc[i:], `\x2d`) {
					return "", true
				}
				b.WriteByte('-')
				i += 3
			case isAlnum(ch) || ch == '.':
				b.WriteByte(ch)
			default:
				return "", true
			}
		}
		machine = b.String()
	case strings.HasPrefix(c, "qemu-") && strings.HasSuffix(c, machinePartSuffix):
		machine = strings.TrimSuffix(c, machinePartSuffix)
		for i := 0; i < len(machine); i++ {
			if ch := machine[i]; !isAlnum(ch) && ch != '-' && ch != '.' {
				return "", true
			}
		}
	default:
		return "", false
	}
	if len(machine) > libvirtMachineMax {
		return "", true
	}
	return machine, true
}

// machineID returns the domain ID of a privileged libvirtd's machine name
// ("qemu-<id>" or "qemu-<id>-..."; libvirt prints the ID with %d, and a
// running domain's is positive).
func machineID(machine string) (int, bool) {
	rest, ok := strings.CutPrefix(machine, "qemu-")
	if !ok {
		return 0, false
	}
	digits, _, _ := strings.Cut(rest, "-")
	if digits == "" || len(digits) > 10 || digits[0] == '0' {
		return 0, false
	}
	for i := 0; i < len(digits); i++ {
		if digits[i] < '0' || digits[i] > '9' {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || n > math.MaxInt32 {
		return 0, false
	}
	return int(n), true
}

// machineNames reports whether libvirt machine name machine is VM vm's:
// what libvirt makes of the name vm with the machine's ID. The names of an
// unprivileged libvirtd ("qemu-<user>-<id>-...") and of an embedded driver
// ("qemu-embed-<hash>-<id>-...") name no VM.
func machineNames(machine, vm string) bool {
	id, ok := machineID(machine)
	return ok && libvirtMachineName(id, vm) == machine
}

// libvirtNamesCollide reports whether libvirt gives VMs a and b the same
// machine name for some domain ID (names that differ only in what libvirt
// drops: '_', repeated or trailing '-' and '.', bytes past 64): the
// daemon cannot tell their QEMUs apart by cgroup. The truncation depends
// only on the ID's length, so one ID of each length is enough.
func libvirtNamesCollide(a, b string) bool {
	for id := 1; id <= math.MaxInt32/10; id *= 10 {
		if libvirtMachineName(id, a) == libvirtMachineName(id, b) {
			return true
		}
	}
	return libvirtMachineName(math.MaxInt32, a) == libvirtMachineName(math.MaxInt32, b)
}

// peerMachine is a libvirt machine cgroup a peer is in.
type peerMachine struct {
	component string // the path component, as the kernel wrote it
	machine   string // its machine name, "" if it has none libvirt makes
}

// libvirtMachines lists the libvirt QEMU machine cgroups in a peer's
// paths, on every hierarchy, each component once.
func libvirtMachines(lines []cgroupLine) []peerMachine {
	var ms []peerMachine
	for _, l := range lines {
		for _, c := range strings.Split(l.Path, "/") {
			m, ok := libvirtMachine(c)
			if ok && !slices.ContainsFunc(ms, func(o peerMachine) bool { return o.component == c }) {
				ms = append(ms, peerMachine{component: c, machine: m})
			}
		}
	}
	return ms
}

// vmIdentity is what a VM's sockets require of a peer besides the socket
// group's access (accessPolicy).
type vmIdentity struct {
	// uid, if not 0, is the only uid admitted besides root and the
	// daemon's own (VMRequest.QEMUUID).
	uid uint32
	// cgroup, if set, is the cgroup a peer must be in or below
	// (VMRequest.QEMUCgroup); it replaces the libvirt machine rule.
	cgroup string
}

// admitCgroups applies the VM's cgroup rule to a peer's cgroups. It
// returns the libvirt machine through which the peer is VM vm's QEMU (""
// if it is in none, or if the VM has a cgroup of its own). twin returns
// another registered VM whose QEMU's machine name machine would also be
// (libvirtNamesCollide), or "": a peer that could be either is refused.
func (id vmIdentity) admitCgroups(vm string, lines []cgroupLine, twin func(machine string) string) (string, error) {
	if id.cgroup != "" {
		p, ok := unifiedCgroup(lines)
		if !ok {
			return "", fmt.Errorf("no unified or name=systemd cgroup to compare with %s: %w", id.cgroup, errNotThisVM)
		}
		if !inCgroup(p, id.cgroup) {
			return "", fmt.Errorf("in cgroup %q, not in %s: %w", p, id.cgroup, errNotThisVM)
		}
		return "", nil
	}
	machine := ""
	for _, m := range libvirtMachines(lines) {
		if !machineNames(m.machine, vm) {
			return "", fmt.Errorf("in libvirt machine cgroup %q, another domain's: %w", m.component, errNotThisVM)
		}
		if other := twin(m.machine); other != "" {
			return "", fmt.Errorf("in libvirt machine cgroup %q, which VM %s's QEMU would have too "+
				"(their names differ only in characters libvirt drops; rename one): %w", m.component, other, errNotThisVM)
		}
		machine = m.machine
	}
	return machine, nil
}

// parseProcStat returns the state and flags (PF_*) of /proc/PID/stat:
// "pid (comm) state ppid pgrp session tty_nr tpgid flags ...", where comm
// may hold anything, parentheses and spaces too, so fields are counted
// from its last ')'.
func parseProcStat(b []byte) (state byte, flags uint64, err error) {
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, 0, errors.New("/proc/PID/stat: no ')'")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 7 || len(f[0]) != 1 {
		return 0, 0, errors.New("/proc/PID/stat: too few fields")
	}
	flags, err = strconv.ParseUint(f[6], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/PID/stat flags: %w", err)
	}
	return f[0][0], flags, nil
}

// Identities of VMStatus.Identity: how the VM's sockets know its QEMU.
const (
	// IdentitySocketGroup: by the socket group only; any QEMU of the group
	// outside libvirt machine cgroups may connect as the VM.
	IdentitySocketGroup = "socket group"
	// IdentityLibvirtMachine starts the identity of a VM whose connected
	// QEMU was admitted through its libvirt machine cgroup (followed by
	// the machine's name).
	IdentityLibvirtMachine = "libvirt machine"
)

// describe says how the VM's sockets know its QEMU (VMStatus.Identity);
// machine is the connected QEMU's libvirt machine, if it was admitted
// through one.
func (id vmIdentity) describe(machine string) string {
	var parts []string
	if id.cgroup != "" {
		parts = append(parts, "cgroup "+id.cgroup)
	}
	if id.uid != 0 {
		parts = append(parts, "uid "+strconv.FormatUint(uint64(id.uid), 10))
	}
	if id.cgroup == "" && machine != "" {
		parts = append(parts, IdentityLibvirtMachine+" "+machine)
	}
	if len(parts) == 0 {
		return IdentitySocketGroup
	}
	return strings.Join(parts, ", ")
}
