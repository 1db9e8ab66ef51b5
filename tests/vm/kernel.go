package vm

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
)

// kernelRecipe names what the kernel component holds; bump it when the build changes.
const kernelRecipe = "kernel-v4"

// guestModules are the modules shipped in the base initramfs (with their dependencies).
// A layer's modules (layerSpec.modules) are in the kernel component too, but go into the
// layer's archive.
var guestModules = []string{
	"vmxnet3",
	"ib_core", "ib_uverbs", "ib_umad", "vmw_pvrdma",
	"configfs", "iw_cm", "ib_cm", "rdma_cm", "rdma_ucm",
	"crc32_generic", "udp_tunnel", "ip6_udp_tunnel", "rdma_rxe",
	"virtio_pci", "virtio_net",
	"8021q",
	// 9p over virtio: the root file system of guests booted with Config.Root.
	"9pnet_virtio", "9p",
}

// moduleSubtreeRE selects the parts of the module tree that can hold guestModules and
// their dependencies (extracting all of it costs ~10 s); installModules fails loudly if a
// dependency lies outside.
var moduleSubtreeRE = regexp.MustCompile(`^lib/modules/[^/]+/(modules\.[a-z.]+|kernel/(drivers/infiniband|drivers/virtio|drivers/net/vmxnet3|net|lib|crypto|block|fs/configfs|fs/9p|fs/netfs|fs/fscache|` +
	// The storage layer: NVMe host and target, brd, SCSI and the SCSI target, NFS.
	`drivers/nvme|drivers/block|drivers/scsi|drivers/target|fs/nfs|fs/nfsd|fs/nfs_common|fs/lockd)/.*|kernel/drivers/net/[^/]+\.ko)$`)

// pvrdmaSrcDir is the driver's directory inside Debian's linux-source tarball.
const pvrdmaSrcDir = "drivers/infiniband/hw/vmw_pvrdma"

// kernelChoice is the guest kernel ABI and the packages that make it.
type kernelChoice struct {
	ABI      string    `json:"abi"`     // e.g. 6.1.0-56-amd64
	Version  string    `json:"version"` // e.g. 6.1.192-2
	Packages []Package `json:"packages"`
}

func (k kernelChoice) pkg(prefix string) Package {
	for _, p := range k.Packages {
		if strings.HasPrefix(p.Name, prefix) {
			return p
		}
	}
	return Package{}
}

var imageNameRE = regexp.MustCompile(`^linux-image-(6\.1\.0-(\d+)-amd64)$`)

// chooseKernel picks the newest bookworm(-security) 6.1.0-N ABI (only abi, if it is not
// empty) for which the image, the headers (amd64 and common), linux-kbuild-6.1 and
// linux-source-6.1 all exist in the same version.
func chooseKernel(ctx context.Context, apt *aptRoot, abi string) (kernelChoice, error) {
	names, err := apt.names(ctx, "linux-image-6.1.0-")
	if err != nil {
		return kernelChoice{}, err
	}
	type cand struct {
		abi string
		n   int
	}
	var cands []cand
	for _, name := range names {
		m := imageNameRE.FindStringSubmatch(name)
		if m == nil || (abi != "" && m[1] != abi) {
			continue
		}
		n, _ := strconv.Atoi(m[2])
		cands = append(cands, cand{abi: m[1], n: n})
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].n > cands[j].n })
	srcVersions, err := apt.candidates(ctx, "linux-source-6.1")
	if err != nil {
		return kernelChoice{}, err
	}
	kbuildVersions, err := apt.candidates(ctx, "linux-kbuild-6.1")
	if err != nil {
		return kernelChoice{}, err
	}
	for _, c := range cands {
		short := strings.TrimSuffix(c.abi, "-amd64")
		pkgs := map[string][]string{}
		for _, name := range []string{"linux-image-" + c.abi, "linux-headers-" + c.abi, "linux-headers-" + short + "-common"} {
			if pkgs[name], err = apt.candidates(ctx, name); err != nil {
				return kernelChoice{}, err
			}
		}
		for _, v := range pkgs["linux-image-"+c.abi] {
			if !contains(pkgs["linux-headers-"+c.abi], v) || !contains(pkgs["linux-headers-"+short+"-common"], v) ||
				!contains(srcVersions, v) || !contains(kbuildVersions, v) {
				continue
			}
			return kernelChoice{ABI: c.abi, Version: v, Packages: []Package{
				{Name: "linux-image-" + c.abi, Version: v, Arch: "amd64"},
				{Name: "linux-headers-" + c.abi, Version: v, Arch: "amd64"},
				{Name: "linux-headers-" + short + "-common", Version: v, Arch: "all"},
				{Name: "linux-kbuild-6.1", Version: v, Arch: "amd64"},
				{Name: "linux-source-6.1", Version: v, Arch: "all"},
			}}, nil
		}
	}
	if abi != "" {
		return kernelChoice{}, fmt.Errorf("no linux-image-%s with matching headers, kbuild and linux-source-6.1 in the indices", abi)
	}
	return kernelChoice{}, errors.New("no linux-image-6.1.0-N-amd64 with matching headers, kbuild and linux-source-6.1 in the indices")
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// kernelManifest describes a built kernel component.
type kernelManifest struct {
	kernelChoice
	// Modules are the base initramfs's modules: guestModules with their dependencies.
	Modules []string `json:"modules"`
	// Layers are the modules each layer adds (its modules and their dependencies, less
	// Modules).
	Layers map[Layer][]string `json:"layers"`
}

