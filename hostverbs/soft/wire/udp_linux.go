//go:build linux

package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"golang.org/x/sys/unix"
)

// UDPWire carries RoCE v2 through the host kernel's UDP stack with
// segmentation offload: one system call moves up to BatchSize packets of a
// flow each way, and the kernel moves each run of them as one buffer
// (a "super-packet") as far as the path allows, cutting it into wire
// packets only where a device or receiver needs that.
//
// Sending: each run of datagrams of one flow (source and destination GID,
// UDP source port, traffic class, hop limit), all of one size except
// perhaps the last, is one sendmmsg message on a UDP socket bound to the
// run's source port, with UDP_SEGMENT set to that size: every segment is
// a whole RoCE packet with its own BTH and ICRC. The source GID, traffic
// class and hop limit travel as control messages (IP_PKTINFO, IP_TOS,
// IP_TTL and their IPv6 twins). Such a socket is unconnected with DF set,
// for which Linux sends IPv4 ID 0 and numbers the segments 0, 1, 2...
// when it cuts them (inet_gso_segment), so Transmit moves segment k to ID
// k, ICRC included (roce.IPIDTable: the ICRC covers the ID). A source
// port whose socket cannot be bound (another program holds the port) is
// sent through a raw socket as KernelWire does, and counted.
//
// Receiving: UDP sockets on port 4791 with UDP_GRO, which get a flow's
// packets coalesced (with their segment size) and without their IP
// headers: UDPWireConfig.QueuesPerFamily of them per family, each a
// receive queue of its own (the fabric runs a goroutine per queue). Those
// of a family share the port through SO_REUSEPORT, and a classic BPF
// program on the group (steerProgram) puts every datagram on the socket
// numbered (the destination address's last 32 bits + the BTH's
// destination QP) mod their number, so that all the packets for one QP
// (requests, responses, ACKs, CNPs) queue on one socket, in order, while
// different QPs (a loopback pair's two ends among them) are handled on
// different cores. Receive rebuilds each packet's header from what the kernel
// reports (addresses, TOS with ECN, TTL) and, for IPv4, finds the ID and
// DF that the ICRC was computed over: first the one a UDPWire sender uses
// (0 for the first segment, then the previous one plus one), checked at
// full CRC-32 strength, else by solving for them (roce.IPIDTable: the
// ICRC still checks the whole packet but 17 of its bits are spent on the
// unknown header fields). A packet whose ICRC does not check is dropped
// and counted (drop_bad_icrc) here; the fabric does not check it again.
type UDPWire struct {
	cfg        UDPWireConfig
	ids        roce.IPIDTable
	rx         []*udpRx
	raw4, raw6 *txSock  // for source ports no UDP socket could be bound to
	socks      sync.Map // udpKey -> *txSock, nil when the port could not be bound
	nsocks     atomic.Int32
	sockMu     sync.Mutex // serialises socket creation
	closeOnce  sync.Once
	closedFlag chan struct{}
	scratch    sync.Pool
	ctrs       [numUDPCounters]atomic.Uint64
	// netns is the network namespace the wire was made in, where send
	// sockets opened later must live too (the goroutine that opens one
	// may run on a thread of another namespace).
	netns *os.File
	// adopted counts the receive sockets taken from Inherit.
	adopted int
	// rxGate (PauseReceive, ResumeReceive): while paused the receivers
	// wait at it and leave datagrams in the kernel.
	rxGate
}

// UDPWireConfig parameterises NewUDPWire.
type UDPWireConfig struct {
	// DisableIPv6 skips the IPv6 sockets (for hosts without IPv6).
	DisableIPv6 bool
	// SocketBuffer is the receive buffer of each port 4791 socket and the
	// send buffer of each send socket (default 8 MiB; forced past the
	// sysctl limits when permitted).
	SocketBuffer int
	// Interface, if set, binds every socket to that network device
	// (SO_BINDTODEVICE), as KernelWireConfig.Interface does.
	Interface string
	// MaxSendSockets bounds the UDP sockets opened for source ports
	// (default 4096); datagrams from further ports go through the raw
	// fallback.
	MaxSendSockets int
	// Inherit are port 4791 receive sockets of a predecessor (a daemon
	// handing over to its successor, or systemd's descriptor store after
	// a crash), with whatever the kernel queued on them meanwhile. One
	// that is a UDP socket of a wanted family bound to port 4791 on
	// Interface is taken instead of a new one. NewUDPWire closes every
	// file of Inherit (it works on duplicates) before it binds new
	// sockets, and then tries a busy port again for a while: a copy held
	// elsewhere (the service manager's) may still be closing.
	Inherit []*os.File
	// Paused opens the wire with receiving paused until ResumeReceive:
	// datagrams wait in the sockets' buffers (a successor rebuilding
	// the QPs they are for).
	Paused bool
	// QueuesPerFamily is the number of port 4791 receive sockets (receive
	// queues) per family, 1 to 64; 0 means 1, the port held exclusively.
	// With more than one they share the port through SO_REUSEPORT: a
	// bulk stream between two QPs of this fabric runs its two ends on two
	// goroutines (1 MiB WRITEs over loopback gain about 13%), but a
	// ping-pong between such QPs pays a wake-up of the other goroutine on
	// every message (its mean round trip 1.8x); so more queues is a
	// choice, not the default. Inherited
	// sockets are all taken whatever their number; a family whose
	// inherited socket was bound without SO_REUSEPORT (by a version with
	// one socket per family) keeps that one socket only.
	QueuesPerFamily int
}

// udpKey names a send socket: the family (bit 16) and the source port.
type udpKey uint32

