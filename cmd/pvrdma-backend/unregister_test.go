package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// TestUnregister: `unregister VM` removes a registration from a real
// daemon (its socket goes, status no longer lists it, it can be registered
// again otherwise), says which VMs exist for an unknown name and that no
// daemon answers without one; the errors that say "unregister it first"
// name the command.
func TestUnregister(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "vm1"}}})

	code, _, stderr := cli(t, "qemu-args", "--vm", "vm1", "--socket-dir", dir, "--mac", "52:54:00:00:00:99")
	require.Equal(t, 1, code)
	assert.Contains(t, stderr, "unregister it first (pvrdma-backend unregister vm1 --socket-dir "+dir+")")

	code, _, stderr = cli(t, "unregister", "nosuch", "--socket-dir", dir)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "pvrdma-backend unregister: VM nosuch is not registered with the daemon on "+dir+" (its VMs: vm1)")

	code, out, stderr := cli(t, "unregister", "--socket-dir", dir, "vm1")
	require.Equal(t, 0, code, stderr)
	assert.Equal(t, "unregistered vm1\n", out)
	_, err := os.Stat(filepath.Join(dir, "vm1.sock"))
	assert.ErrorIs(t, err, os.ErrNotExist, "the VM's socket is gone")
	code, out, _ = cli(t, "status", "--socket-dir", dir)
	require.Equal(t, 0, code)
	assert.NotContains(t, out, "vm1")

	// Registered anew with another MAC, as the error advised.
	code, _, stderr = cli(t, "qemu-args", "--vm", "vm1", "--socket-dir", dir, "--mac", "52:54:00:00:00:99")
	assert.Equal(t, 0, code, stderr)

	code, _, stderr = cli(t, "unregister", "vm1", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "no daemon answers on ")
	assert.Contains(t, stderr, "is `pvrdma-backend serve` running?")

	code, _, _ = cli(t, "unregister", "--socket-dir", dir)
	assert.Equal(t, 2, code, "the VM's name is required")
	code, _, _ = cli(t, "unregister", "a", "b")
	assert.Equal(t, 2, code, "one VM")
	code, _, stderr = cli(t, "unregister", "../x", "--socket-dir", dir)
	assert.Equal(t, 1, code, stderr)
}

func TestUnregisterFirst(t *testing.T) {
	assert.Equal(t, "unregister it first (pvrdma-backend unregister vm1)", unregisterFirst(defaultSocketDir, "vm1"))
	assert.Equal(t, "unregister it first (pvrdma-backend unregister vm1 --socket-dir '/tmp/a b')", unregisterFirst("/tmp/a b", "vm1"))
}

// TestUnregisterConnected: a VM whose QEMU is connected is refused without
// --force (its device would die), and unregistered with it.
func TestUnregisterConnected(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "vm1"}}})
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, "vm1.sock"), Net: "unix"})
	require.NoError(t, err)
	defer conn.Close()
	c := vfiousertest.NewClient(conn)
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	ctl := backend.NewControlClient(controlPath(dir))
	require.Eventually(t, func() bool {
		st, err := ctl.Status(context.Background())
		return err == nil && len(st.VMs) == 1 && st.VMs[0].Connected
	}, 30*time.Second, 10*time.Millisecond, "the client connects as vm1's QEMU")

	code, _, stderr := cli(t, "unregister", "vm1", "--socket-dir", dir)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "VM vm1 is connected: its QEMU would lose the device until it restarts; shut the VM down first, or pass --force")
	code, out, stderr := cli(t, "unregister", "--force", "vm1", "--socket-dir", dir)
	require.Equal(t, 0, code, stderr)
	assert.Equal(t, "unregistered vm1 and disconnected its QEMU\n", out)
	st, err := ctl.Status(context.Background())
	require.NoError(t, err)
	assert.Empty(t, st.VMs)
}
