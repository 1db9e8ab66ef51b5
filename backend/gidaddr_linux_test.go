package backend

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// inNewNetns runs fn on a fresh OS thread in a new, anonymous network
// namespace that vanishes with the thread.
func inNewNetns(t *testing.T, fn func()) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for network namespaces")
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread dies with the namespace
		ns, err := netns.New()
		if err != nil {
			t.Errorf("new netns: %v", err)
			return
		}
		defer ns.Close()
		fn()
	}()
	<-done
}

func TestAddrManagerAddsRefcountsAndRemoves(t *testing.T) {
	inNewNetns(t, func() {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}
		if err := netlink.LinkAdd(veth); err != nil {
			t.Errorf("veth: %v", err)
			return
		}
		m, err := NewAddrManager("fab0")
		if !assert.NoError(t, err) {
			return
		}
		v4 := netip.MustParseAddr("::ffff:10.77.0.1") // a GID: added unmapped
		v6 := netip.MustParseAddr("fe80::5054:ff:fe77:1")
		require.NoError(t, m.Add(v4))
		require.NoError(t, m.Add(v4))
		require.NoError(t, m.Add(v6))
		has := func(a string) bool {
			link, _ := netlink.LinkByName("fab0")
			addrs, _ := netlink.AddrList(link, unix.AF_UNSPEC)
			for _, x := range addrs {
				if x.IP.String() == a {
					return true
				}
			}
			return false
		}
		assert.True(t, has("10.77.0.1"))
		assert.True(t, has("fe80::5054:ff:fe77:1"))
		require.NoError(t, m.Remove(v4))
		assert.True(t, has("10.77.0.1"), "one reference left")
		require.NoError(t, m.Remove(v4))
		assert.False(t, has("10.77.0.1"))

		// Someone else's address is used but never removed.
		link, _ := netlink.LinkByName("fab0")
		other, _ := netlink.ParseAddr("10.0.0.9/24")
		require.NoError(t, netlink.AddrAdd(link, other))
		require.NoError(t, m.Add(netip.MustParseAddr("10.0.0.9")))
		require.NoError(t, m.Close())
		assert.True(t, has("10.0.0.9"))
		assert.False(t, has("fe80::5054:ff:fe77:1"), "Close removes what it added")

		_, err = NewAddrManager("nosuchdev")
		assert.Error(t, err)
	})
}