// The UDPWire's counters, reported through Counters.
const (
	udpTxMessages     = iota // sendmmsg messages (super-packets)
	udpTxSegmented           // of them, those carrying more than one packet
	udpTxRaw                 // datagrams sent through the raw fallback
	udpRxMessages            // messages received
	udpRxCoalesced           // of them, those holding more than one packet
	udpRxIDSolved            // IPv4 packets whose ID was found by solving
	udpRxDropOversize        // packets larger than MaxDatagram, dropped
	udpRxDropNoInfo          // messages without their addresses, dropped
	udpRxDropICRC            // packets whose ICRC did not check, dropped
	numUDPCounters
)

// udpQueuesCounter is the gauge of the receive sockets (Queues) in
// Counters.
const udpQueuesCounter = "wire_rx_queues"

var udpCounterNames = [numUDPCounters]string{
	"wire_tx_messages", "wire_tx_segmented", "wire_tx_raw_fallback",
	"wire_rx_messages", "wire_rx_coalesced", "wire_rx_ipid_solved",
	"wire_rx_drop_oversize", "wire_rx_drop_no_pktinfo",
	"drop_bad_icrc", // the fabric's name: it adds its own
}

// maxGSOSegments is the most packets one message carries (Linux's
// UDP_MAX_SEGMENTS was 64 before 6.x raised it).
const maxGSOSegments = 64

// maxGSOPayload bounds a message's UDP payload: an IPv4 datagram's 64 KiB.
const maxGSOPayload = 65535 - roce.IPv4HeaderSize - roce.UDPHeaderSize

// udpRxMsgs is how many messages one recvmmsg takes, each up to 64 KiB.
const udpRxMsgs = 8

// NewUDPWire opens the port 4791 sockets and the raw fallback senders; the
// send sockets open as source ports appear. It needs port 4791 free (no
// kernel rxe device in this network namespace) and CAP_NET_RAW for the
// fallback.
func NewUDPWire(cfg UDPWireConfig) (w *UDPWire, err error) {
	if cfg.SocketBuffer == 0 {
		cfg.SocketBuffer = 8 << 20
	}
	if cfg.MaxSendSockets == 0 {
		cfg.MaxSendSockets = 4096
	}
	if cfg.QueuesPerFamily == 0 {
		cfg.QueuesPerFamily = 1
	}
	if cfg.QueuesPerFamily < 0 || cfg.QueuesPerFamily > maxQueuesPerFamily {
		for _, f := range cfg.Inherit {
			f.Close()
		}
		return nil, fmt.Errorf("udp wire: %d receive queues per family, want 1 to %d: %w",
			cfg.QueuesPerFamily, maxQueuesPerFamily, hostverbs.ErrInvalid)
	}
	w = &UDPWire{cfg: cfg, closedFlag: make(chan struct{})}
	made := w // a failing return sets w to nil
	defer func() {
		if err != nil {
			_ = made.Close()
		}
	}()
	if w.netns, err = os.Open("/proc/thread-self/ns/net"); err != nil {
		for _, f := range cfg.Inherit {
			f.Close()
		}
		return nil, fmt.Errorf("udp wire: network namespace: %w", err)
	}
	families := []int{unix.AF_INET}
	if !cfg.DisableIPv6 {
		families = append(families, unix.AF_INET6)
	}
	adopted := map[int][]*udpRx{}
	defer func() {
		if err != nil {
			for _, group := range adopted {
				for _, rx := range group {
					rx.file.Close()
				}
			}
		}
	}()
	seen := map[uint64]bool{} // inherited sockets by inode: a socket twice is taken once
	for _, f := range cfg.Inherit {
		for _, fam := range families {
			rx, aerr := adoptUDPRx(f, fam, cfg)
			if aerr != nil {
				err = aerr
			}
			if rx == nil {
				continue
			}
			var st unix.Stat_t
			if unix.Fstat(rx.fd, &st) == nil && seen[st.Ino] {
				rx.file.Close()
				break
			}
			seen[st.Ino] = true
			adopted[fam] = append(adopted[fam], rx)
			w.adopted++
			break
		}
		f.Close()
	}
	if err != nil {
		return nil, err
	}
	for _, fam := range families {
		raw, err := openTx(fam, cfg.SocketBuffer, w.closedFlag)
		if err != nil {
			return nil, fmt.Errorf("udp wire: raw send socket: %w", err)
		}
		if fam == unix.AF_INET {
			w.raw4 = raw
		} else {
			w.raw6 = raw
		}
		if err := bindToDevice(raw.fd, cfg.Interface); err != nil {
			return nil, err
		}
		group := adopted[fam]
		delete(adopted, fam) // the wire's now: Close closes them
		w.rx = append(w.rx, group...)
		if err := w.openRxGroup(fam, group); err != nil {
			return nil, err
		}
	}
	for _, rx := range w.rx {
		rx.rxFn = func(fd uintptr) bool {
			if w.receivePaused() {
				rx.rxN, rx.rxErr = 0, nil // leave it queued; the receiver waits at the gate
				return true
			}
			return rx.recvReady(fd)
		}
	}
	if cfg.Paused {
		w.PauseReceive()
	}
	w.scratch.New = func() any { return newUDPTxScratch() }
	return w, nil
}

// openRxGroup completes family fam's receive sockets, appending them to
// w.rx: group are those adopted from a predecessor (perhaps none). A
// fresh family gets cfg.QueuesPerFamily sockets; an adopted group bound
// with SO_REUSEPORT gets new sockets up to that number, one bound without
// it stays alone. A group of several gets the steering program.
func (w *UDPWire) openRxGroup(fam int, group []*udpRx) error {
	cfg := w.cfg
	n := cfg.QueuesPerFamily
	reuse := n > 1
	if len(group) > 0 {
		reuse = reusesPort(group[0].fd)
		if !reuse {
			return nil // no other socket can bind the port beside it
		}
	}
	if len(group) == 0 {
		var retry time.Duration
		if len(cfg.Inherit) > 0 {
			retry = 2 * time.Second
		}
		if reuse {
			// Port sharing must not join whatever else holds the port
			// (another daemon of this uid): bind it alone first.
			if err := probeUDPPort(fam, cfg, retry); err != nil {
				return err
			}
		}
		rx, err := openUDPRx(fam, cfg, reuse, retry)
		if err != nil {
			return err
		}
		w.rx = append(w.rx, rx)
		group = append(group, rx)
	}
	for len(group) < n {
		rx, err := openUDPRx(fam, cfg, true, 0)
		if err != nil {
			return err
		}
		w.rx = append(w.rx, rx)
		group = append(group, rx)
	}
	if reuse {
		return attachSteering(group[0].fd, fam == unix.AF_INET6, len(group))
	}
	return nil
}

