package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// PacketWire carries RoCE v2 as Ethernet frames on one network device
// (typically the bridge the VMs' NICs are attached to), as ESXi's
// distributed switch does for PVRDMA: frames leave with the sending VM's
// own MAC as source and the address vector's DMAC (which the guest resolved
// with its own ARP/ND) as destination, and every UDP 4791 frame crossing
// the device is captured (promiscuous mode), whoever it is addressed to;
// the fabric keeps those whose destination GID one of its devices owns and
// whose destination MAC is that device's own (DstMAC).
//
// A bridge does not learn source MACs from frames its own device
// transmits, so injecting with a VM's MAC leaves that MAC on the VM's port:
// the guest's ordinary traffic is undisturbed. Nothing needs IP addresses
// on the host.
//
// Its socket can outlive the process (PacketWireConfig.Inherit,
// ReceiveSockets): a successor takes it over with the frames the kernel
// captured meanwhile.
type PacketWire struct {
	fd        int
	file      *os.File
	rc        syscall.RawConn
	ifindex   int
	vlan      uint16
	pcp       int
	closeOnce sync.Once
	closed    chan struct{}
	scratch   sync.Pool
	adopted   int // 1 if the socket was taken from Inherit
	// rxGate (PauseReceive, ResumeReceive): while paused the receiver
	// waits at it and leaves frames in the kernel; sending goes on.
	rxGate

	// Receive state (one reader: queue 0).
	rxHdrs  []unix.Mmsghdr
	rxIovs  []unix.Iovec
	rxEth   [][ethHeaderSize]byte
	rxFrame []FrameInfo // the frames of the last batch Receive returned
	rxK     int
	rxN     int
	rxErr   error
	rxFn    func(uintptr) bool

	txMu   sync.Mutex
	txHdrs []unix.Mmsghdr
	txSent int
	txErr  error
	txFn   func(uintptr) bool
}

// PacketWireConfig parameterises NewPacketWire.
type PacketWireConfig struct {
	// Interface is the network device to attach to, e.g. the VMs' bridge.
	Interface string
	// SocketBuffer is the receive and send buffer size (default 8 MiB).
	SocketBuffer int
	// VLAN, if not 0, is the 802.1Q VLAN (1-4094) of the fabric: every
	// frame sent carries its tag, and only frames of that VLAN are taken
	// in. 0: frames are sent untagged and tagged frames are ignored.
	VLAN uint16
	// PCP is the 802.1Q priority of tagged frames: 0-7, or
	// PCPFromTrafficClass (each frame's DSCP's class selector: the top
	// three bits of its traffic class).
	PCP int
	// Inherit are packet sockets of a predecessor (a daemon handing over
	// to its successor, or systemd's descriptor store after a crash), with
	// the frames the kernel captured on them meanwhile. The first that is
	// a raw AF_PACKET socket bound to Interface (the same device: its
	// index) is taken instead of a new one; its filter, buffers and
	// options are set again as for a new socket, and if it was filtering
	// for something else (another VLAN) the frames it queued are dropped.
	// NewPacketWire closes every file of Inherit (it works on a
	// duplicate).
	Inherit []*os.File
	// Paused opens the wire with receiving paused until ResumeReceive:
	// frames wait in the socket's buffer (a successor rebuilding the QPs
	// they are for).
	Paused bool
}

// PCPFromTrafficClass as PacketWireConfig.PCP derives each frame's
// priority from its traffic class: DSCP >> 3, so CS3 and AF3x give 3.
const PCPFromTrafficClass = -1

const (
	ethHeaderSize  = 14
	vlanHeaderSize = 4
	etherType8021Q = 0x8100
)

// Ancillary loads of classic BPF on sockets (linux/filter.h): SKF_AD_OFF
// plus the offset of the field.
const (
	skfAdOff             = 0xfffff000 // -0x1000
	skfAdVLANTag         = 44
	skfAdVLANTagPresent  = 48
	vlanIDMask           = 0x0fff
	maxVLANID            = 4094
	pcpShift             = 13
	dscpClassSelectorPCP = 5 // a traffic class's top three bits (DSCP >> 3)
)

