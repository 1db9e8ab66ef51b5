package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fakeQEMU writes a script that answers --version, -device help and -object help
// like QEMU does.
func fakeQEMU(t *testing.T, version string, devices, objects []string) string {
	t.Helper()
	var dev, obj strings.Builder
	for _, d := range devices {
		dev.WriteString(`name "` + d + `", bus PCI\n`)
	}
	for _, o := range objects {
		obj.WriteString("  " + o + "\n")
	}
	p := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	script := "#!/bin/sh\ncase \"$1\" in\n" +
		"--version) echo 'QEMU emulator version " + version + " (Debian)';;\n" +
		"-device) printf '" + dev.String() + "';;\n" +
		"-object) printf 'List of user creatable objects:\\n" + obj.String() + "';;\n" +
		"esac\n"
	require.NoError(t, os.WriteFile(p, []byte(script), 0o755))
	return p
}

// fakeHost is a host whose /proc, /sys, /dev and /lib/modules are temp trees.
func fakeHost(t *testing.T) hostEnv {
	root := t.TempDir()
	h := hostEnv{
		proc: filepath.Join(root, "proc"), sys: filepath.Join(root, "sys"), dev: filepath.Join(root, "dev"),
		etc: filepath.Join(root, "etc"), modules: filepath.Join(root, "modules"), kernel: "6.1.0-test",
		libDirs:  []string{filepath.Join(root, "lib")},
		lookPath: func(string) (string, error) { return "", exec.ErrNotFound },
		run: func(ctx context.Context, name string, args ...string) ([]byte, error) {
			return exec.CommandContext(ctx, name, args...).CombinedOutput()
		},
		memlock: func() (unix.Rlimit, error) { return unix.Rlimit{Cur: 8 << 20, Max: 8 << 20}, nil },
	}
	for _, d := range []string{"proc/self", "proc/net", "proc/sys/net/ipv4/conf/all", "proc/sys/net/ipv4/conf/lo", "sys/class/net", "dev", "lib", "modules"} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, d), 0o755))
	}
	writeFile(t, filepath.Join(h.proc, "self/status"), "Name:\tx\nCapEff:\t0000000000000000\n")
	return h
}

func writeFile(t *testing.T, p, s string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
	require.NoError(t, os.WriteFile(p, []byte(s), 0o644))
}

func TestCheckQEMU(t *testing.T) {
	h := fakeHost(t)
	ctx := context.Background()
	good := fakeQEMU(t, "11.1.3", []string{"vmxnet3", "vfio-user-pci"}, []string{"memory-backend-memfd"})
	r := checkQEMU(ctx, h, good)
	require.Equal(t, statusOK, r.Status, r.Detail)
	require.Contains(t, r.Detail, "QEMU 11.1.3")

	old := fakeQEMU(t, "7.2.19", []string{"vmxnet3", "vfio-pci"}, []string{"memory-backend-memfd"})
	r = checkQEMU(ctx, h, old)
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Detail, "no vfio-user-pci device (older than 10.1)")
	require.Contains(t, r.Fix, "trixie")

	noMemfd := fakeQEMU(t, "10.1.0", []string{"vmxnet3", "vfio-user-pci"}, []string{"memory-backend-file"})
	require.Equal(t, statusFail, checkQEMU(ctx, h, noMemfd).Status)

	r = checkQEMU(ctx, h, "")
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Detail, "no qemu-system-x86_64 on PATH")
	r = checkQEMU(ctx, h, "/nonexistent/qemu")
	require.Equal(t, statusFail, r.Status)
	notQEMU := filepath.Join(t.TempDir(), "true")
	require.NoError(t, os.WriteFile(notQEMU, []byte("#!/bin/sh\necho hello\n"), 0o755))
	require.Contains(t, checkQEMU(ctx, h, notQEMU).Detail, "not a QEMU version line")
}