// Adopted returns how many receive sockets the wire took from
// UDPWireConfig.Inherit.
func (w *UDPWire) Adopted() int { return w.adopted }

// ReceiveSockets returns the port 4791 receive sockets' descriptors, by
// family and number ("udp4", "udp4.1", ... "udp6", "udp6.1", ...), for a
// successor to inherit; the wire still owns them.
func (w *UDPWire) ReceiveSockets() map[string]int {
	out := make(map[string]int, len(w.rx))
	var k [2]int
	for _, s := range w.rx {
		name, fam := "udp4", 0
		if s.v6 {
			name, fam = "udp6", 1
		}
		if k[fam] > 0 {
			name = fmt.Sprintf("%s.%d", name, k[fam])
		}
		k[fam]++
		out[name] = s.fd
	}
	return out
}

// Queues returns the number of receive sockets, those of IPv4 first.
func (w *UDPWire) Queues() int { return len(w.rx) }

// ChecksICRC reports that Receive returns only packets whose ICRC checked.
func (w *UDPWire) ChecksICRC() bool { return true }

// Counters adds the wire's statistics to m.
func (w *UDPWire) Counters(m map[string]uint64) {
	for i := range w.ctrs {
		m[udpCounterNames[i]] += w.ctrs[i].Load()
	}
	m[udpQueuesCounter] += uint64(len(w.rx))
}

func (w *UDPWire) inc(c int, n uint64) { w.ctrs[c].Add(n) }

// Close closes every socket; Receive calls return.
func (w *UDPWire) Close() error {
	w.closeOnce.Do(func() {
		close(w.closedFlag)
		closeTx(w.raw4, w.raw6)
		w.sockMu.Lock()
		w.socks.Range(func(k, v any) bool {
			closeTx(v.(*txSock))
			return true
		})
		w.sockMu.Unlock()
		for _, s := range w.rx {
			s.file.Close()
		}
		if w.netns != nil {
			w.netns.Close()
		}
	})
	return nil
}

// sendSock returns the socket for source port port, opening it on first
// use; nil means use the raw fallback.
func (w *UDPWire) sendSock(v6 bool, port uint16) *txSock {
	key := udpKey(port)
	if v6 {
		key |= 1 << 16
	}
	if v, ok := w.socks.Load(key); ok {
		return v.(*txSock)
	}
	w.sockMu.Lock()
	defer w.sockMu.Unlock()
	if v, ok := w.socks.Load(key); ok {
		return v.(*txSock)
	}
	select {
	case <-w.closedFlag:
		return nil
	default:
	}
	var s *txSock
	if int(w.nsocks.Load()) < w.cfg.MaxSendSockets {
		if fd, err := w.inNetns(func() (int, error) { return openUDPTx(v6, port, w.cfg) }); err == nil {
			s = &txSock{fd: fd, closed: w.closedFlag}
			w.nsocks.Add(1)
		}
	}
	w.socks.Store(key, s)
	return s
}

// inNetns runs open on a thread in the wire's network namespace.
func (w *UDPWire) inNetns(open func() (int, error)) (int, error) {
	runtime.LockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return -1, err
	}
	defer orig.Close()
	if err := unix.Setns(int(w.netns.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return -1, fmt.Errorf("udp wire: enter network namespace: %w", err)
	}
	fd, err := open()
	if unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET) == nil {
		runtime.UnlockOSThread() // else the thread stays locked and exits with the goroutine
	}
	return fd, err
}

// openUDPTx opens an unconnected UDP socket bound to port with DF set
// (IPv4 ID 0, see UDPWire) that takes nothing in.
func openUDPTx(v6 bool, port uint16, cfg UDPWireConfig) (fd int, err error) {
	fam := unix.AF_INET
	if v6 {
		fam = unix.AF_INET6
	}
	fd, err = unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return -1, err
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	if err := mmsg.AttachFilter(fd, []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}); err != nil {
		return -1, err
	}
	if err := bindToDevice(fd, cfg.Interface); err != nil {
		return -1, err
	}
	var sa unix.Sockaddr = &unix.SockaddrInet4{Port: int(port)}
	if v6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); err != nil {
			return -1, err
		}
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_MTU_DISCOVER, unix.IPV6_PMTUDISC_DO); err != nil {
			return -1, err
		}
		sa = &unix.SockaddrInet6{Port: int(port)}
	} else if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, unix.IP_PMTUDISC_DO); err != nil {
		return -1, err
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, cfg.SocketBuffer); err != nil {
		return -1, err
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, cfg.SocketBuffer)
	if err := unix.Bind(fd, sa); err != nil {
		return -1, err
	}
	return fd, nil
}

// udpTxScratch holds the messages of one Transmit call.
type udpTxScratch struct {
	hdrs   []unix.Mmsghdr
	segs   []int // datagrams per message
	iovs   []unix.Iovec
	names4 []unix.RawSockaddrInet4
	names6 []unix.RawSockaddrInet6
	oob    []byte
	raw    *txScratch
}

// udpTxOOB is the control data of one message: the source address, TOS,
// TTL and segment size.
var udpTxOOB = unix.CmsgSpace(unix.SizeofInet6Pktinfo) + 2*unix.CmsgSpace(4) + unix.CmsgSpace(2)

// udpTxIovs is the most datagrams one sendmmsg carries (in at most
// BatchSize messages).
const udpTxIovs = 4 * BatchSize

