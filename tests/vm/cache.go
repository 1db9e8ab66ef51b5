package vm

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Environment variables that steer the image cache.
const (
	// EnvCacheDir overrides the cache directory.
	EnvCacheDir = "PVRDMA_VM_CACHE"
	// EnvRefresh, when set to 1, refreshes the package indices and rebuilds whatever
	// changed. Without it a cache that has an image is used as it is (no network).
	EnvRefresh = "PVRDMA_VM_REFRESH"
	// EnvMirror overrides the Debian mirror (default http://deb.debian.org/debian).
	EnvMirror = "PVRDMA_DEBIAN_MIRROR"
	// EnvSecurityMirror overrides the Debian security mirror
	// (default http://deb.debian.org/debian-security).
	EnvSecurityMirror = "PVRDMA_DEBIAN_SECURITY_MIRROR"
)

// DefaultCacheDir returns the image cache directory: $PVRDMA_VM_CACHE, else
// $XDG_CACHE_HOME/pvrdma-backend, else /var/cache/pvrdma-backend.
func DefaultCacheDir() string {
	if d := os.Getenv(EnvCacheDir); d != "" {
		return d
	}
	if d := os.Getenv("XDG_CACHE_HOME"); d != "" {
		return filepath.Join(d, "pvrdma-backend")
	}
	return "/var/cache/pvrdma-backend"
}

// cacheLock is an flock(2) on the cache's lock file. Builders take it exclusively, readers
// shared, so that parallel test binaries never see a half-built cache.
type cacheLock struct{ f *os.File }

func lockCache(dir string, exclusive bool) (*cacheLock, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create cache dir: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open cache lock: %w", err)
	}
	how := unix.LOCK_SH
	if exclusive {
		how = unix.LOCK_EX
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock cache: %w", err)
	}
	return &cacheLock{f: f}, nil
}

func (l *cacheLock) unlock() {
	_ = unix.Flock(int(l.f.Fd()), unix.LOCK_UN)
	l.f.Close()
}

// component is one keyed, immutable directory of the cache, e.g. qemu/<key>.
type component struct {
	kind string // "qemu", "kernel", "initramfs"
	key  string // hex digest of the recipe and the exact package versions
	dir  string // final location
}

// newComponent derives a component's key from its recipe and inputs (sorted by the
// caller where order does not matter).
func newComponent(cacheDir, kind, recipe string, inputs []string) component {
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%s\n", kind, recipe)
	for _, in := range inputs {
		fmt.Fprintf(h, "%s\n", in)
	}
	key := hex.EncodeToString(h.Sum(nil))[:16]
	return component{kind: kind, key: key, dir: filepath.Join(cacheDir, kind, key)}
}

// exists reports whether the component has been built completely (it is only ever
// renamed into place when complete).
func (c component) exists() bool {
	st, err := os.Stat(c.dir)
	return err == nil && st.IsDir()
}

// build runs fn in a fresh temporary directory next to the final one and renames it into
// place when fn succeeds, so an interrupted build never leaves a partial component.
// The caller holds the exclusive cache lock.
func (c component) build(fn func(tmp string) error) error {
	parent := filepath.Dir(c.dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("%s: %w", c.kind, err)
	}
	removeStaleTemps(parent)
	tmp, err := os.MkdirTemp(parent, ".tmp-"+c.key+"-")
	if err != nil {
		return fmt.Errorf("%s: %w", c.kind, err)
	}
	if err := fn(tmp); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("build %s %s: %w", c.kind, c.key, err)
	}
	if err := os.Chmod(tmp, 0o755); err != nil { // MkdirTemp made it 0700
		os.RemoveAll(tmp)
		return fmt.Errorf("%s: %w", c.kind, err)
	}
	if err := os.Rename(tmp, c.dir); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("publish %s: %w", c.kind, err)
	}
	return nil
}

// removeStaleTemps removes build directories left by interrupted builds. Only called
// under the exclusive lock, so no live build owns them.
func removeStaleTemps(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}

// dirSize sums the sizes of the regular files below dir.
func dirSize(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}
