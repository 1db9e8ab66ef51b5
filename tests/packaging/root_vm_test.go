//go:build vm

package packaging

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// cleanRoot returns a fresh copy of a minimal bookworm root with systemd as its init,
// made once by debootstrap into the VM image cache.
func cleanRoot(t *testing.T) string {
	t.Helper()
	return rootWith(t)
}

// rootWith returns a fresh copy of the clean root with the bookworm packages pkgs
// installed (vm.CopyDebianRoot: each package list is installed once into a layer cached
// beside the clean root).
func rootWith(t *testing.T, pkgs ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "root")
	if err := vm.CopyDebianRoot(context.Background(), t.Logf, dir, pkgs...); err != nil {
		t.Fatal(err)
	}
	return dir
}

// boot runs the root under systemd-nspawn until it powers off, with a private
// network; it returns the console output.
func boot(t *testing.T, root string, timeout time.Duration) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// CAP_IPC_LOCK is not in nspawn's default set, and a host has it: the
	// unit grants it to the daemon (and nothing lifts RLIMIT_MEMLOCK).
	cmd := exec.CommandContext(ctx, "systemd-nspawn", "--quiet", "-D", root, "--boot",
		"--register=no", "--keep-unit", "--private-network", "--console=read-only", "--capability=CAP_IPC_LOCK")
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("container did not power off within %v:\n%s", timeout, tail(string(out), 4000))
	}
	if err != nil {
		t.Logf("systemd-nspawn: %v", err)
	}
	return string(out)
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// repoRoot is the module's root directory (where the Makefile is).
func repoRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		t.Fatalf("go list -m: %v", err)
	}
	return strings.TrimSpace(string(out))
}