// buildKernel fills dir with vmlinux, config, modules/lib/modules/<abi>/ (the guest
// modules, vmw_pvrdma.ko in updates/, modules.dep from depmod -b) and manifest.json.
func buildKernel(ctx context.Context, apt *aptRoot, kc kernelChoice, dir string, logf func(string, ...any)) error {
	debs, err := apt.fetch(ctx, kc.Packages)
	if err != nil {
		return err
	}
	deb := map[string]string{}
	for i, p := range kc.Packages {
		deb[p.Name] = debs[i]
	}
	work := filepath.Join(dir, "work")
	defer os.RemoveAll(work)

	// 1. The image: vmlinuz, config and the whole module tree (for dependency lookups).
	img := filepath.Join(work, "image")
	logf("unpacking %s", kc.pkg("linux-image-").debFile())
	if _, err := extractDeb(ctx, deb[kc.pkg("linux-image-").Name], img, func(name string, _ *tar.Header) (bool, error) {
		return strings.HasPrefix(name, "boot/") || moduleSubtreeRE.MatchString(name), nil
	}); err != nil {
		return err
	}
	if err := extractVmlinux(ctx, filepath.Join(img, "boot", "vmlinuz-"+kc.ABI), filepath.Join(dir, "vmlinux")); err != nil {
		return err
	}
	if err := os.Rename(filepath.Join(img, "boot", "config-"+kc.ABI), filepath.Join(dir, "config")); err != nil {
		return err
	}

	// 2. vmw_pvrdma.ko from linux-source against the matching headers.
	ko, err := buildPvrdma(ctx, kc, deb, work, logf)
	if err != nil {
		return fmt.Errorf("build vmw_pvrdma.ko: %w", err)
	}

	// 3. The module subset and modules.dep.
	sets := map[Layer][]string{"": guestModules}
	for name, l := range layers {
		sets[name] = l.modules
	}
	mods, err := installModules(ctx, kc.ABI, filepath.Join(img, "lib", "modules", kc.ABI), ko, filepath.Join(dir, "modules"), sets)
	if err != nil {
		return err
	}
	man := kernelManifest{kernelChoice: kc, Modules: mods[""], Layers: map[Layer][]string{}}
	for name := range layers {
		man.Layers[name] = mods[name]
	}
	b, err := json.MarshalIndent(man, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o644)
}

// extractVmlinux decompresses the xz payload of a bzImage into an ELF vmlinux (booting
// the ELF through its PVH entry skips 5-8 s of in-guest decompression under TCG), and
// checks that it has the PVH entry note.
func extractVmlinux(ctx context.Context, vmlinuz, out string) error {
	raw, err := os.ReadFile(vmlinuz)
	if err != nil {
		return err
	}
	off := bytes.Index(raw, []byte("\xfd7zXZ\x00"))
	if off < 0 {
		return fmt.Errorf("%s: no xz payload", vmlinuz)
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "xz", "-dc", "--single-stream")
	cmd.Stdin = bytes.NewReader(raw[off:])
	cmd.Stdout = f
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("xz -d %s: %w: %s", vmlinuz, err, stderr.String())
	}
	return checkPVH(out)
}

// xenElfNotePhys32Entry is XEN_ELFNOTE_PHYS32_ENTRY, the note QEMU's -kernel loader looks
// for to boot an ELF kernel through the PVH entry point.
const xenElfNotePhys32Entry = 18

