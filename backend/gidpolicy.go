package backend

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"strings"
	"sync"
	"syscall"
)

// GID ownership. A guest names its GIDs itself (CREATE_BIND carries the
// addresses of its vmxnet3), so every bind is checked against the VM's
// policy before the fabric sees it:
//
//   - never: unspecified, loopback, multicast, limited broadcast, 0/8 and
//     240/4, IPv4 link-local 169.254/16 (cloud metadata and other
//     link-local services live there), IPv4-compatible ::/96;
//   - IPv6 link-local (fe80::/10) only as the EUI-64 address of the VM's
//     own MAC, the GID the stock driver binds first;
//   - every other GID must lie in one of the VM's allowed prefixes;
//   - never an address the host holds, or the network or broadcast
//     address of a subnet on any host interface;
//   - never a GID reserved by another VM: a VM's GIDs stay reserved to it
//     from its first bind until it is unregistered, across QEMU restarts
//     and guest reboots.

// PrivateGIDAllow is the IPv4 private ranges and IPv6 unique local
// addresses: the allow list that was the default of L2 and in-process
// fabrics before addresses had to be assigned (issue 23). No fabric uses
// it by default; an operator may declare it as a single-tenant fabric's
// pool (--gid-allow), accepting that any VM may then bind, first come,
// any address in those ranges.
const PrivateGIDAllow = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7"

// GIDAllowNone as the only allow-list item allows no prefix: the VM may
// bind only its own MAC-derived link-local GID.
const GIDAllowNone = "none"

// maxGIDPrefixes bounds an allow list.
const maxGIDPrefixes = 64

// maxReservedGIDs bounds the GIDs reserved to one VM. A VM that needs a
// new one beyond it gives up its least recently bound GID that it does not
// hold now (IPv6 temporary addresses rotate).
const maxReservedGIDs = 64

// ErrBadGIDPolicy: a GID allow list does not parse.
var ErrBadGIDPolicy = errors.New("bad GID allow list")

// ErrGIDRefused: a VM may not bind a GID (wrapped with the reason).
var ErrGIDRefused = errors.New("GID refused")

// ParseGIDAllow parses an allow list: CIDR prefixes or single addresses,
// given as separate items and/or comma-separated within one. No items
// returns nil (use the default); the single item "none" returns an empty,
// non-nil list. Prefixes are canonicalised (host bits cleared, IPv4-mapped
// IPv6 prefixes turned into IPv4 ones).
func ParseGIDAllow(items ...string) ([]netip.Prefix, error) {
	var parts []string
	for _, it := range items {
		for _, p := range strings.Split(it, ",") {
			parts = append(parts, strings.TrimSpace(p))
		}
	}
	if len(parts) == 0 {
		return nil, nil
	}
	if len(parts) == 1 && parts[0] == GIDAllowNone {
		return []netip.Prefix{}, nil
	}
	if len(parts) > maxGIDPrefixes {
		return nil, fmt.Errorf("%d prefixes, at most %d: %w", len(parts), maxGIDPrefixes, ErrBadGIDPolicy)
	}
	out := make([]netip.Prefix, 0, len(parts))
	for _, p := range parts {
		pf, err := parseGIDPrefix(p)
		if err != nil {
			return nil, err
		}
		out = append(out, pf)
	}
	return out, nil
}

func parseGIDPrefix(s string) (netip.Prefix, error) {
	var pf netip.Prefix
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return pf, fmt.Errorf("%q: %w", s, ErrBadGIDPolicy)
		}
		pf = p
	} else {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return pf, fmt.Errorf("%q: not a prefix or address: %w", s, ErrBadGIDPolicy)
		}
		pf = netip.PrefixFrom(a, a.BitLen())
	}
	if a := pf.Addr(); a.Is4In6() {
		if pf.Bits() < 96 {
			return netip.Prefix{}, fmt.Errorf("%q: an IPv4-mapped prefix needs at least 96 bits: %w", s, ErrBadGIDPolicy)
		}
		pf = netip.PrefixFrom(a.Unmap(), pf.Bits()-96)
	}
	return pf.Masked(), nil
}

// FormatGIDAllow is the inverse of ParseGIDAllow (for an empty list,
// "none"), as status reports allow lists.
func FormatGIDAllow(ps []netip.Prefix) []string {
	if len(ps) == 0 {
		return []string{GIDAllowNone}
	}
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}

