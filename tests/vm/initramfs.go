package vm

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
)

// initramfsRecipe names how the base initramfs is assembled; bump it when the selection
// or layout below changes.
const initramfsRecipe = "initramfs-v5"

// guestPackages are the bookworm packages the guest userspace comes from; apt resolves
// their closure, and only the files selected below (plus their shared-library closure)
// go into the initramfs.
var guestPackages = []string{
	"busybox-static",
	"libibverbs1", "ibverbs-providers", "ibverbs-utils", "perftest",
	"librdmacm1", "rdmacm-utils",
	"iproute2", "pciutils", "pci.ids",
	"libgcc-s1", // see dlopenedFiles
}

// skipBinaries are programs of allBinaries packages that the guest does not need.
var skipBinaries = regexp.MustCompile(`^(raw_ethernet_.*|run_perftest_.*|update-pciids)$`)

// allBinaries are packages whose every ELF program goes into the guest.
var allBinaries = map[string]bool{"ibverbs-utils": true, "perftest": true, "rdmacm-utils": true, "pciutils": true}

// someBinaries are single programs taken from bigger packages.
var someBinaries = map[string][]string{
	"iproute2":       {"bin/ip", "sbin/bridge", "usr/bin/rdma"},
	"busybox-static": {"bin/busybox"},
}

// providerFiles are the rdma-core providers the guest needs: vmw_pvrdma and rxe.
var providerFiles = []string{
	"etc/libibverbs.d/vmw_pvrdma.driver",
	"etc/libibverbs.d/rxe.driver",
	"usr/lib/x86_64-linux-gnu/libibverbs/libvmw_pvrdma-rdmav*.so",
	"usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so",
}

// dlopenedFiles are libraries no program names in DT_NEEDED but that are loaded at run
// time: glibc dlopens libgcc_s when a thread exits or is cancelled, and without it rping
// (and anything whose rdma_cm threads exit) aborts at disconnect.
var dlopenedFiles = []string{
	"lib/x86_64-linux-gnu/libgcc_s.so.1",
}

// dataFiles are copied as they are.
var dataFiles = []string{"usr/share/misc/pci.ids"}

// usrMerged maps a Debian path to the merged-/usr layout of the initramfs, where /bin,
// /sbin, /lib and /lib64 are symlinks into /usr (and /var/run into /run). Archive members
// must never name a path through one of these symlinks: the kernel's unpacker would
// replace the symlink with a directory.
func usrMerged(p string) string {
	p = stripSlash(path.Clean("/" + p))
	if p == "var/run" || strings.HasPrefix(p, "var/run/") {
		return "run" + strings.TrimPrefix(p, "var/run")
	}
	for _, d := range []string{"bin", "sbin", "lib", "lib64"} {
		if p == d || strings.HasPrefix(p, d+"/") {
			return "usr/" + p
		}
	}
	return p
}

// initramfsManifest describes the base initramfs.
type initramfsManifest struct {
	Packages []Package        `json:"packages"`
	Files    map[string]int64 `json:"files"` // guest path -> size
}