func checkPVH(vmlinux string) error {
	f, err := elf.Open(vmlinux)
	if err != nil {
		return fmt.Errorf("vmlinux: %w", err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type != elf.PT_NOTE {
			continue
		}
		b, err := io.ReadAll(p.Open())
		if err != nil {
			return err
		}
		for len(b) >= 12 {
			nsz, dsz, typ := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:]), binary.LittleEndian.Uint32(b[8:])
			nameEnd := 12 + int(align4(int(nsz)))
			end := nameEnd + align4(int(dsz))
			if nsz > 64 || end > len(b) || end < nameEnd {
				break
			}
			if string(bytes.TrimRight(b[12:12+nsz], "\x00")) == "Xen" && typ == xenElfNotePhys32Entry {
				return nil
			}
			b = b[end:]
		}
	}
	return errors.New("vmlinux has no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY)")
}

// buildPvrdma extracts the driver's source from linux-source-6.1 and builds it as an
// external module against the unpacked headers. No driver source is kept in our tree.
func buildPvrdma(ctx context.Context, kc kernelChoice, deb map[string]string, work string, logf func(string, ...any)) (string, error) {
	hdr := filepath.Join(work, "headers")
	common := "linux-headers-" + strings.TrimSuffix(kc.ABI, "-amd64") + "-common"
	for _, name := range []string{"linux-headers-" + kc.ABI, common, "linux-kbuild-6.1"} {
		if deb[name] == "" {
			return "", fmt.Errorf("no %s package", name)
		}
		if _, err := extractDeb(ctx, deb[name], hdr, func(n string, _ *tar.Header) (bool, error) {
			return strings.HasPrefix(n, "usr/"), nil
		}); err != nil {
			return "", err
		}
	}
	// The arch headers' Makefile includes the common one by absolute path; point it into
	// the unpacked tree (the relative scripts/tools symlinks already resolve there).
	kdir := filepath.Join(hdr, "usr", "src", "linux-headers-"+kc.ABI)
	mk := filepath.Join(kdir, "Makefile")
	b, err := os.ReadFile(mk)
	if err != nil {
		return "", err
	}
	fixed := strings.ReplaceAll(string(b), "/usr/src/", filepath.Join(hdr, "usr", "src")+"/")
	if err := os.WriteFile(mk, []byte(fixed), 0o644); err != nil {
		return "", err
	}

	src := filepath.Join(work, "src")
	logf("extracting %s from linux-source-6.1 %s", pvrdmaSrcDir, kc.Version)
	if err := extractKernelSubdir(ctx, deb["linux-source-6.1"], pvrdmaSrcDir, src); err != nil {
		return "", err
	}
	logf("building vmw_pvrdma.ko against %s", kc.ABI)
	jobs := strconv.Itoa(runtime.NumCPU())
	cmd := exec.CommandContext(ctx, "make", "-s", "-j"+jobs, "-C", kdir, "M="+src, "CONFIG_INFINIBAND_VMWARE_PVRDMA=m", "modules")
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("make: %w: %s", err, lastLines(string(out), 20))
	}
	ko := filepath.Join(src, "vmw_pvrdma.ko")
	if out, err := exec.CommandContext(ctx, "strip", "--strip-debug", ko).CombinedOutput(); err != nil {
		return "", fmt.Errorf("strip: %w: %s", err, out)
	}
	return ko, nil
}

// extractKernelSubdir streams linux-source's .tar.xz out of its .deb and unpacks only the
// members below sub, stopping once the archive has moved past them.
func extractKernelSubdir(ctx context.Context, deb, sub, dst string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	deb2tar := exec.CommandContext(ctx, "dpkg-deb", "--fsys-tarfile", deb)
	outer, err := deb2tar.StdoutPipe()
	if err != nil {
		return err
	}
	if err := deb2tar.Start(); err != nil {
		return err
	}
	defer func() { cancel(); _ = deb2tar.Wait() }()
	tr := tar.NewReader(outer)
	for {
		hdr, err := tr.Next()
		if err != nil {
			return fmt.Errorf("linux-source: no source tarball: %w", err)
		}
		if strings.HasSuffix(hdr.Name, ".tar.xz") && strings.Contains(hdr.Name, "usr/src/linux-source-") {
			break
		}
	}
	xz := exec.CommandContext(ctx, "xz", "-dc", "-T0")
	xz.Stdin = tr
	inner, err := xz.StdoutPipe()
	if err != nil {
		return err
	}
	if err := xz.Start(); err != nil {
		return err
	}
	defer func() { cancel(); _ = xz.Wait() }()
	found := false
	_, err = extractTar(inner, dst, func(name string, _ *tar.Header) (bool, error) {
		// Members are "linux-source-6.1/<path>".
		_, rel, _ := strings.Cut(name, "/")
		if rel == sub || strings.HasPrefix(rel, sub+"/") {
			found = true
			return true, nil
		}
		if found {
			return false, errStopExtract
		}
		return false, nil
	})
	if err != nil && !errors.Is(err, errStopExtract) {
		return err
	}
	if !found {
		return fmt.Errorf("linux-source has no %s", sub)
	}
	// Flatten <dst>/linux-source-6.1/<sub> to <dst>.
	ents, err := os.ReadDir(dst)
	if err != nil || len(ents) != 1 {
		return fmt.Errorf("unexpected linux-source layout")
	}
	top := filepath.Join(dst, ents[0].Name())
	files, err := os.ReadDir(filepath.Join(top, sub))
	if err != nil {
		return err
	}
	for _, f := range files {
		if err := os.Rename(filepath.Join(top, sub, f.Name()), filepath.Join(dst, f.Name())); err != nil {
			return err
		}
	}
	return os.RemoveAll(top)
}

