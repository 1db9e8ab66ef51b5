//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
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

// storageTransport is how the two guests of a storage row reach each other.
type storageTransport struct {
	name  string // "rxe" (kernel rxe in the guests: the control) or "pvrdma" (our device)
	ibdev string
}

var (
	transportRxe    = storageTransport{"rxe", "rxe0"}
	transportPvrdma = storageTransport{"pvrdma", "vmw_pvrdma0"}
)

// storagePair returns the target's and the initiator's guest configs of a storage row:
// a (10.77.0.1) serves, b (10.77.0.2) connects, both with the storage layer.
func storagePair(t testing.TB, tr storageTransport, d *backend.Daemon, names [2]string, mib int, runs ...vm.StorageRun) [2]vm.Config {
	t.Helper()
	ips := [2]string{"10.77.0.1", "10.77.0.2"}
	var cfgs [2]vm.Config
	for i := range cfgs {
		sc, err := vm.StorageScenario(i == 0, tr.ibdev, ips[i], ips[1-i], mib, runs...)
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
		if tr != transportRxe {
			// What the consumers' kernels warn about after a daemon crash:
			// vm.CrashWarnings says why.
			cfgs[i].KnownWarnings = vm.CrashWarnings()
		}
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
// E2E_STORAGE=nvme,srp). A name that is not a consumer fails the test (a typo would
// otherwise run nothing and pass), and so does a list that names none.
func storageKinds(t testing.TB) []string {
	t.Helper()
	only := os.Getenv("E2E_STORAGE")
	if only == "" {
		return vm.StorageConsumers
	}
	kinds, err := selectStorageKinds(only, vm.StorageConsumers)
	if err != nil {
		t.Fatalf("E2E_STORAGE=%q: %v", only, err)
	}
	return kinds
}

func short(sum string) string {
	if len(sum) > 12 {
		return sum[:12]
	}
	return sum
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
	for _, k := range storageKinds(t) {
		runs = append(runs, vm.StorageRun{Kind: k})
	}
	matrix := map[string]map[string]vm.StorageResult{}
	for _, tr := range []storageTransport{transportRxe, transportPvrdma} {
		t.Run(tr.name, func(t *testing.T) {
			var d *backend.Daemon
			names := [2]string{"sr" + tr.name[:1] + "1", "sr" + tr.name[:1] + "2"}
			if tr == transportPvrdma {
				d = daemon(t, backend.Config{}, names[0], names[1])
			}
			nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
			require.NoError(t, err)
			cfgs := storagePair(t, tr, d, names, storageMiB, runs...)
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

// TestStorageTwoHosts: the storage consumers between two stock guests on two daemons
// (two hosts, each daemon a process in its own network namespace, as TestTwoHosts runs
// them), over our device (rxe has no daemon): NVMe-oF, NFS over RDMA and SRP as in
// TestStorageConsumers; then each again, writing and reading back for 15 s while a
// daemon is upgraded live (A during NVMe-oF, B during NFS, A again during SRP). The
// consumers' connections carry on (every RC QP kept, fast registrations with them): no
// error recovery or reconnect in the initiator's kernel log, the NFS transport connected
// once, and the data checks out on both sides.
func TestStorageTwoHosts(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	bin, nwA, nwB := twoHosts(t)
	dirA := daemonProcessIn(t, nwA, bin, "fabA", "sta")
	dirB := daemonProcessIn(t, nwB, bin, "fabB", "stb")
	ctlA := backend.NewControlClient(filepath.Join(dirA, "control.sock"))
	ctlB := backend.NewControlClient(filepath.Join(dirB, "control.sock"))

	var runs []vm.StorageRun
	for _, k := range storageKinds(t) {
		runs = append(runs, vm.StorageRun{Kind: k})
	}
	type upgrade struct {
		ctl *backend.ControlClient
		gen int
		who string
	}
	upgrades := map[string]upgrade{}
	gens := map[string]int{}
	for i, k := range storageKinds(t) {
		sec := "upgrade-" + k
		runs = append(runs, vm.StorageRun{Kind: k, Section: sec, Secs: 15})
		who, ctl := "A", ctlA
		if i%2 == 1 {
			who, ctl = "B", ctlB
		}
		gens[who]++
		upgrades[sec] = upgrade{ctl, gens[who], who}
	}
	ips := [2]string{"10.77.0.1", "10.77.0.2"}
	dirs := [2]string{dirA, dirB}
	names := [2]string{"sta", "stb"}
	var cfgs [2]vm.Config
	for i := range cfgs {
		sc, err := vm.StorageScenario(i == 0, "vmw_pvrdma0", ips[i], ips[1-i], storageMiB, runs...)
		require.NoError(t, err)
		cfgs[i] = pvrdmaGuestIn(dirs[i], names[i], ips[i]+"/24", sc)
		cfgs[i].Modules, cfgs[i].Layers = rdmaCMModules, []vm.Layer{vm.LayerStorage}
		cfgs[i].NoErrExit, cfgs[i].Timeout = true, 15*time.Minute
	}
	start := time.Now()
	va, err := vm.Start(ctx, t, img, nwA, cfgs[0])
	require.NoError(t, err)
	vb, err := vm.Start(ctx, t, img, nwB, cfgs[1])
	require.NoError(t, err)
	vms := []*vm.VM{va, vb}
	both := []*backend.ControlClient{ctlA, ctlB}
	for _, r := range runs {
		u, ok := upgrades[r.Section]
		if !ok {
			continue
		}
		// The initiator's I/O is under way.
		require.NoError(t, vm.WaitStorageIO(10*time.Minute, vb, r.Section))
		upgradeDuring(t, vms, "=== "+r.Section, both, u.ctl, u.gen, u.who)
	}
	res, err := vm.WaitAll(ctx, va, vb)
	require.NoError(t, err)
	t.Logf("two hosts: %v", time.Since(start).Round(time.Second))
	results := checkStorage(t, "two-hosts", res, runs...)
	var refusedInv uint64
	for _, ctl := range both {
		st, err := ctl.Status(ctx)
		require.NoError(t, err)
		t.Logf("fabric %s counters: %s", st.Fabric.Netdev, nonzero(st.Counters))
		refusedInv += st.Counters["remote_invalidate_refused"]
	}
	// Through a live upgrade the consumers notice nothing: no error recovery, no
	// reconnect, the NFS transport connected once. One exception, still open: a
	// hand-over that cannot freeze every RC QP of a PD in time keeps none of that PD's
	// fast registrations (so that an invalidated key never comes back); the NFS
	// server's SEND with invalidate of such a key is then refused and xprtrdma
	// reconnects once. That case is logged, counted by remote_invalidate_refused, and
	// accepted here; any other reconnect fails.
	for sec := range upgrades {
		sr := results[sec]
		if strings.HasSuffix(sec, vm.StorageNFS) {
			if sr.NFSConnects == 2 && refusedInv > 0 {
				t.Logf("%s: xprtrdma reconnected once after a refused remote invalidation (%d): a fast registration of a PD with a busy QP was not kept across the hand-over (open)", sec, refusedInv)
				continue
			}
			assert.Equal(t, 1, sr.NFSConnects, "%s: the NFS transport's connects", sec)
		}
		assert.NotRegexp(t, `(?i)reconnect|error recovery|flushed|failed`, sr.HostDmesg, "%s: the initiator's kernel", sec)
	}
}

// BenchmarkStorageVsRxe measures NVMe over Fabrics between two stock guests over our
// device against kernel rxe in the guests, in the same run: the initiator's sequential
// write and read of 64 MiB in 1 MiB requests and its 4 KiB random reads and writes at
// queue depth 1 for 10 s each (dd and ioping with O_DIRECT on the namespace, a RAM disk
// on the target), and prints the ratios. TCG guests: the figures are the test bed's,
// compare only within a run.
//
//	go test -tags vm -run '^$' -bench StorageVsRxe -benchtime 1x ./tests/e2e
func BenchmarkStorageVsRxe(b *testing.B) {
	img := image(b)
	ctx := context.Background()
	run := vm.StorageRun{Kind: vm.StorageNVMe, Secs: 10, Bench: true}
	for i := 0; i < b.N; i++ {
		figs := map[string]vm.StorageBench{}
		for _, tr := range []storageTransport{transportRxe, transportPvrdma} {
			names := [2]string{"sb" + tr.name[:1] + "1", "sb" + tr.name[:1] + "2"}
			var d *backend.Daemon
			if tr == transportPvrdma {
				d = daemon(b, backend.Config{Logger: quietLogger()}, names[0], names[1])
			}
			nw, err := vm.NewNetwork(b, vm.NetworkConfig{})
			require.NoError(b, err)
			cfgs := storagePair(b, tr, d, names, 64, run)
			for i := range cfgs {
				cfgs[i].NoErrExit, cfgs[i].Timeout, cfgs[i].QuietConsole = true, 10*time.Minute, true
				cfgs[i].MemLock = true // as production runs them
			}
			vms, err := vm.StartAll(ctx, b, img, nw, cfgs[0], cfgs[1])
			require.NoError(b, err)
			res, err := vm.WaitAll(ctx, vms...)
			require.NoError(b, err)
			sec := vm.Section(res[1].Output, run.Kind)
			f, err := vm.ParseStorageBench(sec)
			require.NoError(b, err, "%s initiator:\n%s", tr.name, sec)
			figs[tr.name] = f
		}
		rxe, ours := figs["rxe"], figs["pvrdma"]
		w := os.Stdout
		fmt.Fprintf(w, "\n%-40s %14s %14s %8s\n", "NVMe-oF, initiator side (TCG guests)", "rxe in guest", "pvrdma", "ratio")
		row := func(key, label, unit string, r, o float64) {
			fmt.Fprintf(w, "%-40s %10.1f %-3s %10.1f %-3s %7.2fx\n", label, r, unit, o, unit, o/r)
			b.ReportMetric(o/r, "x_"+key)
		}
		row("seq_write", "sequential write, 1 MiB O_DIRECT", "MB/s", rxe.SeqWriteMBps, ours.SeqWriteMBps)
		row("seq_read", "sequential read, 1 MiB O_DIRECT", "MB/s", rxe.SeqReadMBps, ours.SeqReadMBps)
		row("rand_read", "4 KiB random read, QD1", "IOPS", rxe.RandReadIOPS, ours.RandReadIOPS)
		row("rand_write", "4 KiB random write, QD1", "IOPS", rxe.RandWriteIOPS, ours.RandWriteIOPS)
		fmt.Fprintf(w, "%-40s %10.0f us %10.0f us (read), %.0f / %.0f us (write)\n", "4 KiB average latency, QD1", rxe.RandReadUs, ours.RandReadUs, rxe.RandWriteUs, ours.RandWriteUs)
	}
}
