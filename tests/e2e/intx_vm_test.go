//go:build vm

package e2e

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestINTxMode: guests without MSI (pci=nomsi) drive the device through
// its level-triggered INTx line (shared with eth0 here): every command of
// the probe and of the tools completes on it. The data path polls: the
// stock driver's legacy handler acts only on the RESPONSE cause, so CQ
// events (ibv_rc_pingpong -e) and async events need MSI-X, as on VMware.
func TestINTxMode(t *testing.T) {
	img := image(t)
	d := daemon(t, backend.Config{}, "ix1", "ix2")
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	steps := []step{{"rc_pingpong",
		"ibv_rc_pingpong -d $dev -g $g -n 300 -s 4096", "ibv_rc_pingpong -d $dev -g $g -n 300 -s 4096 $peer"}}
	tail := "echo '=== interrupts'\ngrep vmw_pvrdma /proc/interrupts\n"
	a := pvrdmaGuest(d, "ix1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps)+tail)
	b := pvrdmaGuest(d, "ix2", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, steps)+tail)
	for _, c := range []*vm.Config{&a, &b} {
		c.KernelArgs, c.NoErrExit, c.Timeout = "pci=nomsi", true, 5*time.Minute
	}
	vms, err := vm.StartAll(ctx, t, img, nw, a, b)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	checkSteps(t, res, steps)
	for _, r := range res {
		irq := vm.Section(r.Output, "interrupts")
		require.Regexp(t, regexp.MustCompile(`IO-APIC.*vmw_pvrdma`), irq, "%s is in INTx mode", r.VM)
		require.NotContains(t, irq, "PCI-MSI")
		t.Logf("%s: %s", r.VM, irq)
	}
}
