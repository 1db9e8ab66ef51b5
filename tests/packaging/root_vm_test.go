//go:build vm

package packaging

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// cleanRoot returns a fresh copy of the clean root (cleanRecipe): a minimal bookworm
// root with systemd as its init, made once by debootstrap into the VM image cache.
func cleanRoot(t *testing.T) string {
	t.Helper()
	return rootWith(t)
}

// rootWith returns a fresh copy of the clean root with the bookworm packages pkgs
// installed (with their dependencies, without recommends). Each package list is
// installed once, by apt-get in the clean root under systemd-nspawn, into a layer cached
// beside it; `make roots` builds the clean root and the layers the tests use (layers)
// before the tests run.
func rootWith(t *testing.T, pkgs ...string) string {
	t.Helper()
	plan, err := pinnedPlan()
	if err != nil {
		t.Fatal(err)
	}
	base, err := ensureRoot(context.Background(), "", plan, pkgs, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "root")
	if out, err := exec.Command("cp", "-a", base, dir).CombinedOutput(); err != nil {
		t.Fatalf("copy clean root: %v: %s", err, out)
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

// repoRoot is the module's root directory (where the Makefile is).
func repoRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		t.Fatalf("go list -m: %v", err)
	}
	return strings.TrimSpace(string(out))
}
