package backend

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Addresses in use on the fabric. In IP mode a GID a guest binds becomes a
// host address on the fabric netdev, and with it a local route: the host's
// own traffic to that address goes to the host, and the kernel answers ARP
// and ND for it. A guest binding the address of a neighbour (the gateway,
// a storage server) would take it away from the whole host. So before the
// first bind of an address, AddrManager.InUse looks for it on the fabric:
//   - in the fabric netdev's neighbour table, in any state but FAILED and
//     INCOMPLETE (the host has talked to it);
//   - as the gateway of any of the host's routes;
//   - IPv4: by an ARP probe on the fabric netdev (RFC 5227: sender address
//     0.0.0.0, so no neighbour's cache changes), answered by anyone within
//     ARPProbeWait.
//
// IPv6 addresses are checked passively only (neighbour table and routes):
// the manager adds them without DAD, which would hold a new GID tentative
// (unusable) for a second.

// ARPProbeWait is how long an ARP probe waits for an answer, in
// arpProbes probes sent evenly over it.
const ARPProbeWait = 300 * time.Millisecond

const arpProbes = 2

// ErrAddrInUse: an address a guest binds is in use on the fabric.
var ErrAddrInUse = errors.New("in use on the fabric")

// InUse reports why a, not yet one of the manager's addresses, is in use
// on the fabric (wrapping ErrAddrInUse), or nil. An error that is not
// ErrAddrInUse means the check itself failed.
func (m *AddrManager) InUse(a netip.Addr) error {
	a = a.Unmap()
	if m.Owns(a) {
		return nil
	}
	m.mu.Lock()
	link := m.link
	neighs, err := m.h.NeighList(link.Attrs().Index, family(a))
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("neighbours of %s: %w", link.Attrs().Name, err)
	}
	for _, n := range neighs {
		if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a &&
			n.State&(netlink.NUD_FAILED|netlink.NUD_INCOMPLETE) == 0 && n.State != netlink.NUD_NONE {
			return fmt.Errorf("%v: the host's neighbour on %s (%v): %w", a, link.Attrs().Name, n.HardwareAddr, ErrAddrInUse)
		}
	}
	m.mu.Lock()
	routes, err := m.h.RouteListFiltered(family(a), &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("routes: %w", err)
	}
	for _, r := range routes {
		if gw, ok := netip.AddrFromSlice(r.Gw); ok && gw.Unmap() == a {
			return fmt.Errorf("%v: a gateway of the host's routes (%v): %w", a, r.Dst, ErrAddrInUse)
		}
		for _, nh := range r.MultiPath {
			if gw, ok := netip.AddrFromSlice(nh.Gw); ok && gw.Unmap() == a {
				return fmt.Errorf("%v: a gateway of the host's routes (%v): %w", a, r.Dst, ErrAddrInUse)
			}
		}
	}
	// The host's own route to a must not change: a becomes a host address
	// only where the host reaches it directly on the fabric netdev, or
	// not at all. Reached through a gateway, it is a remote host's (a
	// server on another subnet a co-tenant talks to); through another
	// device, it belongs to that network.
	if !a.IsLinkLocalUnicast() {
		m.mu.Lock()
		rs, err := m.h.RouteGet(a.AsSlice())
		m.mu.Unlock()
		if err == nil && len(rs) > 0 {
			r := rs[0]
			if r.LinkIndex != link.Attrs().Index {
				dev := fmt.Sprint(r.LinkIndex)
				m.mu.Lock()
				if l, err := m.h.LinkByIndex(r.LinkIndex); err == nil {
					dev = l.Attrs().Name
				}
				m.mu.Unlock()
				return fmt.Errorf("%v: the host reaches it through %s, not the fabric netdev %s: %w", a, dev, link.Attrs().Name, ErrAddrInUse)
			}
			if gw, ok := netip.AddrFromSlice(r.Gw); ok && gw.IsValid() && !gw.IsUnspecified() {
				return fmt.Errorf("%v: the host reaches it through the gateway %v (a remote network's address): %w", a, gw.Unmap(), ErrAddrInUse)
			}
		}
	}
	if !a.Is4() {
		return nil
	}
	m.mu.Lock()
	cur, err := m.h.LinkByIndex(link.Attrs().Index)
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("fabric netdev %s: %w", link.Attrs().Name, err)
	}
	if cur.Attrs().Flags&net.FlagUp == 0 {
		return nil // down: no neighbour can answer, nor reach the address
	}
	mac, err := arpProbe(cur, a, ARPProbeWait)
	if err != nil {
		return fmt.Errorf("ARP probe for %v on %s: %w", a, link.Attrs().Name, err)
	}
	if mac != nil {
		return fmt.Errorf("%v: answered an ARP probe on %s from %v: %w", a, link.Attrs().Name, mac, ErrAddrInUse)
	}
	return nil
}

