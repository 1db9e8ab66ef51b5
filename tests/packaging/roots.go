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
	"slices"
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

// PyverbsPackages are what tests/e2e's TestPyverbsSuite needs in its guest's root:
// python3-pyverbs (rdma-core 44's Python bindings, with the suite in
// /usr/share/doc/rdma-core/tests), iproute2 (the suite runs `ip -j addr`, and pvt_rxe
// runs `rdma link add`) and kmod (pvt_rxe's modprobe).
func PyverbsPackages() []string {
	return []string{"python3-pyverbs", "iproute2", "kmod"}
}

// layers are the package lists the tests install over the clean root, each into a
// layer of its own that EnsureRoots builds ahead of the tests.
func layers() [][]string {
	return [][]string{relayPackages(), PyverbsPackages()}
}

// CopyRoot makes dst a copy of the clean root with pkgs installed, building the
// root and the layer into the cache (cacheDir "" as for EnsureRoots) if they are
// missing. Tests of other packages that boot a Debian root under systemd use it.
func CopyRoot(ctx context.Context, cacheDir string, logf func(string, ...any), dst string, pkgs ...string) error {
	plan, err := pinnedPlan()
	if err != nil {
		return err
	}
	src, err := ensureRoot(ctx, cacheDir, plan, pkgs, logf)
	if err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, "cp", "-a", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("copy the root %s: %w: %s", src, err, out)
	}
	return nil
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

// rootDir is where the clean root of recipe r, with the packages pins (the test bed
// lock's name=version:arch), lives in the cache.
func rootDir(cacheDir string, r rootRecipe, pins []string) string {
	return filepath.Join(cacheDir, "pkgroot", fmt.Sprintf("%s-%s-%s", r.Suite, r.Variant, key(struct {
		R    rootRecipe
		Pins []string
	}{r, pins})))
}

// layerDir is where pkgs installed over base, as the pins say, live in the cache.
func layerDir(base string, pkgs, pins []string) string {
	return base + "+" + key(struct {
		Pkgs, Pins []string
	}{pkgs, pins})
}

// request is what the lock records as the clean root's request.
func (r rootRecipe) request() []string {
	return append([]string{r.Suite, r.Variant}, r.Include...)
}

// layerName is the lock's key for the layer of pkgs.
func layerName(pkgs []string) string { return strings.Join(pkgs, " ") }

// rootPlan is how the roots are built: from the test bed lock's pins, or (update) from
// what the mirror serves, the pins then recorded in lock.
type rootPlan struct {
	lock   *vm.Lock
	update vm.LockUpdate
}

// pinnedPlan is the plan of every test: the lock in force.
func pinnedPlan() (rootPlan, error) {
	l, _, err := vm.LoadLock()
	if err != nil {
		return rootPlan{}, err
	}
	return rootPlan{lock: l}, nil
}

// pins returns the lock's set for name and whether the build takes it as it is (else it
// resolves from the mirror and records what it got).
func (p rootPlan) pins(name string, request []string) (vm.LockedSet, bool, error) {
	set := p.lock.Roots[name]
	ok := len(set.Packages) > 0 && slices.Equal(set.Request, request)
	switch {
	case p.update == vm.UpdateAll, p.update == vm.UpdateMissing && !ok:
		return vm.LockedSet{Request: request}, false, nil
	case !ok:
		return vm.LockedSet{}, false, fmt.Errorf("packaging root %q: %w for the code's request %v (the lock has %v): run `make testbed-lock` to pin it, or `make testbed-update`",
			name, vm.ErrNotLocked, request, set.Request)
	}
	return set, true, nil
}

// record stores a root's resolved set in the plan's lock.
func (p rootPlan) record(name string, set vm.LockedSet) {
	if p.lock.Roots == nil {
		p.lock.Roots = map[string]vm.LockedSet{}
	}
	p.lock.Roots[name] = set
}

// dpkgList returns the root's installed packages as name=version:arch, sorted.
func dpkgList(ctx context.Context, root string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "dpkg-query", "--admindir="+filepath.Join(root, "var/lib/dpkg"), "-W",
		"-f", "${db:Status-Abbrev} ${Package}=${Version}:${Architecture}\n").Output()
	if err != nil {
		return nil, fmt.Errorf("dpkg-query in %s: %w", root, err)
	}
	var list []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && strings.HasPrefix(f[0], "ii") {
			list = append(list, f[1])
		}
	}
	slices.Sort(list)
	return list, nil
}

