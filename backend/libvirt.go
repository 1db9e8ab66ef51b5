package backend

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"
)

// LibvirtOptions are the parts of a libvirt domain that the host decides,
// not the device.
type LibvirtOptions struct {
	// DomainType is "kvm" (default) or "qemu" (TCG).
	DomainType string
	// VCPUs is the vCPU count (default 1).
	VCPUs int
	// NIC is how the paired vmxnet3 reaches the network: "network:NAME"
	// (default "network:default"), "bridge:NAME", or "user" (QEMU's user-mode
	// network, for tests and unprivileged sessions).
	NIC string
	// NoLock leaves out <locked/>: libvirt then does not raise QEMU's
	// RLIMIT_MEMLOCK (which needs CAP_SYS_RESOURCE) and QEMU does not lock guest
	// RAM itself. The device still works: the daemon locks the RAM it maps.
	NoLock bool
	// Emulator, if set, is the QEMU binary libvirt runs (<emulator>); it must
	// have the vfio-user-pci client (QEMU >= 10.1).
	Emulator string
}

// LibvirtDomainXML returns a libvirt domain that gives the VM the PVRDMA
// device, the libvirt form of QEMUArgs: RAM in a shared, preallocated,
// locked memfd (<memoryBacking>), the paired vmxnet3 at Slot.0 on the root
// bus (<interface>), and our vfio-user-pci function at Slot.1, which libvirt
// has no element for, as a <qemu:commandline> -device. The domain has no
// disk or OS yet: add them (virsh edit, virt-xml) before starting it.
func (s VMSpec) LibvirtDomainXML(o LibvirtOptions) (string, error) {
	if err := s.check(); err != nil {
		return "", fmt.Errorf("libvirt xml: %w", err)
	}
	if s.Bus != "" {
		return "", fmt.Errorf("libvirt xml: a named bus (%s) is not supported; the device sits on the root bus", s.Bus)
	}
	if !xmlSafe(s.Socket) || !xmlSafe(s.QMPSocket) {
		return "", fmt.Errorf("libvirt xml: socket path %q: XML cannot carry it (invalid UTF-8 or control characters)", s.Socket)
	}
	if s.MemBytes%(1<<20) != 0 {
		return "", fmt.Errorf("libvirt xml: memory %d bytes: want whole MiB", s.MemBytes)
	}
	domType := o.DomainType
	if domType == "" {
		domType = "kvm"
	}
	if domType != "kvm" && domType != "qemu" {
		return "", fmt.Errorf("libvirt xml: domain type %q: want kvm or qemu", domType)
	}
	vcpus := o.VCPUs
	if vcpus == 0 {
		vcpus = 1
	}
	if vcpus < 0 || vcpus > 1024 {
		return "", fmt.Errorf("libvirt xml: %d vCPUs: want 1..1024", vcpus)
	}
	nic, err := libvirtInterface(o.NIC)
	if err != nil {
		return "", fmt.Errorf("libvirt xml: %w", err)
	}
	dev, err := json.Marshal(s.DeviceJSON(""))
	if err != nil {
		return "", fmt.Errorf("libvirt xml: %w", err)
	}
	var b strings.Builder
	w := func(format string, args ...any) {
		for i, a := range args {
			if v, ok := a.(string); ok {
				args[i] = xmlEscape(v)
			}
		}
		fmt.Fprintf(&b, format+"\n", args...)
	}
	w("<!-- printed by pvrdma-backend libvirt-xml -->")
	w("<domain type='%s' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>", domType)
	w("  <name>%s</name>", s.Name)
	w("  <memory unit='MiB'>%d</memory>", s.MemBytes>>20)
	if o.NoLock {
		w("  <!-- the device reads guest RAM in place: one shared memfd, preallocated (the daemon locks what it maps) -->")
	} else {
		w("  <!-- the device reads guest RAM in place: one shared memfd, preallocated and locked -->")
	}
	w("  <memoryBacking>")
	w("    <source type='memfd'/>")
	w("    <access mode='shared'/>")
	w("    <allocation mode='immediate'/>")
	if !o.NoLock {
		w("    <locked/>")
	}
	w("  </memoryBacking>")
	w("  <vcpu>%d</vcpu>", vcpus)
	if s.QEMUUID != 0 {
		w("  <!-- QEMU runs as a user of this VM's own, the only one (with root) its pvrdma-backend sockets admit -->")
		w("  <seclabel type='static' model='dac' relabel='yes'>")
		w("    <label>+%d:+%d</label>", s.QEMUUID, s.QEMUGID)
		w("  </seclabel>")
	}
	w("  <os>")
	w("    <type arch='x86_64' machine='q35'>hvm</type>")
	w("  </os>")
	w("  <features>")
	w("    <acpi/>")
	w("  </features>")
	w("  <devices>")
	if o.Emulator != "" {
		w("    <emulator>%s</emulator>", o.Emulator)
	}
	w("    <!-- the vmxnet3 the PVRDMA function pairs with: function 0 of the device's slot -->")
	w("    <interface type='%s'>", nic.typ)
	if nic.source != "" {
		w("      <source %s='%s'/>", nic.sourceAttr, nic.source)
	}
	w("      <mac address='%s'/>", s.mac().String())
	w("      <model type='vmxnet3'/>")
	w("      <address type='pci' domain='0x0000' bus='0x00' slot='0x%02x' function='0x0' multifunction='on'/>", s.Slot)
	w("    </interface>")
	w("    <memballoon model='none'/>")
	w("  </devices>")
	w("  <!-- the PVRDMA function (vfio-user; libvirt has no element for it) at function 1 -->")
	w("  <qemu:commandline>")
	w("    <qemu:arg value='-device'/>")
	w("    <qemu:arg value='%s'/>", string(dev))
	if qa := s.QMPArgs(); len(qa) > 0 {
		w("    <!-- a QMP monitor of pvrdma-backend's own: it cancels migrations and snapshots, which would drop the device -->")
		for _, a := range qa {
			w("    <qemu:arg value='%s'/>", a)
		}
	}
	w("  </qemu:commandline>")
	w("</domain>")
	return b.String(), nil
}