// ipModeVM is a daemon in IP mode on fab0 (in the caller's namespace)
// with VM vm1 registered, and a connection of vm1 to drive its GID hooks
// directly; nil (and a test error) if the daemon could not start.
func ipModeVM(t *testing.T) (*Daemon, *vmSession, *vmConn) {
	t.Helper()
	pool, err := ParseGIDAllow(PrivateGIDAllow) // the fabric's declared pool
	require.NoError(t, err)
	d, err := New(Config{SocketDir: t.TempDir(), Fabric: FabricConfig{Netdev: "fab0"}, GIDAllow: pool,
		VMs: []VMRequest{{Name: "vm1"}}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if !assert.NoError(t, err) {
		return nil, nil, nil
	}
	return d, d.vms["vm1"], &vmConn{gids: map[int]hostverbs.GIDEntry{}}
}

// TestGIDBindRateBoundsNetlink: in IP mode every GID a guest binds becomes
// a host address. A guest binding and unbinding in a tight loop (here its
// session's hooks, driven directly) changes the host's addresses at most
// twice per bind the per-VM bucket allows, and its GIDs land on the
// netdev only as far as the policy allows.
func TestGIDBindRateBoundsNetlink(t *testing.T) {
	inNewNetns(t, func() {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}
		if err := netlink.LinkAdd(veth); err != nil {
			t.Errorf("veth: %v", err)
			return
		}
		d, s, c := ipModeVM(t)
		if d == nil {
			return
		}
		defer d.close()
		start := time.Now()
		accepted := 0
		for i := range 2000 {
			e := hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.AddrFrom4([4]byte{10, 78, byte(i >> 8), byte(i)})),
				Type: hostverbs.GIDTypeRoCEv2}
			if err := s.checkGID(c, e); err != nil {
				assert.ErrorIs(t, err, syscall.EAGAIN)
				continue
			}
			accepted++
			s.gidChanged(c, 0, e, true)
			s.gidChanged(c, 0, e, false)
		}
		elapsed := time.Since(start)
		changes := d.fabric.addrs.Changes()
		t.Logf("2000 binds in %v: %d accepted, %d netlink address changes", elapsed, accepted, changes)
		assert.GreaterOrEqual(t, accepted, gidBindBurst)
		assert.LessOrEqual(t, float64(changes), 2*(gidBindBurst+gidBindRate*elapsed.Seconds()+1))
		assert.Equal(t, uint64(2*accepted), changes, "each accepted bind added and removed its address")
		assert.Empty(t, d.fabric.addrs.Owned())

		// The policy applies before netlink: nothing forbidden reaches it,
		// including the edges of a subnet routed on the fabric netdev.
		link, err := netlink.LinkByName("fab0")
		if !assert.NoError(t, err) {
			return
		}
		assert.NoError(t, netlink.LinkSetUp(link))
		_, dst, _ := net.ParseCIDR("10.79.0.0/16")
		assert.NoError(t, netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK}))
		time.Sleep(2 * time.Second) // refill the bucket a little: these must fail on policy, not rate
		for _, a := range []string{"127.0.0.9", "224.0.0.9", "169.254.169.254", "8.8.8.8", "10.79.255.255", "10.79.0.0"} {
			e := hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr(a)), Type: hostverbs.GIDTypeRoCEv2}
			err := s.checkGID(c, e)
			assert.ErrorIs(t, err, ErrGIDRefused, a)
			assert.NotErrorIs(t, err, syscall.EAGAIN, a)
		}
		err = s.checkGID(c, hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr("10.79.255.255")), Type: hostverbs.GIDTypeRoCEv2})
		assert.ErrorContains(t, err, "subnet on the fabric netdev")
		assert.Equal(t, changes, d.fabric.addrs.Changes())
	})
}

// TestGIDNeighbourRefused: in IP mode a guest may not bind the address of
// a neighbour on the fabric (issue 23: a guest bound the fabric's
// 10.80.0.254, which became a host address, and the host's route to that
// neighbour moved to lo). The host at 10.80.0.1/24 on fab0; a neighbour at
// 10.80.0.254 in another namespace, unknown to the host until the ARP
// probe finds it; a route via 10.80.0.253 (a gateway nobody answers for)
// and a neighbour entry for 10.80.0.252. Each is refused, the host's route
// to 10.80.0.254 stays on fab0, and a free address is accepted.
func TestGIDNeighbourRefused(t *testing.T) {
	inNewNetns(t, func() {
		fabricPeer(t, "10.80.0.1/24", "10.80.0.254/24")
		link, err := netlink.LinkByName("fab0")
		require.NoError(t, err)
		_, dst, _ := net.ParseCIDR("10.90.0.0/24")
		require.NoError(t, netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: dst, Gw: net.ParseIP("10.80.0.253")}))
		require.NoError(t, netlink.NeighAdd(&netlink.Neigh{LinkIndex: link.Attrs().Index, IP: net.ParseIP("10.80.0.252"),
			HardwareAddr: net.HardwareAddr{2, 0, 0, 0, 0, 0x52}, State: netlink.NUD_REACHABLE}))
		// The veth's carrier comes up with both ends: wait for it so the
		// probe is not lost.
		// (Polled on this thread: it is the one in the namespace.)
		for deadline := time.Now().Add(hangBound); ; time.Sleep(10 * time.Millisecond) {
			l, err := netlink.LinkByName("fab0")
			if err == nil && l.Attrs().OperState == netlink.OperUp {
				break
			}
			if !assert.True(t, time.Now().Before(deadline), "fab0 never came up: %v", err) {
				return
			}
		}

		d, s, c := ipModeVM(t)
		if d == nil {
			return
		}
		defer d.close()
		bind := func(a string) error {
			return s.checkGID(c, hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr(a)), Type: hostverbs.GIDTypeRoCEv2})
		}
		// Another network of the host's, on another device.
		require.NoError(t, netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "mgmt0"}, PeerName: "mgmt1"}))
		mgmt, err := netlink.LinkByName("mgmt0")
		require.NoError(t, err)
		ma, _ := netlink.ParseAddr("10.91.0.1/24")
		require.NoError(t, netlink.AddrAdd(mgmt, ma))
		require.NoError(t, netlink.LinkSetUp(mgmt))
		for a, why := range map[string]string{
			"10.80.0.254": "answered an ARP probe on fab0",
			"10.80.0.253": "a gateway of the host's routes",
			"10.80.0.252": "the host's neighbour on fab0",
			"10.90.0.5":   "through the gateway 10.80.0.253", // a remote server's
			"10.91.0.5":   "through mgmt0",
		} {
			err := bind(a)
			assert.ErrorIs(t, err, ErrGIDRefused, a)
			assert.ErrorContains(t, err, why, a)
		}
		routeDev := func(a string) string {
			rs, err := netlink.RouteGet(net.ParseIP(a))
			if err != nil || len(rs) == 0 {
				return fmt.Sprint(err)
			}
			l, err := netlink.LinkByIndex(rs[0].LinkIndex)
			if err != nil {
				return fmt.Sprint(err)
			}
			return l.Attrs().Name
		}
		assert.Equal(t, "fab0", routeDev("10.80.0.254"), "the host still reaches its neighbour on the fabric")
		assert.Equal(t, "fab0", routeDev("10.90.0.5"), "and the remote network through its gateway")
		assert.Equal(t, "mgmt0", routeDev("10.91.0.5"), "and its other network where it was")
		assert.Empty(t, d.fabric.addrs.Owned(), "nothing was added")

		require.NoError(t, bind("10.80.0.77"), "a free address")
	})
}

