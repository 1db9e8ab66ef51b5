package vm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// A Debian root for Config.Root (or for systemd-nspawn): a minimal bookworm made once by
// debootstrap into the image cache, and layers of it with extra packages, each made once
// by apt-get inside a copy under systemd-nspawn. Tests boot their own copy.

// DebianRootRecipe names how the clean root is made; bump it when that changes.
const DebianRootRecipe = "bookworm-minbase-systemd-v1"

// CopyDebianRoot writes to dst (which must not exist) a copy of a minimal bookworm root
// with systemd as its init and the bookworm packages pkgs installed (with their
// dependencies, without recommends). The clean root and each package list's layer are
// made once, under the image cache (DefaultCacheDir), by debootstrap and systemd-nspawn
// (Debian packages debootstrap and systemd-container); parallel test binaries wait for
// each other under an flock.
func CopyDebianRoot(ctx context.Context, logf func(string, ...any), dst string, pkgs ...string) error {
	for _, tool := range []string{"debootstrap", "systemd-nspawn"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is missing: run scripts/deps.sh (Debian: debootstrap, systemd-container)", tool)
		}
	}
	base := filepath.Join(DefaultCacheDir(), "pkgroot", DebianRootRecipe)
	if err := ensureDebianBase(ctx, base, logf); err != nil {
		return err
	}
	if len(pkgs) > 0 {
		h := sha256.Sum256([]byte(strings.Join(pkgs, " ")))
		layer := base + "+" + hex.EncodeToString(h[:])[:12]
		if err := ensureDebianLayer(ctx, base, layer, pkgs, logf); err != nil {
			return err
		}
		base = layer
	}
	if out, err := exec.CommandContext(ctx, "cp", "-a", base, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("copy the debian root: %w: %s", err, out)
	}
	return nil
}

// ensureDebianLayer makes layer, a copy of base with pkgs installed by apt-get (run in
// the root under systemd-nspawn, on the host's network), unless it is there.
func ensureDebianLayer(ctx context.Context, base, layer string, pkgs []string, logf func(string, ...any)) error {
	unlock, err := flockPath(layer + ".lock")
	if err != nil {
		return fmt.Errorf("root layer: %w", err)
	}
	defer unlock()
	if _, err := os.Stat(layer); err == nil {
		return nil
	}
	tmp := layer + ".tmp"
	_ = os.RemoveAll(tmp)
	if out, err := exec.CommandContext(ctx, "cp", "-a", base, tmp).CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("root layer: copy the clean root: %w: %s", err, out)
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	start := time.Now()
	script := "apt-get -q update && apt-get -q -y install --no-install-recommends " + strings.Join(pkgs, " ") + " && apt-get clean"
	cmd := exec.CommandContext(ctx, "systemd-nspawn", "--quiet", "-D", tmp, "--register=no", "--keep-unit", "--pipe",
		"-E", "DEBIAN_FRONTEND=noninteractive", "/bin/sh", "-c", script)
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("root layer: install %s: %w: %s", strings.Join(pkgs, " "), err, lastChars(string(out), 2000))
	}
	if err := os.Rename(tmp, layer); err != nil {
		return fmt.Errorf("root layer: %w", err)
	}
	logf("installed %s in a copy of the clean root in %v", strings.Join(pkgs, " "), time.Since(start).Round(time.Second))
	return nil
}

// ensureDebianBase debootstraps the base root unless it is there.
func ensureDebianBase(ctx context.Context, base string, logf func(string, ...any)) error {
	if err := os.MkdirAll(filepath.Dir(base), 0o755); err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	unlock, err := flockPath(base + ".lock")
	if err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	defer unlock()
	if _, err := os.Stat(filepath.Join(base, "usr/lib/systemd/systemd")); err == nil {
		return nil
	}
	mirror := os.Getenv(EnvMirror)
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	tmp := base + ".tmp"
	_ = os.RemoveAll(tmp)
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, "debootstrap", "--variant=minbase", "--include=systemd,systemd-sysv",
		"bookworm", tmp, mirror)
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("debootstrap bookworm: %w: %s", err, lastChars(string(out), 2000))
	}
	// No getty on the container's console: the boot has nothing to wait for.
	_ = os.Remove(filepath.Join(tmp, "etc/systemd/system/getty.target.wants/getty@tty1.service"))
	if err := os.Rename(tmp, base); err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	logf("debootstrapped a clean bookworm root in %v", time.Since(start).Round(time.Second))
	return nil
}

// flockPath takes an exclusive flock on the file name (created if missing) and returns
// its release.
func flockPath(name string) (func(), error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", name, err)
	}
	return func() { f.Close() }, nil
}

// lastChars is the end of s, at most n bytes of it.
func lastChars(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
