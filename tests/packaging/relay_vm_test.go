//go:build vm

package packaging

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// relayScenario runs in the guest under systemd, after multi-user.target: the packaged
// unit, with README's drop-in and modules, relays a VM (hostile's driver over vfio-user)
// to kernel rxe; then the unit without the drop-in must fail, naming /dev/infiniband.
// Each step's output is bracketed for parseSteps.
const relayScenario = `
step() { echo "=== $1"; shift; "$@" 2>&1; echo "=== rc $?"; }
step failed-units systemctl list-units --failed --no-legend --plain
step enabled systemctl is-enabled pvrdma-backend.service
step active systemctl is-active pvrdma-backend.service
step restarts systemctl show -p NRestarts --value pvrdma-backend.service
step modules sh -c 'cut -d" " -f1 /proc/modules | grep -Ex "ib_uverbs|rdma_rxe" | sort'
step status pvrdma-backend status
step security systemd-analyze security --no-pager pvrdma-backend.service
step relay env PVRDMA_RELAY_SOCKET_DIR=/run/pvrdma PVRDMA_RELAY_NETDEV=eth0 PVRDMA_RELAY_GID=10.77.0.11 \
	PVRDMA_RELAY_ITERS=100 /usr/bin/hostile.test -test.v -test.count=1 -test.run '^TestRelayPingPong$' -test.timeout 10m
step journal journalctl -b -u pvrdma-backend.service --no-pager -o cat

# The unit as packaged (no drop-in): it must fail at start, and say why.
rm /etc/systemd/system/pvrdma-backend.service.d/relay.conf
systemctl daemon-reload
since=$(date +%s)
step restart systemctl restart pvrdma-backend.service
i=0
until journalctl -u pvrdma-backend.service --since "@$since" --no-pager -o cat | grep -q /dev/infiniband; do
	i=$((i+1)); [ $i -lt 120 ] || break; sleep 1
done
systemctl stop pvrdma-backend.service
step no-dropin-journal journalctl -u pvrdma-backend.service --since "@$since" --no-pager -o cat
`

// peerScenario is the stock side in a test-bed guest with kernel rxe: ibv_rc_pingpong
// and ibv_ud_pingpong clients of the relayed VM (which waits for its root's systemd:
// retried for up to ten minutes).
const peerScenario = `
pvt_rxe eth0
g=$(pvt_gid_index rxe0 10.77.0.2)
pvt_retry 600 ibv_rc_pingpong -d rxe0 -g $g -n 100 -s 4096 10.77.0.1
echo "=== ud"
pvt_retry 120 ibv_ud_pingpong -d rxe0 -g $g -n 100 -s 1024 -r 50 -p 18516 10.77.0.1
`

