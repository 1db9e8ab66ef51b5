package vm

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// Layer names an optional part of the guest image: a cpio archive the harness appends
// to the base initramfs only for the guests that ask for it (Config.Layers), so that
// every other guest boots with the base alone. A layer holds kernel modules (built in
// the kernel component with the base's, so one modules.dep covers both) and programs
// from bookworm packages with their shared-library closure.
type Layer string

// LayerStorage is what the kernel's RDMA storage consumers need: NVMe over Fabrics
// (nvme-rdma, nvmet-rdma), NFS over RDMA (nfsd, nfsv4, rpcrdma), SRP (ib_srp, ib_srpt
// on the SCSI target core), iSER (ib_iser, ib_isert on LIO's iSCSI target), a RAM
// block device (brd) to serve, nfs-utils' rpc.nfsd, rpc.mountd, exportfs and
// mount.nfs, open-iscsi's iscsid and iscsiadm, and ioping. guest/storage.sh's helpers come
// with it (at /usr/lib/pvt/storage.sh).
const LayerStorage Layer = "storage"

// LayerUCX is UCX from bookworm (ucx-utils' ucx_perftest and ucx_info, libucx0 with
// its verbs transports, loaded by UCX at run time from its module directory), for
// running UCX's own tests over the device. It has no kernel modules.
const LayerUCX Layer = "ucx"

// layerRecipe names how layers are assembled; bump it when layerSpec's use changes.
// Each layer's own recipe is in its spec.
const layerRecipe = "layer-v1"

// layerSpec is what a layer holds.
type layerSpec struct {
	// recipe versions the spec: bump it when anything below changes.
	recipe string
	// modules are kernel modules the layer adds, with their dependencies (those the
	// base already has stay in the base).
	modules []string
	// packages are the bookworm packages whose files the layer takes.
	packages []string
	// programs are the programs taken from each package (paths as the package has
	// them); their shared libraries come along, less those the base already has.
	programs map[string][]string
	// data are globs of other files taken as they are.
	data []string
	// dirs are empty directories the layer creates.
	dirs []string
}

// layers are the layers the image has.
var layers = map[Layer]layerSpec{
	LayerStorage: {
		recipe: "storage-v2",
		modules: []string{
			"nvme_core", "nvme_fabrics", "nvme_rdma", "nvmet", "nvmet_rdma", "brd",
			"sunrpc", "auth_rpcgss", "lockd", "grace", "rpcrdma", "nfsd", "nfs", "nfsv4",
			"scsi_mod", "sd_mod", "scsi_transport_srp", "ib_srp", "target_core_mod", "target_core_iblock", "ib_srpt",
			// iSCSI's login sets up CRC32C (digests) whether or not it uses them.
			"scsi_transport_iscsi", "libiscsi", "ib_iser", "iscsi_target_mod", "ib_isert", "crc32c_generic",
		},
		packages: []string{"nfs-kernel-server", "nfs-common", "ioping", "open-iscsi"},
		programs: map[string][]string{
			"nfs-kernel-server": {"usr/sbin/rpc.nfsd", "usr/sbin/rpc.mountd", "usr/sbin/exportfs"},
			"nfs-common":        {"sbin/mount.nfs"},
			"ioping":            {"usr/bin/ioping"},
			"open-iscsi":        {"sbin/iscsid", "sbin/iscsiadm"},
		},
		// libtirpc reads /etc/netconfig; nfs-utils resolves protocol and service
		// names; iscsiadm and iscsid read iscsid.conf.
		data: []string{"etc/netconfig", "etc/protocols", "etc/services", "etc/iscsi/iscsid.conf"},
		// nfsd's NFSv4 client tracking (the legacy one: a directory) and nfs-utils'
		// state.
		dirs: []string{"var/lib/nfs/v4recovery", "var/lib/nfs/rpc_pipefs"},
	},
	LayerUCX: {
		recipe:   "ucx-v1",
		packages: []string{"ucx-utils", "libucx0"},
		programs: map[string][]string{
			"ucx-utils": {"usr/bin/ucx_perftest", "usr/bin/ucx_info"},
			// UCX opens its transports by these names (lib<framework>_<module>.so.0)
			// in the ucx directory beside libucs: the verbs ones (UD, RC, DC) and
			// shared memory's cma. Not rdmacm's: perftest connects through its own socket.
			"libucx0": {"usr/lib/x86_64-linux-gnu/ucx/libuct_ib.so.0", "usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0"},
		},
	},
}

