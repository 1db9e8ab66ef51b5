package backend

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// hangBound bounds the tests' waits for an event (the daemon serving, a
// connection torn down): it only turns a hang into a failure, and is
// generous so that a loaded machine does not fail them.
const hangBound = 30 * time.Second

// servingLogger returns a logger writing to h and a channel closed when
// the daemon logs "serving": Run has its control socket listening with
// its permissions set. Waiting on it rather than polling for the socket
// file (which exists before its mode is set) does not race the daemon.
func servingLogger(h slog.Handler) (*slog.Logger, <-chan struct{}) {
	ch := make(chan struct{})
	return slog.New(servingHandler{Handler: h, once: new(sync.Once), serving: ch}), ch
}

type servingHandler struct {
	slog.Handler
	once    *sync.Once
	serving chan struct{}
}

func (h servingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelInfo || h.Handler.Enabled(ctx, l)
}

func (h servingHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "serving" {
		h.once.Do(func() { close(h.serving) })
	}
	if !h.Handler.Enabled(ctx, r.Level) {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h servingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	h.Handler = h.Handler.WithAttrs(as)
	return h
}

func (h servingHandler) WithGroup(name string) slog.Handler {
	h.Handler = h.Handler.WithGroup(name)
	return h
}

// waitServing waits until the daemon whose Run reports to done serves
// (serving from servingLogger). If Run returns first, its error goes back
// into done (for the caller's cleanup) and the test fails at once.
func waitServing(t *testing.T, serving <-chan struct{}, done chan error) {
	t.Helper()
	select {
	case <-serving:
	case err := <-done:
		done <- err
		t.Fatalf("daemon stopped before serving: %v", err)
	case <-time.After(hangBound):
		t.Fatalf("daemon not serving after %v", hangBound)
	}
}

// serveQuiet runs a daemon of cfg (its log discarded) until the test
// ends, which requires that it stops cleanly, and returns once it serves.
func serveQuiet(t *testing.T, cfg Config) *Daemon {
	t.Helper()
	logger, serving := servingLogger(slog.NewTextHandler(io.Discard, nil))
	cfg.Logger = logger
	d, err := New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	waitServing(t, serving, done)
	return d
}

func testDaemon(t *testing.T) (*Daemon, string, context.CancelFunc) {
	t.Helper()
	dir := t.TempDir()
	logger, serving := servingLogger(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	d, err := New(Config{SocketDir: dir, VMs: []VMRequest{{Name: "vm1"}}, Logger: logger})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	waitServing(t, serving, done)
	return d, dir, cancel
}

func dialVM(t *testing.T, path string) *vfiousertest.Client {
	t.Helper()
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	c := vfiousertest.NewClient(conn)
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	return c
}

func TestDaemonServesAPVRDMAFunctionPerVM(t *testing.T) {
	d, dir, _ := testDaemon(t)
	ctx := context.Background()
	ctl := NewControlClient(filepath.Join(dir, "control.sock"))
	_, err := ctl.AddVM(ctx, VMRequest{Name: "vm2", MAC: "52:54:00:77:00:02"})
	require.NoError(t, err)

	c := dialVM(t, d.SocketPath("vm1"))
	fd, _, err := vfiousertest.Memfd(64 << 20)
	require.NoError(t, err)
	require.NoError(t, c.DMAMap(0, 64<<20, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, 0))
	id, err := c.Read32(vfiouser.RegionConfig, 0)
	require.NoError(t, err)
	assert.Equal(t, uint32(0x0820_15ad), id, "PCI 15ad:0820")
	class, err := c.Read32(vfiouser.RegionConfig, 8)
	require.NoError(t, err)
	assert.Equal(t, uint32(0x028000), class>>8, "class network-other")
	require.NoError(t, c.Write32(vfiouser.RegionConfig, 4, 0x0006)) // memory decode + bus master, as firmware does
	ver, err := c.Read32(1, 0)                                      // BAR1 VERSION
	require.NoError(t, err)
	assert.Equal(t, uint32(20), ver)

	// A second QEMU on the same VM socket is refused while the first is connected.
	conn2, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: d.SocketPath("vm1"), Net: "unix"})
	require.NoError(t, err)
	c2 := vfiousertest.NewClient(conn2)
	_, err = c2.Negotiate(vfiousertest.QEMUCaps)
	assert.Error(t, err)
	c2.Close()

	st, err := ctl.Status(ctx)
	require.NoError(t, err)
	require.Len(t, st.VMs, 2)
	assert.True(t, st.VMs[0].Connected)
	assert.Equal(t, uint64(64<<20), st.VMs[0].LockedBytes)
	assert.False(t, st.VMs[1].Connected)
	assert.Equal(t, "52:54:00:77:00:02", st.VMs[1].MAC)

	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return !d.Status().VMs[0].Connected }, hangBound, 10*time.Millisecond,
		"EOF tears the device down")
	// The VM socket serves the next QEMU (a restarted VM).
	c3 := dialVM(t, d.SocketPath("vm1"))
	v, err := c3.Read32(1, 0)
	require.NoError(t, err)
	assert.Equal(t, uint32(0xffffffff), v, "memory decode is off again on a new connection")
	require.NoError(t, c3.Write32(vfiouser.RegionConfig, 4, 0x0002))
	v, err = c3.Read32(1, 0)
	require.NoError(t, err)
	assert.Equal(t, uint32(20), v)
	c3.Close()

	require.NoError(t, ctl.RemoveVM(ctx, "vm2"))
	_, err = os.Stat(d.SocketPath("vm2"))
	assert.ErrorIs(t, err, os.ErrNotExist)
}
