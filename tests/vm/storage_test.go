package vm

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func readStorageSample(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "storage", name))
	require.NoError(t, err)
	return string(b)
}

func TestStorageScenario(t *testing.T) {
	sc, err := StorageScenario(false, "rxe0", "10.77.0.2", "10.77.0.1", 32,
		StorageRun{Kind: StorageNVMe, Opts: "reconnect_delay=2"}, StorageRun{Kind: StorageNFS, Section: "upgrade-nfs", Secs: 15},
		StorageRun{Kind: StorageNVMe, Bench: true, Secs: 10})
	require.NoError(t, err)
	require.Equal(t, `pvt_rxe eth0
dmesg -c >/dev/null
echo '=== nvme'
if pvt_storage_host nvme rxe0 10.77.0.2 10.77.0.1 32 0 'reconnect_delay=2'; then echo rc=0; else echo rc=$?; fi
echo '=== upgrade-nfs'
if pvt_storage_host nfs rxe0 10.77.0.2 10.77.0.1 32 15 ''; then echo rc=0; else echo rc=$?; fi
echo '=== nvme'
if PVT_STORAGE_WORK=pvt_bench pvt_storage_host nvme rxe0 10.77.0.2 10.77.0.1 32 10 ''; then echo rc=0; else echo rc=$?; fi
echo '=== end'
`, sc)
	sc, err = StorageScenario(true, "vmw_pvrdma0", "10.77.0.1", "10.77.0.2", 32, StorageRun{Kind: StorageSRP})
	require.NoError(t, err)
	require.Contains(t, sc, "if pvt_storage_target srp vmw_pvrdma0 10.77.0.1 10.77.0.2 32 0; then")
	require.NotContains(t, sc, "pvt_rxe")

	for _, bad := range []struct {
		dev string
		mib int
		r   StorageRun
	}{
		{"rxe0", 32, StorageRun{Kind: "fcoe"}},
		{"rxe0", 32, StorageRun{Kind: StorageNFS, Opts: "x'; reboot; '"}},
		{"rxe0", 32, StorageRun{Kind: StorageNFS, Section: "a b"}},
		{"rxe0", 32, StorageRun{Kind: StorageNFS, Secs: -1}},
		{"rxe0", 0, StorageRun{Kind: StorageNFS}},
		{"rxe0 x", 32, StorageRun{Kind: StorageNFS}},
	} {
		_, err := StorageScenario(true, bad.dev, "10.77.0.1", "10.77.0.2", bad.mib, bad.r)
		require.Error(t, err, "%+v", bad)
	}
}

func TestParseStorage(t *testing.T) {
	target, host := readStorageSample(t, "target.txt"), readStorageSample(t, "initiator.txt")
	for _, k := range StorageConsumers {
		r, err := ParseStorage(target, host, k)
		require.NoError(t, err, k)
		require.NoError(t, r.Err(), k)
		require.Equal(t, 1, r.Passes, k)
		require.Len(t, r.Written, 32, k)
		require.Equal(t, 0, r.TargetRC, k)
		require.Equal(t, 0, r.HostRC, k)
	}
	r, err := ParseStorage(target, host, StorageNVMe)
	require.NoError(t, err)
	require.Contains(t, r.HostDmesg, `nvme nvme0: new ctrl: NQN "pvt-nvme"`)
	require.Contains(t, r.TargetDmesg, "nvmet: adding nsid 1 to subsystem pvt-nvme")
	require.NotContains(t, r.HostDmesg, "sum_written")
	require.Zero(t, r.NFSConnects, "only the NFS run prints its transport's counters")
	r, err = ParseStorage(target, host, StorageNFS)
	require.NoError(t, err)
	require.Equal(t, 1, r.NFSConnects)
	r, err = ParseStorage(target, strings.Replace(host, "xprt:\trdma 0 0 1 ", "xprt:\trdma 0 0 3 ", 1), StorageNFS)
	require.NoError(t, err)
	require.Equal(t, 3, r.NFSConnects, "a reconnect")

	_, err = ParseStorage(target, host, "iser")
	require.True(t, errors.Is(err, errStorageNoRun))

	// The target holds other data: an error naming it.
	bad := strings.Replace(target, "sum_target=f62d7dd187122ae06129058596ba66a8", "sum_target=00000000000000000000000000000000", 1)
	r, err = ParseStorage(bad, host, StorageNVMe)
	require.NoError(t, err)
	require.ErrorContains(t, r.Err(), "the target holds")
	// A side that printed no status.
	r, err = ParseStorage(strings.Replace(target, "=== nvme\n", "=== nvme\nrc=x\n", 1), strings.Replace(host, "rc=0\n=== nfs", "=== nfs", 1), StorageNVMe)
	require.NoError(t, err)
	require.Equal(t, -1, r.HostRC)
	require.ErrorContains(t, r.Err(), "initiator exited -1")
	// An initiator that wrote nothing.
	r, err = ParseStorage(target, "=== nvme\npvt: the target is not ready: fail\n--- dmesg\nrc=1\n", StorageNVMe)
	require.NoError(t, err)
	require.ErrorContains(t, r.Err(), "wrote no data")
}

func TestParseStorageBench(t *testing.T) {
	b, err := ParseStorageBench(readStorageSample(t, "bench.txt"))
	require.NoError(t, err)
	for _, v := range []float64{b.SeqWriteMBps, b.SeqReadMBps, b.RandReadIOPS, b.RandWriteIOPS, b.RandReadUs, b.RandWriteUs} {
		require.Positive(t, v)
	}
	_, err = ParseStorageBench("bench seq_write: 67108864 bytes (64.0MB) copied, 0 seconds, 0MB/s\n")
	require.True(t, errors.Is(err, ErrNoResult))
}

func FuzzParseStorage(f *testing.F) {
	for _, n := range []string{"target.txt", "initiator.txt", "bench.txt"} {
		f.Add(readStorageSample(f, n))
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, k := range StorageConsumers {
			if r, err := ParseStorage(s, s, k); err == nil {
				_ = r.Err()
			}
		}
		_, _ = ParseStorageBench(s)
	})
}
