package backend

import (
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
)

// LibvirtDomain is what AddToLibvirtDomain needs to know of an existing
// domain: its name and RAM size.
type LibvirtDomain struct {
	Name     string
	MemBytes uint64
}

// libvirtQEMUNS is the namespace of libvirt's <qemu:commandline>.
const libvirtQEMUNS = "http://libvirt.org/schemas/domain/qemu/1.0"

// libvirtDomainXML is the part of a domain's XML that is read.
type libvirtDomainXML struct {
	XMLName xml.Name `xml:"domain"`
	Name    string   `xml:"name"`
	Memory  struct {
		Unit  string `xml:"unit,attr"`
		Value string `xml:",chardata"`
	} `xml:"memory"`
}

// ReadLibvirtDomain reads an existing domain's name and RAM size from its
// XML (virsh dumpxml).
func ReadLibvirtDomain(domainXML string) (LibvirtDomain, error) {
	var d libvirtDomainXML
	if err := xml.Unmarshal([]byte(domainXML), &d); err != nil {
		return LibvirtDomain{}, fmt.Errorf("libvirt domain: %w", err)
	}
	if d.Name == "" {
		return LibvirtDomain{}, fmt.Errorf("libvirt domain: no <name>")
	}
	mem, err := libvirtSize(strings.TrimSpace(d.Memory.Value), d.Memory.Unit)
	if err != nil {
		return LibvirtDomain{}, fmt.Errorf("libvirt domain %s: <memory>: %w", d.Name, err)
	}
	return LibvirtDomain{Name: d.Name, MemBytes: mem}, nil
}

// libvirtSize converts a libvirt scaled integer (unit default KiB).
func libvirtSize(v, unit string) (uint64, error) {
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: %w", v, err)
	}
	var scale uint64
	switch unit {
	case "b", "bytes":
		scale = 1
	case "KB":
		scale = 1000
	case "", "k", "KiB":
		scale = 1 << 10
	case "MB":
		scale = 1000 * 1000
	case "M", "MiB":
		scale = 1 << 20
	case "GB":
		scale = 1000 * 1000 * 1000
	case "G", "GiB":
		scale = 1 << 30
	case "T", "TiB":
		scale = 1 << 40
	default:
		return 0, fmt.Errorf("unit %q", unit)
	}
	if n > (1<<64-1)/scale {
		return 0, fmt.Errorf("size %s %s overflows", v, unit)
	}
	return n * scale, nil
}

var (
	domainOpenRE   = regexp.MustCompile(`<domain\b[^>]*>`)
	memBackingRE   = regexp.MustCompile(`(?s)[ \t]*<memoryBacking\s*/>[ \t]*\n?|[ \t]*<memoryBacking\b[^>]*>.*?</memoryBacking>[ \t]*\n?`)
	memballoonRE   = regexp.MustCompile(`(?s)<memballoon\b[^>]*/>|<memballoon\b[^>]*>.*?</memballoon>`)
	afterCurMemRE  = regexp.MustCompile(`</currentMemory>[ \t]*\n`)
	afterMemoryRE  = regexp.MustCompile(`</memory>[ \t]*\n`)
	devicesCloseRE = regexp.MustCompile(`[ \t]*</devices>`)
	qemuCmdCloseRE = regexp.MustCompile(`[ \t]*</qemu:commandline>`)
	domainCloseRE  = regexp.MustCompile(`</domain>`)
)

