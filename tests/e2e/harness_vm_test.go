//go:build vm

package e2e

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/proc"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

func image(t testing.TB) *vm.Image {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	return img
}

// testPool is the GID pool the test bed's daemons declare (--gid-allow):
// the private ranges, which the guests' addresses are in.
// Without a pool a VM binds only its link-local GID.
func testPool(t testing.TB) []netip.Prefix {
	t.Helper()
	p, err := backend.ParseGIDAllow(backend.PrivateGIDAllow)
	require.NoError(t, err)
	return p
}

// daemon starts a backend in this process with the named VMs registered
// (on testPool unless cfg declares another).
func daemon(t testing.TB, cfg backend.Config, names ...string) *backend.Daemon {
	t.Helper()
	if cfg.SocketDir == "" {
		cfg.SocketDir = t.TempDir()
	}
	if cfg.Logger == nil {
		level := slog.LevelInfo
		_ = level.UnmarshalText([]byte(os.Getenv("E2E_LOG"))) // E2E_LOG=debug for the device's command trace
		cfg.Logger = slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: level}))
	}
	if cfg.GIDAllow == nil {
		cfg.GIDAllow = testPool(t)
	}
	for _, n := range names {
		cfg.VMs = append(cfg.VMs, backend.VMRequest{Name: n})
	}
	d, err := backend.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("daemon: %v", err)
		}
	})
	return d
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

// pvrdmaGuest is a guest config with vmxnet3 at 05.0 (MAC as the backend
// derives it for name), our device at 05.1 and the daemon's QMP monitor,
// as qemu-args gives them.
func pvrdmaGuest(d *backend.Daemon, name, ip, scenario string) vm.Config {
	return pvrdmaGuestIn(filepath.Dir(d.SocketPath(name)), name, ip, scenario)
}

// pvrdmaGuestIn is pvrdmaGuest for a daemon serving the socket directory
// dir (one in another process).
func pvrdmaGuestIn(dir, name, ip, scenario string) vm.Config {
	dev, _ := json.Marshal(map[string]any{
		"driver": "vfio-user-pci", "addr": "05.1", "x-no-posted-writes": true,
		"socket": map[string]any{"type": "unix", "path": backend.SocketPath(dir, name)},
	})
	return vm.Config{
		Name:      name,
		NICs:      []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: backend.DefaultMAC(name).String(), IP: ip}},
		ExtraArgs: append([]string{"-device", string(dev)}, backend.VMSpec{QMPSocket: backend.QMPSocketPath(dir, name)}.QMPArgs()...),
		Scenario:  scenario,
	}
}

// buildDaemon builds the daemon's binary from this tree into a temporary
// directory and returns its path.
func buildDaemon(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "pvrdma-backend")
	build := exec.Command("go", "build", "-o", bin, "./cmd/pvrdma-backend")
	build.Dir = repoDir(t)
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// servedDaemon is a `pvrdma-backend serve` process of the test's
// (serveProcess).
type servedDaemon struct {
	dir    string                 // its socket directory
	ctl    *backend.ControlClient // its control socket
	log    *syncBuf               // its output (shown if the test failed)
	cmd    *exec.Cmd
	exited <-chan struct{} // closed when it has exited
}

// serveProcess builds the daemon and runs `pvrdma-backend serve` as a
// process of its own (under its own supervisor, as in a shell: a live
// upgrade execs the worker's binary in its process, a killed worker is
// started again) with the given --vm values, on the test networks' pool,
// and waits until its control socket answers. It is stopped (SIGTERM) at
// cleanup.
func serveProcess(t *testing.T, vms ...string) *servedDaemon {
	t.Helper()
	bin := buildDaemon(t)
	sd := &servedDaemon{dir: filepath.Join(t.TempDir(), "pvrdma"), log: &syncBuf{}}
	args := []string{"serve", "--socket-dir", sd.dir, "--gid-allow", "10.77.0.0/24"}
	for _, v := range vms {
		args = append(args, "--vm", v)
	}
	sd.cmd = exec.Command(bin, args...)
	// A test that dies takes the supervisor with it (and it its worker).
	sd.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	sd.cmd.Stdout, sd.cmd.Stderr = sd.log, sd.log
	exited, err := proc.Start(sd.cmd)
	require.NoError(t, err)
	sd.exited = exited
	t.Cleanup(func() {
		_ = sd.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(time.Minute):
			_ = sd.cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("serve's log:\n%s", tail(sd.log.String(), 12000))
		}
	})
	sd.ctl = backend.NewControlClient(filepath.Join(sd.dir, "control.sock"))
	require.Eventually(t, func() bool {
		_, err := sd.ctl.Status(context.Background())
		return err == nil
	}, time.Minute, 20*time.Millisecond, "serve did not start:\n%s", sd.log.String())
	return sd
}

// quietLogger logs only warnings and errors (benchmarks).
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
