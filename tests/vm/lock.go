package vm

import (
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
)

// The lock file pins every outside input of the test bed (and so of the demo): the
// exact Debian packages of QEMU, of the guest kernel, of the guests' userspace and
// layers, and of the packaging tests' bookworm roots. A build takes exactly those
// versions, whatever the mirror would pick that day: two machines, or one machine a year
// apart, boot the same guests or fail saying which pinned package is no longer served.
// `make testbed-update` moves the pins to what the mirror serves, and rewrites the file
// only when a smoke set of VM tests passes on the new versions (scripts/testbed-update).

// LockFile is the lock's path in the repository, relative to its top.
const LockFile = "tests/vm/testbed.lock.json"

// EnvLock names another lock file to use instead of the one compiled in (the file
// `make testbed-update` tries before it replaces LockFile).
const EnvLock = "PVRDMA_TESTBED_LOCK"

// updateHint is what every error about the lock tells the reader to run.
const updateHint = "run `make testbed-update` to pin what the mirror serves now (it rewrites " + LockFile +
	" only if the smoke VM tests pass on the new versions), or `make testbed-lock` to pin only what the lock lacks"

//go:embed testbed.lock.json
var embeddedLock []byte

// Lock is the content of the lock file.
type Lock struct {
	// Comment says what the file is, for whoever opens it.
	Comment string `json:"comment"`
	// QEMU is the QEMU closure from trixie(-backports).
	QEMU LockedSet `json:"qemu"`
	// Kernel is the guest kernel: its ABI, its Debian version and its packages.
	Kernel LockedKernel `json:"kernel"`
	// Guest is the guests' userspace (the base initramfs) from bookworm.
	Guest LockedSet `json:"guest"`
	// Layers are the optional image layers, each from bookworm.
	Layers map[Layer]LockedSet `json:"layers"`
	// Roots are the packaging tests' bookworm roots: "base" is the clean root
	// (debootstrap's packages, checked after it ran); every other key is a layer
	// installed over it, named by its requested packages joined with spaces, whose
	// Packages are the ones it adds to or changes in the clean root.
	Roots map[string]LockedSet `json:"roots"`
}

// LockedSet is one component's request and the exact packages it resolved to.
type LockedSet struct {
	// Request are the names asked for (the code's list at the time of locking); a build
	// whose code asks for another list refuses the lock.
	Request []string `json:"request"`
	// Packages are name=version:arch, sorted by name.
	Packages []string `json:"packages"`
}

// LockedKernel is the locked guest kernel.
type LockedKernel struct {
	ABI      string   `json:"abi"`
	Version  string   `json:"version"`
	Packages []string `json:"packages"`
}

// LoadLock returns the lock in force: the file $PVRDMA_TESTBED_LOCK names, else the one
// compiled into this binary from LockFile.
func LoadLock() (*Lock, string, error) {
	src, b := LockFile+" (compiled in)", embeddedLock
	if p := os.Getenv(EnvLock); p != "" {
		var err error
		if b, err = os.ReadFile(p); err != nil {
			return nil, "", fmt.Errorf("test bed lock: %w", err)
		}
		src = p
	}
	l, err := ParseLock(b)
	if err != nil {
		return nil, "", fmt.Errorf("test bed lock %s: %w", src, err)
	}
	return l, src, nil
}

// ParseLock decodes and checks a lock file.
func ParseLock(b []byte) (*Lock, error) {
	var l Lock
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&l); err != nil {
		return nil, err
	}
	check := func(what string, pkgs []string) error {
		for _, s := range pkgs {
			if _, err := ParsePackage(s); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
		}
		return nil
	}
	if err := check("qemu", l.QEMU.Packages); err != nil {
		return nil, err
	}
	if err := check("kernel", l.Kernel.Packages); err != nil {
		return nil, err
	}
	if err := check("guest", l.Guest.Packages); err != nil {
		return nil, err
	}
	for name, s := range l.Layers {
		if err := check("layer "+string(name), s.Packages); err != nil {
			return nil, err
		}
	}
	for name, s := range l.Roots {
		if err := check("root "+name, s.Packages); err != nil {
			return nil, err
		}
	}
	return &l, nil
}

// Encode returns the lock as the file holds it: indented JSON, a package a line.
func (l *Lock) Encode() []byte {
	b, err := json.MarshalIndent(l, "", "  ")
	if err != nil {
		panic(err) // plain strings and maps only
	}
	return append(b, '\n')
}

var packageRE = regexp.MustCompile(`^([a-z0-9][a-z0-9+.-]*)=([A-Za-z0-9.+~:-]+):([a-z0-9]+)$`)

// ParsePackage parses name=version:arch (Package.String's form).
func ParsePackage(s string) (Package, error) {
	m := packageRE.FindStringSubmatch(s)
	if m == nil {
		return Package{}, fmt.Errorf("%q is not name=version:arch", s)
	}
	return Package{Name: m[1], Version: m[2], Arch: m[3]}, nil
}