func family(a netip.Addr) int {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// arpPacket is an Ethernet/IPv4 ARP packet (RFC 826), 28 bytes.
func arpPacket(op uint16, sha net.HardwareAddr, spa netip.Addr, tpa netip.Addr) []byte {
	b := make([]byte, 28)
	binary.BigEndian.PutUint16(b[0:], 1)      // hardware: Ethernet
	binary.BigEndian.PutUint16(b[2:], 0x0800) // protocol: IPv4
	b[4], b[5] = 6, 4
	binary.BigEndian.PutUint16(b[6:], op)
	copy(b[8:14], sha)
	s4 := spa.As4()
	copy(b[14:18], s4[:])
	t4 := tpa.As4()
	copy(b[24:28], t4[:])
	return b
}

// parseARP returns the operation and sender of an Ethernet/IPv4 ARP
// packet; ok is false for anything else.
func parseARP(b []byte) (op uint16, sha net.HardwareAddr, spa netip.Addr, ok bool) {
	if len(b) < 28 || binary.BigEndian.Uint16(b[0:]) != 1 || binary.BigEndian.Uint16(b[2:]) != 0x0800 || b[4] != 6 || b[5] != 4 {
		return 0, nil, netip.Addr{}, false
	}
	return binary.BigEndian.Uint16(b[6:]), net.HardwareAddr(append([]byte(nil), b[8:14]...)), netip.AddrFrom4([4]byte(b[14:18])), true
}

// arpProbe sends RFC 5227 probes for a on link and returns the hardware
// address of whoever claims a within wait (an ARP reply from a, or another
// host's probe for a), or nil.
func arpProbe(link netlink.Link, a netip.Addr, wait time.Duration) (net.HardwareAddr, error) {
	attrs := link.Attrs()
	if len(attrs.HardwareAddr) != 6 {
		return nil, nil // not Ethernet (a tun, a wireguard link): no ARP
	}
	proto := int(htons(unix.ETH_P_ARP))
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, proto)
	if err != nil {
		return nil, fmt.Errorf("packet socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ARP), Ifindex: attrs.Index}); err != nil {
		return nil, fmt.Errorf("bind to %s: %w", attrs.Name, err)
	}
	bcast := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ARP), Ifindex: attrs.Index, Halen: 6,
		Addr: [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}}
	probe := arpPacket(1, attrs.HardwareAddr, netip.IPv4Unspecified(), a)
	buf := make([]byte, 128)
	start := time.Now()
	for i := range arpProbes {
		if err := unix.Sendto(fd, probe, 0, bcast); err != nil {
			return nil, fmt.Errorf("send: %w", err)
		}
		until := start.Add(wait * time.Duration(i+1) / arpProbes)
		for {
			left := time.Until(until)
			if left <= 0 {
				break
			}
			n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, int(left.Milliseconds())+1)
			if err != nil && !errors.Is(err, unix.EINTR) {
				return nil, fmt.Errorf("poll: %w", err)
			}
			if n <= 0 {
				continue
			}
			for {
				k, from, err := unix.Recvfrom(fd, buf, 0)
				if errors.Is(err, unix.EAGAIN) {
					break
				}
				if err != nil {
					return nil, fmt.Errorf("receive: %w", err)
				}
				if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
					continue // our own probe
				}
				op, sha, spa, ok := parseARP(buf[:k])
				switch {
				case !ok || sha.String() == attrs.HardwareAddr.String():
				case op == 2 && spa == a:
					return sha, nil // a reply from the address's holder
				case op == 1 && spa.IsUnspecified() && binary.BigEndian.Uint32(buf[24:28]) == binary.BigEndian.Uint32(a.AsSlice()):
					return sha, nil // another host probing for it at the same time
				case op == 1 && spa == a:
					return sha, nil // its holder asking about someone else
				}
			}
		}
	}
	return nil, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
