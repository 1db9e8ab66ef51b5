package backend

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLibvirtMachineName: the machine names libvirt's own tests expect
// (tests/virsystemdtest.c, TEST_MACHINE without an embed root), and the
// rules behind them.
func TestLibvirtMachineName(t *testing.T) {
	for _, c := range []struct {
		name string
		id   int
		want string
	}{
		// libvirt's vectors.
		{"demo", 1, "qemu-1-demo"},
		{"demo-name", 2, "qemu-2-demo-name"},
		{"demo!name", 3, "qemu-3-demoname"},
		{".demo", 4, "qemu-4-demo"},
		{"bull\U0001f4a9", 5, "qemu-5-bull"},
		{"demo..name", 6, "qemu-6-demo.name"},
		{"12345678901234567890123456789012345678901234567890123456789", 7, "qemu-7-123456789012345678901234567890123456789012345678901234567"},
		{"123456789012345678901234567890123456789012345678901234567890", 8, "qemu-8-123456789012345678901234567890123456789012345678901234567"},
		{"kstest-network-device-default-httpks_(c9eed63e-981e-48ec-acdc-56b3f8c5f678)", 100, "qemu-100-kstest-network-device-default-httpksc9eed63e-981e-48ec"},
		{"kstest-network-device-default-httpks_(c9eed63e-981e-48ec--cdc-56b3f8c5f678)", 10, "qemu-10-kstest-network-device-default-httpksc9eed63e-981e-48ec-c"},
		{"demo.-.test.", 11, "qemu-11-demo.test"},
		{"|.-m", 1, "qemu-1-m"},
		{"Auto-esx7.0-rhel7.9-special-characters~!@#$%^&*_=+,?><:;|.\"[]()`\\-m", 1, "qemu-1-Auto-esx7.0-rhel7.9-special-characters.m"},
		// Our VM names ([A-Za-z0-9_.-]).
		{"vma", 7, "qemu-7-vma"},
		{"vm_a", 7, "qemu-7-vma"},  // '_' dropped
		{"a-_-b", 1, "qemu-1-a-b"}, // a dropped byte does not end a run
		{"-vm", 1, "qemu-1-vm"},    // leading '-' dropped
		{"vm-", 1, "qemu-1-vm"},    // trailing trimmed
		{"___", 1, "qemu-1"},       // nothing kept: "qemu-1-" trimmed
		{"a" + strings.Repeat("b", 63), 1234567890, "qemu-1234567890-a" + strings.Repeat("b", 47)}, // 64 bytes
		{strings.Repeat("a", 56) + "-b", 7, "qemu-7-" + strings.Repeat("a", 56)},                   // cut on the '-', then trimmed
	} {
		got := libvirtMachineName(c.id, c.name)
		assert.Equal(t, c.want, got, "%q id %d", c.name, c.id)
		assert.LessOrEqual(t, len(got), libvirtMachineMax)
	}
}

// TestLibvirtMachine: which cgroup path components are libvirt QEMU
// machines, and the machine each names.
func TestLibvirtMachine(t *testing.T) {
	for _, c := range []struct {
		component, machine string
		ok                 bool
	}{
		{`machine-qemu\x2d7\x2dvma.scope`, "qemu-7-vma", true},
		{`machine-qemu\x2d12\x2dweb\x2d01.example.scope`, "qemu-12-web-01.example", true},
		{"qemu-9-vmc.libvirt-qemu", "qemu-9-vmc", true},
		{"qemu-9-a.b-c.libvirt-qemu", "qemu-9-a.b-c", true},
		// libvirt shapes whose name is none libvirt makes: name no VM.
		{`machine-qemu\x2d7\x2dv\x5fa.scope`, "", true}, // an escape other than \x2d
		{`machine-qemu\x2d7\x2dv_a.scope`, "", true},
		{`machine-qemu\x2d7\x2d.scope`, "qemu-7-", true},
		{`machine-qemu\x2d.scope`, "qemu-", true},
		{`machine-qemu\x2d7\x2dvma\x2.scope`, "", true}, // a cut escape
		{`machine-qemu\x2d7\x2d` + strings.Repeat("a", 60) + ".scope", "", true},
		{"qemu-9-v c.libvirt-qemu", "", true},
		// Not a libvirt QEMU machine.
		{"machine.slice", "", false},
		{`machine-lxc\x2d3\x2dct.scope`, "", false},
		{"machine-foo.scope", "", false},
		{"qemu-9-vmc.libvirt-lxc", "", false},
		{"lxc-9-vmc.libvirt-qemu", "", false},
		{"libvirt", "", false},
		{"emulator", "", false},
		{"vcpu0", "", false},
		{"", "", false},
		{"machine-qemu\\x2d", "", false}, // no .scope
	} {
		m, ok := libvirtMachine(c.component)
		assert.Equal(t, c.ok, ok, "%q", c.component)
		assert.Equal(t, c.machine, m, "%q", c.component)
	}
}