// NewPacketWire opens a promiscuous packet socket on cfg.Interface, or
// takes over one of cfg.Inherit. It needs CAP_NET_RAW.
func NewPacketWire(cfg PacketWireConfig) (w *PacketWire, err error) {
	defer func() {
		for _, f := range cfg.Inherit {
			f.Close()
		}
	}()
	ifi, err := net.InterfaceByName(cfg.Interface)
	if err != nil {
		return nil, fmt.Errorf("packet wire: %w", err)
	}
	if cfg.SocketBuffer == 0 {
		cfg.SocketBuffer = 8 << 20
	}
	if cfg.VLAN > maxVLANID {
		return nil, fmt.Errorf("packet wire: VLAN %d: want 1-%d (0: untagged): %w", cfg.VLAN, maxVLANID, hostverbs.ErrInvalid)
	}
	if cfg.PCP < PCPFromTrafficClass || cfg.PCP > 7 {
		return nil, fmt.Errorf("packet wire: PCP %d: want 0-7: %w", cfg.PCP, hostverbs.ErrInvalid)
	}
	w = &PacketWire{fd: -1, ifindex: ifi.Index, closed: make(chan struct{}), vlan: cfg.VLAN, pcp: cfg.PCP}
	defer func() {
		if err != nil && w.fd >= 0 {
			unix.Close(w.fd)
		}
	}()
	filter := filterEthRoCE(cfg.VLAN)
	for _, f := range cfg.Inherit {
		if w.fd, err = dupInherited(f, "packet wire: take over packet socket",
			func(fd int) bool { return isPacketSocket(fd, ifi.Index) }); w.fd >= 0 || err != nil {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	if w.fd >= 0 {
		w.adopted = 1
		if err := setupPacketSocket(w.fd, cfg, filter); err != nil {
			return nil, err
		}
	} else {
		// Protocol 0 receives nothing until bind, so the filter is in
		// place before the first frame can be queued.
		if w.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("packet wire: socket: %w", err)
		}
		if err := setupPacketSocket(w.fd, cfg, filter); err != nil {
			return nil, err
		}
		if err := unix.Bind(w.fd, &unix.SockaddrLinklayer{Protocol: htons16(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
			return nil, fmt.Errorf("packet wire: bind %s: %w", cfg.Interface, err)
		}
	}
	// Adding the membership again to an inherited socket only counts it
	// twice on that socket: the device's promiscuity is raised once.
	mreq := unix.PacketMreq{Ifindex: int32(ifi.Index), Type: unix.PACKET_MR_PROMISC}
	if err := unix.SetsockoptPacketMreq(w.fd, unix.SOL_PACKET, unix.PACKET_ADD_MEMBERSHIP, &mreq); err != nil {
		return nil, fmt.Errorf("packet wire: promiscuous mode on %s: %w", cfg.Interface, err)
	}
	w.file = os.NewFile(uintptr(w.fd), "roce-packet-"+cfg.Interface)
	if w.rc, err = w.file.SyscallConn(); err != nil {
		w.file.Close()
		w.fd = -1
		return nil, fmt.Errorf("packet wire: %w", err)
	}
	w.rxHdrs = make([]unix.Mmsghdr, BatchSize)
	w.rxIovs = make([]unix.Iovec, 2*BatchSize)
	w.rxEth = make([][ethHeaderSize]byte, BatchSize)
	w.rxFrame = make([]FrameInfo, BatchSize)
	w.rxFn, w.txFn = w.recvReady, w.sendReady
	w.scratch.New = func() any { return newPacketTxScratch() }
	if cfg.Paused {
		w.PauseReceive()
	}
	return w, nil
}

// setupPacketSocket sets what a packet socket needs but its binding: the
// buffers, the filter (replacing an inherited socket's; the frames that
// one queued are dropped if it differs) and not to capture the device's
// outgoing frames.
func setupPacketSocket(fd int, cfg PacketWireConfig, filter []unix.SockFilter) error {
	mmsg.SetBuffers(fd, cfg.SocketBuffer)
	old, oerr := mmsg.Filter(fd)
	if err := mmsg.AttachFilter(fd, filter); err != nil {
		return fmt.Errorf("packet wire: filter: %w", err)
	}
	if oerr != nil || !slices.Equal(old, filter) {
		// Inherited from a wire filtering for something else (another
		// VLAN), or a new socket (nothing queued yet): what the old
		// filter let through is not ours to take.
		dropQueued(fd)
	}
	// Our own transmissions would otherwise come back to us as outgoing
	// frames of the device.
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_IGNORE_OUTGOING, 1); err != nil {
		return fmt.Errorf("packet wire: ignore outgoing: %w", err)
	}
	return nil
}

// dropQueued discards the frames queued on the non-blocking socket fd (at
// most maxDropQueued: frames still arriving do not keep it going).
func dropQueued(fd int) {
	var b [1]byte
	for range maxDropQueued {
		if _, _, err := unix.Recvfrom(fd, b[:], unix.MSG_TRUNC); err != nil && err != unix.EINTR {
			return
		}
	}
}

// maxDropQueued exceeds the frames a socket buffer can hold.
const maxDropQueued = 1 << 20

// isPacketSocket reports whether fd is a raw AF_PACKET socket bound to all
// protocols on the network device with index ifindex.
func isPacketSocket(fd, ifindex int) bool {
	for _, o := range [][2]int{{unix.SO_DOMAIN, unix.AF_PACKET}, {unix.SO_TYPE, unix.SOCK_RAW}} {
		if v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, o[0]); err != nil || v != o[1] {
			return false
		}
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return false
	}
	ll, ok := sa.(*unix.SockaddrLinklayer)
	return ok && ll.Ifindex == ifindex && ll.Protocol == htons16(unix.ETH_P_ALL)
}

// Adopted returns how many sockets the wire took from
// PacketWireConfig.Inherit: 1 or 0.
func (w *PacketWire) Adopted() int { return w.adopted }

// ReceiveSockets returns the packet socket's descriptor, named "packet",
// for a successor to inherit; the wire still owns it.
func (w *PacketWire) ReceiveSockets() map[string]int {
	return map[string]int{"packet": w.fd}
}

func htons16(v uint16) uint16 { return v<<8 | v>>8 }

// filterEthRoCE accepts Ethernet frames of the VLAN (0: untagged) carrying
// an unfragmented IPv4 or an IPv6 UDP datagram to port 4791 (RoCE v2), or a
// GRH whose next header is the IBA transport (RoCE v1, Ethertype 0x8915).
// The kernel takes a received frame's 802.1Q tag out of its data before
// packet sockets see it; the filter reads it through the VLAN ancillary
// loads.
func filterEthRoCE(vlan uint16) []unix.SockFilter {
	// Jump offsets are relative to the next instruction; to() turns the
	// absolute targets below into them.
	const accept, drop = 17, 18
	to := func(pc, target int) uint8 { return uint8(target - pc - 1) }
	var pre []unix.SockFilter
	if vlan == 0 {
		pre = []unix.SockFilter{
			{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: skfAdOff + skfAdVLANTagPresent},
			{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: 0},
			{Code: unix.BPF_JMP | unix.BPF_JA, K: 1},
			{Code: unix.BPF_RET | unix.BPF_K, K: 0},
		}
	} else {
		pre = []unix.SockFilter{
			{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: skfAdOff + skfAdVLANTagPresent},
			{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 3, K: 1},
			{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: skfAdOff + skfAdVLANTag},
			{Code: unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, K: vlanIDMask},
			{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 1, Jf: 0, K: uint32(vlan)},
			{Code: unix.BPF_RET | unix.BPF_K, K: 0},
		}
	}
	return append(pre, []unix.SockFilter{
		/* 0 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 12}, // ethertype
		/* 1 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: to(1, 9), K: unix.ETH_P_IP},
		/* 2 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 14 + 9}, // IPv4 protocol
		/* 3 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: to(3, drop), K: unix.IPPROTO_UDP},
		/* 4 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 14 + 6}, // flags + fragment offset
		/* 5 */ {Code: unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K, Jt: to(5, drop), Jf: 0, K: 0x3fff},
		/* 6 */ {Code: unix.BPF_LDX | unix.BPF_B | unix.BPF_MSH, K: 14}, // X = IHL*4
		/* 7 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_IND, K: 14 + 2}, // UDP destination port
		/* 8 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: to(8, accept), Jf: to(8, drop), K: roce.UDPPort},
		/* 9 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: to(9, 14), K: unix.ETH_P_IPV6},
		/* 10 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 14 + 6}, // IPv6 next header
		/* 11 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: to(11, drop), K: unix.IPPROTO_UDP},
		/* 12 */ {Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 14 + 40 + 2},
		/* 13 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: to(13, accept), Jf: to(13, drop), K: roce.UDPPort},
		/* 14 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: to(14, drop), K: roce.EtherTypeRoCEv1},
		/* 15 */ {Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 14 + 6}, // GRH next header
		/* 16 */ {Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: to(16, accept), Jf: to(16, drop), K: roce.GRHNextHeaderBTH},
		/* 17 */ {Code: unix.BPF_RET | unix.BPF_K, K: 0xffffffff},
		/* 18 */ {Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}...)
}

// Queues is 1: one packet socket.
func (w *PacketWire) Queues() int { return 1 }

// Close closes the socket; Receive returns.
func (w *PacketWire) Close() error {
	w.closeOnce.Do(func() {
		close(w.closed)
		w.file.Close()
	})
	return nil
}

type packetTxScratch struct {
	hdrs []unix.Mmsghdr
	iovs []unix.Iovec
	eth  [][ethHeaderSize + vlanHeaderSize]byte
}

func newPacketTxScratch() *packetTxScratch {
	return &packetTxScratch{hdrs: make([]unix.Mmsghdr, BatchSize), iovs: make([]unix.Iovec, 2*BatchSize),
		eth: make([][ethHeaderSize + vlanHeaderSize]byte, BatchSize)}
}

// Transmit sends each datagram as one frame: an Ethernet header built from
// its MACs, then the IP datagram (gathered, not copied).
func (w *PacketWire) Transmit(pkts []Datagram) (int, error) {
	s := w.scratch.Get().(*packetTxScratch)
	defer w.scratch.Put(s)
	sent := 0
	var bad error
	for sent < len(pkts) {
		k := 0
		for sent+k < len(pkts) && k < len(s.hdrs) {
			d := &pkts[sent+k]
			if len(d.Packet) < roce.IPv4HeaderSize {
				bad = fmt.Errorf("packet wire: malformed datagram: %w", hostverbs.ErrInvalid)
				break
			}
			eth := &s.eth[k]
			copy(eth[0:6], d.DstMAC[:])
			copy(eth[6:12], d.SrcMAC[:])
			et := uint16(unix.ETH_P_IP)
			switch {
			case d.RoCEv1:
				et = roce.EtherTypeRoCEv1
			case d.Packet[0]>>4 == 6:
				et = unix.ETH_P_IPV6
			}
			hdr := eth[:ethHeaderSize]
			if w.vlan != 0 {
				binary.BigEndian.PutUint16(eth[12:], etherType8021Q)
				binary.BigEndian.PutUint16(eth[14:], uint16(w.framePCP(d))<<pcpShift|w.vlan)
				hdr = eth[:ethHeaderSize+vlanHeaderSize]
			}
			binary.BigEndian.PutUint16(hdr[len(hdr)-2:], et)
			mmsg.SetIov(&s.iovs[2*k], hdr)
			mmsg.SetIov(&s.iovs[2*k+1], d.Packet)
			h := &s.hdrs[k].Hdr
			*h = unix.Msghdr{Iov: &s.iovs[2*k]}
			h.SetIovlen(2)
			k++
		}
		if k == 0 {
			return sent, bad
		}
		n, err := w.sendmmsg(s.hdrs[:k])
		sent += n
		if err != nil {
			if errors.Is(err, unix.EMSGSIZE) {
				return sent, fmt.Errorf("packet wire: %w", ErrOversize)
			}
			return sent, fmt.Errorf("packet wire: sendmmsg: %w", err)
		}
		if bad != nil {
			return sent, bad
		}
	}
	return sent, nil
}

// framePCP is the 802.1Q priority of d's frame.
func (w *PacketWire) framePCP(d *Datagram) int {
	if w.pcp != PCPFromTrafficClass {
		return w.pcp
	}
	var tclass byte
	if d.Packet[0]>>4 == 4 {
		tclass = d.Packet[1] // IPv4 TOS
	} else {
		tclass = byte(binary.BigEndian.Uint32(d.Packet) >> 20) // IPv6 or GRH traffic class
	}
	return int(tclass >> dscpClassSelectorPCP)
}

func (w *PacketWire) sendmmsg(hdrs []unix.Mmsghdr) (int, error) {
	w.txMu.Lock()
	defer w.txMu.Unlock()
	w.txHdrs, w.txSent, w.txErr = hdrs, 0, nil
	err := w.rc.Write(w.txFn)
	sent, serr := w.txSent, w.txErr
	w.txHdrs = nil
	if err != nil {
		return sent, err
	}
	return sent, serr
}

func (w *PacketWire) sendReady(fd uintptr) bool {
	for w.txSent < len(w.txHdrs) {
		n, err := mmsg.SendMmsg(int(fd), w.txHdrs[w.txSent:])
		if err == unix.EAGAIN {
			return false
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			w.txErr = err
			return true
		}
		w.txSent += n
	}
	return true
}

func (w *PacketWire) recvReady(fd uintptr) bool {
	if w.receivePaused() {
		w.rxN, w.rxErr = 0, nil // leave it queued; Receive waits at the gate
		return true
	}
	for {
		w.rxN, w.rxErr = mmsg.RecvMmsg(int(fd), w.rxHdrs[:w.rxK])
		if w.rxErr == unix.EINTR {
			continue
		}
		return w.rxErr != unix.EAGAIN
	}
}

// Frame describes frame i of the last batch Receive returned: its
// destination MAC (the fabric delivers it only to the device with that
// MAC) and whether it is RoCE v1.
func (w *PacketWire) Frame(queue, i int) FrameInfo {
	if queue != 0 || i < 0 || i >= len(w.rxFrame) {
		return FrameInfo{}
	}
	return w.rxFrame[i]
}

// Receive reads a batch of frames, scattering each Ethernet header aside
// so that each datagram starts at the IP header. While receiving is paused it
// waits, leaving frames in the kernel, until it resumes, the wire closes
// or ctx is done.
func (w *PacketWire) Receive(ctx context.Context, queue int, bufs, out [][]byte) (int, error) {
	if queue != 0 {
		return 0, fmt.Errorf("packet wire: no receive queue %d: %w", queue, hostverbs.ErrInvalid)
	}
	k := min(len(bufs), len(w.rxHdrs))
	for i := range k {
		mmsg.SetIov(&w.rxIovs[2*i], w.rxEth[i][:])
		mmsg.SetIov(&w.rxIovs[2*i+1], bufs[i])
		h := &w.rxHdrs[i].Hdr
		*h = unix.Msghdr{Iov: &w.rxIovs[2*i]}
		h.SetIovlen(2)
	}
	for {
		if w.receivePaused() {
			if !w.waitGate(w.closed, ctx.Done()) {
				if err := ctx.Err(); err != nil {
					return 0, err
				}
				return 0, fmt.Errorf("packet wire: %w", hostverbs.ErrClosed)
			}
			continue
		}
		w.rxK = k
		err := w.rc.Read(w.rxFn)
		n, rerr := w.rxN, w.rxErr
		if err != nil {
			return 0, waitError("packet wire", w.closed, err)
		}
		if rerr != nil {
			return 0, fmt.Errorf("packet wire: recvmmsg: %w", rerr)
		}
		k := 0
		for i := range n {
			l := int(w.rxHdrs[i].Len) - ethHeaderSize
			if l <= 0 || w.rxHdrs[i].Hdr.Flags&unix.MSG_TRUNC != 0 {
				continue // runt, or larger than MaxDatagram: not ours to take
			}
			out[k] = bufs[i][:l]
			eth := &w.rxEth[i]
			w.rxFrame[k] = FrameInfo{DstMAC: [6]byte(eth[0:6]),
				RoCEv1: binary.BigEndian.Uint16(eth[12:]) == roce.EtherTypeRoCEv1}
			k++
		}
		if k > 0 {
			return k, nil
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
	}
}