func newUDPTxScratch() *udpTxScratch {
	return &udpTxScratch{
		hdrs: make([]unix.Mmsghdr, BatchSize), segs: make([]int, BatchSize),
		iovs:   make([]unix.Iovec, udpTxIovs),
		names4: make([]unix.RawSockaddrInet4, BatchSize), names6: make([]unix.RawSockaddrInet6, BatchSize),
		oob: make([]byte, BatchSize*udpTxOOB), raw: newTxScratch(),
	}
}

// flow is what a run of datagrams shares to travel as one message.
type flow struct {
	v6       bool
	hl       int // IP header length
	src, dst [16]byte
	port     uint16
	tclass   uint8
	hop      uint8
}

// parseFlow reads datagram b's flow; ok is false for a malformed one.
func parseFlow(b []byte, f *flow) bool {
	if len(b) < roce.IPv4HeaderSize+roce.UDPHeaderSize {
		return false
	}
	switch b[0] >> 4 {
	case 4:
		if b[0]&0x0f != 5 {
			return false
		}
		*f = flow{hl: roce.IPv4HeaderSize, tclass: b[1], hop: b[8]}
		copy(f.src[12:], b[12:16])
		copy(f.dst[12:], b[16:20])
	case 6:
		if len(b) < roce.IPv6HeaderSize+roce.UDPHeaderSize {
			return false
		}
		*f = flow{v6: true, hl: roce.IPv6HeaderSize,
			tclass: uint8(binary.BigEndian.Uint16(b[0:]) >> 4), hop: b[7]}
		copy(f.src[:], b[8:24])
		copy(f.dst[:], b[24:40])
	default:
		return false
	}
	f.port = binary.BigEndian.Uint16(b[f.hl:])
	return true
}

// Transmit sends the datagrams: each run of one flow and size is one
// message with UDP_SEGMENT, consecutive messages on the same socket one
// sendmmsg call. IPv4 datagrams have their ID (and ICRC) rewritten to
// the one Linux will give them.
func (w *UDPWire) Transmit(pkts []Datagram) (int, error) {
	s := w.scratch.Get().(*udpTxScratch)
	defer w.scratch.Put(s)
	sent := 0
	for sent < len(pkts) {
		var f flow
		if !parseFlow(pkts[sent].Packet, &f) {
			return sent, fmt.Errorf("udp wire: malformed datagram: %w", hostverbs.ErrInvalid)
		}
		if f.v6 && w.raw6 == nil {
			return sent, fmt.Errorf("udp wire: ipv6 disabled: %w", hostverbs.ErrNotSupported)
		}
		sock := w.sendSock(f.v6, f.port)
		if sock == nil {
			n, err := w.transmitRaw(s.raw, pkts[sent:], &f)
			sent += n
			if err != nil {
				return sent, err
			}
			continue
		}
		// Messages for this socket: runs of one flow and size.
		m, used, iov := 0, 0, 0
		for sent+used < len(pkts) && m < len(s.hdrs) {
			k := w.run(pkts[sent+used:], &f, len(s.iovs)-iov)
			if k == 0 {
				break
			}
			w.encodeMsg(s, m, iov, pkts[sent+used:sent+used+k], &f)
			s.segs[m] = k
			m++
			iov += k
			used += k
			if sent+used >= len(pkts) || iov >= len(s.iovs) {
				break
			}
			var next flow
			if !parseFlow(pkts[sent+used].Packet, &next) || next.v6 != f.v6 || next.port != f.port {
				break
			}
			f = next
		}
		n, err := sock.sendmmsg(s.hdrs[:m])
		for i := range n {
			sent += s.segs[i]
			if s.segs[i] > 1 {
				w.inc(udpTxSegmented, 1)
			}
		}
		w.inc(udpTxMessages, uint64(n))
		if err != nil {
			return sent, sendError("sendmmsg", err)
		}
	}
	return sent, nil
}

// run returns how many datagrams from pkts[0] (of flow f) travel in one
// message: the same flow, the size of the first, the last perhaps shorter,
// at most maxIov of them and 64 KiB.
func (w *UDPWire) run(pkts []Datagram, f *flow, maxIov int) int {
	size := len(pkts[0].Packet)
	total := 0
	k := 0
	for k < len(pkts) && k < maxGSOSegments && k < maxIov {
		b := pkts[k].Packet
		if len(b) > size || total+len(b)-f.hl-roce.UDPHeaderSize > maxGSOPayload {
			break
		}
		if k > 0 {
			var g flow
			if !parseFlow(b, &g) || g != *f {
				break
			}
		}
		total += len(b) - f.hl - roce.UDPHeaderSize
		k++
		if len(b) < size {
			break // a shorter datagram ends the run
		}
	}
	return k
}

