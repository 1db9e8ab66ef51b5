//go:build vm

package e2e

import (
	"context"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestDevinfo: the stock driver binds our device, the port is ACTIVE with
// RoCE v2 GIDs, and the caps the guest sees are the ones we advertise:
// fast registration among them (the driver turns bmme_flags into
// MEM_MGT_EXTENSIONS, which kernel consumers require).
func TestDevinfo(t *testing.T) {
	img := image(t)
	d := daemon(t, backend.Config{}, "dev1")
	ctx := context.Background()
	g, err := vm.Start(ctx, t, img, nil, pvrdmaGuest(d, "dev1", "10.0.2.15/24", `
dmesg | grep -i pvrdma || true
ibv_devices
ibv_devinfo -v
cat /sys/class/infiniband/vmw_pvrdma0/ports/1/state
`))
	require.NoError(t, err)
	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	out := res.Output
	require.Contains(t, out, "hca_id:\tvmw_pvrdma0")
	require.Regexp(t, regexp.MustCompile(`state:\s+PORT_ACTIVE \(4\)`), out)
	require.Regexp(t, regexp.MustCompile(`link_layer:\s+Ethernet`), out)
	require.Regexp(t, regexp.MustCompile(`GID\[\s*1\]:\s+::ffff:10\.0\.2\.15, RoCE v2`), out)
	require.Regexp(t, regexp.MustCompile(`device_cap_flags:\s+0x0020[0-9a-f]{4}\n(\s+[A-Z_]+\n)*\s+MEM_MGT_EXTENSIONS\n`), out, "device_cap_flags has fast registration (IB_DEVICE_MEM_MGT_EXTENSIONS, 1<<21)")
}