// TestPackagedRelay proves the relay under the packaged unit: a test-bed guest whose
// root is a bookworm root with the package installed boots it under systemd (vm.Config
// Root, shared over 9p) with kernel rxe. README's drop-in and modules-load.d file,
// taken from README itself, and the relay's options in /etc/default/pvrdma-backend
// (--transport ibverbs --create-rxe eth0) make the unit active, `status` shows the
// ibverbs transport and the rxe device it created, and a VM (hostile's driver over
// vfio-user, as in tests/e2e TestRelayOverRxe) serves stock ibv_rc_pingpong and
// ibv_ud_pingpong clients in a second guest through it. Without the drop-in the unit
// fails at start with an error naming /dev/infiniband.
func TestPackagedRelay(t *testing.T) {
	img, err := vm.EnsureImage(context.Background(), t.Logf)
	require.NoError(t, err)
	root := rootWith(t, relayPackages()...)
	deb := builtDeb(t)
	dropIn := readmeBlock(t, "pvrdma-backend.service.d/relay.conf")
	modulesLoad := readmeBlock(t, "/etc/modules-load.d/pvrdma-relay.conf")
	require.Contains(t, dropIn, "DeviceAllow=char-infiniband_verbs rw")
	require.Contains(t, modulesLoad, "rdma_rxe")

	hostile := filepath.Join(t.TempDir(), "hostile.test")
	build := exec.Command("go", "test", "-c", "-o", hostile, "./tests/hostile")
	build.Dir = repoRoot(t)
	build.Env = append(build.Environ(), "CGO_ENABLED=1")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build the hostile test binary with cgo (needs gcc and libibverbs-dev: make deps): %s", out)

	// Installed as an operator would before a reboot: the package, the relay's options,
	// README's drop-in and modules-load.d file.
	require.NoError(t, os.WriteFile(filepath.Join(root, "root/pvrdma-backend.deb"), deb, 0o644))
	install := exec.Command("systemd-nspawn", "--quiet", "-D", root, "--register=no", "--keep-unit", "--pipe",
		"--private-network", "dpkg", "-i", "/root/pvrdma-backend.deb")
	out, err = install.CombinedOutput()
	require.NoError(t, err, "dpkg -i in the root: %s", out)
	def := filepath.Join(root, "etc/default/pvrdma-backend")
	b, err := os.ReadFile(def)
	require.NoError(t, err)
	opts := `PVRDMA_OPTS="--transport ibverbs --create-rxe eth0 --vm peer --gid-allow 10.77.0.0/24"`
	require.Regexp(t, `(?m)^PVRDMA_OPTS=""$`, string(b))
	b = regexp.MustCompile(`(?m)^PVRDMA_OPTS=""$`).ReplaceAll(b, []byte(opts))
	require.NoError(t, os.WriteFile(def, b, 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(root, "etc/systemd/system/pvrdma-backend.service.d"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "etc/systemd/system/pvrdma-backend.service.d/relay.conf"), []byte(dropIn), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(root, "etc/modules-load.d/pvrdma-relay.conf"), []byte(modulesLoad), 0o644))

	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	a := vm.Config{
		Name: "pkgrelay", Root: root, MemMiB: 1024, Modules: []string{}, NoErrExit: true, Timeout: 15 * time.Minute,
		NICs:      []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:02:01", IP: "10.77.0.1/24"}},
		HostFiles: map[string]string{"/usr/bin/hostile.test": hostile},
		Scenario:  relayScenario,
	}
	b2 := vm.Config{
		Name: "pkgpeer", Modules: []string{"ib_core", "ib_uverbs"}, Timeout: 15 * time.Minute,
		NICs:     []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:02:02", IP: "10.77.0.2/24"}},
		Scenario: peerScenario,
	}
	ctx := context.Background()
	vms, err := vm.StartAll(ctx, t, img, nw, a, b2)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	steps := parseSteps(res[0].Output)
	ok := func(name string) string {
		t.Helper()
		s, found := steps[name]
		require.True(t, found, "step %s did not run", name)
		require.Equal(t, "0", s.rc, "step %s failed:\n%s", name, s.out)
		return strings.TrimSpace(s.out)
	}

	t.Logf("failed units: %q", strings.TrimSpace(steps["failed-units"].out))
	require.Equal(t, "enabled", ok("enabled"))
	require.Equal(t, "active", ok("active"))
	// Started at the first attempt: with ib_uverbs loaded by the unit itself
	// (ExecStartPre=+modprobe), the first start fails (DeviceAllow= found no
	// infiniband_verbs in /proc/devices when the unit started, so the device
	// node is refused) and only Restart=on-failure's second one works.
	require.Equal(t, "0", ok("restarts"), "the unit was restarted:\n%s", steps["journal"].out)
	require.Equal(t, "ib_uverbs\nrdma_rxe", ok("modules"), "modules-load.d loaded the modules at boot")
	status := ok("status")
	require.Regexp(t, `(?m)^transport ibverbs, fabric ip eth0, sockets in /run/pvrdma$`, status)
	require.Regexp(t, `(?m)^host device rxe_eth0 \(created by the daemon\) port 1: ACTIVE$`, status)
	sec := ok("security")
	m := regexp.MustCompile(`Overall exposure level for pvrdma-backend.service: (\d+\.\d) (\S+)`).FindStringSubmatch(sec)
	require.NotNil(t, m, sec)
	t.Logf("systemd-analyze security with the relay drop-in: %s %s", m[1], m[2])
	relay := ok("relay")
	require.Regexp(t, `(?m)^--- PASS: TestRelayPingPong `, relay)
	require.Regexp(t, `(?m)^\s*819200 bytes in [\d.]+ seconds = [\d.]+ Mbit/sec`, res[1].Output, "ibv_rc_pingpong")
	require.Regexp(t, `(?m)^\s*204800 bytes in [\d.]+ seconds = [\d.]+ Mbit/sec`, res[1].Output, "ibv_ud_pingpong")
	journal := ok("journal")
	require.Contains(t, journal, "created rxe link")
	require.NotContains(t, journal, "level=ERROR")
	t.Logf("through the packaged unit: %s", regexp.MustCompile(`RELAY_PINGPONG .*`).FindString(relay))

	// Without the drop-in.
	require.NotEqual(t, "0", steps["restart"].rc, "the unit started without the drop-in:\n%s", steps["restart"].out)
	noDropIn := steps["no-dropin-journal"].out
	require.Regexp(t, `/dev/infiniband/uverbs\d+ is missing`, noDropIn)
	t.Logf("without the drop-in: %s", regexp.MustCompile(`.*/dev/infiniband.*`).FindString(noDropIn))
}