// encodeMsg fills message m with the datagrams of one run, starting at
// iovec iov.
func (w *UDPWire) encodeMsg(s *udpTxScratch, m, iov int, pkts []Datagram, f *flow) {
	h := &s.hdrs[m].Hdr
	*h = unix.Msghdr{}
	for k, d := range pkts {
		if !f.v6 {
			w.ids.SetIPv4ID(d.Packet, uint16(k))
		}
		mmsg.SetIov(&s.iovs[iov+k], d.Packet[f.hl+roce.UDPHeaderSize:])
	}
	h.Iov = &s.iovs[iov]
	h.SetIovlen(len(pkts))
	oob := s.oob[m*udpTxOOB : (m+1)*udpTxOOB]
	n := 0
	if f.v6 {
		sa := &s.names6[m]
		*sa = unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: f.dst}
		binary.BigEndian.PutUint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:], roce.UDPPort)
		mmsg.SetName6(h, sa)
		var pi unix.Inet6Pktinfo
		pi.Addr = f.src
		n += putCmsg(oob[n:], unix.IPPROTO_IPV6, unix.IPV6_PKTINFO, unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet6Pktinfo))
		n += putCmsgInt(oob[n:], unix.IPPROTO_IPV6, unix.IPV6_TCLASS, int32(f.tclass))
		if f.hop != 0 {
			n += putCmsgInt(oob[n:], unix.IPPROTO_IPV6, unix.IPV6_HOPLIMIT, int32(f.hop))
		}
	} else {
		sa := &s.names4[m]
		*sa = unix.RawSockaddrInet4{Family: unix.AF_INET}
		copy(sa.Addr[:], f.dst[12:])
		binary.BigEndian.PutUint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:], roce.UDPPort)
		mmsg.SetName4(h, sa)
		var pi unix.Inet4Pktinfo
		copy(pi.Spec_dst[:], f.src[12:])
		n += putCmsg(oob[n:], unix.IPPROTO_IP, unix.IP_PKTINFO, unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet4Pktinfo))
		n += putCmsgInt(oob[n:], unix.IPPROTO_IP, unix.IP_TOS, int32(f.tclass))
		if f.hop != 0 {
			n += putCmsgInt(oob[n:], unix.IPPROTO_IP, unix.IP_TTL, int32(f.hop))
		}
	}
	if len(pkts) > 1 {
		var seg [2]byte
		binary.NativeEndian.PutUint16(seg[:], uint16(len(pkts[0].Packet)-f.hl-roce.UDPHeaderSize))
		n += putCmsg(oob[n:], unix.SOL_UDP, unix.UDP_SEGMENT, seg[:])
	}
	h.Control = &oob[0]
	h.SetControllen(n)
}

// putCmsg writes one control message into b and returns its space.
func putCmsg(b []byte, level, typ int32, data []byte) int {
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = level, typ
	h.SetLen(unix.CmsgLen(len(data)))
	copy(b[unix.CmsgLen(0):], data)
	return unix.CmsgSpace(len(data))
}

func putCmsgInt(b []byte, level, typ, v int32) int {
	var d [4]byte
	binary.NativeEndian.PutUint32(d[:], uint32(v))
	return putCmsg(b, level, typ, d[:])
}

// transmitRaw sends the leading datagrams of flow f's family and source
// port through the raw socket, with the IDs the fabric chose.
func (w *UDPWire) transmitRaw(s *txScratch, pkts []Datagram, f *flow) (int, error) {
	sock := w.raw4
	if f.v6 {
		sock = w.raw6
	}
	k := 0
	for k < len(pkts) && k < len(s.hdrs) {
		var g flow
		if !parseFlow(pkts[k].Packet, &g) || g.v6 != f.v6 || g.port != f.port {
			break
		}
		k++
	}
	s.fill(pkts[:k], f.v6)
	n, err := sock.sendmmsg(s.hdrs[:k])
	w.inc(udpTxRaw, uint64(n))
	if err != nil {
		return n, sendError("raw sendmmsg", err)
	}
	return n, nil
}

// sendError wraps a failed send call's error; EMSGSIZE becomes ErrOversize.
func sendError(call string, err error) error {
	if errors.Is(err, unix.EMSGSIZE) {
		return fmt.Errorf("udp wire: %w", ErrOversize)
	}
	return fmt.Errorf("udp wire: %s: %w", call, err)
}

// udpRx is a port 4791 receive socket, polled by the Go runtime, with the
// messages of its last recvmmsg that Receive has not handed out yet.
//
// Each message of a recvmmsg lands in its own part of arena, cut into
// slots by one iovec each: slot k holds bytes [k*stride, (k+1)*stride) of
// the message's UDP payload, with rxHeadroom bytes free before it. When the
// message's segments are stride bytes long (as the bulk of a stream's are:
// the queue learns the size from what it receives), segment k is slot k,
// and its IP and UDP headers are rebuilt in the headroom in front of it:
// the packet is checked and handed on where the kernel put it, not copied.
// Segments of another size are copied out into the caller's buffers.
type udpRx struct {
	rawSock // the descriptor, recvmmsg state and headers
	arena   []byte
	// stride is the slot size the iovecs are laid out for; want is the
	// segment size last seen coalesced, which the next recvmmsg uses.
	stride, want int
	// Messages not yet split: cur of msgs, from byte off.
	msgs, cur, off int
	meta           rxMeta
}

// The receive arena's geometry.
const (
	// rxHeadroom is the room for a rebuilt IPv6 and UDP header (IPv4's
	// takes 28 of it) in front of each slot.
	rxHeadroom = roce.IPv6HeaderSize + roce.UDPHeaderSize
	// rxMinStride and rxMaxStride bound the slot size: segments shorter
	// than rxMinStride would need too many iovecs, and a packet in place
	// must fit MaxDatagram with its rebuilt header.
	rxMinStride = 1024
	rxMaxStride = MaxDatagram - rxHeadroom
	// rxDefaultStride is a full 4096-byte-MTU packet without an extended
	// header (the middle packets of WRITEs, SENDs and READ responses).
	rxDefaultStride = roce.BTHSize + 4096 + roce.ICRCSize
	// rxMaxMsg is the largest UDP payload a message can hold.
	rxMaxMsg = 65536
	// rxMaxSlots is the most slots (iovecs) a message is cut into.
	rxMaxSlots = (rxMaxMsg + rxMinStride - 1) / rxMinStride
	// rxMsgArena is a message's part of the arena: enough for rxMaxMsg
	// bytes in slots of any allowed stride, with their headroom.
	rxMsgArena = rxMaxMsg + rxMaxStride + rxMaxSlots*(rxHeadroom+16)
)

// slotLen is the arena bytes a slot of stride bytes takes, headroom
// included, rounded up to 16.
func slotLen(stride int) int { return (rxHeadroom + stride + 15) &^ 15 }

// slotOff is the arena offset of slot k of message m.
func (s *udpRx) slotOff(m, k int) int { return m*rxMsgArena + k*slotLen(s.stride) + rxHeadroom }