// pinMismatch describes how got differs from the pins want, at most a few packages.
func pinMismatch(what string, want, got []string) error {
	w, g := map[string]bool{}, map[string]bool{}
	for _, s := range want {
		w[s] = true
	}
	for _, s := range got {
		g[s] = true
	}
	var diff []string
	for _, s := range got {
		if !w[s] {
			diff = append(diff, "+"+s)
		}
	}
	for _, s := range want {
		if !g[s] {
			diff = append(diff, "-"+s)
		}
	}
	if len(diff) == 0 {
		return nil
	}
	more := ""
	if len(diff) > 12 {
		more = fmt.Sprintf(" and %d more", len(diff)-12)
		diff = diff[:12]
	}
	return fmt.Errorf("%s: the mirror installed other packages than the test bed lock pins (%s%s): the mirror has moved on; run `make testbed-update` to pin what it serves now (it rewrites %s only if the smoke VM tests pass)",
		what, strings.Join(diff, " "), more, vm.LockFile)
}

// layerPins are the packages of list that base does not have as they are.
func layerPins(base, list []string) []string {
	in := map[string]bool{}
	for _, s := range base {
		in[s] = true
	}
	var out []string
	for _, s := range list {
		if !in[s] {
			out = append(out, s)
		}
	}
	return out
}

// wantLayer is the dpkg list a layer over base with pins must have: base's packages,
// those the pins name at the pins' versions, and the pins.
func wantLayer(base, pins []string) []string {
	pinned := map[string]bool{}
	for _, s := range pins {
		if p, err := vm.ParsePackage(s); err == nil {
			pinned[p.Name+":"+p.Arch] = true
		}
	}
	var out []string
	for _, s := range base {
		if p, err := vm.ParsePackage(s); err == nil && pinned[p.Name+":"+p.Arch] {
			continue
		}
		out = append(out, s)
	}
	out = append(out, pins...)
	slices.Sort(out)
	return out
}

// EnsureRoots builds, unless they are cached, the clean root and every package layer
// the tests install over it, under cacheDir's pkgroot/ (cacheDir "" is the VM image
// cache's, vm.DefaultCacheDir), with the packages the test bed lock pins. `make roots`
// runs it before the tests, so that none of them spends its time on debootstrap or apt.
// logf receives what was built and how long it took. It returns the roots'
// directories, the clean root's first.
func EnsureRoots(ctx context.Context, cacheDir string, logf func(string, ...any)) ([]string, error) {
	plan, err := pinnedPlan()
	if err != nil {
		return nil, err
	}
	return ensureRoots(ctx, cacheDir, plan, logf)
}

// UpdateRoots builds the roots from what the mirror serves (every root with
// vm.UpdateAll; with vm.UpdateMissing only those lock does not pin) and records their
// packages in lock, for `make testbed-update`.
func UpdateRoots(ctx context.Context, cacheDir string, lock *vm.Lock, mode vm.LockUpdate, logf func(string, ...any)) ([]string, error) {
	return ensureRoots(ctx, cacheDir, rootPlan{lock: lock, update: mode}, logf)
}

func ensureRoots(ctx context.Context, cacheDir string, plan rootPlan, logf func(string, ...any)) ([]string, error) {
	var dirs []string
	for _, pkgs := range append([][]string{nil}, layers()...) {
		dir, err := ensureRoot(ctx, cacheDir, plan, pkgs, logf)
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, dir)
	}
	return dirs, nil
}