// AddToLibvirtDomain returns an existing domain's XML (as virsh dumpxml
// prints it) with the device added, as LibvirtDomainXML gives it to a new
// domain: its RAM moved to a shared, preallocated (and, unless o.NoLock,
// locked) memfd, its memory balloon removed (a balloon would take pages
// of the RAM the device reads in place), the paired vmxnet3 at Slot.0 of
// the root bus on o.NIC, and the vfio-user-pci function and the daemon's
// QMP monitor in <qemu:commandline>. The rest of the domain (its disks,
// NICs, OS) is kept as it is. The domain's name and RAM must be the VM's;
// a domain that already has a vfio-user device, or a device at Slot of
// the root bus, is refused. o's DomainType, VCPUs and Emulator are a new
// domain's and not used.
func (s VMSpec) AddToLibvirtDomain(domainXML string, o LibvirtOptions) (string, error) {
	if err := s.check(); err != nil {
		return "", fmt.Errorf("libvirt xml: %w", err)
	}
	if s.Bus != "" {
		return "", fmt.Errorf("libvirt xml: a named bus (%s) is not supported; the device sits on the root bus", s.Bus)
	}
	if !xmlSafe(s.Socket) || !xmlSafe(s.QMPSocket) {
		return "", fmt.Errorf("libvirt xml: socket path %q: XML cannot carry it (invalid UTF-8 or control characters)", s.Socket)
	}
	d, err := ReadLibvirtDomain(domainXML)
	if err != nil {
		return "", err
	}
	if d.Name != s.Name {
		return "", fmt.Errorf("libvirt domain %s: the VM is %s: a domain's device is registered under the domain's name", d.Name, s.Name)
	}
	if d.MemBytes != s.MemBytes {
		return "", fmt.Errorf("libvirt domain %s has %d MiB of RAM, the VM %d MiB: give the domain's size (--mem)", d.Name, d.MemBytes>>20, s.MemBytes>>20)
	}
	socks, err := libvirtVFIOUserSockets([]byte(domainXML))
	if err != nil {
		return "", fmt.Errorf("libvirt domain %s: %w", d.Name, err)
	}
	if len(socks) > 0 {
		return "", fmt.Errorf("libvirt domain %s already has a vfio-user device (socket %s)", d.Name, strings.Join(socks, ", "))
	}
	if who, err := rootSlotTaken(domainXML, s.Slot); err != nil {
		return "", fmt.Errorf("libvirt domain %s: %w", d.Name, err)
	} else if who != "" {
		return "", fmt.Errorf("libvirt domain %s: slot 0x%02x of the root bus is taken (%s): pass --slot with a free one", d.Name, s.Slot, who)
	}
	nic, err := libvirtInterface(o.NIC)
	if err != nil {
		return "", fmt.Errorf("libvirt xml: %w", err)
	}
	dev, err := json.Marshal(s.DeviceJSON(""))
	if err != nil {
		return "", fmt.Errorf("libvirt xml: %w", err)
	}
	lines := func(ind string, ls ...string) string {
		var b strings.Builder
		for _, l := range ls {
			b.WriteString(ind + l + "\n")
		}
		return b.String()
	}
	x := domainXML

	// The qemu namespace on the root element.
	open := domainOpenRE.FindString(x)
	if open == "" {
		return "", fmt.Errorf("libvirt domain %s: no <domain> element", d.Name)
	}
	if !strings.Contains(open, libvirtQEMUNS) {
		if strings.Contains(open, "xmlns:qemu=") {
			return "", fmt.Errorf("libvirt domain %s: its xmlns:qemu is not libvirt's qemu namespace", d.Name)
		}
		x = strings.Replace(x, open, strings.TrimSuffix(open, ">")+" xmlns:qemu='"+libvirtQEMUNS+"'>", 1)
	} else if !strings.Contains(open, "xmlns:qemu='"+libvirtQEMUNS+"'") && !strings.Contains(open, `xmlns:qemu="`+libvirtQEMUNS+`"`) {
		return "", fmt.Errorf("libvirt domain %s: libvirt's qemu namespace has a prefix other than qemu", d.Name)
	}

	// The RAM: one shared memfd, preallocated (and locked).
	backing := []string{"<!-- added by pvrdma-backend libvirt-xml: the device reads guest RAM in place -->", "<memoryBacking>",
		"  <source type='memfd'/>", "  <access mode='shared'/>", "  <allocation mode='immediate'/>"}
	if !o.NoLock {
		backing = append(backing, "  <locked/>")
	}
	backing = append(backing, "</memoryBacking>")
	x = memBackingRE.ReplaceAllLiteralString(x, "")
	loc := afterCurMemRE.FindStringIndex(x)
	if loc == nil {
		loc = afterMemoryRE.FindStringIndex(x)
	}
	if loc == nil {
		return "", fmt.Errorf("libvirt domain %s: no </memory> line to put <memoryBacking> after", d.Name)
	}
	x = x[:loc[1]] + lines("  ", backing...) + x[loc[1]:]

	// No balloon.
	if memballoonRE.MatchString(x) {
		x = memballoonRE.ReplaceAllLiteralString(x, "<memballoon model='none'/>")
	}

	// The vmxnet3, and a balloon turned off if the domain named none.
	iface := []string{"<!-- added by pvrdma-backend libvirt-xml: the vmxnet3 the PVRDMA function pairs with, function 0 of its slot -->",
		fmt.Sprintf("<interface type='%s'>", nic.typ)}
	if nic.source != "" {
		iface = append(iface, fmt.Sprintf("  <source %s='%s'/>", nic.sourceAttr, xmlEscape(nic.source)))
	}
	iface = append(iface, fmt.Sprintf("  <mac address='%s'/>", s.mac()), "  <model type='vmxnet3'/>",
		fmt.Sprintf("  <address type='pci' domain='0x0000' bus='0x00' slot='0x%02x' function='0x0' multifunction='on'/>", s.Slot),
		"</interface>")
	if !strings.Contains(x, "<memballoon") {
		iface = append(iface, "<memballoon model='none'/>")
	}
	locs := devicesCloseRE.FindAllStringIndex(x, -1)
	if len(locs) == 0 {
		return "", fmt.Errorf("libvirt domain %s: no <devices>", d.Name)
	}
	at := locs[len(locs)-1][0]
	x = x[:at] + lines("    ", iface...) + x[at:]

	// The PVRDMA function and the daemon's monitor.
	args := []string{"<!-- added by pvrdma-backend libvirt-xml: the PVRDMA function (vfio-user; libvirt has no element for it) at function 1 -->",
		"<qemu:arg value='-device'/>", fmt.Sprintf("<qemu:arg value='%s'/>", xmlEscape(string(dev)))}
	if qa := s.QMPArgs(); len(qa) > 0 {
		args = append(args, "<!-- a QMP monitor of pvrdma-backend's own: it cancels migrations and snapshots, which would drop the device -->")
		for _, a := range qa {
			args = append(args, fmt.Sprintf("<qemu:arg value='%s'/>", xmlEscape(a)))
		}
	}
	if locs := qemuCmdCloseRE.FindAllStringIndex(x, -1); len(locs) > 0 {
		at := locs[len(locs)-1][0]
		x = x[:at] + lines("    ", args...) + x[at:]
	} else {
		locs := domainCloseRE.FindAllStringIndex(x, -1)
		if len(locs) == 0 {
			return "", fmt.Errorf("libvirt domain %s: no </domain>", d.Name)
		}
		at := locs[len(locs)-1][0]
		x = x[:at] + "  <qemu:commandline>\n" + lines("    ", args...) + "  </qemu:commandline>\n" + x[at:]
	}

	// What came out is the same domain with the device.
	if got, err := ReadLibvirtDomain(x); err != nil || got != d {
		return "", fmt.Errorf("libvirt domain %s: the edited XML does not read back (%v)", d.Name, err)
	}
	if socks, err := libvirtVFIOUserSockets([]byte(x)); err != nil || len(socks) != 1 || socks[0] != s.Socket {
		return "", fmt.Errorf("libvirt domain %s: the edited XML does not carry the device (%v %v)", d.Name, socks, err)
	}
	return x, nil
}

