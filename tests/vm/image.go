package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// imageRecipe versions image.json itself.
const imageRecipe = "image-v1"

// Image is a built guest image: QEMU, the guest kernel and the base initramfs, all in the
// cache. It is immutable once returned.
type Image struct {
	// CacheDir is the cache the image lives in.
	CacheDir string `json:"cache_dir"`
	// QEMUDir is the QEMU component (the unpacked trixie tree is QEMUDir/root).
	QEMUDir string `json:"qemu_dir"`
	// QEMUVersion is the Debian version of qemu-system-x86.
	QEMUVersion string `json:"qemu_version"`
	// KernelABI is the guest kernel release, e.g. "6.1.0-56-amd64".
	KernelABI string `json:"kernel_abi"`
	// KernelVersion is the Debian version of the kernel packages, e.g. "6.1.192-2".
	KernelVersion string `json:"kernel_version"`
	// Kernel is the uncompressed PVH-bootable vmlinux.
	Kernel string `json:"kernel"`
	// Initramfs is the base initramfs (newc cpio, uncompressed). Each boot appends a
	// second archive with /init, the scenario and the test's files.
	Initramfs string `json:"initramfs"`
	// Modules are the kernel modules present in the guest.
	Modules []string `json:"modules"`
	// Packages are the exact guest userspace packages.
	Packages []Package `json:"packages"`
	// Layers are the optional archives a guest may add to the base (Config.Layers).
	Layers map[Layer]*LayerImage `json:"layers"`
	// Recipe is the image recipe version.
	Recipe string `json:"recipe"`
	// LockDigest is a digest of the image's part of the test bed lock it was built from:
	// a cached image built from another lock is not used.
	LockDigest string `json:"lock_digest"`
	// Lock is the lock the image was built from (with ImageOptions.Update, the new
	// pins). It is not saved in image.json.
	Lock *Lock `json:"-"`
}

func (img *Image) qemu() qemuInstall { return qemuPaths(img.QEMUDir) }

// QEMUCommand returns a command that runs the image's qemu-system-x86_64 (through the
// unpacked trixie loader and libraries, with its firmware and module directories) with
// args.
func (img *Image) QEMUCommand(ctx context.Context, args ...string) *exec.Cmd {
	return img.qemu().command(ctx, args...)
}

// WriteQEMUWrapper writes an executable shell script at path that runs the image's
// qemu-system-x86_64 as QEMUCommand does, with the script's arguments: an emulator
// for programs that take one binary path (libvirt's <emulator>).
func (img *Image) WriteQEMUWrapper(path string) error {
	cmd := img.QEMUCommand(context.Background())
	var b strings.Builder
	b.WriteString("#!/bin/sh\n# The VM test bed's QEMU, through its own loader and libraries.\n")
	for _, e := range cmd.Env {
		if strings.HasPrefix(e, "QEMU_MODULE_DIR=") {
			b.WriteString("export " + shQuote(e) + "\n")
		}
	}
	b.WriteString("exec")
	for _, a := range cmd.Args {
		b.WriteString(" " + shQuote(a))
	}
	b.WriteString(" \"$@\"\n")
	if err := os.WriteFile(path, []byte(b.String()), 0o755); err != nil {
		return fmt.Errorf("qemu wrapper: %w", err)
	}
	return nil
}

func shQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// ImageOptions configure EnsureImage. The zero value uses the defaults.
type ImageOptions struct {
	// CacheDir defaults to DefaultCacheDir().
	CacheDir string
	// Mirror and SecurityMirror default to $PVRDMA_DEBIAN_MIRROR /
	// $PVRDMA_DEBIAN_SECURITY_MIRROR, else deb.debian.org.
	Mirror, SecurityMirror string
	// Refresh fetches the package indices again (also set by PVRDMA_VM_REFRESH=1) before
	// the image is checked and built; the versions still come from the lock.
	Refresh bool
	// Logf receives progress messages; nil discards them.
	Logf func(format string, args ...any)
	// Lock pins the packages (nil: LoadLock's).
	Lock *Lock
	// Update, when not UpdateNone, resolves packages from the mirror's indices instead
	// of taking the lock's (UpdateAll: every component, the newest the mirror serves;
	// UpdateMissing: only the components the lock does not pin for the code's request)
	// and builds the image from them; the image's Lock field then holds the new pins.
	Update LockUpdate
	// KernelABI, with Update, pins this guest kernel ABI (e.g. 6.1.0-50-amd64) rather
	// than the newest complete one the indices have.
	KernelABI string
}

// LockUpdate says which pins a build may move (ImageOptions.Update).
type LockUpdate string

// The LockUpdate values.
const (
	UpdateNone    LockUpdate = ""
	UpdateAll     LockUpdate = "all"
	UpdateMissing LockUpdate = "missing"
)

// EnsureImage returns the cached image, building whatever is missing. A warm cache is
// used without any network access or apt call. logf (e.g. t.Logf) receives progress; it
// may be nil.
func EnsureImage(ctx context.Context, logf func(format string, args ...any)) (*Image, error) {
	return ImageOptions{Logf: logf}.Ensure(ctx)
}