var (
	v4ThisNet    = netip.MustParsePrefix("0.0.0.0/8")
	v4Loopback   = netip.MustParsePrefix("127.0.0.0/8")
	v4LinkLocal  = netip.MustParsePrefix("169.254.0.0/16")
	v4Multicast  = netip.MustParsePrefix("224.0.0.0/4")
	v4Reserved   = netip.MustParsePrefix("240.0.0.0/4") // includes 255.255.255.255
	v6Compatible = netip.MustParsePrefix("::/96")
)

// staticGIDReason returns why no VM may ever bind a (unmapped), or "".
func staticGIDReason(a netip.Addr) string {
	switch {
	case !a.IsValid() || a.IsUnspecified():
		return "unspecified address"
	case a.IsLoopback() || v4Loopback.Contains(a):
		return "loopback address"
	case a.IsMulticast() || v4Multicast.Contains(a):
		return "multicast address"
	case a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "broadcast address"
	case v4ThisNet.Contains(a), v4Reserved.Contains(a), v6Compatible.Contains(a):
		return "reserved address"
	case v4LinkLocal.Contains(a):
		return "IPv4 link-local address (link-local services such as 169.254.169.254)"
	}
	return ""
}

// linkLocalGID is the fe80::/64 EUI-64 address of mac.
func linkLocalGID(mac net.HardwareAddr) netip.Addr {
	var b [16]byte
	b[0], b[1] = 0xfe, 0x80
	g := NodeGUID(mac)
	for i := range 8 {
		b[15-i] = byte(g >> (8 * i))
	}
	return netip.AddrFrom16(b)
}

// gidPolicy is one VM's static rules.
type gidPolicy struct {
	allow     []netip.Prefix
	linkLocal netip.Addr // the only fe80::/10 GID the VM may bind
	// keepReserved: a GID outside allow that is reserved to the VM
	// already is allowed (a VM on the default, none, keeps what
	// an earlier daemon's default let it reserve).
	keepReserved bool
}

// errNotAssigned: a GID outside the VM's allowed prefixes.
var errNotAssigned = errors.New("not assigned to the VM")

// check applies the static rules and the allow list to a (unmapped).
func (p gidPolicy) check(a netip.Addr) error {
	if r := staticGIDReason(a); r != "" {
		return fmt.Errorf("%v: %s: %w", a, r, ErrGIDRefused)
	}
	if a.Is6() && a.IsLinkLocalUnicast() {
		if a == p.linkLocal {
			return nil
		}
		return fmt.Errorf("%v: link-local GID other than the VM's own %v: %w", a, p.linkLocal, ErrGIDRefused)
	}
	for _, pf := range p.allow {
		if pf.Contains(a) {
			return nil
		}
	}
	if len(p.allow) == 0 {
		return fmt.Errorf("%v: the VM is assigned no addresses (register it with gid-allow=PREFIX, or declare the fabric's pool with --gid-allow): %w (%w)", a, ErrGIDRefused, errNotAssigned)
	}
	return fmt.Errorf("%v: outside the VM's allowed prefixes %v: %w (%w)", a, FormatGIDAllow(p.allow), ErrGIDRefused, errNotAssigned)
}

// Why the host's own addresses are refused (hostAddrs' values).
const (
	reasonHostAddr   = "an address of the host"
	reasonHostSubnet = "the network or broadcast address of one of the host's subnets"
)

// hostAddrs lists what the host holds in its network namespace: every
// interface address, and the network and broadcast addresses of its IPv4
// subnets, each with the reason a guest may not bind it.
func hostAddrs() (map[netip.Addr]string, error) {
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("host addresses: %w", err)
	}
	out := make(map[netip.Addr]string, 3*len(ifaddrs))
	for _, ia := range ifaddrs {
		n, ok := ia.(*net.IPNet)
		if !ok {
			continue
		}
		a, ok := netip.AddrFromSlice(n.IP)
		if !ok {
			continue
		}
		a = a.Unmap()
		ones, bits := n.Mask.Size()
		if a.Is4() && bits == 32 {
			if nw, bc, ok := subnetEdges(netip.PrefixFrom(a, ones)); ok {
				out[nw], out[bc] = reasonHostSubnet, reasonHostSubnet
			}
		}
		out[a] = reasonHostAddr
	}
	return out, nil
}

