package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

func cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestUsage(t *testing.T) {
	code, _, stderr := cli(t)
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "qemu-args")
	code, _, stderr = cli(t, "frobnicate")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, `unknown command "frobnicate"`)
	code, _, _ = cli(t, "qemu-args", "--register=false")
	assert.Equal(t, 2, code, "--vm is required")
	code, _, stderr = cli(t, "serve", "--transport", "ibverbs")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "needs --ibdev NAME or --create-rxe NETDEV")
	code, _, stderr = cli(t, "serve", "--transport", "rdma")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "want soft or ibverbs")
	code, _, stderr = cli(t, "serve", "--ibdev", "rxe0")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "need --transport ibverbs")
	code, _, stderr = cli(t, "serve", "--ip-wire", "gso")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "want udp or raw")
	code, _, stderr = cli(t, "serve", "--ip-wire", "raw", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--ip-wire raw needs IP mode")
	// This host has libibverbs but no RDMA device: the error names what to create.
	code, _, stderr = cli(t, "serve", "--transport", "ibverbs", "--ibdev", "nosuch0", "--fabric-netdev", "lo", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Regexp(t, `no such RDMA device|cannot load libibverbs`, stderr)
	code, _, stderr = cli(t, "serve", "--transport", "ibverbs", "--ibdev", "nosuch0", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "needs --fabric-netdev")
}

func TestQEMUArgsRegistersAndGuardsTheMAC(t *testing.T) {
	dir := t.TempDir()
	d, err := backend.New(backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "vm1"}, {Name: "vm3", RoCEMode: "v1"}},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(dir, "control.sock"))
		return err == nil
	}, 2*time.Second, 10*time.Millisecond)

	code, out, stderr := cli(t, "qemu-args", "--vm", "vm2", "--socket-dir", dir, "--mem", "2G", "--slot", "6")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, out, "size=2048M,share=on")
	assert.Contains(t, out, `"addr":"06.1"`)
	assert.Contains(t, out, filepath.Join(dir, "vm2.sock"))
	_, err = os.Stat(filepath.Join(dir, "vm2.sock"))
	assert.NoError(t, err, "qemu-args registered vm2, so its socket exists before QEMU starts")

	code, _, stderr = cli(t, "qemu-args", "--vm", "vm1", "--socket-dir", dir)
	assert.Equal(t, 0, code, "re-registering with the same MAC is fine: %s", stderr)
	code, _, stderr = cli(t, "qemu-args", "--vm", "vm1", "--socket-dir", dir, "--mac", "52:54:00:00:00:99")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered with MAC "+backend.DefaultMAC("vm1").String())

	code, out, _ = cli(t, "status", "--socket-dir", dir)
	require.Equal(t, 0, code)
	assert.True(t, strings.Contains(out, "vm1") && strings.Contains(out, "vm2"), out)
	assert.Contains(t, out, "RoCE v2 by default, congestion control dcqcn; CNPs sent 0 received 0")
	assert.Regexp(t, `vm3 +false +\S+ +v1 `, out)
	code, out, _ = cli(t, "status", "--socket-dir", dir, "--metrics")
	require.Equal(t, 0, code)
	assert.Contains(t, out, `pvrdma_vm_connected{vm="vm2"} 0`)
}

// TestGIDAllowFlags: the GID allow list given to qemu-args reaches the
// daemon (status shows it), a conflicting one is refused like a
// conflicting MAC, and malformed lists fail before anything starts.
func TestGIDAllowFlags(t *testing.T) {
	dir := t.TempDir()
	d, err := backend.New(backend.Config{SocketDir: dir, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(dir, "control.sock"))
		return err == nil
	}, 2*time.Second, 10*time.Millisecond)

	code, _, stderr := cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--gid-allow", "10.5.0.0/24, fd05::/64")
	require.Equal(t, 0, code, stderr)
	code, out, _ := cli(t, "status", "--socket-dir", dir, "--json")
	require.Equal(t, 0, code)
	assert.Contains(t, out, `"gid_allow": [
        "10.5.0.0/24",
        "fd05::/64"
      ]`)
	code, _, stderr = cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--gid-allow", "10.6.0.0/24")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered with --gid-allow 10.5.0.0/24,fd05::/64")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--roce-mode", "v1")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered as RoCE v2, not v1")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t3", "--socket-dir", dir, "--roce-mode", "v1")
	require.Equal(t, 0, code, stderr)
	_, out, _ = cli(t, "status", "--socket-dir", dir, "--json")
	assert.Contains(t, out, `"roce_mode": "v1"`)
	code, _, stderr = cli(t, "qemu-args", "--vm", "t4", "--socket-dir", dir, "--roce-mode", "v3")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "bad RoCE mode")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t2", "--socket-dir", dir, "--gid-allow", "10.5.0.0/33")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "bad GID allow list")

	code, _, stderr = cli(t, "serve", "--socket-dir", t.TempDir(), "--gid-allow", "nonsense")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--gid-allow")
	code, _, stderr = cli(t, "serve", "--socket-dir", t.TempDir(), "--vm", "v1,gid-allow=300.0.0.0/8")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "bad GID allow list")
}