// TestAddrManagerAdopt: a manager that leaves its addresses (a crash, a
// hand-over) lets the next one adopt them: owned again, taken by a GID
// bind without being added twice, and those no GID took are removed.
func TestAddrManagerAdopt(t *testing.T) {
	inNewNetns(t, func() {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}
		if err := netlink.LinkAdd(veth); err != nil {
			t.Errorf("veth: %v", err)
			return
		}
		a, b := netip.MustParseAddr("10.77.0.1"), netip.MustParseAddr("10.77.0.2")
		m, err := NewAddrManager("fab0")
		require.NoError(t, err)
		require.NoError(t, m.Add(a))
		require.NoError(t, m.Add(b))
		m.Leave()

		n, err := NewAddrManager("fab0")
		require.NoError(t, err)
		got, err := n.Adopt([]netip.Addr{a, b, netip.MustParseAddr("10.77.0.3")})
		require.NoError(t, err)
		assert.Equal(t, 2, got, "only addresses still on the netdev")
		assert.True(t, n.Owns(a), "adopted: the host does not claim it")
		require.NoError(t, n.Add(a)) // the replayed GID bind
		changes := n.Changes()
		n.DropUnreferenced()
		assert.Equal(t, changes+1, n.Changes(), "b, which no GID took again, is removed")
		assert.True(t, n.Owns(a))
		assert.False(t, n.Owns(b))
		link, _ := netlink.LinkByName("fab0")
		addrs, _ := netlink.AddrList(link, unix.AF_INET)
		var left []string
		for _, x := range addrs {
			left = append(left, x.IP.String())
		}
		assert.Equal(t, []string{"10.77.0.1"}, left)
		require.NoError(t, n.Close())
	})
}

// TestIPModeAssignsNoAddressByDefault: in IP mode, where a guest's GID
// becomes a host address, a VM registered without its own gid-allow on a
// daemon with no declared pool may bind only its own link-local GID (issue
// 23: addresses are assigned, not claimed); its registration's gid-allow
// assigns it addresses.
func TestIPModeAssignsNoAddressByDefault(t *testing.T) {
	inNewNetns(t, func() {
		require.NoError(t, netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}))
		d, err := New(Config{SocketDir: t.TempDir(), Fabric: FabricConfig{Netdev: "fab0"},
			VMs:    []VMRequest{{Name: "vm1"}, {Name: "vm2", GIDAllow: []string{"10.80.0.0/24"}}},
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		defer d.close()
		bind := func(vm, a string) error {
			return d.vms[vm].checkGID(&vmConn{gids: map[int]hostverbs.GIDEntry{}},
				hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr(a)), Type: hostverbs.GIDTypeRoCEv2})
		}
		err = bind("vm1", "10.80.0.5")
		require.ErrorIs(t, err, ErrGIDRefused)
		assert.ErrorContains(t, err, "assigned no addresses")
		own := linkLocalGID(DefaultMAC("vm1")).String()
		require.NoError(t, bind("vm1", own), "its own link-local GID")
		require.NoError(t, bind("vm2", "10.80.0.6"), "an address its registration assigns")
		require.ErrorIs(t, bind("vm2", "10.81.0.6"), ErrGIDRefused, "and no other")
	})
}

