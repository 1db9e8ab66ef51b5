//go:build linux

package soft

import (
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

func TestZZPacketMTU(t *testing.T) {
	ns := newNetns(t, "mtu")
	ns.ip(t, "link", "add", "pvtbr0", "mtu", "4150", "type", "bridge")
	ns.ip(t, "link", "set", "pvtbr0", "up")
	ns.ip(t, "link", "add", "ulA", "mtu", "4200", "type", "veth", "peer", "name", "ulB", "mtu", "4200")
	ns.ip(t, "addr", "add", "192.168.240.1/30", "dev", "ulA")
	ns.ip(t, "link", "set", "ulA", "up")
	ns.ip(t, "link", "set", "ulB", "up")
	ns.ip(t, "link", "add", "vxA", "mtu", "4150", "type", "vxlan", "id", "4242", "local", "192.168.240.1", "remote", "192.168.240.2", "dstport", "4789", "dev", "ulA")
	ns.ip(t, "link", "set", "vxA", "master", "pvtbr0", "up")
	ns.ip(t, "tuntap", "add", "tp0", "mode", "tap")
	ns.ip(t, "link", "set", "tp0", "mtu", "4150", "master", "pvtbr0", "up")
	var w *wire.PacketWire
	var err error
	ns.do(t, func() { w, err = wire.NewPacketWire(wire.PacketWireConfig{Interface: "pvtbr0"}) })
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for _, n := range []int{100, 1500, 2108, 4150, 4151} {
		p := make([]byte, n)
		p[0] = 0x45
		_, err := w.Transmit([]wire.Datagram{{Packet: p, SrcMAC: [6]byte{0x52, 0x54, 0, 0, 0, 1}, DstMAC: [6]byte{0x52, 0x54, 0, 0, 0, 2}}})
		t.Logf("%d: %v", n, err)
	}
}
