//go:build linux

package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"golang.org/x/sys/unix"
)

// KernelWire carries RoCE v2 through the host kernel's IP stack, in the
// network namespace of the thread that creates it.
//
// Sending: raw IP sockets with the header included (IPPROTO_RAW), so each
// packet carries the source address of its GID, the UDP source port of
// its QP pair, the TOS of its traffic class, DF and a non-zero IPv4 ID
// that the ICRC was computed over (an ordinary UDP socket can set none of
// these per packet, and an unconnected one sends ID 0). The source
// addresses must be local addresses of the host (the daemon adds bound
// GIDs to its fabric netdev) for replies to come back.
//
// Receiving: raw IPPROTO_UDP sockets with a BPF filter for destination
// port 4791 (IPv4 raw sockets deliver the IP header, which the ICRC
// covers; IPv6 ones do not, so the header is rebuilt from the addresses,
// hop limit and traffic class the kernel reports, every other field being
// fixed or masked), plus UDP sockets bound to port 4791 whose filter drops
// everything: they keep the kernel from answering ICMP port unreachable.
// Batches use sendmmsg and recvmmsg on non-blocking sockets; the receive
// sockets are polled by the Go runtime, the send sockets are not (see
// txSock).
type KernelWire struct {
	tx4, tx6   *txSock
	rx         []*rawSock // one receive queue per family
	sinks      []int
	closeOnce  sync.Once
	scratch    sync.Pool
	closedFlag chan struct{}
}

// KernelWireConfig parameterises NewKernelWire.
type KernelWireConfig struct {
	// DisableIPv6 skips the IPv6 sockets (for hosts without IPv6).
	DisableIPv6 bool
	// SocketBuffer is the receive and send buffer size per socket
	// (default 8 MiB; forced past the sysctl limits when permitted).
	SocketBuffer int
	// Interface, if set, binds the send and receive sockets to that
	// network device (SO_BINDTODEVICE): RoCE leaves only through it, and
	// only RoCE that arrived on it is taken, so a peer on another of the
	// host's networks cannot reach the guests' GIDs through the host's
	// weak-host routing. The port 4791 sinks stay unbound: they only keep
	// the kernel from answering ICMP port unreachable, on every device.
	Interface string
}

// rawSock is a receive socket, polled by the Go runtime.
type rawSock struct {
	fd   int
	file *os.File
	rc   syscall.RawConn
	v6   bool
	// Receive state: the callback handed to RawConn.Read is made once (a
	// closure per call would be a heap allocation per batch), so its
	// arguments live here (one reader per queue).
	rxN   int
	rxK   int
	rxErr error
	rxFn  func(fd uintptr) bool
	// Receive scratch (one reader per queue).
	hdrs  []unix.Mmsghdr
	iovs  []unix.Iovec
	names []unix.RawSockaddrInet6
	oob   []byte
}

// oobPerMsg holds the IPv6 ancillary data: pktinfo, hop limit, tclass.
var oobPerMsg = unix.CmsgSpace(unix.SizeofInet6Pktinfo) + 2*unix.CmsgSpace(4)

