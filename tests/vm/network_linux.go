package vm

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TB is the part of testing.TB the launcher uses; *testing.T and *testing.B satisfy it,
// and a command (the demo) can supply its own.
type TB interface {
	Helper()
	Logf(format string, args ...any)
	Cleanup(func())
	Name() string
}

// Resource names. Namespaces are "pvt-<pid>-<n>", so a later run can tell a dead run's
// leftovers (owner PID gone) from a live one's.
const (
	namePrefix = "pvt-"
	netnsDir   = "/run/netns"
	bridgeName = "pvtbr0"
)

// netSeq numbers the networks of this process.
var netSeq atomic.Int64

// NetworkConfig configures NewNetwork.
type NetworkConfig struct {
	// HostAddr, if set, is an address with prefix for the bridge, e.g. "10.77.0.254/24":
	// code running in Do can then reach the guests (and be reached) over the bridge.
	HostAddr string
	// MTU of the bridge and taps; 0 keeps the default (1500).
	MTU int
}

// Network is a private L2 network: a uniquely named network namespace holding a bridge,
// and one tap per guest NIC attached to it. QEMU runs inside the namespace.
type Network struct {
	name     string
	ns       netns.NsHandle
	hostAddr netip.Prefix
	mtu      int

	mu     sync.Mutex
	taps   []string
	vms    []*VM // the guests started on it
	closed bool
	unreg  func()
}

// join records a guest started on the network.
func (n *Network) join(v *VM) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.vms = append(n.vms, v)
}

// stopOthers stops every guest on the network but v: one guest's kernel fault ends
// the run of the guests that talk to it, which would otherwise wait for it until their
// deadlines.
func (n *Network) stopOthers(v *VM, why string) {
	n.mu.Lock()
	others := make([]*VM, 0, len(n.vms))
	for _, o := range n.vms {
		if o != v {
			others = append(others, o)
		}
	}
	n.mu.Unlock()
	for _, o := range others {
		o.stopFor(why)
	}
}

// NewNetwork creates a network namespace with a bridge (and HostAddr on it, if set).
// t.Cleanup removes the taps, the bridge and the namespace; so does SIGINT/SIGTERM.
func NewNetwork(t TB, cfg NetworkConfig) (*Network, error) {
	t.Helper()
	sweepStale(t.Logf)
	n := &Network{name: fmt.Sprintf("%s%d-%d", namePrefix, os.Getpid(), netSeq.Add(1)), mtu: cfg.MTU, ns: netns.None()}
	if cfg.HostAddr != "" {
		p, err := netip.ParsePrefix(cfg.HostAddr)
		if err != nil {
			return nil, fmt.Errorf("network host address: %w", err)
		}
		n.hostAddr = p
	}
	if n.mtu != 0 && (n.mtu < 576 || n.mtu > 65535) {
		return nil, fmt.Errorf("network MTU %d out of range", n.mtu)
	}
	if err := n.create(); err != nil {
		n.Close()
		return nil, fmt.Errorf("network %s: %w", n.name, err)
	}
	n.unreg = registerCleanup(func() { _ = n.Close() })
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Logf("network %s cleanup: %v", n.name, err)
		}
	})
	return n, nil
}

// Name returns the namespace name (usable with `ip netns exec`).
func (n *Network) Name() string { return n.name }

// Bridge returns the bridge's name inside the namespace.
func (n *Network) Bridge() string { return bridgeName }

// HostAddr returns the bridge's address, or the zero Prefix.
func (n *Network) HostAddr() netip.Prefix { return n.hostAddr }

// NSPath returns the namespace's bind-mount path.
func (n *Network) NSPath() string { return filepath.Join(netnsDir, n.name) }

// create makes the namespace on a locked thread and configures lo and the bridge in it.
func (n *Network) create() error {
	if err := os.MkdirAll(netnsDir, 0o755); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			runtime.UnlockOSThread()
			return
		}
		defer orig.Close()
		ns, err := netns.NewNamed(n.name) // moves this thread into the new namespace
		if err != nil {
			errc <- err
			if netns.Set(orig) == nil {
				runtime.UnlockOSThread()
			}
			return
		}
		n.ns = ns
		err = n.setupInside()
		if rerr := netns.Set(orig); rerr != nil {
			// Leave the thread locked: the runtime discards it when this goroutine ends.
			errc <- errors.Join(err, fmt.Errorf("restore netns: %w", rerr))
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

func (n *Network) setupInside() error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return err
	}
	attrs := netlink.NewLinkAttrs()
	attrs.Name = bridgeName
	if n.mtu != 0 {
		attrs.MTU = n.mtu
	}
	br := &netlink.Bridge{LinkAttrs: attrs}
	if err := netlink.LinkAdd(br); err != nil {
		return fmt.Errorf("add bridge: %w", err)
	}
	if n.hostAddr.IsValid() {
		a, err := netlink.ParseAddr(n.hostAddr.String())
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(br, a); err != nil {
			return fmt.Errorf("bridge address: %w", err)
		}
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return fmt.Errorf("bridge up: %w", err)
	}
	return nil
}