// TestMachineNames: a machine names a VM when libvirt makes that machine
// name of the VM's name with the machine's ID; unprivileged, embedded and
// malformed names name none.
func TestMachineNames(t *testing.T) {
	for _, c := range []struct {
		machine, vm string
		want        bool
	}{
		{"qemu-7-vma", "vma", true},
		{"qemu-7-vma", "vm_a", true}, // libvirt names them alike (libvirtNamesCollide)
		{"qemu-8-vmb", "vma", false},
		{"qemu-7-vma", "vmab", false},
		{"qemu-7-vmab", "vma", false},
		{"qemu-1", "___", true},
		{"qemu-7-" + strings.Repeat("a", 57), strings.Repeat("a", 70), true},
		{"qemu-7-" + strings.Repeat("a", 57), strings.Repeat("a", 57) + "b", true},
		{"qemu-07-vma", "vma", false},
		{"qemu-0-vma", "vma", false},
		{"qemu--1-vma", "vma", false},
		{"qemu-99999999999-vma", "vma", false},
		{"qemu-alice-7-vma", "vma", false},            // unprivileged libvirtd
		{"qemu-embed-0991f456-1-demo", "demo", false}, // embedded driver
		{"qemu-", "vma", false},
		{"", "vma", false},
		{"lxc-7-vma", "vma", false},
	} {
		assert.Equal(t, c.want, machineNames(c.machine, c.vm), "%q %q", c.machine, c.vm)
	}
	assert.True(t, libvirtNamesCollide("vm1", "vm_1"))
	assert.True(t, libvirtNamesCollide("web--1", "web-1"))
	assert.True(t, libvirtNamesCollide(strings.Repeat("a", 60)+"x", strings.Repeat("a", 60)+"y"), "cut alike for long IDs")
	assert.False(t, libvirtNamesCollide("vma", "vmb"))
	assert.False(t, libvirtNamesCollide("vm1", "vm1.a"))
}

// TestParseProcCgroup: v1, v2 and hybrid files parse; anything the kernel
// would not write is refused.
func TestParseProcCgroup(t *testing.T) {
	hybrid := "12:pids:/machine/qemu-9-vmc.libvirt-qemu\n2:cpu,cpuacct:/machine/qemu-9-vmc.libvirt-qemu/emulator\n" +
		"1:name=systemd:/system.slice/x.service\n0::/system.slice/x.service\n"
	lines, err := parseProcCgroup([]byte(hybrid))
	require.NoError(t, err)
	require.Len(t, lines, 4)
	assert.Equal(t, cgroupLine{ID: 2, Controllers: "cpu,cpuacct", Path: "/machine/qemu-9-vmc.libvirt-qemu/emulator"}, lines[1])
	p, ok := unifiedCgroup(lines)
	assert.True(t, ok)
	assert.Equal(t, "/system.slice/x.service", p)

	v1, err := parseProcCgroup([]byte("3:memory:/a\n1:name=systemd:/machine.slice/vm.scope\n"))
	require.NoError(t, err)
	p, ok = unifiedCgroup(v1)
	assert.True(t, ok, "legacy host: name=systemd")
	assert.Equal(t, "/machine.slice/vm.scope", p)
	_, ok = unifiedCgroup([]cgroupLine{{ID: 3, Controllers: "memory", Path: "/"}})
	assert.False(t, ok)

	colon, err := parseProcCgroup([]byte("0::/a:b/c\n"))
	require.NoError(t, err, "a ':' in a cgroup name")
	assert.Equal(t, "/a:b/c", colon[0].Path)

	none, err := parseProcCgroup(nil)
	require.NoError(t, err, "no cgroup file system ever mounted: no hierarchy")
	assert.Empty(t, none)
	machine, err := vmIdentity{}.admitCgroups("vma", none, func(string) string { return "" })
	require.NoError(t, err, "in no machine cgroup: the default rule admits")
	assert.Empty(t, machine)
	_, err = vmIdentity{cgroup: "/machine.slice/vma.scope"}.admitCgroups("vma", none, func(string) string { return "" })
	require.ErrorIs(t, err, errNotThisVM, "cgroup= cannot be checked without a hierarchy")

	for _, bad := range []string{
		"0::/a",                   // no final newline (truncated)
		"0::/a\n\n",               // empty line
		"0::/a\n0::/b\n",          // a hierarchy twice (what a newline in a name would forge)
		"1:cpu:/a\n1:memory:/b\n", // likewise on v1
		"0:cpu:/a\n",              // v2 has no controller list
		"1::/a\n",                 // v1 has one
		"x::/a\n",                 // ID not a number
		"-1::/a\n",                // negative
		"01:cpu:/a\n",             // not as the kernel prints it
		"99999999999:cpu:/a\n",    // out of range
		"0::a\n",                  // relative
		"0:/a\n",                  // one ':'
		"0\n",                     // none
		"1:cpu cpuacct:/a\n",      // a space in the controllers
		"0::/a\x00b\n",            // NUL
		"0::/" + strings.Repeat("a", 4096) + "\n",                                                    // longer than PATH_MAX
		strings.Repeat("0::/\n", 1) + strings.Repeat("1:cpu:/\n", 1) + strings.Repeat("2:x:/\n", 63), // too many lines (and repeats)
		strings.Repeat("a", maxProcCgroupBytes+1),
	} {
		_, err := parseProcCgroup([]byte(bad))
		require.ErrorIs(t, err, errBadProcCgroup, "%q", bad)
	}
}

