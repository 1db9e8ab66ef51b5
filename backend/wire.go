package backend

import (
	"fmt"
	"os"

	"github.com/vishvananda/netlink"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// newKernelWire opens the soft fabric's kernel UDP 4791 path in the
// daemon's network namespace (UDP sockets with segmentation offload, or
// raw sockets if raw) and reports netdev's MTU, from which the fabric
// derives the ports' active MTU as rxe does. The UDP wire takes over the
// port 4791 sockets of inherit (a predecessor's) and then receives
// nothing until resumed; inherit is closed in every case.
func newKernelWire(netdev string, raw bool, queues int, inherit []*os.File) (wire.Wire, int, error) {
	link, err := netlink.LinkByName(netdev)
	if err != nil {
		closeFiles(inherit)
		return nil, 0, fmt.Errorf("fabric netdev %s: %w", netdev, err)
	}
	var w wire.Wire
	if raw {
		closeFiles(inherit)
		w, err = wire.NewKernelWire(wire.KernelWireConfig{Interface: netdev})
	} else {
		w, err = wire.NewUDPWire(wire.UDPWireConfig{Interface: netdev, Inherit: inherit, Paused: len(inherit) > 0, QueuesPerFamily: queues})
	}
	if err != nil {
		return nil, 0, fmt.Errorf("fabric netdev %s: %w", netdev, err)
	}
	return w, link.Attrs().MTU, nil
}

// newPacketWire attaches the soft fabric to a bridge (L2 mode), on the
// fabric's VLAN if it has one, and reports the bridge's MTU. The packet
// wire takes over a packet socket of inherit (a predecessor's) on the
// bridge and then receives nothing until resumed; inherit is closed in
// every case.
func newPacketWire(cfg FabricConfig, inherit []*os.File) (wire.Wire, int, error) {
	bridge := cfg.Bridge
	link, err := netlink.LinkByName(bridge)
	if err != nil {
		closeFiles(inherit)
		return nil, 0, fmt.Errorf("fabric bridge %s: %w", bridge, err)
	}
	pcp := wire.PCPFromTrafficClass
	if cfg.FixedPCP {
		pcp = int(cfg.PCP)
	}
	w, err := wire.NewPacketWire(wire.PacketWireConfig{Interface: bridge, VLAN: cfg.VLAN, PCP: pcp,
		Inherit: inherit, Paused: len(inherit) > 0})
	if err != nil {
		return nil, 0, fmt.Errorf("fabric bridge %s: %w", bridge, err)
	}
	return w, link.Attrs().MTU, nil
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		_ = f.Close()
	}
}
