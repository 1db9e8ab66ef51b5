//go:build vm

package packaging

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// quickStartLines returns every command line of README's numbered quick start, in order,
// each with its step (as readmeQuickStart reads them).
func quickStartLines(t *testing.T) []quickStartLine {
	t.Helper()
	s := readme(t)
	loc := quickStartHeadRE.FindStringIndex(s)
	require.NotNil(t, loc, "README.md has no \"## Quick start\" section")
	sec := s[loc[1]:]
	if next := nextHeadRE.FindStringIndex(sec); next != nil {
		sec = sec[:next[0]]
	}
	var lines []quickStartLine
	for _, m := range fenceRE.FindAllStringSubmatchIndex(sec, -1) {
		step := 0
		for _, sm := range numberedStepRE.FindAllStringSubmatch(sec[:m[0]], -1) {
			step, _ = strconv.Atoi(sm[1])
		}
		for _, l := range strings.Split(sec[m[2]:m[3]], "\n") {
			l = strings.TrimSpace(l)
			if c := commentRE.FindStringIndex(l); c != nil && strings.Count(l[:c[0]], `"`)%2 == 0 && strings.Count(l[:c[0]], `'`)%2 == 0 {
				l = strings.TrimSpace(l[:c[0]])
			}
			if l != "" {
				lines = append(lines, quickStartLine{text: l, step: step})
			}
		}
	}
	return lines
}

// qsFinder finds README's quick-start commands in order: each find starts after the
// line the previous one found, so the commands must come in the order the test runs
// them, and each must be in the step the test expects.
type qsFinder struct {
	t     *testing.T
	lines []quickStartLine
	next  int
}

func (f *qsFinder) find(step int, prefix string) string {
	f.t.Helper()
	for i := f.next; i < len(f.lines); i++ {
		if strings.HasPrefix(f.lines[i].text, prefix) {
			require.Equal(f.t, step, f.lines[i].step, "README's %q is in step %d, not %d", f.lines[i].text, f.lines[i].step, step)
			f.next = i + 1
			return f.lines[i].text
		}
	}
	f.t.Fatalf("README's quick start has no command starting with %q after %q", prefix, f.lines[max(f.next-1, 0)].text)
	return ""
}