// TestAdmitCgroups: the libvirt machine rule on every hierarchy and the
// explicit cgroup rule, on the paths libvirt and systemd make.
func TestAdmitCgroups(t *testing.T) {
	noTwin := func(string) string { return "" }
	parse := func(s string) []cgroupLine {
		t.Helper()
		l, err := parseProcCgroup([]byte(s))
		require.NoError(t, err)
		return l
	}
	def := vmIdentity{}
	for _, c := range []struct {
		what, cgroup string
		machine      string // "" and !ok: refused
		ok           bool
	}{
		{"machined, v2, emulator sub-group", "0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope/libvirt/emulator\n", "qemu-7-vma", true},
		{"machined, v2, the scope", "0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope\n", "qemu-7-vma", true},
		{"machined, hybrid", "4:cpu,cpuacct:/machine.slice/machine-qemu\\x2d7\\x2dvma.scope/emulator\n1:name=systemd:/machine.slice/machine-qemu\\x2d7\\x2dvma.scope\n0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope\n", "qemu-7-vma", true},
		{"libvirt's layout, v1 cpuacct only", "2:cpuacct:/machine/qemu-7-vma.libvirt-qemu\n1:name=systemd:/\n0::/\n", "qemu-7-vma", true},
		{"custom partition", "0::/machine/tenant1.partition/qemu-7-vma.libvirt-qemu/vcpu0\n", "qemu-7-vma", true},
		{"outside the daemon's cgroup namespace", "0::/../../machine.slice/machine-qemu\\x2d7\\x2dvma.scope/libvirt\n", "qemu-7-vma", true},
		{"no machine: the group rule", "0::/user.slice/user-1000.slice/session-2.scope\n", "", true},
		{"another domain's", "0::/machine.slice/machine-qemu\\x2d8\\x2dvmb.scope/libvirt/emulator\n", "", false},
		{"another domain's, one v1 hierarchy only", "3:cpuacct:/machine/qemu-8-vmb.libvirt-qemu\n1:name=systemd:/\n0::/\n", "", false},
		{"ours on v2, another's on v1", "3:cpu:/machine/qemu-8-vmb.libvirt-qemu\n0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope\n", "", false},
		{"a malformed machine scope", "0::/machine.slice/machine-qemu\\x2d7\\x2dvm\\x5fa.scope\n", "", false},
		{"an embedded driver's", "0::/machine.slice/machine-qemu\\x2dembed\\x2d0991f456\\x2d7\\x2dvma.scope\n", "", false},
		{"a legacy scope without ID", "0::/machine.slice/machine-qemu\\x2dvma.scope\n", "", false},
	} {
		m, err := def.admitCgroups("vma", parse(c.cgroup), noTwin)
		if c.ok {
			assert.NoError(t, err, c.what)
			assert.Equal(t, c.machine, m, c.what)
		} else {
			assert.ErrorIs(t, err, errNotThisVM, c.what)
		}
	}
	// Two registered VMs libvirt names alike: their QEMUs are refused.
	_, err := def.admitCgroups("vma", parse("0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope\n"),
		func(m string) string { return map[bool]string{true: "vm_a"}[machineNames(m, "vm_a")] })
	assert.ErrorIs(t, err, errNotThisVM)

	explicit := vmIdentity{cgroup: "/machine.slice/vm1.scope"}
	for _, c := range []struct {
		what, cgroup string
		ok           bool
	}{
		{"the cgroup", "0::/machine.slice/vm1.scope\n", true},
		{"below it", "0::/machine.slice/vm1.scope/payload\n", true},
		{"hybrid: unified line", "1:name=systemd:/elsewhere\n0::/machine.slice/vm1.scope\n", true},
		{"legacy v1: name=systemd", "3:cpu:/\n1:name=systemd:/machine.slice/vm1.scope/x\n", true},
		{"a sibling with its prefix", "0::/machine.slice/vm1.scope2\n", false},
		{"outside", "0::/user.slice\n", false},
		{"the root", "0::/\n", false},
		{"outside the daemon's namespace", "0::/../machine.slice/vm1.scope\n", false},
		{"dot-dot below", "0::/machine.slice/vm1.scope/../vm2.scope\n", false},
		{"v1 only, no name=systemd", "3:cpu:/machine.slice/vm1.scope\n", false},
		{"even in its own libvirt machine", "0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope\n", false},
	} {
		m, err := explicit.admitCgroups("vma", parse(c.cgroup), noTwin)
		if c.ok {
			assert.NoError(t, err, c.what)
			assert.Empty(t, m, c.what)
		} else {
			assert.ErrorIs(t, err, errNotThisVM, c.what)
		}
	}
}