// buildInitramfs writes dir/base.cpio: busybox, rdma-core, perftest, iproute2, pciutils
// with their library closure, and the kernel's guest modules (mods; the layers' modules
// stay in their own archives, though modules.dep names them). /init and the scenario
// come later, per boot, in a second archive.
func buildInitramfs(ctx context.Context, apt *aptRoot, pkgs []Package, kernelDir, abi string, mods []string, dir string, logf func(string, ...any)) error {
	debs, err := apt.fetch(ctx, pkgs)
	if err != nil {
		return err
	}
	root := filepath.Join(dir, "work")
	defer os.RemoveAll(root)
	members := map[string][]string{}
	for i, deb := range debs {
		names, err := extractDeb(ctx, deb, root, func(name string, _ *tar.Header) (bool, error) {
			return !strings.HasPrefix(name, "usr/share/doc/") && !strings.HasPrefix(name, "usr/share/man/") &&
				!strings.HasPrefix(name, "usr/share/locale/"), nil
		})
		if err != nil {
			return err
		}
		members[pkgs[i].Name] = names
	}

	files := map[string]string{} // guest path -> host path
	var elfs []string            // unpacked-tree paths whose libraries are needed
	add := func(rel string) error {
		host, err := resolveIn(root, rel)
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		files[usrMerged(rel)] = host
		if isELF(host) {
			elfs = append(elfs, rel)
		}
		return nil
	}
	for pkg := range allBinaries {
		for _, m := range members[pkg] {
			dirName := path.Dir(m)
			if dirName != "usr/bin" && dirName != "usr/sbin" && dirName != "bin" && dirName != "sbin" || skipBinaries.MatchString(path.Base(m)) {
				continue
			}
			if host, err := resolveIn(root, m); err == nil && isELF(host) {
				if err := add(m); err != nil {
					return err
				}
			}
		}
	}
	for pkg, list := range someBinaries {
		for _, m := range list {
			if !contains(members[pkg], m) {
				return fmt.Errorf("package %s has no %s", pkg, m)
			}
			if err := add(m); err != nil {
				return err
			}
		}
	}
	for _, pat := range slices.Concat(providerFiles, dlopenedFiles, dataFiles) {
		matches, _ := filepath.Glob(filepath.Join(root, pat))
		if len(matches) != 1 {
			return fmt.Errorf("want one file matching %s, found %d", pat, len(matches))
		}
		rel, _ := filepath.Rel(root, matches[0])
		if err := add(rel); err != nil {
			return err
		}
	}
	libs, err := elfClosure(root, elfs)
	if err != nil {
		return err
	}
	for guest, host := range libs {
		files[usrMerged(guest)] = host
	}

	applets, err := busyboxApplets(ctx, files["usr/bin/busybox"])
	if err != nil {
		return err
	}

	out, err := os.Create(filepath.Join(dir, "base.cpio"))
	if err != nil {
		return err
	}
	defer out.Close()
	w := newCPIOWriter(out)
	man := initramfsManifest{Packages: pkgs, Files: map[string]int64{}}
	for _, d := range []string{"usr/bin", "usr/sbin", "usr/lib/x86_64-linux-gnu", "usr/lib64", "proc", "sys", "dev", "run", "etc", "root", "mnt", "var", "tmp"} {
		w.mkdirAll(d, 0o755)
	}
	w.mkdirAll("tmp", 0o1777)
	for _, l := range [][2]string{{"bin", "usr/bin"}, {"sbin", "usr/sbin"}, {"lib", "usr/lib"}, {"lib64", "usr/lib64"}, {"var/run", "../run"}} {
		if err := w.symlink(l[0], l[1]); err != nil {
			return err
		}
	}
	if err := w.charDev("dev/console", 0o600, 5, 1); err != nil {
		return err
	}
	if err := w.charDev("dev/null", 0o666, 1, 3); err != nil {
		return err
	}
	for _, f := range [][2]string{
		{"etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"},
		{"etc/group", "root:x:0:\n"},
		{"etc/hosts", "127.0.0.1 localhost\n"},
		{"etc/nsswitch.conf", "hosts: files\n"},
	} {
		if err := w.file(f[0], 0o644, []byte(f[1])); err != nil {
			return err
		}
	}
	for _, guest := range sortedKeys(files) {
		st, err := os.Stat(files[guest])
		if err != nil {
			return err
		}
		if err := w.copyFile(guest, uint32(st.Mode().Perm()), files[guest]); err != nil {
			return fmt.Errorf("%s: %w", guest, err)
		}
		man.Files[guest] = st.Size()
	}
	// ld.so's own path (PT_INTERP /lib64/ld-linux-x86-64.so.2) resolves through /lib64.
	// Busybox applets, unless a real program of the same name is present (iproute2's ip
	// is in /usr/bin, busybox's would be /usr/sbin/ip, earlier in PATH).
	realProgs := map[string]bool{}
	for guest := range files {
		if d := path.Dir(guest); d == "usr/bin" || d == "usr/sbin" {
			realProgs[path.Base(guest)] = true
		}
	}
	// Debian's busybox-static prefers its applets to PATH lookups in sh
	// (FEATURE_PREFER_APPLETS), so a shell function routes the shadowed names to the
	// real programs; guest/lib.sh sources this file.
	var overrides strings.Builder
	overrides.WriteString("# Generated: real programs that busybox applets would shadow in sh.\n")
	for _, a := range applets {
		guest := usrMerged(a)
		if realProgs[path.Base(guest)] {
			for _, dir := range []string{"usr/bin/", "usr/sbin/"} {
				if _, ok := files[dir+path.Base(guest)]; ok {
					fmt.Fprintf(&overrides, "%s() { /%s%s \"$@\"; }\n", path.Base(guest), dir, path.Base(guest))
					break
				}
			}
			continue
		}
		if err := w.symlink(guest, "/usr/bin/busybox"); err != nil {
			return err
		}
	}
	if err := w.file(guestOverrides, 0o644, []byte(overrides.String())); err != nil {
		return err
	}
	// Kernel modules with modules.dep.
	base := map[string]bool{}
	for _, m := range mods {
		base[m] = true
	}
	modRoot := filepath.Join(kernelDir, "modules")
	err = filepath.WalkDir(filepath.Join(modRoot, "lib", "modules", abi), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasSuffix(p, ".ko") && !base[modName(p)] {
			return err
		}
		rel, _ := filepath.Rel(modRoot, p)
		man.Files[usrMerged(rel)] = 0
		return w.copyFile(usrMerged(rel), 0o644, p)
	})
	if err != nil {
		return err
	}
	if err := w.close(); err != nil {
		return err
	}
	b, err := json.MarshalIndent(man, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o644)
}

// busyboxApplets lists the applet paths (e.g. "bin/ls", "usr/bin/awk") of the static
// busybox by running it on the host.
func busyboxApplets(ctx context.Context, busybox string) ([]string, error) {
	if busybox == "" {
		return nil, fmt.Errorf("no busybox in the selection")
	}
	out, err := exec.CommandContext(ctx, busybox, "--list-full").Output()
	if err != nil {
		return nil, fmt.Errorf("busybox --list-full: %w", err)
	}
	list := strings.Fields(string(out))
	sort.Strings(list)
	return list, nil
}