// TestDefaultAssignsNoAddress: in-process (and L2) mode too, a VM
// registered without its own gid-allow on a daemon with no declared pool
// binds only its link-local GID, so it cannot take the address of a server
// on another host and receive, in process, the SENDs a co-tenant meant for
// that server (issue 23; before, the default was the private ranges and
// the bind below succeeded). A declared pool is taken first come; a VM's
// own gid-allow assigns.
func TestDefaultAssignsNoAddress(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := New(Config{SocketDir: t.TempDir(), Logger: quiet,
		VMs: []VMRequest{{Name: "evil"}, {Name: "tenant", GIDAllow: []string{"10.80.0.11/32"}}}})
	require.NoError(t, err)
	defer d.close()
	bind := func(d *Daemon, vm, a string) error {
		return d.vms[vm].checkGID(&vmConn{gids: map[int]hostverbs.GIDEntry{}},
			hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr(a)), Type: hostverbs.GIDTypeRoCEv2})
	}
	err = bind(d, "evil", "10.80.0.50") // the remote server a co-tenant talks to
	require.ErrorIs(t, err, ErrGIDRefused)
	assert.ErrorContains(t, err, "assigned no addresses")
	require.ErrorIs(t, bind(d, "evil", "fd00::50"), ErrGIDRefused)
	require.NoError(t, bind(d, "evil", linkLocalGID(DefaultMAC("evil")).String()), "its own link-local GID")
	require.NoError(t, bind(d, "tenant", "10.80.0.11"), "the address its registration assigns")
	require.ErrorIs(t, bind(d, "tenant", "10.80.0.50"), ErrGIDRefused, "and no other")

	pool, err := ParseGIDAllow(PrivateGIDAllow)
	require.NoError(t, err)
	d2, err := New(Config{SocketDir: t.TempDir(), Logger: quiet, GIDAllow: pool, VMs: []VMRequest{{Name: "evil"}}})
	require.NoError(t, err)
	defer d2.close()
	require.NoError(t, bind(d2, "evil", "10.80.0.50"), "a declared pool is the operator's choice: first come")
}

// TestFabricMTUChangeCounted: the ports' active MTU comes from the fabric
// device's MTU at start; a later change is said (a warning and the
// fabric_mtu_changes counter) rather than left to show up as dropped
// frames alone.
func TestFabricMTUChangeCounted(t *testing.T) {
	inNewNetns(t, func() {
		require.NoError(t, netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}))
		d, err := New(Config{SocketDir: t.TempDir(), Fabric: FabricConfig{Netdev: "fab0"},
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		defer d.close()
		assert.Zero(t, d.Status().Counters["fabric_mtu_changes"])
		link, err := netlink.LinkByName("fab0")
		require.NoError(t, err)
		require.NoError(t, netlink.LinkSetMTU(link, 1400))
		require.Eventually(t, func() bool { return d.Status().Counters["fabric_mtu_changes"] == 1 },
			10*time.Second, 10*time.Millisecond, "the change is counted")
		require.NoError(t, netlink.LinkSetUp(link)) // not an MTU change
		time.Sleep(50 * time.Millisecond)
		assert.Equal(t, uint64(1), d.Status().Counters["fabric_mtu_changes"])
	})
}

