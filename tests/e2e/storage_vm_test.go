//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// storageMiB is the data each storage run writes and reads back.
const storageMiB = 32

// storageMemMiB is the storage guests' RAM: the base and the storage layer unpacked,
// two RAM disks or an export in the target, the data in the initiator.
const storageMemMiB = 768

// storageTransport is how the two guests of a storage row reach each other.
type storageTransport struct {
	name  string // "rxe" (kernel rxe in the guests: the control) or "pvrdma" (our device)
	ibdev string
}

var (
	transportRxe    = storageTransport{"rxe", "rxe0"}
	transportPvrdma = storageTransport{"pvrdma", "vmw_pvrdma0"}
)

// needFRWR guards the rows over our device until the device has fast registration
// (issue 32): the kernel's storage consumers refuse a device without it ("Memory
// registrations not supported", "'frwr' mode is not supported"). E2E_STORAGE_PVRDMA=1
// runs them. Remove the guard when fast registration lands.
func needFRWR(t *testing.T) {
	t.Helper()
	if os.Getenv("E2E_STORAGE_PVRDMA") != "1" {
		t.Skip("over our device only with E2E_STORAGE_PVRDMA=1 until the device has fast registration (issue 32)")
	}
}

// storagePair returns the target's and the initiator's guest configs of a storage row:
// a (10.77.0.1) serves, b (10.77.0.2) connects, both with the storage layer.
func storagePair(t *testing.T, tr storageTransport, d *backend.Daemon, names [2]string, runs ...vm.StorageRun) [2]vm.Config {
	t.Helper()
	ips := [2]string{"10.77.0.1", "10.77.0.2"}
	var cfgs [2]vm.Config
	for i := range cfgs {
		sc, err := vm.StorageScenario(i == 0, tr.ibdev, ips[i], ips[1-i], storageMiB, runs...)
		require.NoError(t, err)
		if tr == transportRxe {
			cfgs[i] = vm.Config{Name: names[i], Modules: []string{"ib_core", "ib_uverbs"},
				NICs:     []vm.NIC{{Addr: "05.0", MAC: backend.DefaultMAC(names[i]).String(), IP: ips[i] + "/24"}},
				Scenario: sc}
		} else {
			cfgs[i] = pvrdmaGuest(d, names[i], ips[i]+"/24", sc)
			cfgs[i].Modules = rdmaCMModules
		}
		cfgs[i].Layers = []vm.Layer{vm.LayerStorage}
		cfgs[i].MemMiB = storageMemMiB
	}
	return cfgs
}

// checkStorage asserts each run's result (a subtest per run) and returns them.
func checkStorage(t *testing.T, row string, res []vm.Result, runs ...vm.StorageRun) map[string]vm.StorageResult {
	t.Helper()
	out := map[string]vm.StorageResult{}
	for _, r := range runs {
		sec := r.Section
		if sec == "" {
			sec = r.Kind
		}
		t.Run(row+"/"+sec, func(t *testing.T) {
			sr, err := vm.ParseStorage(res[0].Output, res[1].Output, sec)
			require.NoError(t, err)
			out[sec] = sr
			assert.NoError(t, sr.Err(), "target:\n%s\ninitiator:\n%s", sr.TargetLog, sr.HostLog)
			t.Logf("STORAGE %s %s: %d passes of %d MiB, data %s", row, sec, sr.Passes, storageMiB, short(sr.Written))
		})
	}
	return out
}

// storageKinds are the consumers to run: all, or those E2E_STORAGE names (e.g.
// E2E_STORAGE=nvme,srp).
func storageKinds() []string {
	only := os.Getenv("E2E_STORAGE")
	if only == "" {
		return vm.StorageConsumers
	}
	var kinds []string
	for _, k := range vm.StorageConsumers {
		if strings.Contains(","+only+",", ","+k+",") {
			kinds = append(kinds, k)
		}
	}
	return kinds
}

func short(sha string) string {
	if len(sha) > 12 {
		return sha[:12]
	}
	return sha
}

// TestStorageConsumers: the kernel's RDMA storage consumers between two stock guests,
// NVMe over Fabrics (nvmet-rdma target on a RAM disk, nvme-rdma host), NFSv4.2 over
// RDMA (nfsd's RDMA listener on 20049, a mount with proto=rdma) and SRP (ib_srpt on a
// RAM disk, ib_srp logged in over rdma_cm): 32 MiB written and read back with direct
// I/O, the data checked on both sides. Each row runs over kernel rxe in the guests
// (the control) and over our device, in this run.
func TestStorageConsumers(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	var runs []vm.StorageRun
	for _, k := range storageKinds() {
		runs = append(runs, vm.StorageRun{Kind: k})
	}
	matrix := map[string]map[string]vm.StorageResult{}
	for _, tr := range []storageTransport{transportRxe, transportPvrdma} {
		t.Run(tr.name, func(t *testing.T) {
			var d *backend.Daemon
			names := [2]string{"sr" + tr.name[:1] + "1", "sr" + tr.name[:1] + "2"}
			if tr == transportPvrdma {
				needFRWR(t)
				d = daemon(t, backend.Config{}, names[0], names[1])
			}
			nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
			require.NoError(t, err)
			cfgs := storagePair(t, tr, d, names, runs...)
			start := time.Now()
			res := runGuests(ctx, t, img, nw, 10*time.Minute, cfgs[0], cfgs[1])
			t.Logf("%s row: %v", tr.name, time.Since(start).Round(time.Second))
			matrix[tr.name] = checkStorage(t, tr.name, res, runs...)
			if d != nil {
				t.Logf("daemon counters: %s", nonzero(d.Status().Counters))
			}
		})
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%-6s %-8s %-8s\n", "", "rxe", "pvrdma")
	for _, r := range runs {
		fmt.Fprintf(&b, "%-6s", r.Kind)
		for _, tr := range []string{"rxe", "pvrdma"} {
			v := "-"
			if sr, ok := matrix[tr][r.Kind]; ok {
				v = "pass"
				if sr.Err() != nil {
					v = "FAIL"
				}
			}
			fmt.Fprintf(&b, " %-8s", v)
		}
		b.WriteString("\n")
	}
	t.Logf("storage consumers (data checked on both sides):\n%s", b.String())
}
