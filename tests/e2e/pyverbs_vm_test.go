//go:build vm

package e2e

import (
	"context"
	"maps"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/packaging"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// pyverbsModules are loaded by /init: the device, rdma_cm (the suite's rdmacm tests) and
// rxe's dependencies (the control device).
var pyverbsModules = []string{"ib_core", "ib_uverbs", "vmw_pvrdma", "configfs", "iw_cm", "ib_cm", "rdma_cm", "rdma_ucm",
	"crc32_generic", "udp_tunnel", "ip6_udp_tunnel", "rdma_rxe"}

// pyverbsScenario runs rdma-core's test suite, as python3-pyverbs ships it (the larger
// files gzipped by Debian's packaging), on our device and then on rxe with
// run_tests.py -v, each run's report after "=== suite pvrdma" or "=== suite rxe".
const pyverbsScenario = `
cp -r /usr/share/doc/rdma-core/tests /root/rdma-tests
gunzip /root/rdma-tests/*.gz
# rdma-core's udev rule (60-rdma-persistent-naming.rules) names the device by its PCI
# path (rocep0s5f1): find it by its driver.
pv=
for d in /sys/class/infiniband/*; do
	[ "$(basename "$(readlink -f $d/device/driver)")" = vmw_pvrdma ] && pv=$(basename $d)
done
echo "pvrdma device: $pv"
pvt_rxe eth0
pvt_gid_index $pv 10.77.0.1 >/dev/null
pvt_gid_index rxe0 10.77.0.1 >/dev/null
cd /root/rdma-tests
echo "=== suite pvrdma"
timeout 480 python3 run_tests.py --dev $pv -v 2>&1
echo "=== suite rxe"
timeout 480 python3 run_tests.py --dev rxe0 -v 2>&1
echo "=== end"
`

// TestPyverbsSuite runs rdma-core's own Python test suite (rdma-core 44, the guest's)
// in a stock guest over our device and over kernel rxe on the guest's vmxnet3 (the
// control), and compares them test by test: our device has no failure or error that
// rxe does not have but the stock stack's own, and every failure both share has its
// reason (testdata/pyverbs-failures.md lists both kinds, each by test and cause: the
// source line its traceback ends at and the exception it raises). The guest boots a
// bookworm root with python3-pyverbs under systemd (vm.Config.Root): the suite needs
// python3 and the bindings, which a cached root layer installs with apt as a user
// would, where the busybox initramfs would need the interpreter's whole closure copied
// in by hand.
func TestPyverbsSuite(t *testing.T) {
	img := image(t)
	root := filepath.Join(t.TempDir(), "root")
	require.NoError(t, packaging.CopyRoot(context.Background(), "", t.Logf, root, packaging.PyverbsPackages()...))
	d := daemon(t, backend.Config{}, "pyv1")
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	cfg := pvrdmaGuest(d, "pyv1", "10.77.0.1/24", pyverbsScenario)
	cfg.Root, cfg.Modules, cfg.MemMiB = root, pyverbsModules, 1024
	// Each suite takes two to three minutes here; the guest gets both and its boot, with
	// room for a loaded machine, and no more: a hung suite fails the test in minutes.
	res := runGuests(context.Background(), t, img, nw, 15*time.Minute, cfg)
	out := res[0].Output
	require.Contains(t, out, "=== end", "the scenario did not finish:\n%s", out)
	runs := map[string]*utRun{}
	for _, dev := range []string{"pvrdma", "rxe"} {
		r, err := parseUnittest(vm.Section(out, "suite "+dev))
		require.NoError(t, err, "%s:\n%s", dev, vm.Section(out, "suite "+dev))
		runs[dev] = r
		t.Logf("PYVERBS dev=%s %s", dev, r)
	}
	ours, rxe := runs["pvrdma"], runs["rxe"]
	require.Equal(t, rxe.Ran, ours.Ran, "the same suite ran on both")
	checkPyverbsFailures(t, ours, rxe)
	// Every skip over our device has its explanation in testdata/pyverbs-skips.md.
	classes, err := skipClasses("testdata/pyverbs-skips.md", pvrdmaName(out))
	require.NoError(t, err)
	rxeSkips := rxe.skipReasons()
	oursSkips := ours.skipReasons()
	for _, reason := range slices.Sorted(maps.Keys(oursSkips)) {
		ids := oursSkips[reason]
		t.Logf("skipped over our device: %d (rxe: %d) %q", len(ids), len(rxeSkips[strings.ReplaceAll(reason, pvrdmaName(out), "rxe0")]), reason)
		if !classes.match(reason) {
			t.Errorf("skip reason %q (%d tests, e.g. %s) is not explained in testdata/pyverbs-skips.md", reason, len(ids), ids[0])
		}
	}
}

// pvrdmaName is the name the guest's udev gave our device, as the scenario printed it.
func pvrdmaName(out string) string {
	m := regexp.MustCompile(`(?m)^pvrdma device: (\S+)$`).FindStringSubmatch(out)
	if m == nil {
		return "vmw_pvrdma0"
	}
	return m[1]
}
