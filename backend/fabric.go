package backend

// The fabric: the daemon's verbs provider (the soft RoCE transport or the
// relay to an HCA) and its attachment to the host's network.

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/ibverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft"
)

// fabric is the daemon's verbs provider (the soft RoCE fabric, or the
// relay to a host RDMA device) plus its host attachment.
type fabric struct {
	cfg      FabricConfig
	provider hostverbs.Provider
	soft     *soft.Fabric      // soft transport
	relay    *ibverbs.Provider // ibverbs relay
	addrs    *AddrManager      // IP mode: bound GIDs as host addresses
	handover handoverWire      // the wire whose sockets a successor inherits (UDP or packet wire)
	rxe      string            // the rxe link the daemon created (removed at close)
	log      *slog.Logger
	// mtuChanges counts changes of the fabric device's MTU since start
	// (watchMTU); stopWatch ends the watch.
	mtuChanges atomic.Uint64
	stopWatch  chan struct{}
}

// FabricConfig selects the fabric attachment.
type FabricConfig struct {
	// Netdev (IP mode) is a host network device on which bound guest GIDs
	// are added as addresses, so RoCE v2 traffic from other hosts reaches
	// this daemon's UDP port 4791 (soft), or the host device's GID table
	// holds them (relay: the HCA's or the rxe link's netdev).
	Netdev string
	// RawWire (IP mode, soft) sends and receives through raw IP sockets,
	// one packet per slot of each system call (wire.KernelWire), instead
	// of UDP sockets with segmentation offload (wire.UDPWire, the
	// default): for kernels without UDP_SEGMENT and UDP_GRO (before 5.0),
	// or to compare.
	RawWire bool
	// WireQueues (IP mode, soft, UDP wire) is the number of port 4791
	// receive sockets per family, each served by a receive goroutine of
	// its own, with each QP's packets steered to one of them
	// (wire.UDPWireConfig.QueuesPerFamily); 0 means 1.
	WireQueues int
	// Bridge (L2 mode) is the network device the VMs' NICs are bridged
	// on; RoCE v2 frames are captured from and injected into it with the
	// VMs' own MACs, as a distributed switch would. Exclusive with Netdev.
	// Both empty: the daemon's devices reach only each other.
	Bridge string
	// DefaultTOS is the IP TOS of RoCE packets whose traffic class is 0.
	DefaultTOS uint8
	// VLAN (L2 mode) is the 802.1Q VLAN the fabric's frames carry and the
	// only one it takes frames from; 0: untagged.
	VLAN uint16
	// PCP (L2 mode, with FixedPCP) is the 802.1Q priority of every frame;
	// without FixedPCP each frame's priority is its traffic class's top
	// three bits (DSCP >> 3).
	PCP      uint8
	FixedPCP bool
	// Congestion configures the soft transport's DCQCN (on by default;
	// Congestion.Disabled turns it off).
	Congestion soft.CongestionConfig
	// RoCEMode is the RoCE version of VMs registered without their own
	// (VMRequest.RoCEMode): hostverbs.GIDTypeRoCEv1 or v2; 0 means v2.
	// A device offers one version (the stock driver takes one GID type
	// per device); RoCE v1 needs L2 mode or an in-process fabric.
	RoCEMode hostverbs.GIDType
	// IBDevice, if set, relays the VMs' verbs to this host RDMA device
	// through libibverbs instead of the soft transport (needs Netdev).
	IBDevice string
	// IBPort is the host device's port (default 1).
	IBPort uint8
	// IBBusyPoll is the relay's ibverbs.Config.BusyPoll: how long it
	// keeps polling CQs that just completed work before it waits for the
	// next completion event (lower latency for that much CPU; 0: off).
	IBBusyPoll time.Duration
	// CreateRXE, if set, creates a Soft-RoCE link over this netdev (as
	// `rdma link add NAME type rxe netdev NETDEV` does), relays to it, and
	// removes it at shutdown if the daemon created it. It implies IBDevice
	// (default "rxe_" + the netdev) and Netdev.
	CreateRXE string
}

// Transport names the verbs provider a FabricConfig selects.
func (c FabricConfig) Transport() string {
	if c.IBDevice != "" || c.CreateRXE != "" {
		return "ibverbs"
	}
	return "soft"
}

// handoverWire is a wire whose receive sockets outlive the process
// (wire.UDPWire, wire.PacketWire): a successor inherits them with what
// the kernel queued on them while receiving was paused.
type handoverWire interface {
	ReceiveSockets() map[string]int
	Adopted() int
	PauseReceive()
	ResumeReceive()
}