// TestIPModeDefaultKeepsReservedGIDs: a daemon started in IP mode without
// a declared pool, taking over from one whose default let a VM reserve
// 10.80.0.5 (an upgrade from before the IP-mode default), lets that VM
// bind its reserved GID again (its running guest keeps its address), and
// the GIDs its device journal binds again, but no other address; a VM
// with its own gid-allow gets nothing extra.
func TestIPModeDefaultKeepsReservedGIDs(t *testing.T) {
	inNewNetns(t, func() {
		require.NoError(t, netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}))
		dir := t.TempDir()
		state := filepath.Join(dir, "state")
		for vm, req := range map[string]string{"vm1": `{"name":"vm1"}`, "vm2": `{"name":"vm2","gid_allow":["10.81.0.0/24"]}`} {
			require.NoError(t, os.MkdirAll(filepath.Join(state, vm), 0o700))
			require.NoError(t, os.WriteFile(filepath.Join(state, vm, "vm.json"), []byte(req), 0o600))
		}
		require.NoError(t, os.WriteFile(filepath.Join(state, "reservations.json"),
			[]byte(`{"vm1":["10.80.0.5"],"vm2":["10.80.0.9"]}`), 0o600))
		d, err := New(Config{SocketDir: dir, KeepState: true, Fabric: FabricConfig{Netdev: "fab0"},
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		defer d.close()
		bind := func(vm, a string) error {
			s, ok := d.vms[vm]
			require.True(t, ok, "%s registered again", vm)
			return s.checkGID(&vmConn{gids: map[int]hostverbs.GIDEntry{}},
				hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr(a)), Type: hostverbs.GIDTypeRoCEv2})
		}
		require.NoError(t, bind("vm1", "10.80.0.5"), "its reserved GID")
		require.ErrorIs(t, bind("vm1", "10.80.0.6"), ErrGIDRefused, "no other")
		require.ErrorIs(t, bind("vm2", "10.80.0.9"), ErrGIDRefused, "its own gid-allow decides")

		// A predecessor without reservations.json (an older version): the
		// binds its device journal replays are the VM's, and reserved.
		replay := &vmConn{gids: map[int]hostverbs.GIDEntry{}}
		replay.replaying.Store(true)
		require.NoError(t, d.vms["vm1"].checkGID(replay,
			hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr("10.80.0.7")), Type: hostverbs.GIDTypeRoCEv2}),
			"a GID the journal binds again")
		require.NoError(t, bind("vm1", "10.80.0.7"), "reserved from then on")
		replay2 := &vmConn{gids: map[int]hostverbs.GIDEntry{}}
		replay2.replaying.Store(true)
		require.ErrorIs(t, d.vms["vm2"].checkGID(replay2,
			hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr("10.80.0.8")), Type: hostverbs.GIDTypeRoCEv2}),
			ErrGIDRefused, "a VM with its own gid-allow: its list decides, replay or not")
	})
}

// fabricPeer makes, from a thread in a fresh namespace (inNewNetns), the
// fabric netdev fab0 with hostAddr, up, and its veth peer fab1 with
// peerAddr in a namespace of its own (closed at cleanup), and returns that
// namespace; the thread is back in the host's namespace.
func fabricPeer(t *testing.T, hostAddr, peerAddr string) netns.NsHandle {
	t.Helper()
	hostNS, err := netns.Get()
	require.NoError(t, err)
	t.Cleanup(func() { hostNS.Close() })
	peerNS, err := netns.New() // moves this thread into it
	require.NoError(t, err)
	t.Cleanup(func() { peerNS.Close() })
	require.NoError(t, netns.Set(hostNS))
	require.NoError(t, netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}))
	peer, err := netlink.LinkByName("fab1")
	require.NoError(t, err)
	require.NoError(t, netlink.LinkSetNsFd(peer, int(peerNS)))
	ph, err := netlink.NewHandleAt(peerNS)
	require.NoError(t, err)
	defer ph.Close()
	peer, err = ph.LinkByName("fab1")
	require.NoError(t, err)
	pa, err := netlink.ParseAddr(peerAddr)
	require.NoError(t, err)
	require.NoError(t, ph.AddrAdd(peer, pa))
	require.NoError(t, ph.LinkSetUp(peer))
	link, err := netlink.LinkByName("fab0")
	require.NoError(t, err)
	ha, err := netlink.ParseAddr(hostAddr)
	require.NoError(t, err)
	require.NoError(t, netlink.AddrAdd(link, ha))
	require.NoError(t, netlink.LinkSetUp(link))
	return peerNS
}