// NewKernelWire opens the sockets. It needs CAP_NET_RAW and port 4791 free
// (no kernel rxe device in this network namespace).
func NewKernelWire(cfg KernelWireConfig) (w *KernelWire, err error) {
	if cfg.SocketBuffer == 0 {
		cfg.SocketBuffer = 8 << 20
	}
	w = &KernelWire{closedFlag: make(chan struct{})}
	made := w // a failing return sets w to nil
	defer func() {
		if err != nil {
			_ = made.Close()
		}
	}()
	if w.tx4, err = openTx(unix.AF_INET, cfg.SocketBuffer, w.closedFlag); err != nil {
		return nil, fmt.Errorf("kernel wire: ipv4 send socket: %w", err)
	}
	if err := bindToDevice(w.tx4.fd, cfg.Interface); err != nil {
		return nil, err
	}
	rx4, err := openRaw(unix.AF_INET, unix.IPPROTO_UDP, cfg.SocketBuffer)
	if err != nil {
		return nil, fmt.Errorf("kernel wire: ipv4 receive socket: %w", err)
	}
	w.rx = append(w.rx, rx4)
	if err := bindToDevice(rx4.fd, cfg.Interface); err != nil {
		return nil, err
	}
	if err := mmsg.AttachFilter(rx4.fd, filterIPv4RoCE()); err != nil {
		return nil, fmt.Errorf("kernel wire: ipv4 filter: %w", err)
	}
	if err := w.sink(unix.AF_INET); err != nil {
		return nil, err
	}
	if !cfg.DisableIPv6 {
		if w.tx6, err = openTx(unix.AF_INET6, cfg.SocketBuffer, w.closedFlag); err != nil {
			return nil, fmt.Errorf("kernel wire: ipv6 send socket: %w", err)
		}
		if err := bindToDevice(w.tx6.fd, cfg.Interface); err != nil {
			return nil, err
		}
		rx6, err := openRaw(unix.AF_INET6, unix.IPPROTO_UDP, cfg.SocketBuffer)
		if err != nil {
			return nil, fmt.Errorf("kernel wire: ipv6 receive socket: %w", err)
		}
		w.rx = append(w.rx, rx6)
		if err := bindToDevice(rx6.fd, cfg.Interface); err != nil {
			return nil, err
		}
		if err := mmsg.AttachFilter(rx6.fd, filterIPv6RoCE()); err != nil {
			return nil, fmt.Errorf("kernel wire: ipv6 filter: %w", err)
		}
		for _, opt := range []int{unix.IPV6_RECVPKTINFO, unix.IPV6_RECVHOPLIMIT, unix.IPV6_RECVTCLASS} {
			if err := unix.SetsockoptInt(rx6.fd, unix.IPPROTO_IPV6, opt, 1); err != nil {
				return nil, fmt.Errorf("kernel wire: ipv6 receive option %d: %w", opt, err)
			}
		}
		if err := w.sink(unix.AF_INET6); err != nil {
			return nil, err
		}
	}
	for _, r := range w.rx {
		r.initRecv(BatchSize)
	}
	w.scratch.New = func() any { return newTxScratch() }
	return w, nil
}

func openRaw(family, proto, buf int) (*rawSock, error) {
	fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, err
	}
	mmsg.SetBuffers(fd, buf)
	f := os.NewFile(uintptr(fd), fmt.Sprintf("roce-raw-%d-%d", family, proto))
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	s := &rawSock{fd: fd, file: f, rc: rc, v6: family == unix.AF_INET6}
	s.rxFn = s.recvReady
	return s, nil
}

// sink binds a UDP socket to port 4791 that drops everything it gets.
// bindToDevice binds fd to the network device dev (no-op if dev is "").
func bindToDevice(fd int, dev string) error {
	if dev == "" {
		return nil
	}
	if err := unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE, dev); err != nil {
		return fmt.Errorf("kernel wire: bind to device %s: %w", dev, err)
	}
	return nil
}

func (w *KernelWire) sink(family int) error {
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return fmt.Errorf("kernel wire: udp %d socket: %w", roce.UDPPort, err)
	}
	w.sinks = append(w.sinks, fd)
	if err := mmsg.AttachFilter(fd, []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}); err != nil {
		return fmt.Errorf("kernel wire: udp %d drop filter: %w", roce.UDPPort, err)
	}
	var sa unix.Sockaddr = &unix.SockaddrInet4{Port: roce.UDPPort}
	if family == unix.AF_INET6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); err != nil {
			return fmt.Errorf("kernel wire: v6only: %w", err)
		}
		sa = &unix.SockaddrInet6{Port: roce.UDPPort}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return fmt.Errorf("kernel wire: bind udp %d (is a kernel rxe device or another fabric using it?): %w", roce.UDPPort, err)
	}
	return nil
}

// filterIPv4RoCE accepts unfragmented IPv4 datagrams to UDP port 4791
// (raw IPv4 sockets see the packet from the IP header on).
func filterIPv4RoCE() []unix.SockFilter {
	return []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 6},               // flags + fragment offset
		{Code: unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K, Jt: 4, K: 0x3fff}, // MF or offset: drop
		{Code: unix.BPF_LDX | unix.BPF_B | unix.BPF_MSH, K: 0},              // X = IHL*4
		{Code: unix.BPF_LD | unix.BPF_H | unix.BPF_IND, K: 2},               // UDP dst port
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jf: 1, K: roce.UDPPort},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0xffffffff},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}
}