// newFabric attaches the daemon to its fabric. inherit are the fabric
// sockets a predecessor left (continuity.go): the UDP wire (IP mode) or
// the packet wire (L2 mode) takes those it can use, with what the kernel
// queued on them, and receives nothing until resumeReceive. newFabric
// closes inherit in every case.
func newFabric(cfg FabricConfig, inherit []*os.File, log *slog.Logger) (*fabric, error) {
	defer func() { closeFiles(inherit) }() // those not passed on
	if cfg.Netdev != "" && cfg.Bridge != "" {
		return nil, errors.New("fabric: choose IP mode (netdev) or L2 mode (bridge), not both")
	}
	if (cfg.VLAN != 0 || cfg.FixedPCP) && cfg.Bridge == "" {
		return nil, errors.New("fabric: a VLAN and PCP need L2 mode (a fabric bridge); in IP mode tag with a VLAN netdev instead")
	}
	if cfg.VLAN > 4094 || cfg.PCP > 7 {
		return nil, fmt.Errorf("fabric: VLAN %d / PCP %d: want VLAN 1-4094 (0: untagged) and PCP 0-7", cfg.VLAN, cfg.PCP)
	}
	switch cfg.RoCEMode {
	case 0, hostverbs.GIDTypeRoCEv2:
	case hostverbs.GIDTypeRoCEv1:
		if err := cfg.checkRoCEMode(cfg.RoCEMode); err != nil {
			return nil, fmt.Errorf("fabric: default %w", err)
		}
	default:
		return nil, fmt.Errorf("fabric: RoCE mode %d: %w", cfg.RoCEMode, ErrBadRoCEMode)
	}
	if cfg.Transport() == "ibverbs" {
		return newRelayFabric(cfg, log)
	}
	f := &fabric{cfg: cfg, log: log}
	scfg := soft.Config{DefaultTOS: cfg.DefaultTOS, Congestion: cfg.Congestion, Logger: log.With("component", "fabric")}
	if cfg.Bridge != "" {
		w, mtu, err := newPacketWire(cfg, inherit)
		inherit = nil // newPacketWire closes them
		if err != nil {
			return nil, err
		}
		scfg.Wire, scfg.LinkMTU = w, mtu
	}
	if cfg.Netdev != "" {
		checkARPIgnore(log)
		am, err := NewAddrManager(cfg.Netdev)
		if err != nil {
			return nil, err
		}
		f.addrs = am
		w, mtu, err := newKernelWire(cfg.Netdev, cfg.RawWire, cfg.WireQueues, inherit)
		inherit = nil // newKernelWire closes them
		if err != nil {
			am.Close()
			return nil, err
		}
		scfg.Wire, scfg.LinkMTU = w, mtu
	}
	if h, ok := scfg.Wire.(handoverWire); ok {
		f.handover = h
		if n := h.Adopted(); n > 0 {
			log.Info("took over the fabric's receive sockets from the previous daemon", "sockets", n)
		}
	}
	if scfg.Wire != nil {
		log.Info("fabric wire", "receive_queues", scfg.Wire.Queues())
	}
	sf, err := soft.New(scfg)
	if err != nil {
		if scfg.Wire != nil {
			_ = scfg.Wire.Close()
		}
		if f.addrs != nil {
			f.addrs.Close()
		}
		return nil, fmt.Errorf("fabric: %w", err)
	}
	f.soft, f.provider = sf, sf
	if dev := cfg.Netdev + cfg.Bridge; dev != "" && scfg.LinkMTU != 0 {
		f.watchMTU(dev, scfg.LinkMTU)
	}
	return f, nil
}

// watchMTU warns when the fabric device's MTU changes from mtu, the one
// the ports' active MTU was derived from at start: a smaller one drops
// every frame above it (tx_drop_oversize), a larger one goes unused,
// until the daemon is restarted or upgraded. It runs until close.
func (f *fabric) watchMTU(dev string, mtu int) {
	link, err := netlink.LinkByName(dev)
	if err != nil {
		return
	}
	updates := make(chan netlink.LinkUpdate, 16)
	f.stopWatch = make(chan struct{})
	if err := netlink.LinkSubscribeWithOptions(updates, f.stopWatch, netlink.LinkSubscribeOptions{}); err != nil {
		f.log.Warn("cannot watch the fabric device's MTU", "dev", dev, "err", err)
		return
	}
	index := link.Attrs().Index
	go func() {
		last := mtu
		for u := range updates {
			if int(u.Index) != index || u.Attrs() == nil || u.Attrs().MTU == last || u.Attrs().MTU == 0 {
				continue
			}
			last = u.Attrs().MTU
			f.mtuChanges.Add(1)
			f.log.Warn("the fabric device's MTU changed since the daemon started: the ports keep the active MTU derived from the old one, "+
				"so frames above the new MTU are dropped (tx_drop_oversize); keep the MTU fixed, or restart or upgrade the daemon to take the new one",
				"dev", dev, "mtu_at_start", mtu, "mtu", last)
		}
	}()
}

