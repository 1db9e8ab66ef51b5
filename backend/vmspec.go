package backend

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// ErrBadVMName: a VM name is empty, too long or has characters that cannot
// name a socket file.
var ErrBadVMName = errors.New("VM name must be 1-64 characters of [A-Za-z0-9_.-], not starting with '.', and not \"control\"")

var vmNameRE = regexp.MustCompile(`^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$`)

// reservedVMNames name files of the daemon's own in the socket directory
// (control.sock): a VM of that name would collide with them.
var reservedVMNames = map[string]bool{"control": true}

// CheckVMName validates a VM name.
func CheckVMName(name string) error {
	if !vmNameRE.MatchString(name) {
		return fmt.Errorf("VM name %q: %w", name, ErrBadVMName)
	}
	if reservedVMNames[name] {
		return fmt.Errorf("VM name %q is reserved (the daemon's control socket is control.sock): %w", name, ErrBadVMName)
	}
	return nil
}

// DefaultMAC derives a stable MAC address for a VM's paired vmxnet3 from its
// name, in QEMU's 52:54:00 range. The backend and `qemu-args` both use it, so
// the device's node GUID matches the NIC without the guest telling us (the
// driver never writes the MAC registers).
func DefaultMAC(name string) net.HardwareAddr {
	h := sha256.Sum256([]byte("pvrdma-backend/vm/" + name))
	return net.HardwareAddr{0x52, 0x54, 0x00, h[0], h[1], h[2]}
}

// NodeGUID is the EUI-64 of a MAC address (ff:fe inserted, universal/local
// bit flipped), the node GUID RoCE devices report.
func NodeGUID(mac net.HardwareAddr) uint64 {
	if len(mac) != 6 {
		return 0
	}
	b := [8]byte{mac[0] ^ 0x02, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]}
	var g uint64
	for _, x := range b {
		g = g<<8 | uint64(x)
	}
	return g
}

// VMSpec is what the backend and QEMU must agree on for one VM.
type VMSpec struct {
	// Name names the VM and its socket (<SocketDir>/<Name>.sock).
	Name string
	// MAC is the vmxnet3 MAC; DefaultMAC(Name) when nil.
	MAC net.HardwareAddr
	// Slot is the PCI slot: vmxnet3 at Slot.0, PVRDMA at Slot.1.
	Slot int
	// Bus is the PCI bus to plug into ("" = the machine's root bus).
	Bus string
	// MemBytes is the guest RAM size; it backs all RAM with a shared memfd.
	MemBytes uint64
	// Netdev is the id of the -netdev the vmxnet3 attaches to.
	Netdev string
	// Socket is the vfio-user socket path.
	Socket string
	// QMPSocket, if set, is the daemon's QMP socket for the VM
	// (QMPSocketPath): QEMU connects a monitor of the daemon's own to it
	// (QMPArgs), with which the daemon guards the VM against migrations
	// and snapshots that would drop the device.
	QMPSocket string
	// GIDAllow is the VM's GID allow list as registered with the daemon
	// (VMRequest.GIDAllow); nil means the daemon's default.
	GIDAllow []string
	// RoCEMode is the VM's RoCE version as registered ("v1" or "v2";
	// empty: the daemon's default).
	RoCEMode string
	// Doorbells is the VM's doorbell mode as registered ("trapped" or
	// "memory"; empty: the daemon's default, trapped). It changes nothing
	// in QEMU's arguments: QEMU maps what the device offers.
	Doorbells string
	// QEMUUID and QEMUGID, if set, are the credentials the VM's QEMU runs
	// with (VMRequest.QEMUUID); libvirt-xml gives the domain a static DAC
	// label with them, so libvirt starts its QEMU so.
	QEMUUID, QEMUGID uint32
	// QEMUCgroup, if set, is the cgroup the VM's QEMU runs in
	// (VMRequest.QEMUCgroup).
	QEMUCgroup string
}

// SocketPath returns the socket path of VM name in dir.
func SocketPath(dir, name string) string { return filepath.Join(dir, name+".sock") }