// filterIPv6RoCE accepts datagrams to UDP port 4791 (raw IPv6 sockets see
// the packet from the transport header on).
func filterIPv6RoCE() []unix.SockFilter {
	return []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 2},
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jf: 1, K: roce.UDPPort},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0xffffffff},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0},
	}
}

// Queues returns the number of receive sockets.
func (w *KernelWire) Queues() int { return len(w.rx) }

// Close closes every socket; Receive calls return.
func (w *KernelWire) Close() error {
	w.closeOnce.Do(func() {
		close(w.closedFlag)
		closeTx(w.tx4, w.tx6)
		for _, s := range w.rx {
			s.file.Close()
		}
		for _, fd := range w.sinks {
			unix.Close(fd)
		}
	})
	return nil
}

// txScratch holds the headers of one Transmit call.
type txScratch struct {
	hdrs   []unix.Mmsghdr
	iovs   []unix.Iovec
	names4 []unix.RawSockaddrInet4
	names6 []unix.RawSockaddrInet6
}

func newTxScratch() *txScratch {
	return &txScratch{
		hdrs: make([]unix.Mmsghdr, BatchSize), iovs: make([]unix.Iovec, BatchSize),
		names4: make([]unix.RawSockaddrInet4, BatchSize), names6: make([]unix.RawSockaddrInet6, BatchSize),
	}
}

// fill points the first len(pkts) headers at the datagrams, addressed to
// their destinations; they are all IPv6 (v6) or all IPv4.
func (s *txScratch) fill(pkts []Datagram, v6 bool) {
	for k, d := range pkts {
		b := d.Packet
		h := &s.hdrs[k].Hdr
		*h = unix.Msghdr{}
		mmsg.SetIov(&s.iovs[k], b)
		h.Iov = &s.iovs[k]
		h.SetIovlen(1)
		if v6 {
			sa := &s.names6[k]
			*sa = unix.RawSockaddrInet6{Family: unix.AF_INET6}
			copy(sa.Addr[:], b[24:40])
			mmsg.SetName6(h, sa)
		} else {
			sa := &s.names4[k]
			*sa = unix.RawSockaddrInet4{Family: unix.AF_INET}
			copy(sa.Addr[:], b[16:20])
			mmsg.SetName4(h, sa)
		}
	}
}

// Transmit sends the datagrams with sendmmsg, one call per run of the
// same IP version.
func (w *KernelWire) Transmit(pkts []Datagram) (int, error) {
	s := w.scratch.Get().(*txScratch)
	defer w.scratch.Put(s)
	sent := 0
	for sent < len(pkts) {
		v6 := len(pkts[sent].Packet) > 0 && pkts[sent].Packet[0]>>4 == 6
		sock := w.tx4
		if v6 {
			sock = w.tx6
		}
		if sock == nil {
			return sent, fmt.Errorf("kernel wire: ipv6 disabled: %w", hostverbs.ErrNotSupported)
		}
		// The run of datagrams of this version.
		k := 0
		for sent+k < len(pkts) && k < len(s.hdrs) {
			b := pkts[sent+k].Packet
			if len(b) < roce.IPv4HeaderSize || (b[0]>>4 == 6) != v6 || (v6 && len(b) < roce.IPv6HeaderSize) {
				break
			}
			k++
		}
		s.fill(pkts[sent:sent+k], v6)
		if k == 0 {
			return sent, fmt.Errorf("kernel wire: malformed datagram: %w", hostverbs.ErrInvalid)
		}
		n, err := sock.sendmmsg(s.hdrs[:k])
		sent += n
		if err != nil {
			if errors.Is(err, unix.EMSGSIZE) {
				return sent, fmt.Errorf("kernel wire: %w", ErrOversize)
			}
			return sent, fmt.Errorf("kernel wire: sendmmsg: %w", err)
		}
	}
	return sent, nil
}

func (s *rawSock) recvReady(fd uintptr) bool {
	for {
		s.rxN, s.rxErr = mmsg.RecvMmsg(int(fd), s.hdrs[:s.rxK])
		if s.rxErr == unix.EINTR {
			continue
		}
		return s.rxErr != unix.EAGAIN
	}
}

func (s *rawSock) initRecv(n int) {
	s.hdrs = make([]unix.Mmsghdr, n)
	s.iovs = make([]unix.Iovec, n)
	s.names = make([]unix.RawSockaddrInet6, n)
	if s.v6 {
		s.oob = make([]byte, n*oobPerMsg)
	}
}