func TestCheckMemlock(t *testing.T) {
	h := fakeHost(t)
	r := checkMemlock(h, 0)
	require.Equal(t, statusFail, r.Status, "8 MiB, no capabilities")
	require.Contains(t, r.Detail, "8 MiB")
	require.Equal(t, statusOK, checkMemlock(h, 4<<20).Status, "the limit covers --max-locked-memory")
	writeFile(t, filepath.Join(h.proc, "self/status"), "CapEff:\t0000000000004000\n")
	require.Contains(t, checkMemlock(h, 0).Detail, "CAP_IPC_LOCK")
	writeFile(t, filepath.Join(h.proc, "self/status"), "CapEff:\t0000000001000000\n")
	require.Contains(t, checkMemlock(h, 0).Detail, "CAP_SYS_RESOURCE")
	writeFile(t, filepath.Join(h.proc, "self/status"), "CapEff:\t0000000000000000\n")
	h.memlock = func() (unix.Rlimit, error) { return unix.Rlimit{Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY}, nil }
	require.Equal(t, statusOK, checkMemlock(h, 0).Status)
}

func TestCheckSocketDir(t *testing.T) {
	dir := t.TempDir()
	require.Equal(t, statusOK, checkSocketDir(filepath.Join(dir, "pvrdma"), "").Status, "missing, parent writable")
	require.Equal(t, statusOK, checkSocketDir(filepath.Join(dir, "a/b/pvrdma"), "").Status, "missing parents are created")
	notDir := filepath.Join(dir, "file-parent")
	writeFile(t, notDir, "")
	require.Equal(t, statusFail, checkSocketDir(filepath.Join(notDir, "x/pvrdma"), "").Status, "nearest existing ancestor unusable")
	require.NoError(t, os.Chmod(dir, 0o777))
	r := checkSocketDir(dir, "")
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Detail, "other users may write to it")
	require.NoError(t, os.Chmod(dir, 0o750))
	require.Equal(t, statusOK, checkSocketDir(dir, "").Status)
	require.Equal(t, statusFail, checkSocketDir(dir, "no-such-group-pvrdma-test").Status)
	f := filepath.Join(dir, "file")
	writeFile(t, f, "")
	require.Contains(t, checkSocketDir(f, "").Detail, "not a directory")
}

func TestCheckARPIgnoreAndUDP(t *testing.T) {
	h := fakeHost(t)
	conf := filepath.Join(h.proc, "sys/net/ipv4/conf")
	writeFile(t, filepath.Join(conf, "all/arp_ignore"), "0\n")
	writeFile(t, filepath.Join(conf, "lo/arp_ignore"), "0\n")
	writeFile(t, filepath.Join(conf, "fab0/arp_ignore"), "0\n")
	writeFile(t, filepath.Join(conf, "eth0/arp_ignore"), "0\n")
	writeFile(t, filepath.Join(conf, "default/arp_ignore"), "1\n")
	r := checkARPIgnore(h, "fab0")
	require.Equal(t, statusWarn, r.Status)
	require.Contains(t, r.Detail, "arp_ignore is 0 on eth0:", "eth0 answers for the fabric's addresses; lo and fab0 itself do not count")
	writeFile(t, filepath.Join(conf, "eth0/arp_ignore"), "1\n")
	require.Equal(t, statusOK, checkARPIgnore(h, "fab0").Status, "every other interface ignores")
	writeFile(t, filepath.Join(conf, "eth0/arp_ignore"), "0\n")
	writeFile(t, filepath.Join(conf, "all/arp_ignore"), "1\n")
	require.Equal(t, statusOK, checkARPIgnore(h, "fab0").Status, "all=1 is enough")

	// /proc/net/udp with one socket on 0.0.0.0:4791 (0x12B7) and one on 53.
	udp := "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n" +
		"  0: 00000000:12B7 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 1234 2 0000000000000000 0\n" +
		"  1: 0100007F:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 1235 2 0000000000000000 0\n"
	require.Equal(t, 1, countUDPPort([]byte(udp), 4791))
	require.Equal(t, 0, countUDPPort([]byte(udp), 4792))
	writeFile(t, filepath.Join(h.proc, "net/udp"), udp)
	r = checkUDP4791(h, true)
	require.Equal(t, statusFail, r.Status, "IP mode cannot bind 4791")
	require.Contains(t, r.Detail, "1 sockets bound")
	require.Equal(t, statusOK, checkUDP4791(h, false).Status, "L2 mode does not bind UDP")
	writeFile(t, filepath.Join(h.sys, "class/infiniband/rxe0/ports/1/state"), "4: ACTIVE\n")
	require.Contains(t, checkUDP4791(h, false).Detail, "RDMA devices: rxe0")
}