// subnetEdges returns the network and broadcast addresses of an IPv4
// prefix shorter than /31 (ok false otherwise).
func subnetEdges(pf netip.Prefix) (network, broadcast netip.Addr, ok bool) {
	if !pf.Addr().Is4() || pf.Bits() < 0 || pf.Bits() >= 31 {
		return netip.Addr{}, netip.Addr{}, false
	}
	pf = pf.Masked()
	b := pf.Addr().As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]) | ^uint32(0)>>pf.Bits()
	return pf.Addr(), netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}), true
}

// gidOwners reserves GIDs to VMs across the daemon: a GID one VM has
// bound is refused to every other VM until the first is unregistered.
type gidOwners struct {
	mu    sync.Mutex
	seq   uint64
	owner map[netip.Addr]*gidReservation
}

type gidReservation struct {
	vm   string
	used uint64 // seq of the last bind
}

func newGIDOwners() *gidOwners { return &gidOwners{owner: map[netip.Addr]*gidReservation{}} }

// reserve records a as vm's, refusing it if another VM holds it. At the
// per-VM cap it frees vm's least recently bound GID that holding(a) says
// the VM no longer holds, or refuses.
// It reports whether the set of reservations changed.
func (o *gidOwners) reserve(vm string, a netip.Addr, holding func(netip.Addr) bool) (bool, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.seq++
	if r := o.owner[a]; r != nil {
		if r.vm != vm {
			return false, fmt.Errorf("%v: reserved by another VM: %w (%w)", a, ErrGIDRefused, syscall.EBUSY)
		}
		r.used = o.seq
		return false, nil
	}
	n := 0
	var victim netip.Addr
	var oldest uint64
	for ga, r := range o.owner {
		if r.vm != vm {
			continue
		}
		n++
		if !holding(ga) && (!victim.IsValid() || r.used < oldest) {
			victim, oldest = ga, r.used
		}
	}
	if n >= maxReservedGIDs {
		if !victim.IsValid() {
			return false, fmt.Errorf("%v: the VM holds %d GIDs already: %w", a, n, ErrGIDRefused)
		}
		delete(o.owner, victim)
	}
	o.owner[a] = &gidReservation{vm: vm, used: o.seq}
	return true, nil
}

// holds reports whether a is reserved to vm.
func (o *gidOwners) holds(vm string, a netip.Addr) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	r := o.owner[a]
	return r != nil && r.vm == vm
}

// release frees every GID reserved to vm; it reports whether there were any.
func (o *gidOwners) release(vm string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := len(o.owner)
	for a, r := range o.owner {
		if r.vm == vm {
			delete(o.owner, a)
		}
	}
	return len(o.owner) != n
}

// snapshot returns the reservations by VM, each VM's GIDs least recently
// bound first.
func (o *gidOwners) snapshot() map[string][]netip.Addr {
	o.mu.Lock()
	defer o.mu.Unlock()
	type entry struct {
		a    netip.Addr
		used uint64
	}
	by := map[string][]entry{}
	for a, r := range o.owner {
		by[r.vm] = append(by[r.vm], entry{a, r.used})
	}
	out := make(map[string][]netip.Addr, len(by))
	for vm, es := range by {
		sort.Slice(es, func(i, j int) bool { return es[i].used < es[j].used })
		for _, e := range es {
			out[vm] = append(out[vm], e.a)
		}
	}
	return out
}

// adopt takes the reservations a previous daemon recorded (snapshot):
// each GID goes to its VM unless another VM holds it already, at most
// maxReservedGIDs a VM (the most recently bound kept). It returns how many
// it took.
func (o *gidOwners) adopt(res map[string][]netip.Addr) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for vm, as := range res {
		if CheckVMName(vm) != nil {
			continue
		}
		if len(as) > maxReservedGIDs {
			as = as[len(as)-maxReservedGIDs:]
		}
		for _, a := range as {
			if !a.IsValid() || o.owner[a] != nil {
				continue
			}
			o.seq++
			o.owner[a] = &gidReservation{vm: vm, used: o.seq}
			n++
		}
	}
	return n
}

// reserved lists vm's reserved GIDs.
func (o *gidOwners) reserved(vm string) []netip.Addr {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []netip.Addr
	for a, r := range o.owner {
		if r.vm == vm {
			out = append(out, a)
		}
	}
	return out
}
