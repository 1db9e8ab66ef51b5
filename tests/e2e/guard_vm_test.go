//go:build vm

package e2e

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestMigrationGuard: QEMU 11's vfio-user-pci migrates without the
// device's state and adds no blocker, so the daemon cancels migrations on
// its own QMP monitor of each VM (qemu-args' -chardev/-mon). Two guests run
// a data-checked ibv_rc_pingpong; during it the test starts a `migrate` of
// the first VM on the VM's main monitor (as libvirt or an operator would);
// the daemon cancels it, both monitors are verified as the device's QEMU,
// the ping-pong in flight completes, and a fresh one passes after.
func TestMigrationGuard(t *testing.T) {
	img := image(t)
	d := daemon(t, backend.Config{}, "mg1", "mg2")
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	steps := []step{
		{"during", "ibv_rc_pingpong -d $dev -g $g -n 10000 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 10000 -s 4096 -c $peer"},
		{"after", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096 -c", "ibv_rc_pingpong -d $dev -g $g -n 500 -s 4096 -c $peer"},
	}
	cfgs := []vm.Config{
		pvrdmaGuest(d, "mg1", "10.77.0.1/24", matrixScenario("vmw_pvrdma0", "10.77.0.1", "", true, steps)),
		pvrdmaGuest(d, "mg2", "10.77.0.2/24", matrixScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", false, steps)),
	}
	for i := range cfgs {
		cfgs[i].NoErrExit = true
		cfgs[i].Timeout = 8 * time.Minute
	}
	vms, err := vm.StartAll(ctx, t, img, nw, cfgs...)
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		return strings.Contains(vms[0].Output(), "=== during") && strings.Contains(vms[1].Output(), "=== during")
	}, 5*time.Minute, 200*time.Millisecond, "the guests never started the ping-pong")
	time.Sleep(time.Second) // into the ping-pong (10000 iterations take 6 s or more under TCG)

	q, err := backend.DialQMP(ctx, vms[0].QMPPath(), 10*time.Second)
	require.NoError(t, err)
	defer q.Close()
	_, err = q.Run(ctx, "migrate", map[string]any{"uri": "file:" + filepath.Join(t.TempDir(), "mg1.mig")})
	require.NoError(t, err, "QEMU starts the migration: nothing in QEMU blocks it")
	var status string
	require.Eventually(t, func() bool {
		ret, err := q.Run(ctx, "query-migrate", nil)
		if err != nil {
			return false
		}
		var m struct {
			Status string `json:"status"`
		}
		_ = json.Unmarshal(ret, &m)
		status = m.Status
		return status == "cancelled" || status == "completed" || status == "failed"
	}, time.Minute, 50*time.Millisecond, "the migration never ended")
	require.Equal(t, "cancelled", status, "the daemon cancels the migration")

	st := d.Status()
	require.Len(t, st.VMs, 2)
	for _, v := range st.VMs {
		assert.Equal(t, backend.QMPVerified, v.QMP, "%s: the daemon's monitor is the device's QEMU", v.Name)
		want := uint64(0)
		if v.Name == "mg1" {
			want = 1
		}
		assert.Equal(t, want, v.MigrationsCancelled, v.Name)
	}
	running, err := q.Run(ctx, "query-status", nil)
	require.NoError(t, err)
	assert.Contains(t, string(running), `"running"`, "the VM keeps running here")

	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	checkSteps(t, res, steps)
}