func (s VMSpec) check() error {
	if err := CheckVMName(s.Name); err != nil {
		return err
	}
	if s.Slot > 31 || s.Slot < 0 || (s.Slot == 0 && s.Bus == "") {
		return fmt.Errorf("PCI slot %d: must be 1..31 on the root bus (0..31 on a named bus)", s.Slot)
	}
	if s.MemBytes < 64<<20 || s.MemBytes%(2<<20) != 0 {
		return fmt.Errorf("memory %d bytes: must be a multiple of 2 MiB, at least 64 MiB", s.MemBytes)
	}
	if s.MAC != nil && len(s.MAC) != 6 {
		return fmt.Errorf("MAC %v: not a 48-bit MAC", s.MAC)
	}
	if s.Netdev == "" || s.Socket == "" {
		return errors.New("netdev id and socket path are required")
	}
	return nil
}

func (s VMSpec) mac() net.HardwareAddr {
	if s.MAC != nil {
		return s.MAC
	}
	return DefaultMAC(s.Name)
}

// DeviceJSON returns the vfio-user-pci -device (and device_add) properties
// for our function. x-no-posted-writes is required: the driver reads the
// capabilities from guest RAM right after its DSRHIGH write, which a posted
// write would race, and posted doorbells let QEMU queue MMIO without bound
// (docs/ARCHITECTURE.md).
func (s VMSpec) DeviceJSON(id string) map[string]any {
	d := map[string]any{
		"driver":             "vfio-user-pci",
		"socket":             map[string]any{"type": "unix", "path": s.Socket},
		"addr":               fmt.Sprintf("%02x.1", s.Slot),
		"x-no-posted-writes": true,
	}
	if id != "" {
		d["id"] = id
	}
	if s.Bus != "" {
		d["bus"] = s.Bus
	}
	return d
}

// NICJSON returns the vmxnet3 -device (and device_add) properties.
func (s VMSpec) NICJSON(id string) map[string]any {
	d := map[string]any{
		"driver":        "vmxnet3",
		"netdev":        s.Netdev,
		"mac":           s.mac().String(),
		"addr":          fmt.Sprintf("%02x.0", s.Slot),
		"multifunction": true,
	}
	if id != "" {
		d["id"] = id
	}
	if s.Bus != "" {
		d["bus"] = s.Bus
	}
	return d
}

// QEMUArgs returns the QEMU command-line arguments that give a VM the
// PVRDMA device: RAM in a shared memfd (the device reads guest memory in
// place), locked RAM, the paired vmxnet3 at function 0 and our vfio-user
// device at function 1 of the slot.
func (s VMSpec) QEMUArgs() ([]string, error) {
	if err := s.check(); err != nil {
		return nil, fmt.Errorf("qemu args: %w", err)
	}
	nic, err := json.Marshal(s.NICJSON(""))
	if err != nil {
		return nil, err
	}
	dev, err := json.Marshal(s.DeviceJSON(""))
	if err != nil {
		return nil, err
	}
	mem := strconv.FormatUint(s.MemBytes>>20, 10) + "M"
	return append([]string{
		"-m", mem,
		"-object", "memory-backend-memfd,id=pvrdma-ram,size=" + mem + ",share=on,prealloc=on",
		"-machine", "q35,memory-backend=pvrdma-ram",
		"-overcommit", "mem-lock=on",
		"-device", string(nic),
		"-device", string(dev),
	}, s.QMPArgs()...), nil
}

// QMPReconnect is how often QEMU retries its connection to the daemon's
// QMP socket while the daemon is away (QEMU reports the first failure
// once, not every retry).
const QMPReconnect = time.Second

// QMPArgs returns the arguments that connect a QMP monitor of the
// daemon's own to QMPSocket (none without one): QEMU is the client and
// reconnects by itself, so the daemon needs no access to the VM's main
// monitor and finds the monitor again after a restart. -mon rather than
// QEMU 11's -object monitor-qmp, which QEMU 10.1 lacks (QEMU 11 warns
// that -mon is deprecated).
func (s VMSpec) QMPArgs() []string {
	if s.QMPSocket == "" {
		return nil
	}
	return []string{
		"-chardev", "socket,id=pvrdma-qmp,path=" + strings.ReplaceAll(s.QMPSocket, ",", ",,") +
			",reconnect-ms=" + strconv.FormatInt(QMPReconnect.Milliseconds(), 10),
		"-mon", "chardev=pvrdma-qmp,mode=control",
	}
}