func (o ImageOptions) withDefaults() ImageOptions {
	if o.CacheDir == "" {
		o.CacheDir = DefaultCacheDir()
	}
	if o.Mirror == "" {
		o.Mirror = envOr(EnvMirror, "http://deb.debian.org/debian")
	}
	if o.SecurityMirror == "" {
		o.SecurityMirror = envOr(EnvSecurityMirror, "http://deb.debian.org/debian-security")
	}
	if os.Getenv(EnvRefresh) == "1" {
		o.Refresh = true
	}
	if o.Update != UpdateNone {
		o.Refresh = true
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	return o
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// Ensure is EnsureImage with options.
func (o ImageOptions) Ensure(ctx context.Context) (*Image, error) {
	o = o.withDefaults()
	if o.Lock == nil {
		l, src, err := LoadLock()
		if err != nil {
			return nil, err
		}
		o.Lock = l
		o.Logf("test bed lock: %s (kernel %s, %s)", src, l.Kernel.ABI, l.Kernel.Version)
	}
	digest := o.Lock.imageDigest()
	if !o.Refresh {
		l, err := lockCache(o.CacheDir, false)
		if err != nil {
			return nil, err
		}
		img, err := loadImage(o.CacheDir, digest)
		l.unlock()
		if err == nil {
			img.Lock = o.Lock
			return img, nil
		}
	}
	l, err := lockCache(o.CacheDir, true)
	if err != nil {
		return nil, err
	}
	defer l.unlock()
	if !o.Refresh {
		// Another process may have built it while we waited for the lock.
		if img, err := loadImage(o.CacheDir, digest); err == nil {
			img.Lock = o.Lock
			return img, nil
		}
	}
	start := time.Now()
	img, err := o.build(ctx)
	if err != nil {
		return nil, err
	}
	o.Logf("image ready in %v: %s", time.Since(start).Round(time.Millisecond), o.CacheDir)
	return img, nil
}

func imagePath(cacheDir string) string { return filepath.Join(cacheDir, "image.json") }

// loadImage reads image.json and checks that it was built from the lock whose image
// digest is lockDigest and that everything it names is still there.
func loadImage(cacheDir, lockDigest string) (*Image, error) {
	b, err := os.ReadFile(imagePath(cacheDir))
	if err != nil {
		return nil, err
	}
	var img Image
	if err := json.Unmarshal(b, &img); err != nil {
		return nil, fmt.Errorf("image.json: %w", err)
	}
	if img.Recipe != fullRecipe() {
		return nil, errors.New("image recipe changed")
	}
	if img.LockDigest != lockDigest {
		return nil, errors.New("image built from another test bed lock")
	}
	q := img.qemu()
	need := []string{img.Kernel, img.Initramfs, q.Binary, q.Loader}
	for name := range layers {
		if img.Layers[name] == nil {
			return nil, fmt.Errorf("image has no layer %s", name)
		}
		need = append(need, img.Layers[name].Archive)
	}
	for _, p := range need {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("image incomplete: %w", err)
		}
	}
	return &img, nil
}

func fullRecipe() string {
	parts := []string{imageRecipe, qemuRecipe, kernelRecipe, initramfsRecipe, layerRecipe}
	for _, name := range sortedKeys(layers) {
		parts = append(parts, layers[name].recipe)
	}
	return strings.Join(parts, "+")
}

// build resolves exact package versions (from cached indices, fetching them first if
// there are none or Refresh is set), builds the components whose keys are missing and
// writes image.json.
func (o ImageOptions) build(ctx context.Context) (*Image, error) {
	bookworm := &aptRoot{dir: filepath.Join(o.CacheDir, "apt", "bookworm"), logf: o.Logf, sources: []string{
		"deb " + o.Mirror + " bookworm main",
		"deb " + o.Mirror + " bookworm-updates main",
		"deb " + o.SecurityMirror + " bookworm-security main",
	}}
	trixie := &aptRoot{dir: filepath.Join(o.CacheDir, "apt", "trixie"), logf: o.Logf, sources: []string{
		"deb " + o.Mirror + " trixie main",
		"deb " + o.Mirror + " trixie-backports main",
	}}
	for _, a := range []*aptRoot{bookworm, trixie} {
		if err := a.prepare(); err != nil {
			return nil, fmt.Errorf("apt root: %w", err)
		}
		if o.Refresh || !a.hasLists() {
			if err := a.update(ctx); err != nil {
				return nil, err
			}
		}
	}

	// The pins: the lock's, or (Update) what the indices resolve to.
	lock := o.Lock.clone()
	pick := func(what string, set *LockedSet, apt *aptRoot, request []string) ([]Package, error) {
		if o.Update == UpdateAll || (o.Update == UpdateMissing && !set.pins(request)) {
			pkgs, err := apt.resolve(ctx, request)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", what, err)
			}
			*set = LockedSet{Request: slices.Clone(request), Packages: PackageStrings(pkgs)}
		}
		// Always in the lock's order: the components' keys are the same whether the
		// packages were just resolved or taken from the lock.
		return set.Resolve(what, request)
	}

	// QEMU.
	qpkgs, err := pick("qemu", &lock.QEMU, trixie, qemuPackages)
	if err != nil {
		return nil, err
	}
	qc := newComponent(o.CacheDir, "qemu", qemuRecipe, pkgStrings(qpkgs))
	if !qc.exists() {
		t := time.Now()
		if err := qc.build(func(tmp string) error { return buildQEMU(ctx, trixie, qpkgs, tmp, o.Logf) }); err != nil {
			return nil, err
		}
		o.Logf("qemu component %s built in %v", qc.key, time.Since(t).Round(time.Millisecond))
	}

	// Kernel.
	var kc kernelChoice
	if o.Update == UpdateAll || (o.Update == UpdateMissing && lock.Kernel.ABI == "") || (o.Update != UpdateNone && o.KernelABI != "") {
		if kc, err = chooseKernel(ctx, bookworm, o.KernelABI); err != nil {
			return nil, err
		}
		lock.Kernel = LockedKernel{ABI: kc.ABI, Version: kc.Version, Packages: PackageStrings(kc.Packages)}
	}
	if kc, err = lock.lockedKernel(); err != nil {
		return nil, err
	}
	kcomp := newComponent(o.CacheDir, "kernel", kernelRecipe+" "+layerKernelRecipe(), pkgStrings(kc.Packages))
	if !kcomp.exists() {
		t := time.Now()
		if err := kcomp.build(func(tmp string) error { return buildKernel(ctx, bookworm, kc, tmp, o.Logf) }); err != nil {
			return nil, err
		}
		o.Logf("kernel component %s (%s) built in %v", kcomp.key, kc.ABI, time.Since(t).Round(time.Millisecond))
	}
	var kman kernelManifest
	if err := readJSON(filepath.Join(kcomp.dir, "manifest.json"), &kman); err != nil {
		return nil, err
	}

	// Initramfs.
	upkgs, err := pick("guest", &lock.Guest, bookworm, guestPackages)
	if err != nil {
		return nil, err
	}
	ic := newComponent(o.CacheDir, "initramfs", initramfsRecipe, append(pkgStrings(upkgs), "kernel="+kcomp.key))
	if !ic.exists() {
		t := time.Now()
		if err := ic.build(func(tmp string) error {
			return buildInitramfs(ctx, bookworm, upkgs, kcomp.dir, kc.ABI, kman.Modules, tmp, o.Logf)
		}); err != nil {
			return nil, err
		}
		o.Logf("initramfs component %s built in %v (%d MiB)", ic.key, time.Since(t).Round(time.Millisecond), dirSize(ic.dir)>>20)
	}
	var iman initramfsManifest
	if err := readJSON(filepath.Join(ic.dir, "manifest.json"), &iman); err != nil {
		return nil, err
	}

	// Layers.
	built := map[Layer]*LayerImage{}
	for _, name := range sortedKeys(layers) {
		spec := layers[name]
		if lock.Layers == nil {
			lock.Layers = map[Layer]LockedSet{}
		}
		set := lock.Layers[name]
		lpkgs, err := pick("layer "+string(name), &set, bookworm, spec.packages)
		if err != nil {
			return nil, err
		}
		lock.Layers[name] = set
		lc := newComponent(o.CacheDir, "layer-"+string(name), layerRecipe+" "+spec.recipe,
			append(pkgStrings(lpkgs), "kernel="+kcomp.key, "initramfs="+ic.key))
		if !lc.exists() {
			t := time.Now()
			if err := lc.build(func(tmp string) error {
				return buildLayer(ctx, bookworm, spec, lpkgs, kman.Layers[name], kcomp.dir, kc.ABI, iman, tmp)
			}); err != nil {
				return nil, err
			}
			o.Logf("layer %s component %s built in %v (%d MiB)", name, lc.key, time.Since(t).Round(time.Millisecond), dirSize(lc.dir)>>20)
		}
		built[name] = &LayerImage{Archive: filepath.Join(lc.dir, "layer.cpio"), Modules: kman.Layers[name], Packages: lpkgs}
	}

	img := &Image{
		CacheDir:      o.CacheDir,
		QEMUDir:       qc.dir,
		QEMUVersion:   versionOf(qpkgs, "qemu-system-x86"),
		KernelABI:     kc.ABI,
		KernelVersion: kc.Version,
		Kernel:        filepath.Join(kcomp.dir, "vmlinux"),
		Initramfs:     filepath.Join(ic.dir, "base.cpio"),
		Modules:       kman.Modules,
		Packages:      upkgs,
		Layers:        built,
		Recipe:        fullRecipe(),
		LockDigest:    lock.imageDigest(),
		Lock:          lock,
	}
	b, err := json.MarshalIndent(img, "", "  ")
	if err != nil {
		return nil, err
	}
	tmp := imagePath(o.CacheDir) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, imagePath(o.CacheDir)); err != nil {
		return nil, err
	}
	return img, nil
}

func pkgStrings(pkgs []Package) []string {
	s := make([]string, len(pkgs))
	for i, p := range pkgs {
		s[i] = p.String()
	}
	return s
}

func versionOf(pkgs []Package, name string) string {
	for _, p := range pkgs {
		if p.Name == name {
			return p.Version
		}
	}
	return ""
}

func readJSON(p string, v any) error {
	b, err := os.ReadFile(p)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	return nil
}
