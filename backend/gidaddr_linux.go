package backend

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// AddrManager puts the GIDs that guests bind onto a host network device as
// host addresses (/32 or /128, no DAD), so that RoCE v2 traffic for them
// reaches this host's UDP port 4791 and the kernel answers ARP/ND for them
// on the fabric. Addresses are reference-counted (two VMs may bind the same
// link-local GID index on different fabrics, or one VM binds a GID twice) and
// only addresses this manager added are ever removed.
type AddrManager struct {
	h     *netlink.Handle
	link  netlink.Link
	mu    sync.Mutex
	owned map[netip.Addr]int // address -> references; 0 entries are deleted
	// changes counts the addresses added and removed through netlink.
	changes atomic.Uint64
}

// Changes returns how many addresses the manager has added or removed.
func (m *AddrManager) Changes() uint64 { return m.changes.Load() }

// NewAddrManager manages addresses on the named netdev in the current
// network namespace.
func NewAddrManager(netdev string) (*AddrManager, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle: %w", err)
	}
	link, err := h.LinkByName(netdev)
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("fabric netdev %q: %w", netdev, err)
	}
	return &AddrManager{h: h, link: link, owned: map[netip.Addr]int{}}, nil
}

func hostPrefix(a netip.Addr) *net.IPNet {
	bits := 128
	if a.Is4() {
		bits = 32
	}
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(bits, bits)}
}

// Add adds a (reference to) address a.
func (m *AddrManager) Add(a netip.Addr) error {
	a = a.Unmap()
	m.mu.Lock()
	defer m.mu.Unlock()
	if n, ok := m.owned[a]; ok {
		m.owned[a] = n + 1
		return nil
	}
	addr := &netlink.Addr{IPNet: hostPrefix(a), Flags: unix.IFA_F_NODAD}
	err := m.h.AddrAdd(m.link, addr)
	switch {
	case errors.Is(err, unix.EEXIST):
		// Configured by someone else: use it, never remove it.
		return nil
	case err != nil:
		return fmt.Errorf("add %v to %s: %w", a, m.link.Attrs().Name, err)
	}
	m.changes.Add(1)
	m.owned[a] = 1
	return nil
}

// Remove drops a reference to a, deleting the address with the last one.
func (m *AddrManager) Remove(a netip.Addr) error {
	a = a.Unmap()
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.owned[a]
	if !ok {
		return nil
	}
	if n > 1 {
		m.owned[a] = n - 1
		return nil
	}
	delete(m.owned, a)
	m.changes.Add(1)
	err := m.h.AddrDel(m.link, &netlink.Addr{IPNet: hostPrefix(a)})
	if err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
		return fmt.Errorf("remove %v from %s: %w", a, m.link.Attrs().Name, err)
	}
	return nil
}

// Owns reports whether this manager added a (for a guest's GID).
func (m *AddrManager) Owns(a netip.Addr) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.owned[a.Unmap()]
	return ok
}

// SubnetEdges returns the network and broadcast addresses of the IPv4
// subnets on the netdev: those of its addresses and of routes through it
// (a fabric netdev may carry only a route, its addresses being guests').
func (m *AddrManager) SubnetEdges() (map[netip.Addr]struct{}, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	routes, err := m.h.RouteList(m.link, unix.AF_INET)
	if err != nil {
		return nil, fmt.Errorf("routes of %s: %w", m.link.Attrs().Name, err)
	}
	out := make(map[netip.Addr]struct{}, 2*len(routes))
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if !ok {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		if n, b, ok := subnetEdges(netip.PrefixFrom(a, ones)); ok {
			out[n], out[b] = struct{}{}, struct{}{}
		}
	}
	return out, nil
}

// Owned returns the addresses this manager has added.
func (m *AddrManager) Owned() []netip.Addr {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]netip.Addr, 0, len(m.owned))
	for a := range m.owned {
		out = append(out, a)
	}
	return out
}

// Adopt takes as its own, unreferenced, the addresses of addrs that are on
// the netdev: those a previous daemon added for guests' GIDs (the state
// directory lists them). The guests' GIDs replayed into their devices
// reference them again; DropUnreferenced removes the rest.
func (m *AddrManager) Adopt(addrs []netip.Addr) (int, error) {
	have, err := m.h.AddrList(m.link, netlink.FAMILY_ALL)
	if err != nil {
		return 0, fmt.Errorf("addresses of %s: %w", m.link.Attrs().Name, err)
	}
	on := map[netip.Addr]bool{}
	for _, a := range have {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			on[ip.Unmap()] = true
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, a := range addrs {
		a = a.Unmap()
		if _, ok := m.owned[a]; !ok && on[a] {
			m.owned[a] = 0
			n++
		}
	}
	return n, nil
}

// DropUnreferenced removes the adopted addresses no GID took again.
func (m *AddrManager) DropUnreferenced() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for a, n := range m.owned {
		if n > 0 {
			continue
		}
		delete(m.owned, a)
		m.changes.Add(1)
		_ = m.h.AddrDel(m.link, &netlink.Addr{IPNet: hostPrefix(a)})
	}
}

// Leave closes the manager and leaves its addresses in place, for the
// next daemon to adopt (a restart or hand-over keeps guests' GIDs).
func (m *AddrManager) Leave() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.owned = map[netip.Addr]int{}
	m.h.Close()
}

// Close removes every address this manager added.
func (m *AddrManager) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var first error
	for a := range m.owned {
		if err := m.h.AddrDel(m.link, &netlink.Addr{IPNet: hostPrefix(a)}); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) && first == nil {
			first = fmt.Errorf("remove %v: %w", a, err)
		}
		delete(m.owned, a)
	}
	m.h.Close()
	return first
}

// checkARPIgnore warns when the host would answer ARP for guest GIDs on
// every interface. IP mode makes each bound IPv4 GID a host address; with
// Linux's default arp_ignore=0 the host then also claims the guest's IP on
// the VM-facing bridge, stealing the guest's own traffic. arp_ignore=1
// confines the replies to the fabric netdev, where the address lives.
func checkARPIgnore(log *slog.Logger) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/conf/all/arp_ignore")
	if err != nil {
		return
	}
	if v := strings.TrimSpace(string(b)); v == "0" {
		log.Warn("net.ipv4.conf.all.arp_ignore is 0: the host will answer ARP for guest GIDs on every interface, " +
			"including the VMs' own network; set it to 1 (sysctl -w net.ipv4.conf.all.arp_ignore=1)")
	}
}