// LayerImage is a built layer.
type LayerImage struct {
	// Archive is the layer's newc cpio archive (uncompressed).
	Archive string `json:"archive"`
	// Modules are the kernel modules the layer adds to the base's.
	Modules []string `json:"modules"`
	// Packages are the exact packages its files come from.
	Packages []Package `json:"packages"`
}

// layerManifest describes a built layer.
type layerManifest struct {
	Packages []Package        `json:"packages"`
	Files    map[string]int64 `json:"files"` // guest path -> size
}

// layerKernelRecipe is the part of the kernel component's key that names its modules:
// the base's and every layer's.
func layerKernelRecipe() string {
	parts := []string{strings.Join(guestModules, ",")}
	for _, n := range sortedKeys(layers) {
		if len(layers[n].modules) == 0 {
			continue // a layer of programs only: the kernel component stays as it is
		}
		parts = append(parts, string(n)+"="+strings.Join(layers[n].modules, ","))
	}
	return strings.Join(parts, " ")
}

// buildLayer writes dir/layer.cpio: the layer's modules (mods, from the kernel
// component) and its programs and data files from pkgs, with their shared libraries,
// less every file the base initramfs already has (same packages from the same indices).
func buildLayer(ctx context.Context, apt *aptRoot, spec layerSpec, pkgs []Package, mods []string, kernelDir, abi string, base initramfsManifest, dir string) error {
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
	var elfs []string
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
	for _, pkg := range sortedKeys(spec.programs) {
		for _, p := range spec.programs[pkg] {
			if !contains(members[pkg], p) {
				return fmt.Errorf("package %s has no %s", pkg, p)
			}
			if err := add(p); err != nil {
				return err
			}
		}
	}
	for _, pat := range spec.data {
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

	out, err := os.Create(filepath.Join(dir, "layer.cpio"))
	if err != nil {
		return err
	}
	defer out.Close()
	w := newCPIOWriter(out)
	// The base's directories, so that the archive never creates a path through one of
	// its symlinks (/bin, /lib, ...) or changes a mode.
	for d := range base.Files {
		for p := path.Dir(d); p != "." && p != ""; p = path.Dir(p) {
			w.dirs[p] = true
		}
	}
	for _, d := range []string{"tmp", "proc", "sys", "dev", "run", "etc", "root", "mnt", "var"} {
		w.dirs[d] = true
	}
	man := layerManifest{Packages: pkgs, Files: map[string]int64{}}
	for _, d := range spec.dirs {
		w.mkdirAll(d, 0o755)
	}
	for _, guest := range sortedKeys(files) {
		if _, ok := base.Files[guest]; ok {
			continue
		}
		st, err := os.Stat(files[guest])
		if err != nil {
			return err
		}
		if err := w.copyFile(guest, uint32(st.Mode().Perm()), files[guest]); err != nil {
			return fmt.Errorf("%s: %w", guest, err)
		}
		man.Files[guest] = st.Size()
	}
	// The layer's kernel modules (modules.dep, in the base, already names them).
	want := map[string]bool{}
	for _, m := range mods {
		want[m] = true
	}
	modRoot := filepath.Join(kernelDir, "modules")
	found := map[string]bool{}
	err = filepath.WalkDir(filepath.Join(modRoot, "lib", "modules", abi), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".ko") || !want[modName(p)] {
			return err
		}
		found[modName(p)] = true
		rel, _ := filepath.Rel(modRoot, p)
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		man.Files[usrMerged(rel)] = st.Size()
		return w.copyFile(usrMerged(rel), 0o644, p)
	})
	if err != nil {
		return err
	}
	for _, m := range mods {
		if !found[m] {
			return fmt.Errorf("module %s is not in the kernel component", m)
		}
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

// layerModules are the modules of the base and of the named layers.
func (img *Image) layerModules(names []Layer) []string {
	mods := slices.Clone(img.Modules)
	for _, n := range names {
		if l := img.Layers[n]; l != nil {
			mods = append(mods, l.Modules...)
		}
	}
	return mods
}