// slot returns slot k of message m: the stride bytes its iovec points at.
func (s *udpRx) slot(m, k int) []byte {
	o := s.slotOff(m, k)
	return s.arena[o : o+s.stride : o+s.stride]
}

// layout points every message's iovecs at its slots for s.want.
func (s *udpRx) layout() {
	s.stride = s.want
	n := (rxMaxMsg + s.stride - 1) / s.stride
	for m := range len(s.hdrs) {
		for k := range n {
			mmsg.SetIov(&s.iovs[m*rxMaxSlots+k], s.slot(m, k))
		}
	}
}

// copyOut copies n bytes from offset o of message m's payload into dst.
func (s *udpRx) copyOut(dst []byte, m, o int) {
	for len(dst) > 0 {
		k, in := o/s.stride, o%s.stride
		c := copy(dst, s.slot(m, k)[in:])
		dst, o = dst[c:], o+c
	}
}

// rxMeta is what the kernel reports about one received message.
type rxMeta struct {
	ok       bool
	seg      int // segment size, 0 if not coalesced
	dst      [16]byte
	tclass   uint8
	hop      uint8
	nextID   uint16 // the ID expected for the next IPv4 segment
	received int    // the message's length
}

// udpRxOOB is the control data of one received message.
var udpRxOOB = unix.CmsgSpace(unix.SizeofInet6Pktinfo) + 3*unix.CmsgSpace(4)

// openUDPRx opens and binds a port 4791 receive socket of family fam,
// with SO_REUSEPORT if reuse. retryBusy keeps trying a bind that finds
// the port in use for that long (a discarded predecessor's socket whose
// last copy is still closing).
func openUDPRx(fam int, cfg UDPWireConfig, reuse bool, retryBusy time.Duration) (s *udpRx, err error) {
	fd, err := bindUDPRx(fam, cfg, reuse, retryBusy)
	if err != nil {
		return nil, err
	}
	return newUDPRx(fd, fam)
}

// probeUDPPort checks that nothing holds port 4791 (family fam, on the
// configured interface) by binding it without SO_REUSEPORT, retrying as
// openUDPRx does, and releases it again.
func probeUDPPort(fam int, cfg UDPWireConfig, retryBusy time.Duration) error {
	fd, err := bindUDPRx(fam, cfg, false, retryBusy)
	if err != nil {
		return err
	}
	unix.Close(fd)
	return nil
}

// bindUDPRx is openUDPRx's socket, set up and bound.
func bindUDPRx(fam int, cfg UDPWireConfig, reuse bool, retryBusy time.Duration) (fd int, err error) {
	fd, err = unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return -1, fmt.Errorf("udp wire: udp %d socket: %w", roce.UDPPort, err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	if fam == unix.AF_INET6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); err != nil {
			return -1, fmt.Errorf("udp wire: IPV6_V6ONLY: %w", err)
		}
	}
	if err := setupUDPRx(fd, fam, cfg); err != nil {
		return -1, err
	}
	if err := bindToDevice(fd, cfg.Interface); err != nil {
		return -1, err
	}
	if reuse {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			return -1, fmt.Errorf("udp wire: SO_REUSEPORT: %w", err)
		}
	}
	var sa unix.Sockaddr = &unix.SockaddrInet4{Port: roce.UDPPort}
	if fam == unix.AF_INET6 {
		sa = &unix.SockaddrInet6{Port: roce.UDPPort}
	}
	deadline := time.Now().Add(retryBusy)
	for {
		err = unix.Bind(fd, sa)
		if err != unix.EADDRINUSE || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return -1, fmt.Errorf("udp wire: bind udp %d (is a kernel rxe device or another fabric using it?): %w", roce.UDPPort, err)
	}
	return fd, nil
}

// setupUDPRx sets a receive socket's options but IPV6_V6ONLY (fixed at
// bind) and SO_BINDTODEVICE; an adopted socket gets them again. (Not the
// device: setting it on a bound socket rehashes it, which takes it out of
// its SO_REUSEPORT group; isUDPRx checked it is the configured one.)
func setupUDPRx(fd, fam int, cfg UDPWireConfig) error {
	type opt struct{ level, name, val int }
	opts := []opt{{unix.SOL_UDP, unix.UDP_GRO, 1}}
	if fam == unix.AF_INET6 {
		opts = append(opts, opt{unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1}, opt{unix.IPPROTO_IPV6, unix.IPV6_RECVTCLASS, 1},
			opt{unix.IPPROTO_IPV6, unix.IPV6_RECVHOPLIMIT, 1},
			// rxe and HCAs send RoCE with UDP checksum 0, which IPv6
			// otherwise forbids; the ICRC covers the packet.
			opt{unix.SOL_UDP, unix.UDP_NO_CHECK6_RX, 1})
	} else {
		opts = append(opts, opt{unix.IPPROTO_IP, unix.IP_PKTINFO, 1}, opt{unix.IPPROTO_IP, unix.IP_RECVTOS, 1},
			opt{unix.IPPROTO_IP, unix.IP_RECVTTL, 1})
	}
	for _, o := range opts {
		if err := unix.SetsockoptInt(fd, o.level, o.name, o.val); err != nil {
			return fmt.Errorf("udp wire: socket option %d/%d: %w", o.level, o.name, err)
		}
	}
	mmsg.SetBuffers(fd, cfg.SocketBuffer)
	return nil
}

// newUDPRx wraps a set-up, bound receive socket; it owns fd from then on.
func newUDPRx(fd, fam int) (*udpRx, error) {
	f := os.NewFile(uintptr(fd), fmt.Sprintf("roce-udp-%d", fam))
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	s := newUDPRxState(fam == unix.AF_INET6)
	s.fd, s.file, s.rc = fd, f, rc
	s.rxFn = s.recvReady
	return s, nil
}

