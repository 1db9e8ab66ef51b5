package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// A guest with its own root (Config.Root) boots the test bed's kernel and initramfs as
// any guest does; /init then mounts the host directory, shared over virtio-9p, and
// switches to its systemd. This file prepares the directory on the host.

// validateRoot checks Config.Root: an absolute directory with an /sbin/init, an image
// whose kernel has 9p, and the harness's own QEMU command line.
func (cfg *Config) validateRoot(img *Image) error {
	if !filepath.IsAbs(cfg.Root) {
		return fmt.Errorf("root %q: want an absolute path", cfg.Root)
	}
	if cfg.Launch != nil {
		return errors.New("Config.Root needs the harness's own QEMU command line, not Config.Launch")
	}
	r, err := os.OpenRoot(cfg.Root)
	if err != nil {
		return fmt.Errorf("root: %w", err)
	}
	defer r.Close()
	// /sbin/init is usually an absolute symlink (to /lib/systemd/systemd): Lstat it.
	if _, err := r.Lstat("sbin/init"); err != nil {
		return fmt.Errorf("root %s has no /sbin/init: %w", cfg.Root, err)
	}
	if img != nil {
		for _, m := range rootModules {
			if !contains(img.Modules, m) {
				return fmt.Errorf("root: module %s is not in the guest image (rebuild it: make image)", m)
			}
		}
	}
	return nil
}

// modulesDir is the image's module tree for its kernel (lib/modules/<abi> of the kernel
// component, next to the vmlinux).
func (img *Image) modulesDir() string {
	return filepath.Join(filepath.Dir(img.Kernel), "modules", "lib", "modules", img.KernelABI)
}

// installRoot writes what a guest with its own root needs into Config.Root: the guest
// kernel's modules (with modules.dep) as lib/modules/<abi>, for the root's modprobe and
// systemd-modules-load, and the test's Files and HostFiles. Every write stays inside the
// root (os.Root): a symlink in it cannot send one elsewhere on the host.
func installRoot(img *Image, cfg *Config) error {
	r, err := os.OpenRoot(cfg.Root)
	if err != nil {
		return fmt.Errorf("root: %w", err)
	}
	defer r.Close()
	src := img.modulesDir()
	dst := path.Join("lib/modules", img.KernelABI)
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := path.Join(dst, filepath.ToSlash(rel))
		if d.IsDir() {
			return r.MkdirAll(target, 0o755)
		}
		return copyIntoRoot(r, target, p, 0o644)
	})
	if err != nil {
		return fmt.Errorf("root: kernel modules: %w", err)
	}
	for _, p := range sortedKeys(cfg.Files) {
		if err := writeIntoRoot(r, guestRel(p), cfg.Files[p], 0o755); err != nil {
			return fmt.Errorf("root: file %s: %w", p, err)
		}
	}
	for _, p := range sortedKeys(cfg.HostFiles) {
		st, err := os.Stat(cfg.HostFiles[p])
		if err != nil {
			return fmt.Errorf("root: host file for %s: %w", p, err)
		}
		if err := copyIntoRoot(r, guestRel(p), cfg.HostFiles[p], st.Mode().Perm()); err != nil {
			return fmt.Errorf("root: host file for %s: %w", p, err)
		}
	}
	return nil
}

// guestRel turns a validated absolute guest path into one relative to the root.
func guestRel(p string) string { return strings.TrimPrefix(path.Clean(p), "/") }

// copyIntoRoot copies the host file src to name inside r with mode perm.
func copyIntoRoot(r *os.Root, name, src string, perm fs.FileMode) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return writeIntoRoot(r, name, b, perm)
}

// writeIntoRoot writes name inside r (creating its directories) with exactly mode perm.
func writeIntoRoot(r *os.Root, name string, b []byte, perm fs.FileMode) error {
	if err := r.MkdirAll(path.Dir(name), 0o755); err != nil {
		return err
	}
	if err := r.WriteFile(name, b, perm); err != nil {
		return err
	}
	return r.Chmod(name, perm) // WriteFile's mode is subject to the umask
}
