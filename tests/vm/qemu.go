package vm

import (
	"archive/tar"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// qemuRecipe names how the QEMU component is built; bump it when that changes.
const qemuRecipe = "qemu-v1"

// qemuPackages are taken from trixie-backports (QEMU >= 10.1 has the vfio-user-pci
// client); apt resolves their dependency closure from trixie.
var qemuPackages = []string{
	"qemu-system-x86/trixie-backports",
	"qemu-system-common/trixie-backports",
	"qemu-system-data/trixie-backports",
	"seabios/trixie-backports",
}

// Paths inside the unpacked QEMU root.
const (
	qemuBinRel    = "usr/bin/qemu-system-x86_64"
	qemuLoaderRel = "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
	qemuModRel    = "usr/lib/x86_64-linux-gnu/qemu"
)

// buildQEMU unpacks the QEMU closure into dir/root and checks that it runs through its own
// loader.
func buildQEMU(ctx context.Context, apt *aptRoot, pkgs []Package, dir string, logf func(string, ...any)) error {
	debs, err := apt.fetch(ctx, pkgs)
	if err != nil {
		return err
	}
	root := filepath.Join(dir, "root")
	logf("unpacking %d QEMU packages", len(debs))
	for _, deb := range debs {
		if _, err := extractDeb(ctx, deb, root, func(name string, _ *tar.Header) (bool, error) {
			return !strings.HasPrefix(name, "usr/share/doc/") && !strings.HasPrefix(name, "usr/share/man/") &&
				!strings.HasPrefix(name, "usr/share/locale/"), nil
		}); err != nil {
			return err
		}
	}
	if err := relativizeSymlinks(root); err != nil {
		return err
	}
	q := qemuPaths(dir)
	out, err := q.command(ctx, "--version").CombinedOutput()
	if err != nil {
		return fmt.Errorf("unpacked QEMU does not run: %w: %s", err, out)
	}
	logf("%s", strings.SplitN(string(out), "\n", 2)[0])
	return nil
}

// qemuInstall locates an unpacked QEMU.
type qemuInstall struct {
	Root    string // unpacked trixie tree
	Binary  string // qemu-system-x86_64
	Loader  string // the tree's own ld-linux-x86-64.so.2
	LibPath string // --library-path for the loader
	DataDir []string
	ModDir  string
}

func qemuPaths(dir string) qemuInstall {
	root := filepath.Join(dir, "root")
	return qemuInstall{
		Root:    root,
		Binary:  filepath.Join(root, qemuBinRel),
		Loader:  filepath.Join(root, qemuLoaderRel),
		LibPath: filepath.Join(root, "usr/lib/x86_64-linux-gnu") + ":" + filepath.Join(root, "lib/x86_64-linux-gnu"),
		DataDir: []string{filepath.Join(root, "usr/share/qemu"), filepath.Join(root, "usr/share/seabios")},
		ModDir:  filepath.Join(root, qemuModRel),
	}
}

// command runs QEMU through the unpacked loader with the unpacked libraries, firmware and
// modules; the host's libc is never used or changed.
func (q qemuInstall) command(ctx context.Context, args ...string) *exec.Cmd {
	full := []string{"--library-path", q.LibPath, "--argv0", "qemu-system-x86_64", q.Binary}
	for _, d := range q.DataDir {
		full = append(full, "-L", d)
	}
	full = append(full, args...)
	cmd := exec.CommandContext(ctx, q.Loader, full...)
	cmd.Env = append(os.Environ(), "QEMU_MODULE_DIR="+q.ModDir)
	return cmd
}

// relativizeSymlinks rewrites absolute symlinks inside root (e.g. qemu's bios-256k.bin ->
// /usr/share/seabios/bios-256k.bin) to relative ones, so they resolve inside the tree
// instead of on the host.
func relativizeSymlinks(root string) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeSymlink == 0 {
			return err
		}
		target, err := os.Readlink(p)
		if err != nil || !strings.HasPrefix(target, "/") {
			return err
		}
		rel, err := filepath.Rel(filepath.Dir(p), filepath.Join(root, target))
		if err != nil {
			return err
		}
		if err := os.Remove(p); err != nil {
			return err
		}
		return os.Symlink(rel, p)
	})
}
