package vm

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// CanRaiseMemlock reports whether this process may raise RLIMIT_MEMLOCK
// (CAP_SYS_RESOURCE), as libvirt must for a domain with <locked/>. The sandboxes the
// tests run in may lack it; a libvirt test then prints its domain with --lock=false.
func CanRaiseMemlock() bool {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		return false
	}
	if lim.Max == unix.RLIM_INFINITY {
		return true
	}
	caps, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, unix.CAP_SYS_RESOURCE, 0, 0, 0)
	return err == nil && caps == 1
}

// CleanupMachineCgroups removes, when t ends, the partition cgroup (/machine) that
// libvirt creates on each cgroup hierarchy for its domains and leaves behind when they
// stop, where it did not exist when this was called (rmdir: empty cgroups only, deepest
// first).
func CleanupMachineCgroups(t TB) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return fmt.Errorf("cgroup mounts: %w", err)
	}
	var created []string
	for _, l := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(l, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 1 || (g[0] != "cgroup" && g[0] != "cgroup2") {
			continue
		}
		dir := filepath.Join(f[4], "machine")
		if _, err := os.Stat(dir); os.IsNotExist(err) {
			created = append(created, dir)
		}
	}
	t.Cleanup(func() {
		for _, dir := range created {
			if err := rmdirCgroups(dir); err != nil && !os.IsNotExist(err) {
				t.Logf("libvirt's partition %s left behind: %v", dir, err)
			}
		}
	})
	return nil
}

// rmdirCgroups removes a cgroup and those below it, deepest first.
func rmdirCgroups(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if e.IsDir() {
			_ = rmdirCgroups(filepath.Join(dir, e.Name()))
		}
	}
	return os.Remove(dir)
}