// rootSlotTaken names the element whose PCI address is slot of bus 0 of
// PCI domain 0, if any.
func rootSlotTaken(domainXML string, slot int) (string, error) {
	dec := xml.NewDecoder(strings.NewReader(domainXML))
	var stack []string
	for {
		tok, err := dec.Token()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return "", nil
			}
			return "", err
		}
		switch t := tok.(type) {
		case xml.StartElement:
			if t.Name.Local == "address" && len(stack) > 0 {
				a := map[string]string{}
				for _, at := range t.Attr {
					a[at.Name.Local] = at.Value
				}
				if a["type"] == "pci" && pciNum(a["domain"]) == 0 && pciNum(a["bus"]) == 0 && pciNum(a["slot"]) == int64(slot) {
					return fmt.Sprintf("<%s> at %s:%s.%s", stack[len(stack)-1], a["bus"], a["slot"], a["function"]), nil
				}
			}
			stack = append(stack, t.Name.Local)
		case xml.EndElement:
			if len(stack) > 0 {
				stack = stack[:len(stack)-1]
			}
		}
	}
}

// pciNum reads a libvirt PCI address part (0x.. or decimal; absent: 0).
func pciNum(s string) int64 {
	if s == "" {
		return 0
	}
	n, err := strconv.ParseInt(s, 0, 64)
	if err != nil {
		return -1
	}
	return n
}