func TestCheckRelayPieces(t *testing.T) {
	h := fakeHost(t)
	require.Equal(t, statusFail, checkLibibverbs(h).Status)
	writeFile(t, filepath.Join(h.libDirs[0], "libibverbs.so.1"), "")
	require.Equal(t, statusOK, checkLibibverbs(h).Status)
	require.Equal(t, statusFail, checkIBDev(h, "").Status)
	require.Equal(t, statusFail, checkIBDev(h, "rxe0").Status)
	writeFile(t, filepath.Join(h.sys, "class/infiniband/rxe0/ports/1/state"), "1: DOWN\n")
	require.Equal(t, statusWarn, checkIBDev(h, "rxe0").Status)
	writeFile(t, filepath.Join(h.sys, "class/infiniband/rxe0/ports/1/state"), "4: ACTIVE\n")
	require.Equal(t, statusOK, checkIBDev(h, "rxe0").Status)

	require.Equal(t, statusWarn, checkRXE(h).Status)
	writeFile(t, filepath.Join(h.modules, h.kernel, "kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz"), "")
	require.Contains(t, checkRXE(h).Detail, "modprobe rdma_rxe")
	require.NoError(t, os.MkdirAll(filepath.Join(h.sys, "module/rdma_rxe"), 0o755))
	require.Contains(t, checkRXE(h).Detail, "loaded")

	require.Equal(t, statusWarn, checkKVM(h).Status)

	r := checkNetCaps(h, true)
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Detail, "CAP_NET_RAW and CAP_NET_ADMIN")
	writeFile(t, filepath.Join(h.proc, "self/status"), "CapEff:\t0000000000002000\n")
	require.Equal(t, statusOK, checkNetCaps(h, false).Status, "L2 mode needs only CAP_NET_RAW")
	require.Equal(t, statusFail, checkNetCaps(h, true).Status)
}

func TestDoctorOutputAndExit(t *testing.T) {
	h := fakeHost(t)
	h.memlock = func() (unix.Rlimit, error) { return unix.Rlimit{Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY}, nil }
	good := fakeQEMU(t, "11.1.3", []string{"vmxnet3", "vfio-user-pci"}, []string{"memory-backend-memfd"})
	res := doctor(context.Background(), h, doctorOpts{qemu: good, socketDir: filepath.Join(t.TempDir(), "s"), transport: "soft"})
	for _, r := range res {
		require.NotEqual(t, statusFail, r.Status, "%+v", r)
	}
	var buf bytes.Buffer
	require.NoError(t, printChecks(&buf, res, true))
	var back []checkResult
	require.NoError(t, json.Unmarshal(buf.Bytes(), &back))
	require.Equal(t, res, back)
	buf.Reset()
	require.NoError(t, printChecks(&buf, []checkResult{fail("x", "do y", "broken")}, false))
	require.Regexp(t, `^FAIL +x +broken\n +fix: do y\n$`, buf.String())

	res = doctor(context.Background(), h, doctorOpts{qemu: good, socketDir: t.TempDir(), transport: "ibverbs", netdev: "a", bridge: "b"})
	var names []string
	for _, r := range res {
		if r.Status == statusFail {
			names = append(names, r.Name)
		}
	}
	require.Equal(t, []string{"fabric", "libibverbs", "rdma-device"}, names)
	res = doctor(context.Background(), h, doctorOpts{qemu: good, socketDir: t.TempDir(), transport: "soft", bridge: "no-such-br0"})
	names = nil
	for _, r := range res {
		if r.Status == statusFail {
			names = append(names, r.Name)
		}
	}
	require.Equal(t, []string{"fabric-bridge", "net-caps"}, names, "a missing bridge, no CAP_NET_RAW")

	// The command exits 1 on a FAIL (no QEMU at the given path).
	var out, errb bytes.Buffer
	rc := run(context.Background(), []string{"doctor", "--qemu", "/nonexistent/qemu", "--json"}, &out, &errb)
	require.Equal(t, 1, rc, errb.String())
	require.Contains(t, errb.String(), "checks failed")
	require.NoError(t, json.Unmarshal(out.Bytes(), &back))
	require.Equal(t, "qemu", back[0].Name)
	require.Equal(t, statusFail, back[0].Status)
}

