package ibverbs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAccessProblem: why a device the kernel has cannot be opened, on fake sysfs and
// /dev trees.
func TestAccessProblem(t *testing.T) {
	sys, dev := t.TempDir(), t.TempDir()
	mk := func(p, content string) {
		t.Helper()
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
	}
	require.Empty(t, accessProblem(sys, dev, "rxe_eth0"), "the kernel has no such device: nothing to explain")

	require.NoError(t, os.MkdirAll(filepath.Join(sys, "class/infiniband/rxe_eth0"), 0o755))
	require.Contains(t, accessProblem(sys, dev, "rxe_eth0"), "no verbs device for it: load ib_uverbs")

	mk(filepath.Join(sys, "class/infiniband_verbs/uverbs0/ibdev"), "mlx5_0\n")
	mk(filepath.Join(sys, "class/infiniband_verbs/uverbs1/ibdev"), "rxe_eth0\n")
	p := accessProblem(sys, dev, "rxe_eth0")
	require.Contains(t, p, filepath.Join(dev, "infiniband/uverbs1")+" is missing")
	require.Contains(t, p, "PrivateDevices=yes")
	require.Contains(t, p, "DeviceAllow=char-infiniband_verbs rw")

	mk(filepath.Join(dev, "infiniband/uverbs1"), "")
	require.Empty(t, accessProblem(sys, dev, "rxe_eth0"), "the node opens")
}
