//go:build vm

package e2e

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestAttachHotplug: `pvrdma-backend attach` (backend.Attach over QMP) adds
// the device and its paired vmxnet3 to a running guest through an empty
// pcie-root-port; the guest's PCIe hot-plug finds both, the stock driver
// binds and the port goes ACTIVE.
func TestAttachHotplug(t *testing.T) {
	img := image(t)
	d := daemon(t, backend.Config{}, "hp1")
	ctx := context.Background()
	cfg := vm.Config{
		Name: "hp1",
		NICs: []vm.NIC{{Model: "vmxnet3", Addr: "05.0", IP: "10.0.2.15/24"}},
		ExtraArgs: []string{
			"-device", "pcie-root-port,id=rp1,bus=pcie.0,addr=06.0,chassis=1,slot=1",
			"-netdev", "user,id=hp0,restrict=on",
		},
		// qboot, unlike SeaBIOS and OVMF, reserves no memory window behind an
		// empty root port; the kernel sizes one for hot-plug itself.
		KernelArgs: "pci=realloc,hpmemsize=8M",
		Timeout:    4 * time.Minute,
		Scenario: `
echo READY-FOR-HOTPLUG
t=0
until lspci -n | grep -q 15ad:0820; do
  t=$((t+1)); [ $t -lt 240 ] || { echo "no hot-plugged device"; exit 1; }; sleep 0.5
done
lspci -nn
t=0
until [ -d /sys/bus/pci/devices/0000:01:00.0/net ]; do
  t=$((t+1)); [ $t -lt 100 ] || { echo "vmxnet3 did not bind"; dmesg | tail -40; exit 1; }; sleep 0.2
done
dev=$(ls /sys/bus/pci/devices/0000:01:00.0/net)
ip link set "$dev" up
ip addr add 10.0.3.15/24 dev "$dev"
t=0
until [ -e /sys/class/infiniband/vmw_pvrdma0/ports/1/gids/1 ] && [ "$(cat /sys/class/infiniband/vmw_pvrdma0/ports/1/gids/1)" != 0000:0000:0000:0000:0000:0000:0000:0000 ]; do
  t=$((t+1)); [ $t -lt 100 ] || break; sleep 0.2
done
ibv_devinfo
ibv_devinfo -v | grep GID
`,
	}
	g, err := vm.Start(ctx, t, img, nil, cfg)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return strings.Contains(g.Output(), "READY-FOR-HOTPLUG") },
		3*time.Minute, 200*time.Millisecond, "guest never got ready")

	q, err := backend.DialQMP(ctx, g.QMPPath(), 10*time.Second)
	require.NoError(t, err)
	defer q.Close()
	spec := backend.VMSpec{Name: "hp1", Bus: "rp1", MemBytes: vm.DefaultMemMiB << 20, Netdev: "hp0", Socket: d.SocketPath("hp1")}
	require.NoError(t, backend.Attach(ctx, q, spec))

	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	require.Regexp(t, regexp.MustCompile(`01:00\.0 .*\[15ad:07b0\]`), res.Output)
	require.Regexp(t, regexp.MustCompile(`01:00\.1 .*\[15ad:0820\]`), res.Output)
	require.Regexp(t, regexp.MustCompile(`state:\s+PORT_ACTIVE \(4\)`), res.Output)
	require.Regexp(t, regexp.MustCompile(`GID\[\s*1\]:\s+::ffff:10\.0\.3\.15, RoCE v2`), res.Output)
	guid := backend.NodeGUID(backend.DefaultMAC("hp1"))
	require.Contains(t, res.Output, fmt.Sprintf("node_guid:\t\t\t%04x:%04x:%04x:%04x",
		guid>>48, guid>>32&0xffff, guid>>16&0xffff, guid&0xffff), "node GUID is the EUI-64 of the VM's MAC")
}