// ParsePackages parses a list of name=version:arch.
func ParsePackages(ss []string) ([]Package, error) {
	out := make([]Package, 0, len(ss))
	for _, s := range ss {
		p, err := ParsePackage(s)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// PackageStrings is the inverse of ParsePackages, sorted by name.
func PackageStrings(pkgs []Package) []string {
	s := pkgStrings(pkgs)
	sort.Strings(s)
	return s
}

// ErrNotLocked is wrapped by the errors about a component the lock does not pin for the
// code's request.
var ErrNotLocked = errors.New("not pinned by the test bed lock")

// Packages returns the set's packages for request, or an error naming the command to
// run when the set was locked for another request.
func (s LockedSet) Resolve(what string, request []string) ([]Package, error) {
	if len(s.Packages) == 0 {
		return nil, fmt.Errorf("%s: %w (the lock has no entry): %s", what, ErrNotLocked, updateHint)
	}
	if !sameRequest(s.Request, request) {
		return nil, fmt.Errorf("%s: %w: the lock was made for %v, the code asks for %v: %s",
			what, ErrNotLocked, s.Request, request, updateHint)
	}
	return ParsePackages(s.Packages)
}

func sameRequest(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	sort.Strings(a)
	sort.Strings(b)
	return slices.Equal(a, b)
}

// lockedKernel returns the kernel choice the lock pins.
func (l *Lock) lockedKernel() (kernelChoice, error) {
	if l.Kernel.ABI == "" || len(l.Kernel.Packages) == 0 {
		return kernelChoice{}, fmt.Errorf("kernel: %w: %s", ErrNotLocked, updateHint)
	}
	pkgs, err := ParsePackages(l.Kernel.Packages)
	if err != nil {
		return kernelChoice{}, err
	}
	return kernelChoice{ABI: l.Kernel.ABI, Version: l.Kernel.Version, Packages: pkgs}, nil
}

// LockDiff lists, a line each, what differs between two locks: packages added, removed
// or at another version, per component.
func LockDiff(old, new *Lock) []string {
	var out []string
	diff := func(what string, a, b []string) {
		av, bv := versions(a), versions(b)
		for _, n := range sortedStrings(bv) {
			switch ov, ok := av[n]; {
			case !ok:
				out = append(out, fmt.Sprintf("%s: + %s %s", what, n, bv[n]))
			case ov != bv[n]:
				out = append(out, fmt.Sprintf("%s: %s %s -> %s", what, n, ov, bv[n]))
			}
		}
		for _, n := range sortedStrings(av) {
			if _, ok := bv[n]; !ok {
				out = append(out, fmt.Sprintf("%s: - %s %s", what, n, av[n]))
			}
		}
	}
	diff("qemu", old.QEMU.Packages, new.QEMU.Packages)
	if old.Kernel.ABI != new.Kernel.ABI || old.Kernel.Version != new.Kernel.Version {
		out = append(out, fmt.Sprintf("kernel: %s (%s) -> %s (%s)", old.Kernel.ABI, old.Kernel.Version, new.Kernel.ABI, new.Kernel.Version))
	}
	diff("guest", old.Guest.Packages, new.Guest.Packages)
	for _, n := range unionKeys(old.Layers, new.Layers) {
		diff("layer "+string(n), old.Layers[n].Packages, new.Layers[n].Packages)
	}
	for _, n := range unionKeys(old.Roots, new.Roots) {
		diff("root "+n, old.Roots[n].Packages, new.Roots[n].Packages)
	}
	return out
}

// versions maps name:arch to version.
func versions(ss []string) map[string]string {
	m := map[string]string{}
	for _, s := range ss {
		if p, err := ParsePackage(s); err == nil {
			m[p.Name+":"+p.Arch] = p.Version
		}
	}
	return m
}

func sortedStrings(m map[string]string) []string {
	k := make([]string, 0, len(m))
	for n := range m {
		k = append(k, n)
	}
	sort.Strings(k)
	return k
}

func unionKeys[K ~string, V any](a, b map[K]V) []K {
	seen := map[K]bool{}
	var k []K
	for _, m := range []map[K]V{a, b} {
		for n := range m {
			if !seen[n] {
				seen[n] = true
				k = append(k, n)
			}
		}
	}
	slices.Sort(k)
	return k
}

// pins reports whether the set was locked for request.
func (s LockedSet) pins(request []string) bool {
	return len(s.Packages) > 0 && sameRequest(s.Request, request)
}

// clone returns a deep copy of the lock.
func (l *Lock) clone() *Lock {
	c, err := ParseLock(l.Encode())
	if err != nil {
		panic(err) // a lock that parsed once parses again
	}
	return c
}

// imageDigest is a digest of the parts of the lock the VM image is built from (not the
// packaging roots'), recorded in image.json.
func (l *Lock) imageDigest() string {
	b, err := json.Marshal(struct {
		QEMU   LockedSet
		Kernel LockedKernel
		Guest  LockedSet
		Layers map[Layer]LockedSet
	}{l.QEMU, l.Kernel, l.Guest, l.Layers})
	if err != nil {
		panic(err)
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])[:16]
}
