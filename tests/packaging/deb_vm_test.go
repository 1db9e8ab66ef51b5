//go:build vm

package packaging

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// pkgScript runs inside the container once it has booted: install, check the service,
// follow README's quick start (doctor, PVRDMA_OPTS, restart, status), register a VM,
// remove. The /root/qs-*.sh scripts hold README's own commands (readmeQuickStart),
// /root/qs-opts its PVRDMA_OPTS line and /root/qs-fabric the link that line names, which
// systemd-networkd makes at boot (fabricNetworkd). Each step's output is bracketed so the test can pick
// it out.
const pkgScript = `#!/bin/sh
step() { echo "=== $1"; shift; "$@" 2>&1; echo "=== rc $?"; }
waitstatus() {
	i=0
	while [ $i -lt 100 ]; do
		pvrdma-backend status >/dev/null 2>&1 && return 0
		sleep 0.1; i=$((i+1))
	done
	return 1
}
step fabric sh -c 'n=$(cat /root/qs-fabric); i=0; until [ -e /sys/class/net/$n ]; do i=$((i+1)); [ $i -lt 100 ] || exit 1; sleep 0.1; done; echo $n $(cat /sys/class/net/$n/flags)'
step install sh /root/qs-install.sh
step enabled systemctl is-enabled pvrdma-backend.service
step wait waitstatus
step active systemctl is-active pvrdma-backend.service
step status pvrdma-backend status
step status-json pvrdma-backend status --json
step group getent group pvrdma
step user sh -c 'pid=$(systemctl show -p MainPID --value pvrdma-backend.service); stat -c "%U %G" /proc/$pid; grep -E "^Cap(Eff|Amb|Bnd)" /proc/$pid/status'
step dir stat -c '%a %U %G' /run/pvrdma
step control stat -c '%a %U %G' /run/pvrdma/control.sock
step doctor sh /root/qs-doctor.sh
step opts sh -c 'grep -v "^PVRDMA_OPTS=" /etc/default/pvrdma-backend > /tmp/default && cat /root/qs-opts >> /tmp/default && cat /tmp/default > /etc/default/pvrdma-backend'
step restart sh /root/qs-restart.sh
step wait-restart waitstatus
step qs-status sh /root/qs-status.sh
step qs-status-json pvrdma-backend status --json
step qemu-args pvrdma-backend qemu-args --vm pkgvm --mem 256M
step vmsock stat -c '%a %U %G' /run/pvrdma/pkgvm.sock
step qmpsock stat -c '%a %U %G' /run/pvrdma/pkgvm.qmp
step hook stat -c '%a %U %G' /etc/libvirt/hooks/qemu.d/pvrdma-backend
step hook-migrate sh -c 'pvrdma-backend libvirt-xml --vm pkgvm --mem 256M --register=false | /etc/libvirt/hooks/qemu.d/pvrdma-backend pkgvm migrate begin -'
step hook-restore sh -c 'pvrdma-backend libvirt-xml --vm pkgvm --mem 256M --register=false | /etc/libvirt/hooks/qemu.d/pvrdma-backend pkgvm restore begin -'
step hook-start sh -c 'pvrdma-backend libvirt-xml --vm pkgvm --mem 256M --register=false | /etc/libvirt/hooks/qemu.d/pvrdma-backend pkgvm start begin -'
step man test -s /usr/share/man/man8/pvrdma-backend.8
step conffile cat /var/lib/dpkg/info/pvrdma-backend.conffiles
step security sh -c 'systemd-analyze security pvrdma-backend.service | tail -1'
step relay-doctor pvrdma-backend doctor --transport ibverbs --ibdev rxe0
step relay-serve pvrdma-backend serve --socket-dir /tmp/relay --transport ibverbs --ibdev rxe0 --fabric-netdev lo
step journal journalctl -b -u pvrdma-backend.service --no-pager -o cat
step remove dpkg -r pvrdma-backend
step after-remove systemctl is-active pvrdma-backend.service
step binary-gone test ! -e /usr/bin/pvrdma-backend
step hook-gone test ! -e /etc/libvirt/hooks/qemu.d/pvrdma-backend
`

