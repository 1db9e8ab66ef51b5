//go:build vm

package packaging

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// rootRecipe names how the clean root is made; bump it when that changes.
const rootRecipe = "bookworm-minbase-systemd-v1"

// cleanRoot returns a fresh copy of a minimal bookworm root with systemd as its init,
// made once by debootstrap into the VM image cache.
func cleanRoot(t *testing.T) string {
	t.Helper()
	return rootWith(t)
}

// rootWith returns a fresh copy of the clean root with the bookworm packages pkgs
// installed (with their dependencies, without recommends). Each package list is
// installed once, by apt-get in the clean root under systemd-nspawn, into a layer cached
// beside it.
func rootWith(t *testing.T, pkgs ...string) string {
	t.Helper()
	for _, tool := range []string{"debootstrap", "systemd-nspawn"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing: run scripts/deps.sh (Debian: debootstrap, systemd-container)", tool)
		}
	}
	base := filepath.Join(vm.DefaultCacheDir(), "pkgroot", rootRecipe)
	if err := ensureBase(base, t.Logf); err != nil {
		t.Fatal(err)
	}
	if len(pkgs) > 0 {
		h := sha256.Sum256([]byte(strings.Join(pkgs, " ")))
		layer := base + "+" + hex.EncodeToString(h[:])[:12]
		if err := ensureLayer(base, layer, pkgs, t.Logf); err != nil {
			t.Fatal(err)
		}
		base = layer
	}
	dir := filepath.Join(t.TempDir(), "root")
	if out, err := exec.Command("cp", "-a", base, dir).CombinedOutput(); err != nil {
		t.Fatalf("copy clean root: %v: %s", err, out)
	}
	return dir
}

// ensureLayer makes layer, a copy of base with pkgs installed by apt-get (run in the
// root under systemd-nspawn, on the host's network), unless it is there; under an flock
// so that parallel test binaries make it once.
func ensureLayer(base, layer string, pkgs []string, logf func(string, ...any)) error {
	lock, err := os.OpenFile(layer+".lock", os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("root layer: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("root layer: lock: %w", err)
	}
	if _, err := os.Stat(layer); err == nil {
		return nil
	}
	tmp := layer + ".tmp"
	_ = os.RemoveAll(tmp)
	if out, err := exec.Command("cp", "-a", base, tmp).CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("root layer: copy the clean root: %w: %s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	start := time.Now()
	script := "apt-get -q update && apt-get -q -y install --no-install-recommends " + strings.Join(pkgs, " ") + " && apt-get clean"
	cmd := exec.CommandContext(ctx, "systemd-nspawn", "--quiet", "-D", tmp, "--register=no", "--keep-unit", "--pipe",
		"-E", "DEBIAN_FRONTEND=noninteractive", "/bin/sh", "-c", script)
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("root layer: install %s: %w: %s", strings.Join(pkgs, " "), err, tail(string(out), 2000))
	}
	if err := os.Rename(tmp, layer); err != nil {
		return fmt.Errorf("root layer: %w", err)
	}
	logf("installed %s in a copy of the clean root in %v", strings.Join(pkgs, " "), time.Since(start).Round(time.Second))
	return nil
}

// ensureBase debootstraps the base root unless it is there, under an flock so that
// parallel test binaries build it once.
func ensureBase(base string, logf func(string, ...any)) error {
	if err := os.MkdirAll(filepath.Dir(base), 0o755); err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	lock, err := os.OpenFile(base+".lock", os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("clean root: lock: %w", err)
	}
	if _, err := os.Stat(filepath.Join(base, "usr/lib/systemd/systemd")); err == nil {
		return nil
	}
	mirror := os.Getenv(vm.EnvMirror)
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	tmp := base + ".tmp"
	_ = os.RemoveAll(tmp)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, "debootstrap", "--variant=minbase", "--include=systemd,systemd-sysv",
		"bookworm", tmp, mirror)
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("debootstrap bookworm: %w: %s", err, tail(string(out), 2000))
	}
	// No getty on the container's console: the boot has nothing to wait for.
	_ = os.Remove(filepath.Join(tmp, "etc/systemd/system/getty.target.wants/getty@tty1.service"))
	if err := os.Rename(tmp, base); err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	logf("debootstrapped a clean bookworm root in %v", time.Since(start).Round(time.Second))
	return nil
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