// newRelayFabric opens the host RDMA device (creating an rxe link first if
// asked) and manages the guests' GIDs as addresses on its netdev, from
// which the kernel fills the device's GID table.
func newRelayFabric(cfg FabricConfig, log *slog.Logger) (*fabric, error) {
	if cfg.Bridge != "" {
		return nil, errors.New("fabric: the ibverbs relay works in IP mode (--fabric-netdev or --create-rxe), not on a bridge")
	}
	if cfg.CreateRXE != "" {
		if cfg.Netdev != "" && cfg.Netdev != cfg.CreateRXE {
			return nil, fmt.Errorf("fabric: --create-rxe %s and --fabric-netdev %s: the rxe link's netdev is the fabric netdev", cfg.CreateRXE, cfg.Netdev)
		}
		cfg.Netdev = cfg.CreateRXE
		if cfg.IBDevice == "" {
			cfg.IBDevice = "rxe_" + cfg.CreateRXE
		}
	}
	if cfg.Netdev == "" {
		return nil, fmt.Errorf("fabric: the ibverbs relay to %s needs --fabric-netdev (the device's netdev, where guests' GIDs become addresses and so enter its GID table)", cfg.IBDevice)
	}
	f := &fabric{cfg: cfg, log: log}
	if cfg.CreateRXE != "" {
		created, err := createRXE(cfg.IBDevice, cfg.CreateRXE, log)
		if err != nil {
			return nil, fmt.Errorf("fabric: %w", err)
		}
		if created {
			f.rxe = cfg.IBDevice
		}
	}
	fail := func(err error) (*fabric, error) {
		if f.addrs != nil {
			f.addrs.Close()
		}
		f.deleteRXE()
		return nil, fmt.Errorf("fabric: %w", err)
	}
	checkARPIgnore(log)
	am, err := NewAddrManager(cfg.Netdev)
	if err != nil {
		return fail(err)
	}
	f.addrs = am
	p, err := ibverbs.New(ibverbs.Config{Device: cfg.IBDevice, Port: cfg.IBPort, BusyPoll: cfg.IBBusyPoll, Logger: log.With("component", "relay")})
	if err != nil {
		return fail(err)
	}
	f.relay, f.provider = p, p
	return f, nil
}

// sockets returns the fabric's descriptors a successor inherits, by name
// ("udp4", "udp4.1", ... "udp6", ... on the UDP wire, "packet" on the
// packet wire); none on other wires.
func (f *fabric) sockets() map[string]int {
	if f.handover == nil {
		return nil
	}
	return f.handover.ReceiveSockets()
}

// pauseReceive leaves what arrives from the network in the kernel (for a
// successor); resumeReceive takes it again.
func (f *fabric) pauseReceive() {
	if f.handover != nil {
		f.handover.PauseReceive()
	}
}

func (f *fabric) resumeReceive() {
	if f.handover != nil {
		f.handover.ResumeReceive()
	}
}

func (f *fabric) status() FabricStatus {
	st := FabricStatus{Mode: "local"}
	switch {
	case f.cfg.Netdev != "":
		st = FabricStatus{Mode: "ip", Netdev: f.cfg.Netdev}
	case f.cfg.Bridge != "":
		st = FabricStatus{Mode: "l2", Netdev: f.cfg.Bridge, VLAN: f.cfg.VLAN}
		if f.cfg.VLAN != 0 {
			st.PCP = "auto (traffic class >> 5)"
			if f.cfg.FixedPCP {
				st.PCP = fmt.Sprint(f.cfg.PCP)
			}
		}
	}
	st.RoCEMode = RoCEModeName(f.cfg.RoCEMode)
	if f.soft != nil {
		st.Congestion = "dcqcn"
		if f.cfg.Congestion.Disabled {
			st.Congestion = "off"
		}
		for _, r := range f.soft.QPRates() {
			st.QPRates = append(st.QPRates, QPRateStatus{VM: r.Device, QPN: r.QPN, RateMbps: r.Rate / 1e6,
				TargetMbps: r.Target / 1e6, Alpha: r.Alpha, CNPs: r.CNPs})
		}
		sort.Slice(st.QPRates, func(i, j int) bool {
			a, b := st.QPRates[i], st.QPRates[j]
			return a.VM < b.VM || a.VM == b.VM && a.QPN < b.QPN
		})
	}
	if f.relay != nil {
		st.HostDevice = relayStatus(f.relay, f.rxe != "")
	}
	return st
}

func (f *fabric) counters() map[string]uint64 {
	c := map[string]uint64{}
	if f.soft != nil {
		c = f.soft.Counters()
	}
	if f.addrs != nil {
		c["netdev_addr_changes"] = f.addrs.Changes()
	}
	if n := f.mtuChanges.Load(); n > 0 {
		c["fabric_mtu_changes"] = n
	}
	if f.handover != nil {
		c["wire_rx_sockets_inherited"] = uint64(f.handover.Adopted())
	}
	return c
}

func (f *fabric) gidBound(e hostverbs.GIDEntry, bound bool) error {
	if f.addrs == nil {
		return nil
	}
	if bound {
		return f.addrs.Add(e.GID.Addr())
	}
	return f.addrs.Remove(e.GID.Addr())
}

// close releases the fabric. keepAddrs leaves guests' GID addresses on
// the netdev for the next daemon (continuity.go).
func (f *fabric) close(keepAddrs bool) error {
	if f.stopWatch != nil {
		close(f.stopWatch)
	}
	err := f.provider.Close()
	if f.addrs != nil && keepAddrs {
		f.addrs.Leave()
	} else if f.addrs != nil {
		if aerr := f.addrs.Close(); err == nil {
			err = aerr
		}
	}
	if derr := f.deleteRXE(); err == nil {
		err = derr
	}
	return err
}