// readmeLibvirtScript runs README's quick start on the host as an operator would, in a
// private mount and network namespace so that the host's files and network are not
// touched: /etc is an overlay (what the package, usermod, printf and qemu.conf write
// lands in memory), libvirt's state and /run/pvrdma are tmpfs, and br0 is made in the
// namespace. $1 is the directory with the step scripts (README's lines, one file each:
// qs-*.sh) and where each step's output goes (steps.out), $2 the unpacked package, $3
// the existing domain's XML (no device), $4 the directory for the console, libvirt's
// QEMU log and QEMU's pid. Each step's output is bracketed as pkgScript's is.
const readmeLibvirtScript = `set -u
qs=$1 pkg=$2 existing=$3 out=$4
export PATH=$pkg/usr/bin:$PATH LIBVIRT_DEFAULT_URI=qemu:///system
step() {
	n=$1; shift; s=$(date +%s)
	echo "=== $n" >> "$qs"/steps.out; "$@" >> "$qs"/steps.out 2>&1; rc=$?
	echo "(step $n took $(( $(date +%s) - s ))s)" >> "$qs"/steps.out; echo "=== rc $rc" >> "$qs"/steps.out
}
T=$(mktemp -d)
mount -t tmpfs tmpfs "$T" && mkdir "$T"/upper "$T"/work || exit 1
mount -t overlay overlay -o lowerdir=/etc,upperdir="$T"/upper,workdir="$T"/work /etc || exit 1
for d in /run/libvirt /var/lib/libvirt /var/cache/libvirt /run/pvrdma; do
	mount -t tmpfs -o mode=0755 tmpfs "$d" || exit 1
done
mkdir -p "$out"/varlog && mount --bind "$out"/varlog /var/log/libvirt || exit 1
ip link set lo up
# The namespace's own sysfs (its netdevs, br0 among them), the cgroup hierarchies kept.
mkdir "$T"/cg && mount --rbind /sys/fs/cgroup "$T"/cg && mount -t sysfs sysfs /sys && mount --move "$T"/cg /sys/fs/cgroup || exit 1
# libvirt as Debian's libvirt-daemon-system leaves it: its own user for QEMU; the test bed's
# paths need no relabelling (dynamic_ownership off), and no systemd places the domains.
getent passwd libvirt-qemu >/dev/null || useradd --system --user-group --no-create-home --home-dir /var/lib/libvirt --shell /usr/sbin/nologin libvirt-qemu
mkdir -p /etc/libvirt/hooks/qemu.d
cat > /etc/libvirt/qemu.conf <<'EOC'
user = "libvirt-qemu"
group = "libvirt-qemu"
dynamic_ownership = 0
remember_owner = 0
cgroup_controllers = [ "cpuacct" ]
namespaces = [ ]
stdio_handler = "file"
EOC
cat > /etc/libvirt/libvirtd.conf <<'EOC'
unix_sock_rw_perms = "0700"
auth_unix_rw = "none"
log_outputs = "3:stderr"
EOC
cd "$qs"/cwd
# Step 2, the package: what its files and its postinst put on the host (the daemon's
# user and the socket group; the hook runs the unpacked binary).
step package sh -c 'cp "$0"/etc/default/pvrdma-backend /etc/default/pvrdma-backend &&
	printf "#!/bin/sh\nexec %s libvirt-hook \"\$@\"\n" "$0"/usr/bin/pvrdma-backend > /etc/libvirt/hooks/qemu.d/pvrdma-backend &&
	chmod 0755 /etc/libvirt/hooks/qemu.d/pvrdma-backend &&
	groupadd --system pvrdma && useradd --system --gid pvrdma --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin pvrdma' "$pkg"
# The domain that existed before: defined by libvirtd, which the operator restarts in step 5.
libvirtd -p /run/libvirt/libvirtd.pid 2>"$out"/libvirtd.log &
lv=$!
i=0
until [ -S /run/libvirt/libvirt-sock ]; do
	i=$((i+1)); [ $i -lt 300 ] || { echo "libvirtd did not start"; cat "$out"/libvirtd.log; exit 1; }
	sleep 0.1
done
step existing virsh define "$existing"
# Step 3.
step bridge sh -e "$qs"/qs-bridge.sh
step doctor-before sh "$qs"/qs-doctor.sh
# Step 4: PVRDMA_OPTS in /etc/default, the service (re)started as its unit starts it.
step opts sh -c 'grep -v "^PVRDMA_OPTS=" /etc/default/pvrdma-backend > /tmp/default.$$ && cat "$0" >> /tmp/default.$$ && cat /tmp/default.$$ > /etc/default/pvrdma-backend' "$qs"/qs-opts
. /etc/default/pvrdma-backend
pvrdma-backend serve --socket-dir /run/pvrdma --socket-group pvrdma $PVRDMA_OPTS > "$out"/daemon.log 2>&1 &
daemon=$!
i=0
until pvrdma-backend status >/dev/null 2>&1; do
	i=$((i+1)); [ $i -lt 300 ] || { echo "the daemon did not start"; cat "$out"/daemon.log; exit 1; }
	sleep 0.1
done
step status sh -e "$qs"/qs-status.sh
# Step 5: the socket group, AppArmor where it confines QEMU, libvirtd restarted.
step usermod sh -e "$qs"/qs-usermod.sh
if [ -d /sys/kernel/security/apparmor ]; then step apparmor sh -e "$qs"/qs-apparmor.sh; fi
kill $lv; wait $lv 2>/dev/null
libvirtd -p /run/libvirt/libvirtd.pid 2>>"$out"/libvirtd.log &
lv=$!
i=0
until virsh list --all >/dev/null 2>&1; do
	i=$((i+1)); [ $i -lt 300 ] || { echo "libvirtd did not restart"; cat "$out"/libvirtd.log; exit 1; }
	sleep 0.1
done
step doctor-after sh "$qs"/qs-doctor2.sh
step dumpxml sh -e "$qs"/qs-dumpxml.sh
step libvirt-xml sh -e "$qs"/qs-libvirt-xml.sh
: > "$out"/console.log
chmod 0666 "$out"/console.log
tail -n +1 -F "$out"/console.log 2>/dev/null &
tailer=$!
step start sh -e "$qs"/qs-start.sh
cat /run/libvirt/qemu/vm1.pid > "$out"/qemu.pid 2>/dev/null
step qemu-cred sh -c 'grep -E "^(Uid|Gid|Groups):" /proc/$(cat "$0"/qemu.pid)/status' "$out"
while virsh domstate vm1 2>/dev/null | grep -q running; do sleep 0.5; done
step status-end pvrdma-backend status
sleep 0.2
kill $daemon $lv $tailer 2>/dev/null
wait $daemon $lv 2>/dev/null
exit 0
`

