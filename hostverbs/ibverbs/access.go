package ibverbs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// accessProblem explains why libibverbs cannot open the RDMA device name although the
// kernel has it (it is in sys/class/infiniband): no verbs device for it (ib_uverbs not
// loaded), its node missing under dev/infiniband (a systemd unit's PrivateDevices=yes
// gives the daemon a /dev without it), or the node refused (a unit's DevicePolicy, or
// file permissions). It returns "" when the kernel has no such device or the node
// opens. sys and dev are the sysfs and /dev roots ("/sys", "/dev").
func accessProblem(sys, dev, name string) string {
	if _, err := os.Stat(filepath.Join(sys, "class/infiniband", name)); err != nil {
		return ""
	}
	verbs := filepath.Join(sys, "class/infiniband_verbs")
	ents, _ := os.ReadDir(verbs)
	node := ""
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(verbs, e.Name(), "ibdev"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			node = e.Name()
			break
		}
	}
	if node == "" {
		return fmt.Sprintf("the kernel has %s but no verbs device for it: load ib_uverbs (modprobe ib_uverbs; "+
			"under the packaged unit, list it in /etc/modules-load.d/)", name)
	}
	path := filepath.Join(dev, "infiniband", node)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	switch {
	case err == nil:
		f.Close()
		return ""
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Sprintf("the kernel has %s, but %s is missing: a systemd unit with PrivateDevices=yes, "+
			"as packaged, hides /dev/infiniband (the relay's drop-in: PrivateDevices=no, DevicePolicy=closed, "+
			"DeviceAllow=char-infiniband_verbs rw; see pvrdma-backend(8))", name, path)
	case errors.Is(err, fs.ErrPermission):
		return fmt.Sprintf("the kernel has %s, but %s cannot be opened: %v (under systemd: DeviceAllow=char-infiniband_verbs rw, "+
			"with ib_uverbs loaded before the unit starts; see pvrdma-backend(8))", name, path, err)
	}
	return fmt.Sprintf("the kernel has %s, but %s cannot be opened: %v", name, path, err)
}