// TestCheckCgroupPath: a VM's cgroup is absolute, clean, below / and
// bounded.
func TestCheckCgroupPath(t *testing.T) {
	for _, ok := range []string{"/machine.slice/vm1.scope", "/a", `/machine.slice/machine-qemu\x2d1\x2dvm.scope`, "/a:b/c d"} {
		assert.NoError(t, CheckCgroupPath(ok), ok)
	}
	for _, bad := range []string{"", "/", "a/b", "/a/", "/a//b", "/a/./b", "/a/../b", "/..", "/a/..", "/a,b", "/a\nb", "/a\x00",
		"/" + strings.Repeat("a", 256), "/" + strings.Repeat("a/", 600)} {
		assert.ErrorIs(t, CheckCgroupPath(bad), ErrBadCgroup, "%q", bad)
	}
}

// TestParseProcStat: state and flags after the last ')' of comm.
func TestParseProcStat(t *testing.T) {
	st, flags, err := parseProcStat([]byte("42 (qemu) sys) R 1 42 42 0 -1 4194560 0 0\n"))
	require.NoError(t, err)
	assert.Equal(t, byte('R'), st)
	assert.EqualValues(t, 4194560, flags)
	st, flags, err = parseProcStat([]byte("42 (a b) Z 1 42 42 0 -1 4194308 0\n"))
	require.NoError(t, err)
	assert.Equal(t, byte('Z'), st)
	assert.NotZero(t, flags&pfExiting)
	for _, bad := range []string{"", "42 qemu R 1", "42 (q) R 1 2 3", "42 (q) R 1 2 3 4 5 x", "42 (q) RR 1 2 3 4 5 6"} {
		_, _, err := parseProcStat([]byte(bad))
		assert.Error(t, err, "%q", bad)
	}
}

// TestIdentityDescribe: what status says of each identity.
func TestIdentityDescribe(t *testing.T) {
	assert.Equal(t, IdentitySocketGroup, vmIdentity{}.describe(""))
	assert.Equal(t, "libvirt machine qemu-7-vma", vmIdentity{}.describe("qemu-7-vma"))
	assert.Equal(t, "uid 1234", vmIdentity{uid: 1234}.describe(""))
	assert.Equal(t, "uid 1234, libvirt machine qemu-7-vma", vmIdentity{uid: 1234}.describe("qemu-7-vma"))
	assert.Equal(t, "cgroup /x, uid 1234", vmIdentity{uid: 1234, cgroup: "/x"}.describe(""))
}

// FuzzParseProcCgroup: any file either is refused or gives at most
// maxCgroupLines hierarchies, each once, with absolute bounded paths; the
// identity rules on it never panic and admit a libvirt machine only for
// the VM it names.
func FuzzParseProcCgroup(f *testing.F) {
	for _, s := range []string{
		"0::/\n",
		"0::/machine.slice/machine-qemu\\x2d7\\x2dvma.scope/libvirt/emulator\n",
		"12:pids:/machine/qemu-9-vmc.libvirt-qemu\n2:cpu,cpuacct:/machine/qemu-9-vmc.libvirt-qemu/emulator\n1:name=systemd:/\n0::/\n",
		"0::/a\n0::/b\n",
		"0::/../../x\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		lines, err := parseProcCgroup(b)
		if err != nil {
			return
		}
		require.LessOrEqual(t, len(lines), maxCgroupLines)
		seen := map[int]bool{}
		for _, l := range lines {
			require.False(t, seen[l.ID])
			seen[l.ID] = true
			require.True(t, strings.HasPrefix(l.Path, "/"))
			require.LessOrEqual(t, len(l.Path), maxCgroupPathLen)
		}
		m, err := vmIdentity{}.admitCgroups("vma", lines, func(string) string { return "" })
		if err == nil && m != "" {
			require.True(t, machineNames(m, "vma"))
		}
		_, _ = vmIdentity{cgroup: "/machine.slice/vm1.scope"}.admitCgroups("vma", lines, func(string) string { return "" })
	})
}