// Do runs fn on an OS thread that is inside the network's namespace. Sockets fn opens
// stay in the namespace after Do returns, and processes fn starts run in it.
func (n *Network) Do(fn func() error) error {
	n.mu.Lock()
	closed := n.closed
	n.mu.Unlock()
	if closed {
		return fmt.Errorf("network %s is closed", n.name)
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(n.ns); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns %s: %w", n.name, err)
			return
		}
		err = fn()
		if rerr := netns.Set(orig); rerr != nil {
			errc <- errors.Join(err, fmt.Errorf("restore netns: %w", rerr))
			return // thread stays locked and is discarded
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// addTap creates a persistent tap attached to the bridge and returns its name.
func (n *Network) addTap() (string, error) {
	n.mu.Lock()
	name := "pvtap" + strconv.Itoa(len(n.taps))
	n.taps = append(n.taps, name)
	n.mu.Unlock()
	err := n.Do(func() error {
		br, err := netlink.LinkByName(bridgeName)
		if err != nil {
			return err
		}
		attrs := netlink.NewLinkAttrs()
		attrs.Name = name
		attrs.MasterIndex = br.Attrs().Index
		if n.mtu != 0 {
			attrs.MTU = n.mtu
		}
		tap := &netlink.Tuntap{LinkAttrs: attrs, Mode: netlink.TUNTAP_MODE_TAP, Flags: netlink.TUNTAP_NO_PI}
		if err := netlink.LinkAdd(tap); err != nil {
			return fmt.Errorf("add tap %s: %w", name, err)
		}
		if n.mtu != 0 {
			// A tap is made by ioctl, which takes no MTU; at 1500 it
			// would pull the bridge's MTU down to its own.
			if err := netlink.LinkSetMTU(tap, n.mtu); err != nil {
				return fmt.Errorf("tap %s MTU %d: %w", name, n.mtu, err)
			}
		}
		return netlink.LinkSetUp(tap)
	})
	return name, err
}

// Close removes the taps, the bridge and the namespace. Guests using the network must
// have been stopped (VM cleanups run before the network's, as they are registered
// later). It is idempotent.
func (n *Network) Close() error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil
	}
	taps := n.taps
	n.mu.Unlock()
	var errs []error
	if n.ns.IsOpen() {
		errs = append(errs, n.Do(func() error {
			var errs []error
			for _, name := range append(taps, bridgeName) {
				l, err := netlink.LinkByName(name)
				if err != nil {
					continue // never created, or gone with its QEMU
				}
				if err := netlink.LinkDel(l); err != nil {
					errs = append(errs, fmt.Errorf("delete %s: %w", name, err))
				}
			}
			return errors.Join(errs...)
		}))
	}
	n.mu.Lock()
	n.closed = true
	n.mu.Unlock()
	if err := netns.DeleteNamed(n.name); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
		errs = append(errs, fmt.Errorf("delete netns: %w", err))
	}
	if n.ns.IsOpen() {
		n.ns.Close()
	}
	if n.unreg != nil {
		n.unreg()
	}
	return errors.Join(errs...)
}

// ownerAlive reports whether a resource named "pvt-<pid>-..." belongs to a live process.
func ownerAlive(name string) bool {
	rest, ok := strings.CutPrefix(name, namePrefix)
	if !ok {
		return true
	}
	pidStr, _, _ := strings.Cut(rest, "-")
	pid, err := strconv.Atoi(pidStr)
	if err != nil || pid <= 0 {
		return true
	}
	if pid == os.Getpid() {
		return true
	}
	return !errors.Is(unix.Kill(pid, 0), unix.ESRCH)
}

var sweepOnce sync.Once

// sweepStale removes namespaces and run directories of earlier runs whose process is
// gone (crashed, killed by a test timeout). It runs once per process.
func sweepStale(logf func(string, ...any)) {
	sweepOnce.Do(func() { sweep(logf) })
}

// sweep removes dead runs' namespaces and run directories.
func sweep(logf func(string, ...any)) {
	if ents, err := os.ReadDir(netnsDir); err == nil {
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), namePrefix) && !ownerAlive(e.Name()) {
				if err := netns.DeleteNamed(e.Name()); err == nil {
					logf("removed stale network namespace %s", e.Name())
				}
			}
		}
	}
	if ents, err := os.ReadDir(os.TempDir()); err == nil {
		for _, e := range ents {
			if e.IsDir() && strings.HasPrefix(e.Name(), namePrefix) && !ownerAlive(e.Name()) {
				if err := os.RemoveAll(filepath.Join(os.TempDir(), e.Name())); err == nil {
					logf("removed stale run directory %s", e.Name())
				}
			}
		}
	}
}