// libvirtHost is a fake host with libvirt's qemu.conf, the package's group
// and Debian's libvirt-qemu user.
func libvirtHost(t *testing.T, qemuConf, groups string) hostEnv {
	h := fakeHost(t)
	writeFile(t, filepath.Join(h.etc, "libvirt/qemu.conf"), qemuConf)
	writeFile(t, filepath.Join(h.etc, "passwd"), "root:x:0:0:root:/root:/bin/sh\n"+
		"libvirt-qemu:x:64055:108:Libvirt Qemu,,,:/var/lib/libvirt:/usr/sbin/nologin\n"+
		"pvrdma:x:998:998:pvrdma-backend daemon:/nonexistent:/usr/sbin/nologin\n"+
		"vmuser:x:2001:2001::/home/vmuser:/bin/sh\n")
	writeFile(t, filepath.Join(h.etc, "group"), groups)
	return h
}

func TestCheckQEMUGroup(t *testing.T) {
	const conf = "# libvirt's qemu.conf\n#user = \"root\"\n"
	notIn := "root:x:0:\nkvm:x:108:\npvrdma:x:998:\n"
	in := "root:x:0:\nkvm:x:108:\npvrdma:x:998:libvirt-qemu\n"

	h := libvirtHost(t, conf, notIn)
	r := checkQEMUGroup(h, "", nil)
	require.Equal(t, statusFail, r.Status, "%+v", r)
	require.Contains(t, r.Detail, "libvirt-qemu (libvirt's QEMU user) not in group pvrdma")
	require.True(t, strings.HasPrefix(r.Fix, "usermod -aG pvrdma libvirt-qemu;"), r.Fix)
	require.Contains(t, r.Fix, "restart libvirtd")

	h = libvirtHost(t, conf, in)
	r = checkQEMUGroup(h, "", nil)
	require.Equal(t, statusOK, r.Status, "%+v", r)
	require.Contains(t, r.Detail, "libvirt-qemu (libvirt's QEMU user) in group pvrdma")

	// qemu.conf's own user, by name or number; root; the socket group as QEMU's group.
	h = libvirtHost(t, "user = \"vmuser\"  # ours\n", in)
	r = checkQEMUGroup(h, "", nil)
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Fix, "usermod -aG pvrdma vmuser")
	h = libvirtHost(t, "user = \"+2001\"\n", "pvrdma:x:998:vmuser\n")
	require.Equal(t, statusOK, checkQEMUGroup(h, "", nil).Status)
	h = libvirtHost(t, "user = \"root\"\n", notIn)
	require.Equal(t, statusOK, checkQEMUGroup(h, "", nil).Status)
	h = libvirtHost(t, "group = \"pvrdma\"\n", notIn)
	require.Equal(t, statusOK, checkQEMUGroup(h, "", nil).Status)

	// A VM pinned to a user of its own: that user too.
	h = libvirtHost(t, conf, in)
	r = checkQEMUGroup(h, "", []uint32{2001})
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Detail, "vmuser (the user a VM is pinned to (uid 2001)) not in group pvrdma")
	require.Contains(t, r.Fix, "usermod -aG pvrdma vmuser")
	require.NotContains(t, r.Fix, "libvirt-qemu")

	// Another --socket-group; no such group.
	r = checkQEMUGroup(h, "rdmavm", nil)
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Detail, "no group rdmavm")

	// Without libvirt, nothing to check but the group.
	h = libvirtHost(t, conf, notIn)
	require.NoError(t, os.Remove(filepath.Join(h.etc, "libvirt/qemu.conf")))
	r = checkQEMUGroup(h, "", nil)
	require.Equal(t, statusOK, r.Status)
	require.Contains(t, r.Detail, "libvirt is not installed")
}

