package vm

import (
	"bytes"
	_ "embed"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
)

//go:embed guest/init.sh
var initScript []byte

//go:embed guest/lib.sh
var libScript []byte

//go:embed guest/storage.sh
var storageScript []byte

//go:embed guest/root-run.sh
var rootRunScript []byte

//go:embed guest/pvt-scenario.service
var rootRunUnit []byte

// Guest paths of the per-boot archive.
const (
	guestLib       = "usr/lib/pvt/lib.sh"
	guestStorage   = "usr/lib/pvt/storage.sh"   // with LayerStorage
	guestOverrides = "usr/lib/pvt/overrides.sh" // in the base image
	guestScenario  = "pvt/scenario"
	guestConfig    = "etc/pvt/config"
	// A guest with its own root (Config.Root): the runner and its unit, which /init
	// copies with the scenario and the helpers into /run/pvt and
	// /run/systemd/system before switching to the root.
	guestRootRun  = "usr/lib/pvt/root-run.sh"
	guestRootUnit = "usr/lib/pvt/pvt-scenario.service"
	rootLib       = "/run/pvt/lib.sh"
	// rootTag is the 9p mount tag of the shared root.
	rootTag = "pvtroot"
)

var (
	moduleNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
	vmNameRE     = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,30}$`)
	pciAddrRE    = regexp.MustCompile(`^([0-9a-fA-F]{1,2})\.([0-7])$`)
)

// guestConfigFile renders /etc/pvt/config (sourced by /init). Every value has been
// validated, so plain double quotes are safe.
func guestConfigFile(nonce, hostname string, preload, modules []string, nics []NIC, root string) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "PVT_NONCE=%q\n", nonce)
	fmt.Fprintf(&b, "PVT_ROOT=%q\n", root)
	fmt.Fprintf(&b, "PVT_HOSTNAME=%q\n", hostname)
	fmt.Fprintf(&b, "PVT_PRELOAD=%q\n", strings.Join(preload, " "))
	fmt.Fprintf(&b, "PVT_MODULES=%q\n", strings.Join(modules, " "))
	var ns []string
	for _, n := range nics {
		ip := n.IP
		if ip == "" {
			ip = "-"
		}
		ns = append(ns, strings.ToLower(n.MAC)+"="+ip)
	}
	fmt.Fprintf(&b, "PVT_NICS=%q\n", strings.Join(ns, " "))
	return b.Bytes()
}

// writeOverlay writes the per-boot cpio archive: /init, the helper library, the config,
// the scenario and the test's files. The kernel unpacks it over the base archive. For a
// guest with its own root, the archive has the root's scenario runner instead of the
// test's files (Start writes those into the root).
func writeOverlay(w io.Writer, cfg *Config, nonce string) error {
	cw := newCPIOWriter(w)
	cw.file("init", 0o755, initScript)
	cw.file(guestLib, 0o644, libScript)
	tag, lib := "", "/"+guestLib
	if cfg.Root != "" {
		tag, lib = rootTag, rootLib
	}
	cw.file(guestConfig, 0o600, guestConfigFile(nonce, cfg.Name, preloadModules(cfg), cfg.modules(), cfg.NICs, tag))
	libs := ". " + lib + "\n"
	if slices.Contains(cfg.Layers, LayerStorage) {
		cw.file(guestStorage, 0o644, storageScript)
		libs += ". /" + guestStorage + "\n"
	}
	script := "set -e\n" + libs + cfg.Scenario + "\n"
	if cfg.NoErrExit {
		script = libs + cfg.Scenario + "\n"
	}
	cw.file(guestScenario, 0o755, []byte(script))
	if cfg.Root != "" {
		cw.file(guestRootRun, 0o755, rootRunScript)
		cw.file(guestRootUnit, 0o644, rootRunUnit)
		return cw.close()
	}
	for _, p := range sortedKeys(cfg.Files) {
		if err := cw.file(usrMerged(p), 0o755, cfg.Files[p]); err != nil {
			return err
		}
	}
	for _, p := range sortedKeys(cfg.HostFiles) {
		st, err := os.Stat(cfg.HostFiles[p])
		if err != nil {
			return fmt.Errorf("host file for %s: %w", p, err)
		}
		if err := cw.copyFile(usrMerged(p), uint32(st.Mode().Perm()), cfg.HostFiles[p]); err != nil {
			return fmt.Errorf("host file for %s: %w", p, err)
		}
	}
	return cw.close()
}

// rootModules mount a guest's own root (Config.Root): 9p over virtio-pci.
var rootModules = []string{"virtio_pci", "9pnet_virtio", "9p"}

// preloadModules are loaded before Config.Modules: the NIC drivers and, for a guest
// with its own root, rootModules.
func preloadModules(cfg *Config) []string {
	var mods []string
	add := func(m string) {
		if !contains(mods, m) {
			mods = append(mods, m)
		}
	}
	for _, n := range cfg.NICs {
		switch n.model() {
		case "vmxnet3":
			add("vmxnet3")
		case "virtio-net-pci":
			add("virtio_pci")
			add("virtio_net")
		}
	}
	if cfg.Root != "" {
		for _, m := range rootModules {
			add(m)
		}
	}
	return mods
}

// validate checks a Config before anything is created.
func (cfg *Config) validate(img *Image) error {
	if !vmNameRE.MatchString(cfg.Name) {
		return fmt.Errorf("vm name %q: want [a-z0-9-], at most 31 characters", cfg.Name)
	}
	if cfg.MemMiB != 0 && (cfg.MemMiB < 128 || cfg.MemMiB > 16384) {
		return fmt.Errorf("vm %s: MemMiB %d out of range 128..16384", cfg.Name, cfg.MemMiB)
	}
	for _, l := range cfg.Layers {
		if _, ok := layers[l]; !ok {
			return fmt.Errorf("vm %s: no layer %q", cfg.Name, l)
		}
		if img != nil && img.Layers[l] == nil {
			return fmt.Errorf("vm %s: the image has no layer %q (rebuild it: make image)", cfg.Name, l)
		}
	}
	if len(cfg.Layers) > 0 && cfg.Root != "" {
		return fmt.Errorf("vm %s: Layers are initramfs archives, not for a guest with its own Root", cfg.Name)
	}
	var have []string
	if img != nil {
		have = img.layerModules(cfg.Layers)
	}
	for _, m := range cfg.modules() {
		if !moduleNameRE.MatchString(m) {
			return fmt.Errorf("vm %s: bad module name %q", cfg.Name, m)
		}
		if img != nil && !contains(have, strings.ReplaceAll(m, "-", "_")) {
			return fmt.Errorf("vm %s: module %s is not in the guest image or its layers %v (have %v)", cfg.Name, m, cfg.Layers, have)
		}
	}
	seen := map[string]bool{}
	for i := range cfg.NICs {
		n := &cfg.NICs[i]
		switch n.model() {
		case "vmxnet3", "virtio-net-pci":
		default:
			return fmt.Errorf("vm %s: NIC model %q not supported (vmxnet3, virtio-net-pci)", cfg.Name, n.Model)
		}
		if n.Addr != "" && !pciAddrRE.MatchString(n.Addr) {
			return fmt.Errorf("vm %s: NIC address %q: want slot.function, e.g. 05.0", cfg.Name, n.Addr)
		}
		if n.MAC != "" {
			hw, err := net.ParseMAC(n.MAC)
			if err != nil || len(hw) != 6 {
				return fmt.Errorf("vm %s: NIC MAC %q: %v", cfg.Name, n.MAC, err)
			}
			n.MAC = hw.String()
			if seen[n.MAC] {
				return fmt.Errorf("vm %s: duplicate MAC %s", cfg.Name, n.MAC)
			}
			seen[n.MAC] = true
		}
		if n.IP != "" {
			if _, err := netip.ParsePrefix(n.IP); err != nil {
				return fmt.Errorf("vm %s: NIC IP %q: want address/prefix: %w", cfg.Name, n.IP, err)
			}
		}
	}
	for p := range cfg.Files {
		if err := checkGuestPath(p); err != nil {
			return fmt.Errorf("vm %s: %w", cfg.Name, err)
		}
	}
	for p := range cfg.HostFiles {
		if err := checkGuestPath(p); err != nil {
			return fmt.Errorf("vm %s: %w", cfg.Name, err)
		}
	}
	if cfg.Root != "" {
		if err := cfg.validateRoot(img); err != nil {
			return fmt.Errorf("vm %s: %w", cfg.Name, err)
		}
	}
	return nil
}

func checkGuestPath(p string) error {
	c := cpioName(p)
	if !strings.HasPrefix(p, "/") || c == "" || strings.Contains(p, "..") || c == "init" ||
		strings.HasPrefix(c, "pvt/") || strings.HasPrefix(c, "etc/pvt/") {
		return fmt.Errorf("guest file path %q: want an absolute path outside /init, /pvt and /etc/pvt", p)
	}
	return nil
}
