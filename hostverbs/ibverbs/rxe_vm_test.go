//go:build vm

package ibverbs

import (
	"context"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestRelayOverKernelRxe builds this package's tests (cgo, against bookworm's
// libibverbs-dev, the guest's rdma-core) and runs them in a test-bed guest
// with kernel rxe on its NIC: the providers' conformance suite through the
// relay, the GID checks and the teardown count of `rdma resource show`.
func TestRelayOverKernelRxe(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "ibverbs.test")
	build := exec.Command("go", "test", "-c", "-o", bin, ".")
	build.Env = append(build.Environ(), "CGO_ENABLED=1")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build the guest's test binary (needs gcc and libibverbs-dev: make deps): %s", out)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	g, err := vm.Start(context.Background(), t, img, nil, vm.Config{
		Name:      "relay",
		Modules:   []string{"ib_core", "ib_uverbs"},
		MemMiB:    768,
		Timeout:   8 * time.Minute,
		NICs:      []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:21", IP: "10.0.2.15/24"}},
		HostFiles: map[string]string{"/usr/bin/ibverbs.test": bin},
		Scenario: `
pvt_rxe eth0
pvt_gid_index rxe0 10.0.2.15
PVRDMA_IBDEV=rxe0 /usr/bin/ibverbs.test -test.v -test.count=1 -test.timeout 6m -test.run 'TestConformanceRelay|TestUnknownGIDRefused|TestTeardownLeavesNothing'
`,
	})
	require.NoError(t, err)
	res, err := g.WaitOK(context.Background())
	require.NoError(t, err)
	for _, name := range []string{"TestConformanceRelay", "TestUnknownGIDRefused", "TestTeardownLeavesNothing"} {
		require.Regexp(t, regexp.MustCompile(`(?m)^--- PASS: `+name+` `), res.Output, "%s did not pass in the guest", name)
	}
	require.NotContains(t, res.Output, "--- SKIP")
	require.NotContains(t, res.Output, "--- FAIL")
	var passed []string
	for _, l := range strings.Split(res.Output, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "--- PASS: TestConformanceRelay/") {
			passed = append(passed, strings.TrimSpace(l))
		}
	}
	t.Logf("conformance through the relay over kernel rxe:\n%s", strings.Join(passed, "\n"))
	require.Len(t, passed, 11)
}