// Receive reads a batch from queue's socket.
func (w *KernelWire) Receive(ctx context.Context, queue int, bufs, out [][]byte) (int, error) {
	if queue < 0 || queue >= len(w.rx) {
		return 0, fmt.Errorf("kernel wire: no receive queue %d: %w", queue, hostverbs.ErrInvalid)
	}
	s := w.rx[queue]
	k := w.prepareRecv(s, bufs)
	s.rxK = k
	err := s.rc.Read(s.rxFn)
	n, rerr := s.rxN, s.rxErr
	if err != nil {
		return 0, waitError("kernel wire", w.closedFlag, err)
	}
	if rerr != nil {
		return 0, fmt.Errorf("kernel wire: recvmmsg: %w", rerr)
	}
	w.finishRecv(s, bufs, out, n)
	return n, nil
}

// prepareRecv points the receive headers at bufs.
func (w *KernelWire) prepareRecv(s *rawSock, bufs [][]byte) int {
	k := min(len(bufs), len(s.hdrs))
	off := 0
	if s.v6 {
		off = roce.IPv6HeaderSize // room for the rebuilt IPv6 header
	}
	for i := range k {
		h := &s.hdrs[i].Hdr
		*h = unix.Msghdr{}
		mmsg.SetIov(&s.iovs[i], bufs[i][off:])
		h.Iov = &s.iovs[i]
		h.SetIovlen(1)
		mmsg.SetName6(h, &s.names[i])
		if s.v6 {
			oob := s.oob[i*oobPerMsg : (i+1)*oobPerMsg]
			h.Control = &oob[0]
			h.SetControllen(len(oob))
		}
	}
	return k
}

// finishRecv cuts the n datagrams received to their lengths.
func (w *KernelWire) finishRecv(s *rawSock, bufs, out [][]byte, n int) {
	for i := range n {
		l := int(s.hdrs[i].Len)
		if s.v6 {
			l = s.rebuildIPv6(bufs[i], i, l)
		}
		out[i] = bufs[i][:l]
	}
}

// TryReceive is Receive without waiting.
func (w *KernelWire) TryReceive(queue int, bufs, out [][]byte) (int, error) {
	if queue < 0 || queue >= len(w.rx) {
		return 0, fmt.Errorf("kernel wire: no receive queue %d: %w", queue, hostverbs.ErrInvalid)
	}
	s := w.rx[queue]
	k := w.prepareRecv(s, bufs)
	n, err := mmsg.RecvMmsg(s.fd, s.hdrs[:k])
	if err == unix.EAGAIN || err == unix.EINTR {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("kernel wire: recvmmsg: %w", err)
	}
	w.finishRecv(s, bufs, out, n)
	return n, nil
}

// rebuildIPv6 writes the IPv6 header of datagram i in front of its UDP
// payload and returns the datagram length (0 if the kernel did not report
// what the header needs).
func (s *rawSock) rebuildIPv6(b []byte, i, n int) int {
	h := &s.hdrs[i].Hdr
	src := &s.names[i]
	var dst [16]byte
	var hop, tclass uint8
	haveDst := false
	mmsg.Cmsgs(s.oob[i*oobPerMsg:i*oobPerMsg+int(h.Controllen)], func(level, typ int32, data []byte) {
		if level != unix.IPPROTO_IPV6 {
			return
		}
		switch {
		case typ == unix.IPV6_PKTINFO && len(data) >= unix.SizeofInet6Pktinfo:
			copy(dst[:], data[:16])
			haveDst = true
		case typ == unix.IPV6_HOPLIMIT && len(data) >= 4:
			hop = uint8(binary.NativeEndian.Uint32(data))
		case typ == unix.IPV6_TCLASS && len(data) >= 4:
			tclass = uint8(binary.NativeEndian.Uint32(data))
		}
	})
	if !haveDst || src.Family != unix.AF_INET6 {
		return 0
	}
	hdr := b[:roce.IPv6HeaderSize]
	binary.BigEndian.PutUint32(hdr[0:], 6<<28|uint32(tclass)<<20)
	binary.BigEndian.PutUint16(hdr[4:], uint16(n))
	hdr[6] = unix.IPPROTO_UDP
	hdr[7] = hop
	copy(hdr[8:24], src.Addr[:])
	copy(hdr[24:40], dst[:])
	return roce.IPv6HeaderSize + n
}
