package backend

import (
	"encoding/json"
	"encoding/xml"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// domainXML is the part of libvirt's domain schema the test reads back.
type domainXML struct {
	Type   string `xml:"type,attr"`
	Name   string `xml:"name"`
	Memory struct {
		Unit  string `xml:"unit,attr"`
		Value int    `xml:",chardata"`
	} `xml:"memory"`
	Backing struct {
		Source struct {
			Type string `xml:"type,attr"`
		} `xml:"source"`
		Access struct {
			Mode string `xml:"mode,attr"`
		} `xml:"access"`
		Locked *struct{} `xml:"locked"`
	} `xml:"memoryBacking"`
	Iface struct {
		Type   string `xml:"type,attr"`
		Source struct {
			Bridge  string `xml:"bridge,attr"`
			Network string `xml:"network,attr"`
		} `xml:"source"`
		MAC struct {
			Address string `xml:"address,attr"`
		} `xml:"mac"`
		Model struct {
			Type string `xml:"type,attr"`
		} `xml:"model"`
		Addr struct {
			Slot          string `xml:"slot,attr"`
			Function      string `xml:"function,attr"`
			Multifunction string `xml:"multifunction,attr"`
		} `xml:"address"`
	} `xml:"devices>interface"`
	Args []struct {
		Value string `xml:"value,attr"`
	} `xml:"http://libvirt.org/schemas/domain/qemu/1.0 commandline>arg"`
}

func TestLibvirtDomainXML(t *testing.T) {
	spec := VMSpec{Name: "vm1", Slot: 6, MemBytes: 2 << 30, Netdev: "net0", Socket: "/run/pvrdma/vm1's.sock"}
	x, err := spec.LibvirtDomainXML(LibvirtOptions{NIC: "bridge:br0"})
	require.NoError(t, err)
	var d domainXML
	require.NoError(t, xml.Unmarshal([]byte(x), &d), x)
	require.Equal(t, "kvm", d.Type)
	require.Equal(t, "vm1", d.Name)
	require.Equal(t, "MiB", d.Memory.Unit)
	require.Equal(t, 2048, d.Memory.Value)
	require.Equal(t, "memfd", d.Backing.Source.Type)
	require.Equal(t, "shared", d.Backing.Access.Mode)
	require.NotNil(t, d.Backing.Locked)
	require.Equal(t, "bridge", d.Iface.Type)
	require.Equal(t, "br0", d.Iface.Source.Bridge)
	require.Equal(t, DefaultMAC("vm1").String(), d.Iface.MAC.Address)
	require.Equal(t, "vmxnet3", d.Iface.Model.Type)
	require.Equal(t, "0x06", d.Iface.Addr.Slot)
	require.Equal(t, "0x0", d.Iface.Addr.Function)
	require.Equal(t, "on", d.Iface.Addr.Multifunction)
	require.Len(t, d.Args, 2)
	require.Equal(t, "-device", d.Args[0].Value)
	var dev map[string]any
	require.NoError(t, json.Unmarshal([]byte(d.Args[1].Value), &dev), "the escaped attribute reads back as the device's JSON")
	require.Equal(t, spec.DeviceJSON("")["addr"], dev["addr"])
	require.Equal(t, "vfio-user-pci", dev["driver"])
	require.Equal(t, map[string]any{"type": "unix", "path": "/run/pvrdma/vm1's.sock"}, dev["socket"])
	require.Equal(t, true, dev["x-no-posted-writes"])

	x, err = spec.LibvirtDomainXML(LibvirtOptions{NoLock: true, DomainType: "qemu"})
	require.NoError(t, err)
	d = domainXML{}
	require.NoError(t, xml.Unmarshal([]byte(x), &d))
	require.Nil(t, d.Backing.Locked)
	require.Equal(t, "network", d.Iface.Type)
	require.Equal(t, "default", d.Iface.Source.Network)
	require.Equal(t, "qemu", d.Type)
}

func TestLibvirtDomainXMLErrors(t *testing.T) {
	good := VMSpec{Name: "vm1", Slot: 5, MemBytes: 1 << 30, Netdev: "net0", Socket: "/run/pvrdma/vm1.sock"}
	for name, tc := range map[string]struct {
		spec VMSpec
		opts LibvirtOptions
	}{
		"bad name":         {VMSpec{Name: "../x", Slot: 5, MemBytes: 1 << 30, Netdev: "n", Socket: "s"}, LibvirtOptions{}},
		"named bus":        {VMSpec{Name: "vm1", Bus: "pci.1", Slot: 0, MemBytes: 1 << 30, Netdev: "n", Socket: "s"}, LibvirtOptions{}},
		"domain type":      {good, LibvirtOptions{DomainType: "xen"}},
		"vcpus":            {good, LibvirtOptions{VCPUs: -1}},
		"nic":              {good, LibvirtOptions{NIC: "macvtap:eth0"}},
		"nic without name": {good, LibvirtOptions{NIC: "bridge:"}},
		"nic bad name":     {good, LibvirtOptions{NIC: "bridge:br0'/><x"}},
		"socket not utf-8": {VMSpec{Name: "vm1", Slot: 5, MemBytes: 1 << 30, Netdev: "n", Socket: "/tmp/\xff.sock"}, LibvirtOptions{}},
		"socket control":   {VMSpec{Name: "vm1", Slot: 5, MemBytes: 1 << 30, Netdev: "n", Socket: "/tmp/\x01.sock"}, LibvirtOptions{}},
	} {
		_, err := tc.spec.LibvirtDomainXML(tc.opts)
		require.Error(t, err, name)
	}
}

// FuzzLibvirtDomainXML: whatever the socket path (an operator's
// --socket-dir) and the NIC spec, the printed domain is well-formed XML whose
// device argument reads back as the device's JSON with the same path.
func FuzzLibvirtDomainXML(f *testing.F) {
	f.Add("/run/pvrdma/vm1.sock", "bridge:br0", "vm1")
	f.Add("/tmp/a'b\"c<d>&e/x.sock", "network:default", "a-b_c.d")
	f.Add("/tmp/\x01\n\t]]>--/s.sock", "user", "x")
	f.Add("/tmp/--/s.sock", "user", "a--b")
	f.Fuzz(func(t *testing.T, socket, nic, name string) {
		spec := VMSpec{Name: name, Slot: 5, MemBytes: 1 << 30, Netdev: "net0", Socket: socket}
		x, err := spec.LibvirtDomainXML(LibvirtOptions{NIC: nic})
		if err != nil {
			return
		}
		require.True(t, utf8.ValidString(socket), "an invalid socket path was accepted")
		require.False(t, strings.ContainsRune(socket, 0), "a NUL in the socket path was accepted")
		var d domainXML
		require.NoError(t, xml.Unmarshal([]byte(x), &d), "%s", x)
		require.Len(t, d.Args, 2)
		var dev map[string]any
		require.NoError(t, json.Unmarshal([]byte(d.Args[1].Value), &dev))
		require.Equal(t, socket, dev["socket"].(map[string]any)["path"])
		require.Equal(t, name, d.Name)
	})
}

// TestLibvirtDomainXMLMonitor: with a QMP socket the domain carries the
// daemon's monitor as <qemu:commandline> arguments, as qemu-args does.
func TestLibvirtDomainXMLMonitor(t *testing.T) {
	spec := VMSpec{Name: "vm1", Slot: 6, MemBytes: 2 << 30, Netdev: "net0", Socket: "/run/pvrdma/vm1.sock", QMPSocket: "/run/pvrdma/vm1,x.qmp"}
	x, err := spec.LibvirtDomainXML(LibvirtOptions{})
	require.NoError(t, err)
	var d domainXML
	require.NoError(t, xml.Unmarshal([]byte(x), &d), x)
	var args []string
	for _, a := range d.Args {
		args = append(args, a.Value)
	}
	require.Len(t, args, 6)
	require.Equal(t, []string{"-chardev", "socket,id=pvrdma-qmp,path=/run/pvrdma/vm1,,x.qmp,reconnect-ms=1000",
		"-mon", "chardev=pvrdma-qmp,mode=control"}, args[2:], "a comma in the path is doubled for QEMU's option syntax")
	q, err := spec.QEMUArgs()
	require.NoError(t, err)
	require.Equal(t, args[2:], q[len(q)-4:], "qemu-args and libvirt-xml give the same monitor")
}

// TestLibvirtHook: the hook refuses migrate and restore of a domain that
// libvirt-xml printed (and one in QEMU's legacy -device syntax), and
// passes every other operation and every domain without the device.
func TestLibvirtHook(t *testing.T) {
	spec := VMSpec{Name: "vm1", Slot: 6, MemBytes: 2 << 30, Netdev: "net0", Socket: "/run/pvrdma/vm1.sock", QMPSocket: "/run/pvrdma/vm1.qmp"}
	x, err := spec.LibvirtDomainXML(LibvirtOptions{})
	require.NoError(t, err)
	for _, op := range []string{"migrate", "restore"} {
		err := LibvirtHook("vm1", op, []byte(x))
		require.ErrorIs(t, err, ErrHookRefused, op)
		require.ErrorIs(t, err, ErrNotMigratable, op)
		require.Contains(t, err.Error(), "/run/pvrdma/vm1.sock", "the refusal names the device")
		require.Contains(t, err.Error(), `to `+op+` domain "vm1"`)
	}
	for _, op := range []string{"prepare", "start", "started", "stopped", "release", "reconnect", "attach", ""} {
		require.NoError(t, LibvirtHook("vm1", op, []byte(x)), op)
	}
	plain := `<domain type='kvm'><name>other</name><devices><interface type='network'/></devices>
<qemu:commandline xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'><qemu:arg value='-device'/><qemu:arg value='{"driver":"virtio-rng-pci"}'/></qemu:commandline></domain>`
	require.NoError(t, LibvirtHook("other", "migrate", []byte(plain)), "a domain without the device migrates")
	legacy := `<domain xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'><name>l</name><qemu:commandline>
<qemu:arg value='-device'/><qemu:arg value='vfio-user-pci,socket.type=unix,socket.path=/run/pvrdma/l.sock'/></qemu:commandline></domain>`
	require.ErrorIs(t, LibvirtHook("l", "restore", []byte(legacy)), ErrHookRefused)
	require.ErrorIs(t, LibvirtHook("b", "migrate", []byte("<domain><vfio-user-pci")), ErrHookRefused,
		"unreadable XML that names the device is refused")
	require.NoError(t, LibvirtHook("b", "migrate", []byte("<domain><disk")), "unreadable XML without the device passes")
}

func FuzzLibvirtHook(f *testing.F) {
	spec := VMSpec{Name: "vm1", Slot: 6, MemBytes: 1 << 30, Netdev: "net0", Socket: "/run/pvrdma/vm1.sock", QMPSocket: "/run/pvrdma/vm1.qmp"}
	x, err := spec.LibvirtDomainXML(LibvirtOptions{})
	require.NoError(f, err)
	f.Add("migrate", x)
	f.Add("restore", `<domain><qemu:commandline><qemu:arg value='-device'/></qemu:commandline></domain>`)
	f.Add("start", x)
	f.Fuzz(func(t *testing.T, op, domainXML string) {
		err := LibvirtHook("d", op, []byte(domainXML))
		if !LibvirtHookOps[op] {
			require.NoError(t, err, "only migrate and restore are ever refused")
		}
		if err != nil {
			require.ErrorIs(t, err, ErrHookRefused)
			require.Contains(t, domainXML, "vfio-user-pci", "refused a domain that never names the device")
		}
	})
}

// TestLibvirtDomainXMLIdentity: a VM with a QEMU uid of its own gets a
// static DAC label, so libvirt runs its QEMU as that uid in the socket
// group; `--vm NAME,uid=N` registers the same identity.
func TestLibvirtDomainXMLIdentity(t *testing.T) {
	spec := VMSpec{Name: "vm1", Slot: 6, MemBytes: 2 << 30, Netdev: "net0", Socket: "/run/pvrdma/vm1.sock", QEMUUID: 1001, QEMUGID: 998}
	x, err := spec.LibvirtDomainXML(LibvirtOptions{})
	require.NoError(t, err)
	var d struct {
		Seclabel struct {
			Type  string `xml:"type,attr"`
			Model string `xml:"model,attr"`
			Label string `xml:"label"`
		} `xml:"seclabel"`
	}
	require.NoError(t, xml.Unmarshal([]byte(x), &d), x)
	require.Equal(t, "static", d.Seclabel.Type)
	require.Equal(t, "dac", d.Seclabel.Model)
	require.Equal(t, "+1001:+998", d.Seclabel.Label)

	req, err := ParseVMFlag("vm1,uid=1001,mem=1G")
	require.NoError(t, err)
	require.EqualValues(t, 1001, req.QEMUUID)
	for _, bad := range []string{"vm1,uid=0", "vm1,uid=-1", "vm1,uid=x", "vm1,uid=4294967296"} {
		_, err := ParseVMFlag(bad)
		require.Error(t, err, bad)
	}
}
