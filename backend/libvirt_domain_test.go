package backend

import (
	"encoding/json"
	"encoding/xml"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// dumpedDomain is a domain as virsh dumpxml prints it: a disk, a NIC of
// its own, a balloon, a hugepages-free memoryBacking, addresses assigned.
const dumpedDomain = `<domain type='kvm' id='3'>
  <name>web1</name>
  <uuid>6f1b7c1e-0d5a-4bfa-9c1e-7c1f0d5a4bfa</uuid>
  <memory unit='KiB'>4194304</memory>
  <currentMemory unit='KiB'>4194304</currentMemory>
  <memoryBacking>
    <nosharepages/>
  </memoryBacking>
  <vcpu placement='static'>2</vcpu>
  <os>
    <type arch='x86_64' machine='pc-q35-7.2'>hvm</type>
    <boot dev='hd'/>
  </os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/var/lib/libvirt/images/web1.qcow2'/>
      <target dev='vda' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x04' slot='0x00' function='0x0'/>
    </disk>
    <controller type='pci' index='1' model='pcie-root-port'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0' multifunction='on'/>
    </controller>
    <interface type='bridge'>
      <mac address='52:54:00:aa:bb:cc'/>
      <source bridge='br0'/>
      <model type='virtio'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </interface>
    <memballoon model='virtio'>
      <address type='pci' domain='0x0000' bus='0x05' slot='0x00' function='0x0'/>
    </memballoon>
  </devices>
</domain>
`

// TestAddToLibvirtDomain: an existing domain keeps what it has (its disk,
// NIC, OS) and gains the device as a new domain would have it: a shared,
// preallocated, locked memfd for its RAM, no balloon, the vmxnet3 at
// slot.0 and the function and the daemon's monitor in <qemu:commandline>.
func TestAddToLibvirtDomain(t *testing.T) {
	d, err := ReadLibvirtDomain(dumpedDomain)
	require.NoError(t, err)
	require.Equal(t, LibvirtDomain{Name: "web1", MemBytes: 4 << 30}, d)

	spec := VMSpec{Name: "web1", Slot: 5, MemBytes: 4 << 30, Netdev: "net0", Socket: "/run/pvrdma/web1.sock", QMPSocket: "/run/pvrdma/web1.qmp"}
	x, err := spec.AddToLibvirtDomain(dumpedDomain, LibvirtOptions{NIC: "bridge:br0"})
	require.NoError(t, err)
	t.Logf("%s", x)
	var got domainXML
	require.NoError(t, xml.Unmarshal([]byte(x), &got), x)
	require.Equal(t, "memfd", got.Backing.Source.Type)
	require.Equal(t, "shared", got.Backing.Access.Mode)
	require.NotNil(t, got.Backing.Locked)
	require.NotContains(t, x, "nosharepages")
	require.Contains(t, x, "<memballoon model='none'/>")
	require.NotContains(t, x, "model='virtio'>\n      <address type='pci' domain='0x0000' bus='0x05'", "the balloon's element is gone")
	require.Contains(t, x, "<domain type='kvm' id='3' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>")
	for _, kept := range []string{"<source file='/var/lib/libvirt/images/web1.qcow2'/>", "<mac address='52:54:00:aa:bb:cc'/>", "<boot dev='hd'/>"} {
		require.Contains(t, x, kept)
	}
	var ifaces struct {
		Ifaces []struct {
			MAC struct {
				Address string `xml:"address,attr"`
			} `xml:"mac"`
			Model struct {
				Type string `xml:"type,attr"`
			} `xml:"model"`
			Addr struct {
				Slot string `xml:"slot,attr"`
			} `xml:"address"`
		} `xml:"devices>interface"`
	}
	require.NoError(t, xml.Unmarshal([]byte(x), &ifaces))
	require.Len(t, ifaces.Ifaces, 2)
	require.Equal(t, "vmxnet3", ifaces.Ifaces[1].Model.Type)
	require.Equal(t, DefaultMAC("web1").String(), ifaces.Ifaces[1].MAC.Address)
	require.Equal(t, "0x05", ifaces.Ifaces[1].Addr.Slot)
	require.Len(t, got.Args, 6, "-device, the function, -chardev, its socket, -mon, its options")
	var dev map[string]any
	require.NoError(t, json.Unmarshal([]byte(got.Args[1].Value), &dev))
	require.Equal(t, "vfio-user-pci", dev["driver"])
	require.Equal(t, "05.1", dev["addr"])
	require.Contains(t, got.Args[3].Value, "path=/run/pvrdma/web1.qmp")
	socks, err := libvirtVFIOUserSockets([]byte(x))
	require.NoError(t, err)
	require.Equal(t, []string{"/run/pvrdma/web1.sock"}, socks, "the libvirt hook sees the device")

	// Once more on the result: refused, it has the device.
	_, err = spec.AddToLibvirtDomain(x, LibvirtOptions{NIC: "bridge:br0"})
	require.ErrorContains(t, err, "already has a vfio-user device")

	// A domain with a <qemu:commandline> of its own keeps it; no balloon at all gets none.
	own := strings.Replace(strings.Replace(dumpedDomain, "<domain type='kvm' id='3'>", "<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>", 1),
		"</devices>\n", "</devices>\n  <qemu:commandline>\n    <qemu:arg value='-no-hpet'/>\n  </qemu:commandline>\n", 1)
	own = memballoonRE.ReplaceAllString(own, "")
	x, err = spec.AddToLibvirtDomain(own, LibvirtOptions{NIC: "network:default", NoLock: true})
	require.NoError(t, err)
	got = domainXML{}
	require.NoError(t, xml.Unmarshal([]byte(x), &got), x)
	require.Nil(t, got.Backing.Locked)
	require.Equal(t, "-no-hpet", got.Args[0].Value)
	require.Len(t, got.Args, 7)
	require.Equal(t, 1, strings.Count(x, "<qemu:commandline>"))
	require.Contains(t, x, "<memballoon model='none'/>")

	// Refusals: another name, another size, a taken slot.
	_, err = VMSpec{Name: "web2", Slot: 5, MemBytes: 4 << 30, Netdev: "n", Socket: "s"}.AddToLibvirtDomain(dumpedDomain, LibvirtOptions{})
	require.ErrorContains(t, err, "the VM is web2")
	_, err = VMSpec{Name: "web1", Slot: 5, MemBytes: 1 << 30, Netdev: "n", Socket: "s"}.AddToLibvirtDomain(dumpedDomain, LibvirtOptions{})
	require.ErrorContains(t, err, "has 4096 MiB of RAM, the VM 1024 MiB")
	_, err = VMSpec{Name: "web1", Slot: 2, MemBytes: 4 << 30, Netdev: "n", Socket: "s"}.AddToLibvirtDomain(dumpedDomain, LibvirtOptions{})
	require.ErrorContains(t, err, "slot 0x02 of the root bus is taken (<controller> at 0x00:0x02.0x0): pass --slot")
	_, err = ReadLibvirtDomain("<domain><name>x</name><memory unit='parsec'>1</memory></domain>")
	require.ErrorContains(t, err, `unit "parsec"`)
}