// ensureRoot returns the cached root with pkgs installed over the clean root (the clean
// root itself when pkgs is empty), building whatever is missing.
func ensureRoot(ctx context.Context, cacheDir string, plan rootPlan, pkgs []string, logf func(string, ...any)) (string, error) {
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
	base, basePins, err := ensureBase(ctx, cacheDir, cleanRecipe(), plan, logf)
	if err != nil {
		return "", err
	}
	if len(pkgs) == 0 {
		return base, nil
	}
	return ensureLayer(ctx, base, basePins, pkgs, plan, logf)
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

// ensureBase returns the clean root and its packages, debootstrapping it unless it is
// there. A root is built in a temporary directory beside it and renamed into place only
// when complete and, with the lock's pins, only if debootstrap installed exactly the
// pinned packages.
func ensureBase(ctx context.Context, cacheDir string, r rootRecipe, plan rootPlan, logf func(string, ...any)) (string, []string, error) {
	set, pinned, err := plan.pins("base", r.request())
	if err != nil {
		return "", nil, err
	}
	base := rootDir(cacheDir, r, set.Packages)
	if !pinned {
		// The packages are known once debootstrap has run: build aside, then key.
		base = filepath.Join(cacheDir, "pkgroot", "update-"+r.Suite)
	}
	lock, err := lockFile(base + ".lock")
	if err != nil {
		return "", nil, fmt.Errorf("clean root: lock: %w", err)
	}
	defer lock.Close()
	if _, err := os.Stat(filepath.Join(base, "usr/lib/systemd/systemd")); err == nil && pinned {
		return base, set.Packages, nil
	}
	tmp := base + ".tmp"
	if err := debootstrap(ctx, tmp, r, logf); err != nil {
		return "", nil, err
	}
	list, err := dpkgList(ctx, tmp)
	if err == nil && pinned {
		err = pinMismatch("clean root ("+strings.Join(r.request(), " ")+")", set.Packages, list)
	}
	if err != nil {
		_ = os.RemoveAll(tmp)
		return "", nil, err
	}
	if !pinned {
		plan.record("base", vm.LockedSet{Request: r.request(), Packages: list})
		base = rootDir(cacheDir, r, list)
		if _, err := os.Stat(base); err == nil {
			_ = os.RemoveAll(tmp)
			return base, list, nil
		}
	}
	if err := os.Rename(tmp, base); err != nil {
		return "", nil, fmt.Errorf("clean root: %w", err)
	}
	return base, list, nil
}

// debootstrap makes dir a clean root of recipe r.
func debootstrap(ctx context.Context, tmp string, r rootRecipe, logf func(string, ...any)) error {
	mirror := os.Getenv(vm.EnvMirror)
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	_ = os.RemoveAll(tmp)
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	start := time.Now()
	logf("debootstrap %s (%s, with %s) into %s", r.Suite, r.Variant, strings.Join(r.Include, ","), tmp)
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
	logf("debootstrapped a clean %s root in %v (downloading and unpacking %v, configuring %v)", r.Suite,
		time.Since(start).Round(time.Second), firstTook.Round(time.Second), (time.Since(start) - firstTook).Round(time.Second))
	return nil
}

// ensureLayer returns a copy of base (whose packages are basePins) with pkgs installed by
// apt-get (run in the root under systemd-nspawn, on the host's network), building it
// unless it is there: with the lock's pins, every package at its pinned version, and
// only if the result is exactly the pinned set.
func ensureLayer(ctx context.Context, base string, basePins, pkgs []string, plan rootPlan, logf func(string, ...any)) (string, error) {
	name := layerName(pkgs)
	set, pinned, err := plan.pins(name, pkgs)
	if err != nil {
		return "", err
	}
	layer := layerDir(base, pkgs, set.Packages)
	if !pinned {
		layer = base + "+update"
	}
	lock, err := lockFile(layer + ".lock")
	if err != nil {
		return "", fmt.Errorf("root layer: lock: %w", err)
	}
	defer lock.Close()
	if _, err := os.Stat(layer); err == nil && pinned {
		return layer, nil
	}
	tmp := layer + ".tmp"
	_ = os.RemoveAll(tmp)
	if out, err := exec.Command("cp", "-a", base, tmp).CombinedOutput(); err != nil {
		_ = os.RemoveAll(tmp)
		return "", fmt.Errorf("root layer: copy the clean root: %w: %s", err, out)
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	start := time.Now()
	install := pkgs
	if pinned {
		install = nil
		for _, s := range set.Packages {
			p, err := vm.ParsePackage(s)
			if err != nil {
				return "", err
			}
			install = append(install, p.Name+"="+p.Version)
		}
	}
	logf("install %s in a copy of the clean root: %s", strings.Join(pkgs, " "), layer)
	script := "apt-get -q update && apt-get -q -y -o Dpkg::Options::=--force-unsafe-io install --no-install-recommends " +
		strings.Join(install, " ") + " && apt-get clean"
	cmd := exec.CommandContext(ctx, "systemd-nspawn", "--quiet", "-D", tmp, "--register=no", "--keep-unit", "--pipe",
		"-E", "DEBIAN_FRONTEND=noninteractive", "/bin/sh", "-c", script)
	out, err := cmd.CombinedOutput()
	if err != nil && pinned && strings.Contains(string(out), "was not found") {
		err = fmt.Errorf("%w: the mirror no longer serves a version the test bed lock pins; run `make testbed-update` to pin what it serves now", err)
	}
	if err != nil {
		_ = os.RemoveAll(tmp)
		return "", fmt.Errorf("root layer: install %s: %w: %s", strings.Join(pkgs, " "), err, tail(string(out), 2000))
	}
	list, err := dpkgList(ctx, tmp)
	if err == nil && pinned {
		err = pinMismatch("root layer "+name, wantLayer(basePins, set.Packages), list)
	}
	if err != nil {
		_ = os.RemoveAll(tmp)
		return "", err
	}
	if !pinned {
		pins := layerPins(basePins, list)
		plan.record(name, vm.LockedSet{Request: slices.Clone(pkgs), Packages: pins})
		layer = layerDir(base, pkgs, pins)
		if _, err := os.Stat(layer); err == nil {
			_ = os.RemoveAll(tmp)
			return layer, nil
		}
	}
	if err := os.Rename(tmp, layer); err != nil {
		return "", fmt.Errorf("root layer: %w", err)
	}
	logf("installed %s in a copy of the clean root in %v", strings.Join(pkgs, " "), time.Since(start).Round(time.Second))
	return layer, nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