// newUDPRxState is a receive socket's buffers and headers, laid out for
// rxDefaultStride.
func newUDPRxState(v6 bool) *udpRx {
	s := &udpRx{rawSock: rawSock{v6: v6,
		hdrs: make([]unix.Mmsghdr, udpRxMsgs), iovs: make([]unix.Iovec, udpRxMsgs*rxMaxSlots),
		names: make([]unix.RawSockaddrInet6, udpRxMsgs), oob: make([]byte, udpRxMsgs*udpRxOOB)},
		arena: make([]byte, udpRxMsgs*rxMsgArena), want: rxDefaultStride}
	s.layout()
	return s
}

// adoptUDPRx takes over a predecessor's receive socket if it is one this
// wire would have opened: a UDP socket of family fam bound to port 4791 on
// the configured interface. It returns nil (and f untouched) if not. The
// wire gets a duplicate; f stays the caller's.
func adoptUDPRx(f *os.File, fam int, cfg UDPWireConfig) (*udpRx, error) {
	fd, err := dupInherited(f, fmt.Sprintf("udp wire: take over udp %d socket", roce.UDPPort),
		func(fd int) bool { return isUDPRx(fd, fam, cfg.Interface) })
	if fd < 0 {
		return nil, err
	}
	if err := setupUDPRx(fd, fam, cfg); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return newUDPRx(fd, fam)
}

// isUDPRx reports whether fd is a UDP socket of family fam (IPv6 only, for
// IPv6) bound to port 4791 and to the network device iface ("": to none).
func isUDPRx(fd, fam int, iface string) bool {
	if fam == unix.AF_INET6 {
		if v, err := unix.GetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY); err != nil || v != 1 {
			return false
		}
	}
	for _, o := range [][2]int{{unix.SO_DOMAIN, fam}, {unix.SO_TYPE, unix.SOCK_DGRAM}, {unix.SO_PROTOCOL, unix.IPPROTO_UDP}} {
		if v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, o[0]); err != nil || v != o[1] {
			return false
		}
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return false
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		if a.Port != roce.UDPPort || a.Addr != [4]byte{} {
			return false
		}
	case *unix.SockaddrInet6:
		if a.Port != roce.UDPPort || a.Addr != [16]byte{} {
			return false
		}
	default:
		return false
	}
	dev, err := unix.GetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE)
	return err == nil && dev == iface
}

func (s *udpRx) prepare() {
	if s.want != s.stride {
		s.layout()
	}
	n := (rxMaxMsg + s.stride - 1) / s.stride
	for i := range s.hdrs {
		h := &s.hdrs[i].Hdr
		*h = unix.Msghdr{}
		h.Iov = &s.iovs[i*rxMaxSlots]
		h.SetIovlen(n)
		mmsg.SetName6(h, &s.names[i])
		oob := s.oob[i*udpRxOOB : (i+1)*udpRxOOB]
		h.Control = &oob[0]
		h.SetControllen(len(oob))
	}
}

// Receive returns the next packets from queue's socket, waiting for some
// if none is left from the last system call. Packets whose segments fit
// the queue's slots are handed on in place (out[i] a view of the wire's
// arena), others copied into bufs.
func (w *UDPWire) Receive(ctx context.Context, queue int, bufs, out [][]byte) (int, error) {
	return w.receive(queue, bufs, out, true)
}

// TryReceive is Receive without waiting.
func (w *UDPWire) TryReceive(queue int, bufs, out [][]byte) (int, error) {
	return w.receive(queue, bufs, out, false)
}

// receive hands out what is left of the last system call's messages, or
// makes another (waiting for datagrams if wait, else returning 0).
func (w *UDPWire) receive(queue int, bufs, out [][]byte, wait bool) (int, error) {
	if queue < 0 || queue >= len(w.rx) {
		return 0, fmt.Errorf("udp wire: no receive queue %d: %w", queue, hostverbs.ErrInvalid)
	}
	s := w.rx[queue]
	for {
		if s.cur < s.msgs {
			if n := w.split(s, bufs, out); n > 0 {
				return n, nil
			}
			continue
		}
		if w.receivePaused() {
			if !wait {
				return 0, nil
			}
			if !w.waitGate(w.closedFlag, nil) {
				return 0, fmt.Errorf("udp wire: %w", hostverbs.ErrClosed)
			}
			continue
		}
		s.prepare()
		var n int
		var err error
		if wait {
			s.rxK = len(s.hdrs)
			if rerr := s.rc.Read(s.rxFn); rerr != nil {
				return 0, waitError("udp wire", w.closedFlag, rerr)
			}
			n, err = s.rxN, s.rxErr
		} else {
			n, err = mmsg.RecvMmsg(s.fd, s.hdrs)
			if err == unix.EAGAIN || err == unix.EINTR {
				return 0, nil
			}
		}
		if err != nil {
			return 0, fmt.Errorf("udp wire: recvmmsg: %w", err)
		}
		w.started(s, n)
	}
}

// started records that the last recvmmsg returned n messages.
func (w *UDPWire) started(s *udpRx, n int) {
	s.msgs, s.cur, s.off = n, 0, 0
	w.inc(udpRxMessages, uint64(n))
	if n > 0 {
		s.readMeta(0)
	}
}