type libvirtNIC struct{ typ, sourceAttr, source string }

// nicNameRE is what a libvirt network or a bridge may be named here.
var nicNameRE = regexp.MustCompile(`^[A-Za-z0-9_.:@-]{1,64}$`)

// xmlSafe reports whether s can be written as XML 1.0 character data.
func xmlSafe(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsFunc(s, func(r rune) bool {
		return r < 0x20 && r != '\t' && r != '\n' && r != '\r' || r == 0xFFFE || r == 0xFFFF
	})
}

func libvirtInterface(spec string) (libvirtNIC, error) {
	if spec == "" {
		spec = "network:default"
	}
	kind, name, _ := strings.Cut(spec, ":")
	if name != "" && !nicNameRE.MatchString(name) {
		return libvirtNIC{}, fmt.Errorf("NIC %q: bad %s name", spec, kind)
	}
	switch {
	case kind == "network" && name != "":
		return libvirtNIC{"network", "network", name}, nil
	case kind == "bridge" && name != "":
		return libvirtNIC{"bridge", "bridge", name}, nil
	case spec == "user":
		return libvirtNIC{typ: "user"}, nil
	}
	return libvirtNIC{}, fmt.Errorf("NIC %q: want network:NAME, bridge:NAME or user", spec)
}

// xmlEscape escapes text for element content and single-quoted attributes
// (double quotes stay as they are: the device's JSON reads as JSON).
var xmlEscaper = strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", "'", "&apos;",
	"\n", "&#xA;", "\r", "&#xD;", "\t", "&#x9;")

func xmlEscape(s string) string { return xmlEscaper.Replace(s) }

// LibvirtHookOps are the libvirt qemu hook operations the hook refuses for
// a domain with the device: "migrate" (libvirt runs it on the destination
// of an incoming migration) and "restore" (a saved image started again).
// QEMU's vfio-user-pci carries no device state in either, so the guest
// would resume with a device whose objects are gone and with memory the
// device wrote missing. libvirt runs no hook on the source of a save: the
// daemon's QMP monitor cancels that migration (vmmonitor.go).
var LibvirtHookOps = map[string]bool{"migrate": true, "restore": true}

// ErrHookRefused is the libvirt hook's refusal.
var ErrHookRefused = errors.New("refused")

// LibvirtHook decides a libvirt qemu hook call (/etc/libvirt/hooks/qemu.d/):
// domain and op are its first two arguments, domainXML its standard input.
// It returns an error naming the device for an operation in
// LibvirtHookOps on a domain with a vfio-user-pci device, and nil
// otherwise (every other operation, and domains without the device, pass
// untouched: the hook must never stand in the way of other VMs).
func LibvirtHook(domain, op string, domainXML []byte) error {
	if !LibvirtHookOps[op] {
		return nil
	}
	socks, err := libvirtVFIOUserSockets(domainXML)
	if err != nil {
		// Unreadable XML: refuse only if it names the device at all.
		if !bytes.Contains(domainXML, []byte("vfio-user-pci")) {
			return nil
		}
		socks = []string{"(domain XML unreadable: " + err.Error() + ")"}
	}
	if len(socks) == 0 {
		return nil
	}
	return fmt.Errorf("%w to %s domain %q: it has a PVRDMA device (vfio-user-pci, socket %s), "+
		"and QEMU's vfio-user-pci cannot carry that device's state, so the guest would resume with a dead device "+
		"and lose the memory the device wrote; shut the VM down and start it again instead: %w",
		ErrHookRefused, op, domain, strings.Join(socks, ", "), ErrNotMigratable)
}

// ErrNotMigratable: a VM with the device cannot be migrated, saved or
// restored (QEMU 11's vfio-user-pci has no migration support).
var ErrNotMigratable = errors.New("a VM with a vfio-user PVRDMA device cannot be migrated, saved or restored")

// libvirtVFIOUserSockets returns the vfio-user sockets of the
// vfio-user-pci devices a domain's <qemu:commandline> adds.
func libvirtVFIOUserSockets(domainXML []byte) ([]string, error) {
	var dom struct {
		Args []struct {
			Value string `xml:"value,attr"`
		} `xml:"commandline>arg"`
	}
	if err := xml.Unmarshal(domainXML, &dom); err != nil {
		return nil, fmt.Errorf("domain XML: %w", err)
	}
	var socks []string
	for i, a := range dom.Args {
		if a.Value != "-device" || i+1 >= len(dom.Args) {
			continue
		}
		v := dom.Args[i+1].Value
		var dev struct {
			Driver string `json:"driver"`
			Socket struct {
				Path string `json:"path"`
			} `json:"socket"`
		}
		switch {
		case json.Unmarshal([]byte(v), &dev) == nil && dev.Driver == "vfio-user-pci":
			socks = append(socks, dev.Socket.Path)
		case strings.HasPrefix(v, "vfio-user-pci,") || strings.HasPrefix(v, "driver=vfio-user-pci"):
			socks = append(socks, v)
		}
	}
	return socks, nil
}