// modName normalises a module file or module name ("ip6_udp_tunnel.ko" and
// "ip6-udp-tunnel" are the same module).
func modName(s string) string {
	return strings.ReplaceAll(strings.TrimSuffix(filepath.Base(s), ".ko"), "-", "_")
}

// installModules copies the modules of every set (the base's, "", and each layer's) and
// their dependencies (from each module's .modinfo "depends=") from the unpacked tree into
// out/lib/modules/<abi>/, adds vmw_pvrdma.ko as updates/vmw_pvrdma.ko and runs depmod -b
// on the result. It returns each set's module names: the base's with their dependencies,
// a layer's without those the base already has.
func installModules(ctx context.Context, abi, tree, pvrdmaKo, out string, sets map[Layer][]string) (map[Layer][]string, error) {
	order, err := os.ReadFile(filepath.Join(tree, "modules.order"))
	if err != nil {
		return nil, err
	}
	paths := map[string]string{} // module name -> path relative to tree
	for _, line := range strings.Fields(string(order)) {
		paths[modName(line)] = line
	}
	paths["vmw_pvrdma"] = "updates/vmw_pvrdma.ko"
	host := func(name string) string {
		if name == "vmw_pvrdma" {
			return pvrdmaKo
		}
		return filepath.Join(tree, paths[name])
	}
	closure := func(roots []string) (map[string]bool, error) {
		need := map[string]bool{}
		queue := append([]string(nil), roots...)
		for len(queue) > 0 {
			m := queue[0]
			queue = queue[1:]
			if need[m] {
				continue
			}
			if _, ok := paths[m]; !ok {
				return nil, fmt.Errorf("module %s is not in the kernel package (built in?)", m)
			}
			need[m] = true
			deps, err := modDepends(host(m))
			if err != nil {
				return nil, fmt.Errorf("module %s: %w", m, err)
			}
			queue = append(queue, deps...)
		}
		return need, nil
	}
	base, err := closure(sets[""])
	if err != nil {
		return nil, err
	}
	all := map[string]bool{}
	res := map[Layer][]string{}
	for set, roots := range sets {
		need, err := closure(roots)
		if err != nil {
			return nil, fmt.Errorf("modules of %q: %w", set, err)
		}
		names := []string{}
		for m := range need {
			all[m] = true
			if set == "" || !base[m] {
				names = append(names, m)
			}
		}
		sort.Strings(names)
		res[set] = names
	}
	dst := filepath.Join(out, "lib", "modules", abi)
	for m := range all {
		target := filepath.Join(dst, paths[m])
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return nil, err
		}
		data, err := os.ReadFile(host(m))
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(target, data, 0o644); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"modules.order", "modules.builtin", "modules.builtin.modinfo"} {
		if data, err := os.ReadFile(filepath.Join(tree, f)); err == nil {
			if err := os.WriteFile(filepath.Join(dst, f), data, 0o644); err != nil {
				return nil, err
			}
		}
	}
	depmod, err := exec.LookPath("depmod")
	if err != nil {
		for _, d := range []string{"/usr/sbin/depmod", "/sbin/depmod"} {
			if _, serr := os.Stat(d); serr == nil {
				depmod, err = d, nil
			}
		}
	}
	if err != nil {
		return nil, errors.New("depmod not found: install kmod (make deps)")
	}
	if b, err := exec.CommandContext(ctx, depmod, "-b", out, abi).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("depmod: %w: %s", err, b)
	}
	return res, nil
}

// modDepends reads "depends=" from a module's .modinfo section.
func modDepends(ko string) ([]string, error) {
	f, err := elf.Open(ko)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, errors.New("no .modinfo")
	}
	data, err := sec.Data()
	if err != nil {
		return nil, err
	}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			var deps []string
			for _, d := range strings.Split(string(v), ",") {
				if d != "" {
					deps = append(deps, modName(d))
				}
			}
			return deps, nil
		}
	}
	return nil, nil
}