// readMeta parses message i's control data and length.
func (s *udpRx) readMeta(i int) {
	h := &s.hdrs[i].Hdr
	m := rxMeta{received: int(s.hdrs[i].Len)}
	oob := s.oob[i*udpRxOOB : i*udpRxOOB+int(h.Controllen)]
	var haveDst bool
	mmsg.Cmsgs(oob, func(level, typ int32, data []byte) {
		switch {
		case level == unix.SOL_UDP && typ == unix.UDP_GRO && len(data) >= 4:
			m.seg = int(binary.NativeEndian.Uint32(data))
		case level == unix.IPPROTO_IP && typ == unix.IP_PKTINFO && len(data) >= unix.SizeofInet4Pktinfo:
			m.dst[10], m.dst[11] = 0xff, 0xff
			copy(m.dst[12:], data[8:12])
			haveDst = true
		case level == unix.IPPROTO_IP && typ == unix.IP_TOS && len(data) >= 1:
			m.tclass = data[0]
		case level == unix.IPPROTO_IP && typ == unix.IP_TTL && len(data) >= 4:
			m.hop = uint8(binary.NativeEndian.Uint32(data))
		case level == unix.IPPROTO_IPV6 && typ == unix.IPV6_PKTINFO && len(data) >= unix.SizeofInet6Pktinfo:
			copy(m.dst[:], data[:16])
			haveDst = true
		case level == unix.IPPROTO_IPV6 && typ == unix.IPV6_TCLASS && len(data) >= 4:
			m.tclass = uint8(binary.NativeEndian.Uint32(data))
		case level == unix.IPPROTO_IPV6 && typ == unix.IPV6_HOPLIMIT && len(data) >= 4:
			m.hop = uint8(binary.NativeEndian.Uint32(data))
		}
	})
	fam := uint16(unix.AF_INET)
	if s.v6 {
		fam = unix.AF_INET6
	}
	m.ok = haveDst && s.names[i].Family == fam && h.Flags&unix.MSG_TRUNC == 0
	if m.seg >= rxMinStride && m.seg <= rxMaxStride && m.seg < m.received {
		// A coalesced run: the size the next system call's slots take.
		s.want = m.seg
	}
	s.meta = m
}

// split cuts the pending messages into packets with rebuilt IP headers,
// in place where a segment is one slot, else copied into bufs; it sets
// out and returns how many it set (0 when it only dropped).
func (w *UDPWire) split(s *udpRx, bufs, out [][]byte) int {
	hl := roce.IPv4HeaderSize
	if s.v6 {
		hl = roce.IPv6HeaderSize
	}
	hdr := hl + roce.UDPHeaderSize
	n := 0
	for n < len(out) && n < len(bufs) && s.cur < s.msgs {
		m := &s.meta
		if !m.ok {
			w.inc(udpRxDropNoInfo, 1)
			s.next()
			continue
		}
		seg := m.received - s.off
		if m.seg > 0 && m.seg < seg {
			seg = m.seg
		}
		if seg <= 0 {
			s.next()
			continue
		}
		o := s.off
		s.off += seg
		if s.off == seg && s.off < m.received {
			w.inc(udpRxCoalesced, 1) // the first of several segments
		}
		var d []byte
		switch dlen := hdr + seg; {
		case dlen > MaxDatagram:
			w.inc(udpRxDropOversize, 1)
		case o%s.stride == 0 && seg <= s.stride:
			// The segment is slot o/stride: its header goes in the
			// headroom in front of it.
			start := s.slotOff(s.cur, o/s.stride)
			d = s.arena[start-hdr : start+seg : start+seg]
		case dlen > len(bufs[n]):
			w.inc(udpRxDropOversize, 1)
		default:
			d = bufs[n][:dlen]
			s.copyOut(d[hdr:], s.cur, o)
		}
		if d != nil && w.rebuild(s, d) {
			out[n] = d
			n++
		}
		if s.off >= m.received {
			s.next()
		}
	}
	return n
}

// next moves to the following message.
func (s *udpRx) next() {
	s.cur++
	s.off = 0
	if s.cur < s.msgs {
		s.readMeta(s.cur)
	}
}

// rebuild writes the IP and UDP headers at the front of datagram d, whose
// UDP payload is in place after them, and checks its ICRC (for IPv4,
// finding the ID and DF it was computed over); it reports false, and
// counts, when the packet is dropped.
func (w *UDPWire) rebuild(s *udpRx, d []byte) bool {
	m := &s.meta
	src := &s.names[s.cur]
	hl := roce.IPv4HeaderSize
	if s.v6 {
		hl = roce.IPv6HeaderSize
	}
	dlen := len(d)
	plen := dlen - hl - roce.UDPHeaderSize
	if s.v6 {
		binary.BigEndian.PutUint32(d[0:], 6<<28|uint32(m.tclass)<<20)
		binary.BigEndian.PutUint16(d[4:], uint16(roce.UDPHeaderSize+plen))
		d[6] = unix.IPPROTO_UDP
		d[7] = m.hop
		copy(d[8:24], src.Addr[:])
		copy(d[24:40], m.dst[:])
	} else {
		d[0] = 0x45
		d[1] = m.tclass
		binary.BigEndian.PutUint16(d[2:], uint16(dlen))
		binary.BigEndian.PutUint16(d[4:], m.nextID)
		binary.BigEndian.PutUint16(d[6:], 0x4000) // DF
		d[8] = m.hop
		d[9] = unix.IPPROTO_UDP
		d[10], d[11] = 0, 0
		sin := (*unix.RawSockaddrInet4)(unsafe.Pointer(src))
		copy(d[12:16], sin.Addr[:])
		copy(d[16:20], m.dst[12:])
	}
	u := d[hl:]
	copy(u[0:2], (*[2]byte)(unsafe.Pointer(&src.Port))[:]) // network order already
	binary.BigEndian.PutUint16(u[2:], roce.UDPPort)
	binary.BigEndian.PutUint16(u[4:], uint16(roce.UDPHeaderSize+plen))
	u[6], u[7] = 0, 0
	if plen < roce.BTHSize+roce.ICRCSize {
		return true // too short to be RoCE: the fabric's parser drops it
	}
	if s.v6 {
		if binary.LittleEndian.Uint32(d[dlen-roce.ICRCSize:]) != roce.ICRC(d, roce.IPv6HeaderSize) {
			w.inc(udpRxDropICRC, 1)
			return false
		}
		return true
	}
	guess := m.nextID
	if !w.ids.RecoverIPv4ID(d) {
		m.nextID++
		w.inc(udpRxDropICRC, 1)
		return false
	}
	id := binary.BigEndian.Uint16(d[4:])
	if id != guess {
		w.inc(udpRxIDSolved, 1)
	}
	m.nextID = id + 1
	return true
}
