//go:build vm

package vm_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestStorageLayer boots a guest with the storage layer: its modules load (those of
// NVMe-oF, NFS over RDMA and SRP, on both sides), its programs run, and its helpers are
// sourced; a guest without the layer cannot ask for its modules.
func TestStorageLayer(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	l := img.Layers[vm.LayerStorage]
	require.NotNil(t, l, "the image has the storage layer")
	st, err := os.Stat(l.Archive)
	require.NoError(t, err)
	t.Logf("storage layer: %d modules, %d KiB", len(l.Modules), st.Size()>>10)

	_, err = vm.Start(ctx, t, img, nil, vm.Config{Name: "nolayer", Modules: []string{"nvme_rdma"}, Scenario: "true"})
	require.ErrorContains(t, err, "not in the guest image", "a guest without the layer")

	g, err := vm.Start(ctx, t, img, nil, vm.Config{
		Name:   "layer",
		Layers: []vm.Layer{vm.LayerStorage},
		Scenario: `
for m in nvme_rdma nvmet_rdma rpcrdma nfsd nfsv4 ib_srp ib_srpt target_core_iblock sd_mod brd; do
	modprobe $m
done
cut -d' ' -f1 /proc/modules | sort
echo "--- programs"
rpc.nfsd --help 2>&1 | head -1
exportfs -h 2>&1 | head -1
mount.nfs -V
ioping -v
pvt_configfs
ls /sys/kernel/config
type pvt_storage_target
`,
	})
	require.NoError(t, err)
	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	for _, m := range []string{"nvme_rdma", "nvmet_rdma", "rpcrdma", "nfsd", "nfsv4", "ib_srp", "ib_srpt", "target_core_iblock", "sd_mod", "brd"} {
		require.Regexp(t, "(?m)^"+m+"$", res.Output, "module %s loaded", m)
	}
	require.Contains(t, res.Output, "mount.nfs: (linux nfs-utils")
	require.Regexp(t, `(?m)^ioping \d`, res.Output)
	require.Regexp(t, `(?m)^nvmet$`, res.Output, "configfs has nvmet")
	require.Contains(t, res.Output, "pvt_storage_target is a function")
}

// BenchmarkBootStorageLayer measures what the storage layer costs a boot: guests
// without and with it, alternately, each to the end of an empty scenario.
//
//	go test -tags vm -run '^$' -bench BootStorageLayer -benchtime 5x ./tests/vm/
func BenchmarkBootStorageLayer(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := vm.EnsureImage(ctx, b.Logf)
	require.NoError(b, err)
	var sums [2]vm.Timings
	for i := 0; i < b.N; i++ {
		for j, layers := range [][]vm.Layer{nil, {vm.LayerStorage}} {
			g, err := vm.Start(ctx, b, img, nil, vm.Config{Name: fmt.Sprintf("boot%d", j), Layers: layers, Scenario: "true", QuietConsole: true})
			require.NoError(b, err)
			res, err := g.WaitOK(ctx)
			require.NoError(b, err)
			sums[j].BootToInit += res.Timings.BootToInit
			sums[j].Total += res.Timings.Total
			sums[j].GuestUptimeAtInit += res.Timings.GuestUptimeAtInit
		}
	}
	n := time.Duration(b.N)
	for j, name := range []string{"base", "storage"} {
		b.ReportMetric(float64((sums[j].BootToInit / n).Milliseconds()), name+"_boot_to_init_ms")
		b.ReportMetric(float64((sums[j].GuestUptimeAtInit / n).Milliseconds()), name+"_uptime_at_init_ms")
		b.ReportMetric(float64((sums[j].Total / n).Milliseconds()), name+"_total_ms")
	}
}