// ParseVMFlag parses a `serve --vm` value: NAME, NAME=MAC, then optional
// comma-separated options: gid-allow=PREFIX (repeatable; a CIDR prefix, a
// single address, or "none"), mem=SIZE, roce=v1|v2,
// doorbells=trapped|memory (VMRequest.Doorbells), uid=N (the QEMU's
// user) and cgroup=PATH (the QEMU's cgroup, VMRequest.QEMUCgroup). For
// example
//
//	vm1=52:54:00:12:34:56,gid-allow=10.1.0.0/24,gid-allow=fd00:1::/64
//	vm2,cgroup=/machine.slice/vm2.scope
func ParseVMFlag(v string) (VMRequest, error) {
	head, opts, _ := strings.Cut(v, ",")
	name, mac, hasMAC := strings.Cut(head, "=")
	if err := CheckVMName(name); err != nil {
		return VMRequest{}, err
	}
	req := VMRequest{Name: name}
	if hasMAC {
		m, err := net.ParseMAC(mac)
		if err != nil || len(m) != 6 {
			return VMRequest{}, fmt.Errorf("VM %s: MAC %q: %w", name, mac, ErrBadMAC)
		}
		req.MAC = m.String()
	}
	if opts == "" {
		return req, nil
	}
	for _, o := range strings.Split(opts, ",") {
		k, val, ok := strings.Cut(o, "=")
		switch {
		case ok && k == "gid-allow":
			req.GIDAllow = append(req.GIDAllow, val)
		case ok && k == "roce":
			if _, err := ParseRoCEMode(val); err != nil || val == "" {
				return VMRequest{}, fmt.Errorf("VM %s: roce=%q: want v1 or v2: %w", name, val, ErrBadRoCEMode)
			}
			req.RoCEMode = val
		case ok && k == "uid":
			n, err := strconv.ParseUint(val, 10, 32)
			if err != nil || n == 0 {
				return VMRequest{}, fmt.Errorf("VM %s: uid=%q: want the QEMU's user ID (not 0: root is always admitted)", name, val)
			}
			req.QEMUUID = uint32(n)
		case ok && k == "cgroup":
			if err := CheckCgroupPath(val); err != nil {
				return VMRequest{}, fmt.Errorf("VM %s: %w", name, err)
			}
			req.QEMUCgroup = val
		case ok && k == "doorbells":
			if _, err := vdev.ParseDoorbellMode(val); err != nil || val == "" {
				return VMRequest{}, fmt.Errorf("VM %s: doorbells=%q: want trapped or memory: %w", name, val, ErrBadGIDPolicy)
			}
			req.Doorbells = val
		case ok && k == "mem":
			n, err := ParseSize(val)
			if err != nil || n == 0 {
				return VMRequest{}, fmt.Errorf("VM %s: mem=%q: want a size such as 4G or 512M", name, val)
			}
			req.MemBytes = n
		default:
			return VMRequest{}, fmt.Errorf("VM %s: option %q: want gid-allow=PREFIX, mem=SIZE, roce=v1|v2, doorbells=trapped|memory, uid=N or cgroup=PATH: %w", name, o, ErrBadGIDPolicy)
		}
	}
	if _, err := ParseGIDAllow(req.GIDAllow...); err != nil {
		return VMRequest{}, fmt.Errorf("VM %s: %w", name, err)
	}
	return req, nil
}

// ParseSize parses a byte count: digits with an optional K, M or G suffix
// (powers of 1024), at most 1 PiB.
func ParseSize(v string) (uint64, error) {
	mult := uint64(1)
	switch {
	case strings.HasSuffix(v, "K"):
		mult, v = 1<<10, strings.TrimSuffix(v, "K")
	case strings.HasSuffix(v, "M"):
		mult, v = 1<<20, strings.TrimSuffix(v, "M")
	case strings.HasSuffix(v, "G"):
		mult, v = 1<<30, strings.TrimSuffix(v, "G")
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil || n > (1<<50)/mult {
		return 0, fmt.Errorf("bad size %q", v)
	}
	return n * mult, nil
}