// TestReadmeLibvirtQuickStart runs README's quick start, steps 2 to 6, as written and in
// README's order, on a host with libvirt, in a private mount and network namespace: the
// package's files and what its postinst does, the bridge and `doctor`, README's
// PVRDMA_OPTS and the daemon as the unit starts it, `status`; then the socket group
// (`usermod`), AppArmor where the host has it, libvirtd restarted with QEMU running as
// libvirt-qemu (not root), `doctor` again; then a domain that existed before the
// device (a test-bed guest, with a balloon of its own) dumped, given the device by
// `libvirt-xml --domain`, defined and started; in the guest, README's `modprobe
// vmw_pvrdma` and `ibv_devinfo`, the vmxnet3 with the address PVRDMA_OPTS assigns, and
// the driver build's kernel version. doctor must FAIL on the socket group with the fix
// before usermod and pass it after; the daemon must admit libvirt-qemu's QEMU through the
// group. What is not run as written: `apt install` (the package is unpacked, its postinst's
// user and group made; the guest has no apt, its driver is built as README builds it by
// the test bed), and `systemctl restart` (the test starts the daemon with the unit's
// command line and restarts libvirtd itself).
func TestReadmeLibvirtQuickStart(t *testing.T) {
	for _, tool := range []string{"libvirtd", "virsh", "unshare", "dpkg-deb", "useradd", "usermod", "groupadd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing: scripts/deps.sh installs libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients, passwd", tool)
		}
	}
	lines := quickStartLines(t)
	f := &qsFinder{t: t, lines: lines}
	install := f.find(2, "apt install ./")
	bridge := f.find(3, "ip link add br0")
	doctor := f.find(3, "pvrdma-backend doctor")
	opts := f.find(4, "PVRDMA_OPTS=")
	restart := f.find(4, "systemctl restart pvrdma-backend")
	status := f.find(4, "pvrdma-backend status")
	usermod := f.find(5, "usermod -aG pvrdma libvirt-qemu")
	apparmor := f.find(5, "printf '/run/pvrdma/*.sock rw,")
	restartLibvirt := f.find(5, "systemctl restart libvirtd")
	doctor2 := f.find(5, "pvrdma-backend doctor")
	dumpxml := f.find(5, "virsh dumpxml --inactive vm1 > ")
	libvirtXML := f.find(5, "pvrdma-backend libvirt-xml --domain ")
	start := f.find(5, "virsh define ")
	modprobe := f.find(6, "modprobe vmw_pvrdma")
	devinfo := f.find(6, "ibv_devinfo")
	kver := f.find(6, "v=$(uname -r")
	t.Logf("README's quick start, as run: %q", []string{install, bridge, doctor, opts, restart, status, usermod, apparmor,
		restartLibvirt, doctor2, dumpxml, libvirtXML, start, modprobe, devinfo, kver})
	require.Contains(t, start, "virsh start vm1")
	optsCfg := quickStart{opts: quickStartLine{text: opts}}.parseOpts(t)
	var vm1 *backend.VMRequest
	for i := range optsCfg.vms {
		if optsCfg.vms[i].Name == "vm1" {
			vm1 = &optsCfg.vms[i]
		}
	}
	require.NotNil(t, vm1, "README's PVRDMA_OPTS registers vm1")
	require.Len(t, vm1.GIDAllow, 1)
	vm1Addr, _, _ := strings.Cut(vm1.GIDAllow[0], "/")

	img, err := vm.EnsureImage(context.Background(), t.Logf)
	require.NoError(t, err)
	// The package, unpacked: its binary, hook and /etc/default file.
	work := t.TempDir()
	require.NoError(t, os.Chmod(work, 0o755)) // QEMU, as libvirt-qemu, reads the wrapper and writes the console here
	require.NoError(t, os.Chmod(filepath.Dir(work), 0o755))
	deb := filepath.Join(work, "pvrdma-backend.deb")
	require.NoError(t, os.WriteFile(deb, builtDeb(t), 0o644))
	pkg := filepath.Join(work, "pkg")
	out, err := exec.Command("dpkg-deb", "-x", deb, pkg).CombinedOutput()
	require.NoError(t, err, "dpkg-deb -x: %s", out)
	emulator := filepath.Join(work, "qemu-system-x86_64")
	require.NoError(t, img.WriteQEMUWrapper(emulator))

	qs := filepath.Join(work, "qs")
	require.NoError(t, os.MkdirAll(filepath.Join(qs, "cwd"), 0o755))
	lock := ""
	if !vm.CanRaiseMemlock() {
		// This sandbox cannot raise QEMU's RLIMIT_MEMLOCK, which <locked/> needs.
		lock = " --lock=false"
		t.Logf("no CAP_SYS_RESOURCE here: libvirt-xml is run with --lock=false")
	}
	for name, line := range map[string]string{"bridge": bridge, "doctor": doctor, "status": status, "usermod": usermod,
		"apparmor": apparmor, "doctor2": doctor2, "dumpxml": dumpxml, "libvirt-xml": libvirtXML + lock, "start": start} {
		require.NoError(t, os.WriteFile(filepath.Join(qs, "qs-"+name+".sh"), []byte(line+"\n"), 0o755))
	}
	require.NoError(t, os.WriteFile(filepath.Join(qs, "qs-opts"), []byte(opts+"\n"), 0o644))
	logs := filepath.Join(work, "logs")
	require.NoError(t, os.Mkdir(logs, 0o755))
	script := filepath.Join(work, "readme.sh")
	require.NoError(t, os.WriteFile(script, []byte(readmeLibvirtScript), 0o755))
	// Mount points the namespace's tmpfs mounts need on the host; /run/pvrdma is removed
	// afterwards if the test made it.
	for _, d := range []string{"/run/libvirt", "/var/lib/libvirt", "/var/log/libvirt", "/var/cache/libvirt"} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	if _, err := os.Stat("/run/pvrdma"); os.IsNotExist(err) {
		require.NoError(t, os.Mkdir("/run/pvrdma", 0o755))
		t.Cleanup(func() { _ = os.Remove("/run/pvrdma") })
	}
	t.Cleanup(func() { // libvirt daemonizes QEMU out of the launcher's process group
		if b, err := os.ReadFile(filepath.Join(logs, "qemu.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	require.NoError(t, vm.CleanupMachineCgroups(t))

	cfg := vm.Config{
		Name:    "vm1",
		NICs:    []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: backend.DefaultMAC("vm1").String(), IP: vm1Addr + "/24"}},
		Modules: []string{"ib_core", "ib_uverbs"}, // README's modprobe loads the driver
		Scenario: fmt.Sprintf(`
%s
%s -v
cat /sys/class/infiniband/vmw_pvrdma0/ports/1/state
g=$(pvt_gid_index vmw_pvrdma0 %s)
echo "gid index of %s: $g"
ibv_rc_pingpong -d vmw_pvrdma0 -g $g -n 100 -s 4096 > /tmp/server.log 2>&1 &
sleep 1
pvt_retry 5 ibv_rc_pingpong -d vmw_pvrdma0 -g $g -n 100 -s 4096 127.0.0.1
wait
cat /tmp/server.log
%s
echo "kernel source version: $v"
`, modprobe, devinfo, vm1Addr, vm1Addr, kver),
		// The host's steps come before QEMU starts, and the guest boots under TCG.
		BootTimeout: 10 * time.Minute,
		Timeout:     20 * time.Minute,
		Launch: func(b vm.Boot) (*exec.Cmd, error) {
			// QEMU runs as libvirt-qemu: it must reach the result socket.
			if err := os.Chmod(filepath.Dir(b.ResultSocket), 0o755); err != nil {
				return nil, err
			}
			if err := os.Chmod(b.ResultSocket, 0o666); err != nil {
				return nil, err
			}
			existing := fmt.Sprintf(`<domain type='qemu'>
  <name>vm1</name>
  <memory unit='MiB'>%d</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>%s</kernel>
    <initrd>%s</initrd>
    <cmdline>%s</cmdline>
  </os>
  <features>
    <acpi/>
  </features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>%s</emulator>
    <serial type='file'><source path='%s'/><target port='0'/></serial>
    <serial type='unix'><source mode='connect' path='%s'/><target port='1'/></serial>
    <memballoon model='virtio'/>
  </devices>
</domain>
`, b.MemMiB, b.Kernel, b.Initrd, xmlAttr(b.Append), emulator, filepath.Join(logs, "console.log"), b.ResultSocket)
			path := filepath.Join(work, "existing.xml")
			if err := os.WriteFile(path, []byte(existing), 0o644); err != nil {
				return nil, err
			}
			for _, p := range []string{b.Kernel, b.Initrd} {
				if err := readableBy(p); err != nil {
					return nil, err
				}
			}
			return exec.Command("unshare", "--mount", "--net", "--propagation", "private", "sh", script, qs, pkg, path, logs), nil
		},
	}
	g, err := vm.Start(context.Background(), t, img, nil, cfg)
	require.NoError(t, err)
	res, gerr := g.WaitOK(context.Background())
	raw, _ := os.ReadFile(filepath.Join(qs, "steps.out"))
	t.Logf("README's steps on the host:\n%s", raw)
	if gerr != nil {
		t.Logf("the guest: %v\n%s\nconsole:\n%s", gerr, res.Output, tail(g.Console(), 4000))
	}
	for _, l := range []string{"daemon.log", "varlog/qemu/vm1.log", "libvirtd.log"} {
		if b, err := os.ReadFile(filepath.Join(logs, l)); err == nil {
			t.Logf("%s:\n%s", l, tail(string(b), 6000))
		}
	}
	steps := parseSteps(string(raw))
	ok := func(name string) string {
		t.Helper()
		s, found := steps[name]
		require.True(t, found, "step %s did not run", name)
		require.Equal(t, "0", s.rc, "step %s failed:\n%s", name, s.out)
		return s.out
	}
	ok("package")
	ok("existing")
	ok("bridge")
	// doctor before the socket group: FAIL with the fix; after: OK.
	before := steps["doctor-before"].out
	assert.Regexp(t, `(?m)^FAIL +qemu-group +libvirt-qemu \(libvirt's QEMU user\) not in group pvrdma`, before)
	assert.Regexp(t, `(?m)^ +fix: usermod -aG pvrdma libvirt-qemu;`, before)
	assert.Regexp(t, `(?m)^OK +fabric-bridge +br0 `, before)
	assert.Regexp(t, `(?m)^OK +libvirt-hook `, before)
	ok("status")
	assert.Contains(t, steps["status"].out, "fabric l2 br0")
	ok("usermod")
	after := steps["doctor-after"].out
	assert.Regexp(t, `(?m)^OK +qemu-group +libvirt-qemu \(libvirt's QEMU user\) in group pvrdma`, after)
	assert.Regexp(t, `(?m)^OK +apparmor `, after)
	ok("dumpxml")
	ok("libvirt-xml")
	ok("start")
	cred := ok("qemu-cred")
	t.Logf("libvirt's QEMU:\n%s", cred)
	assert.NotRegexp(t, `(?m)^Uid:\s+0\s`, cred, "QEMU does not run as root")
	xml, err := os.ReadFile(filepath.Join(qs, "cwd", "vm1-pvrdma.xml"))
	require.NoError(t, err)
	assert.Contains(t, string(xml), "<memballoon model='none'/>", "the existing domain's balloon is gone")
	require.NoError(t, gerr, "the guest:\n%s", res.Output)
	assert.Contains(t, res.Output, "hca_id:\tvmw_pvrdma0")
	assert.Regexp(t, regexp.MustCompile(`state:\s+PORT_ACTIVE \(4\)`), res.Output)
	assert.Regexp(t, `gid index of `+regexp.QuoteMeta(vm1Addr)+`: [1-9]`, res.Output, "the address PVRDMA_OPTS assigns is the guest's GID")
	assert.Regexp(t, regexp.MustCompile(`(?m)^\s*819200 bytes in .* seconds = .*Mbit/sec`), res.Output)
	assert.Contains(t, res.Output, "kernel source version: 6.1\n", "README's driver build takes linux-source-6.1 on the test bed's Debian 12 kernel")
	end := ok("status-end")
	assert.Regexp(t, `(?m)^vm1 +`, end)
	assert.Contains(t, end, "vm1: identity: ")
}

// xmlAttr escapes s for XML element text.
func xmlAttr(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", "'", "&apos;").Replace(s)
}

// readableBy makes sure a user other than root can read path (a file of the test's
// own boot, or of the test bed's cache, whose files are readable already): the file
// readable by others and every directory above it searchable.
func readableBy(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Mode().Perm()&0o004 == 0 {
		if err := os.Chmod(path, fi.Mode().Perm()|0o004); err != nil {
			return err
		}
	}
	for d := filepath.Dir(path); d != "/"; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(d, fi.Mode().Perm()|0o011); err != nil {
				return err
			}
		}
	}
	return nil
}