func TestCheckAppArmor(t *testing.T) {
	h := libvirtHost(t, "", "pvrdma:x:998:libvirt-qemu\n")
	r := checkAppArmor(h, "/run/pvrdma")
	require.Equal(t, statusOK, r.Status, "no AppArmor: %+v", r)
	require.Contains(t, r.Detail, "AppArmor is not enabled")

	require.NoError(t, os.MkdirAll(filepath.Join(h.sys, "kernel/security/apparmor"), 0o755))
	local := filepath.Join(h.etc, "apparmor.d/local/abstractions/libvirt-qemu")
	writeFile(t, local, "# Site-specific additions and overrides for 'abstractions/libvirt-qemu'\n")
	r = checkAppArmor(h, "/run/pvrdma")
	require.Equal(t, statusFail, r.Status, "%+v", r)
	require.Equal(t, `printf '/run/pvrdma/*.sock rw,\n/run/pvrdma/*.qmp rw,\n' >> /etc/apparmor.d/local/abstractions/libvirt-qemu`,
		strings.Split(r.Fix, ";")[0])

	// The fix, as a shell runs it, makes it pass.
	cmd := exec.Command("sh", "-c", strings.Replace(strings.Split(r.Fix, ";")[0], "/etc/", h.etc+"/", 1))
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	r = checkAppArmor(h, "/run/pvrdma")
	require.Equal(t, statusOK, r.Status, "%+v", r)

	// Only the socket: still missing the QMP socket.
	writeFile(t, local, "/run/pvrdma/*.sock rw,\n")
	require.Equal(t, statusFail, checkAppArmor(h, "/run/pvrdma").Status)
	// Wider rules in the abstraction itself count.
	writeFile(t, filepath.Join(h.etc, "apparmor.d/abstractions/libvirt-qemu"), "  owner /run/pvrdma/** rwk,\n")
	require.Equal(t, statusOK, checkAppArmor(h, "/run/pvrdma").Status)
	require.Equal(t, statusFail, checkAppArmor(h, "/srv/pvrdma").Status, "another socket directory")

	// libvirt's security driver off: AppArmor does not confine QEMU.
	writeFile(t, filepath.Join(h.etc, "libvirt/qemu.conf"), "security_driver = \"none\"\n")
	r = checkAppArmor(h, "/srv/pvrdma")
	require.Equal(t, statusOK, r.Status)
	require.Contains(t, r.Detail, "security_driver is none")
	writeFile(t, filepath.Join(h.etc, "libvirt/qemu.conf"), "security_driver = [ \"apparmor\" ]\n")
	require.Equal(t, statusFail, checkAppArmor(h, "/srv/pvrdma").Status)
}

func TestAppArmorGlob(t *testing.T) {
	for _, c := range []struct {
		glob, path string
		match      bool
	}{
		{"/run/pvrdma/*.sock", "/run/pvrdma/vm.sock", true},
		{"/run/pvrdma/*.sock", "/run/pvrdma/state/vm.sock", false},
		{"/run/pvrdma/**", "/run/pvrdma/state/vm.sock", true},
		{"/run/pvrdma/*.{sock,qmp}", "/run/pvrdma/vm.qmp", true},
		{"/run/pvrdma/vm?.sock", "/run/pvrdma/vm1.sock", true},
		{"/{,var/}run/pvrdma/*", "/run/pvrdma/vm.sock", true},
	} {
		re, err := appArmorGlob(c.glob)
		require.NoError(t, err)
		require.Equal(t, c.match, re.MatchString(c.path), "%s ~ %s", c.glob, c.path)
	}
}