// runner is the oneshot unit that runs pkgScript at boot and powers the container off.
const runner = `[Unit]
Description=package test
After=multi-user.target
[Service]
Type=oneshot
StandardOutput=append:/root/pkgtest.out
StandardError=inherit
ExecStart=/root/pkgtest.sh
ExecStopPost=/bin/systemctl --no-block poweroff
[Install]
WantedBy=multi-user.target
`

// TestDebInstallsService builds the package with `make deb` and, in a clean bookworm root
// booted under systemd, follows README's quick start with README's own commands: the
// install command, `doctor`, the PVRDMA_OPTS line, the restart and `status` (the
// container's systemd-networkd makes the fabric bridge or netdev the line names). It
// checks what an operator sees: the service enabled and running, `status` answering with
// the fabric and the VMs the line registers (their GID prefixes and locked-memory limit),
// the socket directory and sockets with the documented owners and modes, and nothing
// running after removal.
func TestDebInstallsService(t *testing.T) {
	qs := readmeQuickStart(t)
	opts := qs.parseOpts(t)
	require.NotEmpty(t, opts.vms, "README's PVRDMA_OPTS registers no VM: %s", qs.opts.text)
	root := cleanRoot(t)
	deb := builtDeb(t)

	debPath := filepath.Join(root, qs.debPath(t))
	require.NoError(t, os.MkdirAll(filepath.Dir(debPath), 0o755))
	require.NoError(t, os.WriteFile(debPath, deb, 0o644))
	for name, line := range map[string]string{"install": qs.install.text, "doctor": qs.doctor.text,
		"restart": qs.restart.text, "status": qs.status.text} {
		script := "cd /root\n" + line + "\n"
		require.NoError(t, os.WriteFile(filepath.Join(root, "root/qs-"+name+".sh"), []byte(script), 0o755))
	}
	require.NoError(t, os.WriteFile(filepath.Join(root, "root/qs-opts"), []byte(qs.opts.text+"\n"), 0o644))
	fabric := fabricNetworkd(t, root, opts)
	require.NoError(t, os.WriteFile(filepath.Join(root, "root/qs-fabric"), []byte(fabric+"\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(root, "root/pkgtest.sh"), []byte(pkgScript), 0o755))
	unit := filepath.Join(root, "etc/systemd/system/pkgtest.service")
	require.NoError(t, os.WriteFile(unit, []byte(runner), 0o644))
	require.NoError(t, os.Symlink("/etc/systemd/system/pkgtest.service",
		filepath.Join(root, "etc/systemd/system/multi-user.target.wants/pkgtest.service")))

	start := time.Now()
	console := boot(t, root, 3*time.Minute)
	raw, err := os.ReadFile(filepath.Join(root, "root/pkgtest.out"))
	require.NoError(t, err, "the package test did not run; console:\n%s", tail(console, 4000))
	t.Logf("container boot, install, checks and power-off in %v; script output:\n%s", time.Since(start).Round(100*time.Millisecond), raw)
	steps := parseSteps(string(raw))

	ok := func(name string) string {
		t.Helper()
		s, found := steps[name]
		require.True(t, found, "step %s did not run", name)
		require.Equal(t, "0", s.rc, "step %s failed:\n%s", name, s.out)
		return strings.TrimSpace(s.out)
	}
	ok("fabric")
	ok("install")
	require.Equal(t, "enabled", ok("enabled"))
	ok("wait")
	require.Equal(t, "active", ok("active"))
	require.Contains(t, ok("status"), "transport soft")
	var st backend.Status
	require.NoError(t, json.Unmarshal([]byte(ok("status-json")), &st))
	require.Equal(t, "/run/pvrdma", st.SocketDir)
	require.Regexp(t, `^pvrdma:x:\d+:`, ok("group"))
	// The daemon's own user, with the three capabilities it needs and no
	// others: CAP_NET_ADMIN (12), CAP_NET_RAW (13), CAP_IPC_LOCK (14).
	user := ok("user")
	require.Regexp(t, `(?m)^pvrdma +pvrdma$`, user)
	require.Regexp(t, `(?m)^CapEff:\s+0000000000007000$`, user)
	require.Regexp(t, `(?m)^CapBnd:\s+0000000000007000$`, user)
	require.Equal(t, "750 pvrdma pvrdma", ok("dir"), "the daemon runs as its own user")
	require.Equal(t, "600 pvrdma pvrdma", ok("control"))
	// README's doctor: no QEMU in the clean root, so it says so with the fix and exits 1;
	// the fabric it names is there.
	require.Equal(t, "1", steps["doctor"].rc, steps["doctor"].out)
	require.Regexp(t, `(?m)^FAIL +qemu +no qemu-system-x86_64 on PATH\n +fix: install QEMU >= 10.1`, steps["doctor"].out)
	require.Regexp(t, `(?m)^OK +socket-dir +/run/pvrdma: mode 0750, owner pvrdma, group pvrdma$`, steps["doctor"].out)
	require.Regexp(t, `(?m)^OK +memlock +CAP_IPC_LOCK`, steps["doctor"].out)
	require.Regexp(t, `(?m)^OK +libvirt-hook +/etc/libvirt/hooks/qemu.d/pvrdma-backend refuses migrate and restore`, steps["doctor"].out)
	if opts.bridge != "" {
		require.Regexp(t, `(?m)^OK +fabric-bridge +`+regexp.QuoteMeta(opts.bridge)+` `, steps["doctor"].out)
	}
	// README's PVRDMA_OPTS, restart and status: the fabric and the VMs it names.
	ok("opts")
	ok("restart")
	ok("wait-restart")
	qsStatus := ok("qs-status")
	switch {
	case opts.bridge != "":
		require.Regexp(t, `(?m)^transport soft, fabric l2 `+regexp.QuoteMeta(opts.bridge)+`, sockets in /run/pvrdma$`, qsStatus)
	case opts.netdev != "":
		require.Regexp(t, `(?m)^transport soft, fabric ip `+regexp.QuoteMeta(opts.netdev)+`, sockets in /run/pvrdma$`, qsStatus)
	}
	var qst backend.Status
	require.NoError(t, json.Unmarshal([]byte(ok("qs-status-json")), &qst))
	for _, req := range opts.vms {
		require.Regexp(t, `(?m)^`+regexp.QuoteMeta(req.Name)+` +false +`, qsStatus, "README's VM %s is registered, not connected", req.Name)
		var vm *backend.VMStatus
		for i := range qst.VMs {
			if qst.VMs[i].Name == req.Name {
				vm = &qst.VMs[i]
			}
		}
		require.NotNil(t, vm, "status --json has no VM %s", req.Name)
		if req.GIDAllow != nil {
			allow, err := backend.ParseGIDAllow(strings.Join(req.GIDAllow, ","))
			require.NoError(t, err)
			require.Equal(t, backend.FormatGIDAllow(allow), vm.GIDAllow, "VM %s's GID prefixes", req.Name)
		}
		if req.MemBytes > 0 {
			require.Equal(t, req.MemBytes+backend.LockSlack, vm.LockedLimit, "VM %s may lock its RAM plus %d bytes", req.Name, backend.LockSlack)
		}
	}
	t.Logf("README's quick start in the container: %s / %s / %s / %s / %s", qs.install.text, qs.doctor.text, qs.opts.text, qs.restart.text, qs.status.text)
	require.Contains(t, ok("qemu-args"), "vfio-user-pci")
	require.Equal(t, "660 pvrdma pvrdma", ok("vmsock"))
	require.Equal(t, "660 pvrdma pvrdma", ok("qmpsock"), "the daemon's QMP socket has the VM socket's access")
	// The libvirt hook, run as libvirt runs it (arguments, domain XML on
	// stdin), refuses migrate and restore of the domain libvirt-xml prints
	// and passes its start.
	require.Equal(t, "755 root root", ok("hook"))
	for _, op := range []string{"hook-migrate", "hook-restore"} {
		require.Equal(t, "1", steps[op].rc, steps[op].out)
		require.Regexp(t, `refused to (migrate|restore) domain "pkgvm": it has a PVRDMA device \(vfio-user-pci, socket /run/pvrdma/pkgvm.sock\)`, steps[op].out)
	}
	require.Empty(t, ok("hook-start"), "the hook prints nothing for other operations")
	ok("man")
	require.Equal(t, "/etc/default/pvrdma-backend", ok("conffile"))
	t.Logf("systemd-analyze security: %s", steps["security"].out)
	m := regexp.MustCompile(`Overall exposure level for pvrdma-backend.service: (\d+\.\d)`).FindStringSubmatch(steps["security"].out)
	require.NotNil(t, m, steps["security"].out)
	exposure, err := strconv.ParseFloat(m[1], 64)
	require.NoError(t, err)
	require.LessOrEqual(t, exposure, 2.5, "systemd-analyze security: the unit's exposure (4.5 as root with six capabilities)")
	// The packaged binary carries the relay; without rdma-core it says what to install.
	require.Regexp(t, `(?m)^OK +transport +ibverbs: the relay loads libibverbs at start$`, steps["relay-doctor"].out)
	require.Regexp(t, `(?m)^FAIL +libibverbs +libibverbs.so.1 not found`, steps["relay-doctor"].out)
	require.Equal(t, "1", steps["relay-serve"].rc, steps["relay-serve"].out)
	require.Contains(t, steps["relay-serve"].out, "apt install libibverbs1 ibverbs-providers")
	ok("remove")
	require.Equal(t, "inactive", strings.TrimSpace(steps["after-remove"].out))
	ok("binary-gone")
	ok("hook-gone")
}

type step struct{ out, rc string }

var stepRE = regexp.MustCompile(`(?ms)^=== (\S+)\n(.*?)^=== rc (\d+)$`)

func parseSteps(s string) map[string]step {
	m := map[string]step{}
	for _, g := range stepRE.FindAllStringSubmatch(s, -1) {
		m[g[1]] = step{out: g[2], rc: g[3]}
	}
	return m
}

// debBuild is the package `make deb` built for this test binary: every
// test installs the same one, built once.
var debBuild struct {
	once sync.Once
	deb  []byte
	err  error
}

// builtDeb returns the package built from the work tree by `make deb`
// (the first caller builds it).
func builtDeb(t *testing.T) []byte {
	t.Helper()
	debBuild.once.Do(func() {
		dist, err := os.MkdirTemp("", "pvrdma-deb-")
		if err != nil {
			debBuild.err = err
			return
		}
		defer os.RemoveAll(dist)
		start := time.Now()
		mk := exec.Command("make", "deb", "DIST="+dist)
		mk.Dir = repoRoot(t)
		out, err := mk.CombinedOutput()
		if err != nil {
			debBuild.err = fmt.Errorf("make deb: %w\n%s", err, out)
			return
		}
		debs, _ := filepath.Glob(filepath.Join(dist, "pvrdma-backend_*.deb"))
		if len(debs) != 1 {
			debBuild.err = fmt.Errorf("make deb made %d packages:\n%s", len(debs), out)
			return
		}
		debBuild.deb, debBuild.err = os.ReadFile(debs[0])
		t.Logf("make deb: %s in %v", filepath.Base(debs[0]), time.Since(start).Round(100*time.Millisecond))
	})
	require.NoError(t, debBuild.err)
	return debBuild.deb
}
