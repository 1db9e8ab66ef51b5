//go:build vm

package e2e

import (
	"context"
	"encoding/binary"
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

// libvirtScript runs Debian's libvirtd for one transient domain in a private mount
// namespace (tmpfs over libvirt's config, state, log and cache directories, and a
// libvirt-qemu user added to a private copy of /etc/passwd), so the host's files are
// never touched: QEMU runs as root, without namespaces or a security driver, in the machine
// cgroup libvirt makes for the domain (cgroup_controllers = [ "cpuacct" ]: accounting only,
// nothing that schedules or limits it; with no systemd here, libvirt's own layout,
// /machine/qemu-<id>-<name>.libvirt-qemu, on the unified hierarchy if it has a controller,
// else on cpuacct's v1 hierarchy).
// $1 is the domain XML, $2 the domain's name, $3 a host directory for the console log,
// libvirt's QEMU log and QEMU's PID, $4 the pvrdma-backend binary whose libvirt hook is
// installed as /etc/libvirt/hooks/qemu.d/pvrdma-backend (the package's hook runs
// /usr/bin/pvrdma-backend), $5 a save image of a domain with the device. Once the
// domain runs, the script tries to save it (the daemon's QMP monitor must cancel that)
// and to restore $5 (the hook must refuse it), logging both to $3.
const libvirtScript = `set -eu
xml=$1 name=$2 out=$3 bin=$4 image=$5
T=$(mktemp -d)
cp /etc/passwd /etc/group "$T"/
grep -q '^libvirt-qemu:' "$T"/passwd || echo 'libvirt-qemu:x:64055:64055:libvirt:/var/lib/libvirt:/usr/sbin/nologin' >> "$T"/passwd
grep -q '^libvirt-qemu:' "$T"/group || echo 'libvirt-qemu:x:64055:' >> "$T"/group
mount --bind "$T"/passwd /etc/passwd
mount --bind "$T"/group /etc/group
for d in /etc/libvirt /run/libvirt /var/lib/libvirt /var/log/libvirt /var/cache/libvirt; do
	mount -t tmpfs -o mode=0755 tmpfs "$d"
done
cat > /etc/libvirt/qemu.conf <<'EOC'
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ "cpuacct" ]
namespaces = [ ]
stdio_handler = "file"
EOC
mkdir -p /etc/libvirt/hooks/qemu.d
printf '#!/bin/sh\nexec %s libvirt-hook "$@"\n' "$bin" > /etc/libvirt/hooks/qemu.d/pvrdma-backend
chmod 0755 /etc/libvirt/hooks/qemu.d/pvrdma-backend
cat > /etc/libvirt/libvirtd.conf <<'EOC'
unix_sock_rw_perms = "0700"
auth_unix_rw = "none"
log_outputs = "3:stderr"
EOC
libvirtd -p /run/libvirt/libvirtd.pid 2>"$out"/libvirtd.log &
lv=$!
i=0
until [ -S /run/libvirt/libvirt-sock ]; do
	i=$((i+1)); [ $i -lt 300 ] || { echo "libvirtd did not start"; cat "$out"/libvirtd.log; exit 1; }
	sleep 0.1
done
libvirtd --version
: > "$out"/console.log
tail -n +1 -F "$out"/console.log 2>/dev/null &
tailer=$!
rc=0
virsh -c qemu:///system create "$xml" || rc=$?
if [ $rc -eq 0 ]; then
	cat /run/libvirt/qemu/"$name".pid > "$out"/qemu.pid
	echo "libvirt: domain $name running, QEMU pid $(cat "$out"/qemu.pid)"
	src=0; virsh -c qemu:///system save "$name" "$out"/saved.img > "$out"/save.log 2>&1 || src=$?
	echo "rc=$src" >> "$out"/save.log
	rrc=0; virsh -c qemu:///system restore "$image" > "$out"/restore.log 2>&1 || rrc=$?
	echo "rc=$rrc" >> "$out"/restore.log
	while virsh -c qemu:///system domstate "$name" 2>/dev/null | grep -q running; do sleep 0.5; done
fi
cp /var/log/libvirt/qemu/"$name".log "$out"/qemu.log 2>/dev/null || true
sleep 0.2
kill $tailer $lv 2>/dev/null || true
wait $lv 2>/dev/null || true
exit $rc
`

// TestLibvirtDomain: the domain `pvrdma-backend libvirt-xml` prints, started by
// Debian 12's libvirt with the test bed's QEMU 11 as its emulator (only the boot files
// and serial ports of the test bed added), gives a stock guest our device with its
// port ACTIVE, and verbs work through it. libvirt puts the QEMU in the domain's machine
// cgroup, and the daemon admits it through that cgroup (issue 23: the VM is registered
// without a uid, yet no other libvirt domain's QEMU could connect as it).
func TestLibvirtDomain(t *testing.T) {
	for _, tool := range []string{"libvirtd", "virsh", "virt-xml-validate", "unshare"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing: scripts/deps.sh installs libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients, libxml2-utils", tool)
		}
	}
	img := image(t)
	// libvirt's directories must exist on the host for the namespace's tmpfs mounts.
	for _, d := range []string{"/etc/libvirt", "/run/libvirt", "/var/lib/libvirt", "/var/log/libvirt", "/var/cache/libvirt"} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	require.NoError(t, vm.CleanupMachineCgroups(t))
	work := t.TempDir()
	sockDir := filepath.Join(work, "sock")
	d := daemon(t, backend.Config{SocketDir: sockDir})
	bin := buildDaemon(t)
	emulator := filepath.Join(work, "qemu-system-x86_64")
	require.NoError(t, img.WriteQEMUWrapper(emulator))

	// doctor, given the test bed's QEMU, finds what the VM needs.
	out, _ := exec.Command(bin, "doctor", "--qemu", emulator, "--socket-dir", sockDir).CombinedOutput() // exit status: the host may lack pieces the VM test does not need
	t.Logf("pvrdma-backend doctor --qemu %s:\n%s", emulator, out)
	require.Regexp(t, `(?m)^OK +qemu +QEMU 1\d\.\d+\.\d+ at .*, with vfio-user-pci, vmxnet3 and memory-backend-memfd$`, string(out))
	require.Regexp(t, `(?m)^OK +memfd-seal `, string(out))

	const name = "lv1"
	out, err := exec.Command(bin, "libvirt-xml", "--vm", name, "--socket-dir", sockDir, "--mem", "512M",
		"--domain-type", "qemu", "--nic", "user", "--emulator", emulator, "--lock="+strconv.FormatBool(vm.CanRaiseMemlock())).CombinedOutput()
	require.NoError(t, err, "libvirt-xml: %s", out)
	domain := string(out)
	t.Logf("pvrdma-backend libvirt-xml:\n%s", domain)
	validate := func(path string) {
		out, err := exec.Command("virt-xml-validate", path, "domain").CombinedOutput()
		require.NoError(t, err, "virt-xml-validate: %s", out)
		t.Logf("virt-xml-validate: %s", strings.TrimSpace(string(out)))
	}
	require.NoError(t, os.WriteFile(filepath.Join(work, "printed.xml"), out, 0o644))
	validate(filepath.Join(work, "printed.xml"))

	// A save image of the same domain under another name, as `virsh save`
	// writes it (libvirt's header, then the domain XML): its restore must
	// be refused by the hook.
	image := filepath.Join(work, "lv1-saved.img")
	require.NoError(t, os.WriteFile(image, libvirtSaveImage(strings.Replace(domain, "<name>lv1</name>", "<name>lv1-saved</name>", 1)), 0o644))

	script := filepath.Join(work, "libvirt.sh")
	require.NoError(t, os.WriteFile(script, []byte(libvirtScript), 0o755))
	logs := filepath.Join(work, "logs")
	require.NoError(t, os.Mkdir(logs, 0o755))
	t.Cleanup(func() { // libvirt daemonizes QEMU out of the launcher's process group
		if b, err := os.ReadFile(filepath.Join(logs, "qemu.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	cfg := vm.Config{
		Name: name,
		NICs: []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: backend.DefaultMAC(name).String(), IP: "10.0.2.15/24"}},
		Scenario: `
ibv_devinfo -v
cat /sys/class/infiniband/vmw_pvrdma0/ports/1/state
ibv_rc_pingpong -d vmw_pvrdma0 -g 1 -n 100 -s 4096 > /tmp/server.log 2>&1 &
sleep 1
pvt_retry 5 ibv_rc_pingpong -d vmw_pvrdma0 -g 1 -n 100 -s 4096 127.0.0.1
wait
cat /tmp/server.log
`,
		Launch: func(b vm.Boot) (*exec.Cmd, error) {
			x := strings.Replace(domain, "</os>", fmt.Sprintf(
				"  <kernel>%s</kernel>\n    <initrd>%s</initrd>\n    <cmdline>%s</cmdline>\n  </os>\n"+
					"  <on_poweroff>destroy</on_poweroff>\n  <on_reboot>destroy</on_reboot>\n  <on_crash>destroy</on_crash>",
				b.Kernel, b.Initrd, b.Append), 1)
			x = strings.Replace(x, "</devices>", fmt.Sprintf(
				"  <serial type='file'><source path='%s'/><target port='0'/></serial>\n"+
					"    <serial type='unix'><source mode='connect' path='%s'/><target port='1'/></serial>\n  </devices>",
				filepath.Join(logs, "console.log"), b.ResultSocket), 1)
			path := filepath.Join(work, "domain.xml")
			if err := os.WriteFile(path, []byte(x), 0o644); err != nil {
				return nil, err
			}
			validate(path)
			return exec.Command("unshare", "--mount", "--propagation", "private", "sh", script, path, name, logs, bin, image), nil
		},
	}
	ctx := context.Background()
	g, err := vm.Start(ctx, t, img, nil, cfg)
	require.NoError(t, err)
	assert.Eventually(t, func() bool {
		for _, v := range d.Status().VMs {
			if v.Name == name && v.QMP == backend.QMPVerified {
				return true
			}
		}
		return false
	}, 3*time.Minute, 50*time.Millisecond, "libvirt's QEMU connected the daemon's QMP monitor")
	// The QEMU's cgroups, and the identity the daemon admitted it with.
	if b, err := os.ReadFile(filepath.Join(logs, "qemu.pid")); err == nil {
		cg, _ := os.ReadFile("/proc/" + strings.TrimSpace(string(b)) + "/cgroup")
		t.Logf("libvirt's QEMU (pid %s) is in:\n%s", strings.TrimSpace(string(b)), cg)
	}
	st := d.Status()
	for _, v := range st.VMs {
		if v.Name == name {
			if !assert.Regexp(t, `^`+backend.IdentityLibvirtMachine+` qemu-[1-9][0-9]*-lv1$`, v.Identity,
				"the daemon admitted libvirt's QEMU through its machine cgroup") {
				lvlog, _ := os.ReadFile(filepath.Join(logs, "libvirtd.log"))
				for _, l := range strings.Split(string(lvlog), "\n") {
					if strings.Contains(strings.ToLower(l), "cgroup") {
						t.Logf("libvirtd: %s", l)
					}
				}
			}
		}
	}
	assert.Zero(t, st.Counters["refused_peers"], "no peer refused")
	res, err := g.WaitOK(ctx)
	if qlog, rerr := os.ReadFile(filepath.Join(logs, "qemu.log")); rerr == nil {
		t.Logf("libvirt's QEMU log (its command line):\n%s", qlog)
	}
	require.NoError(t, err)
	require.Contains(t, res.Output, "hca_id:\tvmw_pvrdma0")
	require.Regexp(t, regexp.MustCompile(`state:\s+PORT_ACTIVE \(4\)`), res.Output)
	require.Regexp(t, regexp.MustCompile(`(?m)^\s*819200 bytes in .* seconds = .*Mbit/sec`), res.Output)

	// virsh save: libvirt runs no hook on the source of a save; the
	// daemon's monitor must cancel the migration libvirt starts, the save
	// fail and the guest run on. Debian 12's libvirt 9.0 cannot start a
	// migration on QEMU 11 at all (it passes `migrate` the "detach"
	// argument QEMU removed), which this checks for: then nothing reached
	// the guard. A libvirt that can migrate must meet the guard.
	save, err := os.ReadFile(filepath.Join(logs, "save.log"))
	require.NoError(t, err)
	t.Logf("virsh save:\n%s", save)
	require.NotContains(t, string(save), "rc=0", "virsh save of a domain with the device succeeded")
	cancelled := uint64(1)
	if strings.Contains(string(save), "Parameter 'detach' is unexpected") {
		t.Logf("this libvirt cannot save or migrate a domain on QEMU 11 (migrate's detach argument): the guard was not reached")
		cancelled = 0
	} else {
		require.Contains(t, string(save), "cancel")
	}
	for _, v := range d.Status().VMs {
		if v.Name == name {
			require.Equal(t, cancelled, v.MigrationsCancelled)
		}
	}
	// virsh restore: the hook refused it with its reason.
	restore, err := os.ReadFile(filepath.Join(logs, "restore.log"))
	require.NoError(t, err)
	t.Logf("virsh restore:\n%s", restore)
	require.NotContains(t, string(restore), "rc=0")
	require.Contains(t, string(restore), `refused to restore domain "lv1-saved": it has a PVRDMA device (vfio-user-pci, socket `+filepath.Join(sockDir, name+".sock"))
}

// libvirtSaveImage is the start of a libvirt save image of a domain
// (src/qemu/qemu_saveimage.h: the magic, version 2, the XML's length with
// its NUL, was_running, format 0 (raw), no cookie, 14 unused words; then
// the XML) with no QEMU migration stream behind it: enough for libvirt to
// read the domain and run the restore hook.
func libvirtSaveImage(domainXML string) []byte {
	b := []byte("LibvirtQemudSave")
	for _, v := range []uint32{2, uint32(len(domainXML) + 1), 1, 0, 0} {
		b = binary.LittleEndian.AppendUint32(b, v)
	}
	b = append(b, make([]byte, 14*4)...)
	return append(append(b, domainXML...), 0)
}

// repoDir is the module's root directory.
func repoDir(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	require.NoError(t, err)
	return strings.TrimSpace(string(out))
}
