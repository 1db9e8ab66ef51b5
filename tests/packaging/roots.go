package packaging

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// rootRecipe is how the clean root is made: debootstrap's suite, variant and extra
// packages, then the changes made to what it left (Tweaks names them: change it when
// they change). The cached root's directory is keyed on a digest of the recipe, so a
// changed recipe builds a new root beside the old one.
type rootRecipe struct {
	Suite   string
	Variant string
	Include []string
	Tweaks  string
}

// cleanRecipe is the clean root: a minimal bookworm with systemd as its init, without a
// getty on the console (a container's boot has nothing to wait for).
func cleanRecipe() rootRecipe {
	return rootRecipe{Suite: "bookworm", Variant: "minbase", Include: []string{"systemd", "systemd-sysv"}, Tweaks: "two-stage,no-getty-tty1"}
}

// relayPackages are what the relay needs in the root besides the package: libibverbs
// and its rxe provider, modprobe (systemd-modules-load uses libkmod; the kernel's module
// autoloading runs /sbin/modprobe) and iproute2's rdma (the relay test counts the host
// device's objects with it).
func relayPackages() []string {
	return []string{"kmod", "libibverbs1", "ibverbs-providers", "iproute2"}
}

// layers are the package lists the tests install over the clean root, each into a
// layer of its own that EnsureRoots builds ahead of the tests.
func layers() [][]string {
	return [][]string{relayPackages()}
}

// key is a short digest of v's JSON encoding.
func key(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only ever called with plain structs and string slices
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])[:12]
}

// rootDir is where the clean root of recipe r lives in the cache.
func rootDir(cacheDir string, r rootRecipe) string {
	return filepath.Join(cacheDir, "pkgroot", fmt.Sprintf("%s-%s-%s", r.Suite, r.Variant, key(r)))
}

// layerDir is where pkgs installed over base live in the cache.
func layerDir(base string, pkgs []string) string {
	return base + "+" + key(pkgs)
}

// EnsureRoots builds, unless they are cached, the clean root and every package layer
// the tests install over it, under cacheDir's pkgroot/ (cacheDir "" is the VM image
// cache's, vm.DefaultCacheDir). `make roots` runs it before the tests, so that none of
// them spends its time on debootstrap or apt. logf receives what was built and how long
// it took. It returns the roots' directories, the clean root's first.
func EnsureRoots(ctx context.Context, cacheDir string, logf func(string, ...any)) ([]string, error) {
	var dirs []string
	for _, pkgs := range append([][]string{nil}, layers()...) {
		dir, err := ensureRoot(ctx, cacheDir, pkgs, logf)
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, dir)
	}
	return dirs, nil
}

// ensureRoot returns the cached root with pkgs installed over the clean root (the clean
// root itself when pkgs is empty), building whatever is missing.
func ensureRoot(ctx context.Context, cacheDir string, pkgs []string, logf func(string, ...any)) (string, error) {
	for _, tool := range []string{"debootstrap", "systemd-nspawn"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "", fmt.Errorf("%s is missing: run scripts/deps.sh (Debian: debootstrap, systemd-container)", tool)
		}
	}
	if cacheDir == "" {
		cacheDir = vm.DefaultCacheDir()
	}
	if logf == nil {
		logf = func(string, ...any) {}
	}
	base := rootDir(cacheDir, cleanRecipe())
	if err := ensureBase(ctx, base, cleanRecipe(), logf); err != nil {
		return "", err
	}
	if len(pkgs) == 0 {
		return base, nil
	}
	layer := layerDir(base, pkgs)
	if err := ensureLayer(ctx, base, layer, pkgs, logf); err != nil {
		return "", err
	}
	return layer, nil
}

// lockFile takes an exclusive flock on path, so that parallel test binaries and `make
// roots` build a root once.
func lockFile(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ensureBase debootstraps the clean root unless it is there. A root is built in a
// temporary directory beside it and renamed into place only when complete.
func ensureBase(ctx context.Context, base string, r rootRecipe, logf func(string, ...any)) error {
	lock, err := lockFile(base + ".lock")
	if err != nil {
		return fmt.Errorf("clean root: lock: %w", err)
	}
	defer lock.Close()
	if _, err := os.Stat(filepath.Join(base, "usr/lib/systemd/systemd")); err == nil {
		return nil
	}
	mirror := os.Getenv(vm.EnvMirror)
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	tmp := base + ".tmp"
	_ = os.RemoveAll(tmp)
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	start := time.Now()
	logf("debootstrap %s (%s, with %s) into %s", r.Suite, r.Variant, strings.Join(r.Include, ","), base)
	fail := func(what string, err error, out []byte) error {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("debootstrap %s: %s: %w: %s", r.Suite, what, err, tail(string(out), 2000))
	}
	// The first stage downloads and unpacks; the second, in the root, configures the
	// packages with dpkg, which without force-unsafe-io syncs every file it writes (a root
	// that a crash leaves half-made is removed and made again anyway).
	first := exec.CommandContext(ctx, "debootstrap", "--foreign", "--variant="+r.Variant,
		"--include="+strings.Join(r.Include, ","), r.Suite, tmp, mirror)
	if out, err := first.CombinedOutput(); err != nil {
		return fail("first stage", err, out)
	}
	firstTook := time.Since(start)
	unsafeIO := filepath.Join(tmp, "etc/dpkg/dpkg.cfg.d/pvrdma-test-unsafe-io")
	if err := os.WriteFile(unsafeIO, []byte("force-unsafe-io\n"), 0o644); err != nil {
		return fail("dpkg options", err, nil)
	}
	second := exec.CommandContext(ctx, "chroot", tmp, "/debootstrap/debootstrap", "--second-stage")
	if out, err := second.CombinedOutput(); err != nil {
		return fail("second stage", err, out)
	}
	if err := os.Remove(unsafeIO); err != nil {
		return fail("dpkg options", err, nil)
	}
	// The tweaks (cleanRecipe's Tweaks names them).
	_ = os.Remove(filepath.Join(tmp, "etc/systemd/system/getty.target.wants/getty@tty1.service"))
	if err := os.Rename(tmp, base); err != nil {
		return fmt.Errorf("clean root: %w", err)
	}
	logf("debootstrapped a clean %s root in %v (downloading and unpacking %v, configuring %v)", r.Suite,
		time.Since(start).Round(time.Second), firstTook.Round(time.Second), (time.Since(start) - firstTook).Round(time.Second))
	return nil
}

// ensureLayer makes layer, a copy of base with pkgs installed by apt-get (run in the
// root under systemd-nspawn, on the host's network), unless it is there.
func ensureLayer(ctx context.Context, base, layer string, pkgs []string, logf func(string, ...any)) error {
	lock, err := lockFile(layer + ".lock")
	if err != nil {
		return fmt.Errorf("root layer: lock: %w", err)
	}
	defer lock.Close()
	if _, err := os.Stat(layer); err == nil {
		return nil
	}
	tmp := layer + ".tmp"
	_ = os.RemoveAll(tmp)
	if out, err := exec.Command("cp", "-a", base, tmp).CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("root layer: copy the clean root: %w: %s", err, out)
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	start := time.Now()
	logf("install %s in a copy of the clean root: %s", strings.Join(pkgs, " "), layer)
	script := "apt-get -q update && apt-get -q -y -o Dpkg::Options::=--force-unsafe-io install --no-install-recommends " +
		strings.Join(pkgs, " ") + " && apt-get clean"
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

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
