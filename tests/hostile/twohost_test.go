package hostile

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// twoHosts are two network namespaces, two "hosts", joined by a veth
// pair: host i's end is dev[i], up, with address addr[i] of their /24.
type twoHosts struct {
	ns   [2]string
	dev  [2]string
	addr [2]netip.Addr
}

// needNetns skips tb unless it can make network namespaces and run
// daemons in them: root and ip (iproute2).
func needNetns(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root for network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		tb.Skip("needs ip (iproute2) to run daemons in network namespaces")
	}
}

// netnsName names this test process's network namespace tag, uniquely on
// the machine.
func netnsName(tag string) string { return fmt.Sprintf("pvrdma-hostile-%d-%s", os.Getpid(), tag) }

// newNetns creates network namespace name (ip netns add, so that `ip
// netns exec` runs daemons in it); cleanup removes it, and the devices in
// it, also after a failure. It skips tb where namespaces cannot be made.
func newNetns(tb testing.TB, name string) {
	tb.Helper()
	needNetns(tb)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Skipf("cannot create a network namespace: ip netns add: %v: %s", err, out)
	}
	tb.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			tb.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
}

// newTwoHosts creates the namespaces (newNetns) and the veth pair, with
// addresses subnet.1 and subnet.2; cleanup removes the namespaces, and the
// veth with them, also after a failure. It skips the test where
// namespaces cannot be made (not root, no ip, no permission).
func newTwoHosts(t *testing.T, subnet netip.Prefix) twoHosts {
	t.Helper()
	var h twoHosts
	base := subnet.Masked().Addr().As4()
	for i := range 2 {
		// Unique per test process; interface names fit IFNAMSIZ.
		h.ns[i] = netnsName(string(rune('a' + i)))
		h.dev[i] = fmt.Sprintf("pvh%d%c", os.Getpid()%10000000, 'a'+i)
		a := base
		a[3] = byte(i + 1)
		h.addr[i] = netip.AddrFrom4(a)
		newNetns(t, h.ns[i])
	}
	var err error
	var nsh [2]netns.NsHandle
	var nl [2]*netlink.Handle
	for i := range 2 {
		nsh[i], err = netns.GetFromName(h.ns[i])
		require.NoError(t, err)
		defer nsh[i].Close()
		nl[i], err = netlink.NewHandleAt(nsh[i])
		require.NoError(t, err)
		defer nl[i].Close()
	}
	require.NoError(t, nl[0].LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: h.dev[0]}, PeerName: h.dev[1],
		PeerNamespace: netlink.NsFd(nsh[1])}), "veth %s/%s", h.dev[0], h.dev[1])
	for i := range 2 {
		for _, name := range []string{"lo", h.dev[i]} {
			l, err := nl[i].LinkByName(name)
			require.NoError(t, err)
			if name != "lo" {
				a := &netlink.Addr{IPNet: &net.IPNet{IP: h.addr[i].AsSlice(), Mask: net.CIDRMask(subnet.Bits(), 32)}}
				require.NoError(t, nl[i].AddrAdd(l, a))
			}
			require.NoError(t, nl[i].LinkSetUp(l))
		}
	}
	return h
}

// TestUpgradeKeepsRemotePeer: a VM's RC connection to a VM on another host
// survives live upgrades of either host's daemon. Two daemons in two
// network namespaces (IP mode, UDP 4791 over a veth pair) serve one VM
// each; the VMs' QPs are connected to each other and stream verified RDMA
// WRITEs both ways while daemon A is upgraded three times and daemon B
// once. No WRITE may fail or deliver other bytes, every hand-over keeps the
// QP (and errors none), both QPs end in RTS, and both streams go on after
// the last upgrade. The pauses, and the longest time the peer's stream
// went without a completion across each, are logged, not asserted.
func TestUpgradeKeepsRemotePeer(t *testing.T) {
	hosts := newTwoHosts(t, netip.MustParsePrefix("10.211.0.0/24"))
	bin := daemonBinary(t)
	names := [2]string{"rpa", "rpb"}
	gids := [2]netip.Addr{netip.MustParseAddr("10.211.0.11"), netip.MustParseAddr("10.211.0.21")}
	var envs [2]*env
	var eps [2]*endpoint
	for i := range 2 {
		dir := serveProcess(t, []string{names[i]}, daemonOpts{bin: bin, netns: hosts.ns[i],
			args: []string{"--fabric-netdev", hosts.dev[i], "--gid-allow", "10.211.0.0/24"}})
		envs[i] = externalEnv(t, dir)
		eps[i] = envs[i].endpointGID(names[i], gidV4(gids[i]))
	}
	connectRC(eps[0], eps[1], 12, 7)
	exchange(t, eps[0], eps[1]) // the fabric carries both ways
	exchange(t, eps[1], eps[0])

	// Each stream WRITEs from the first half of its VM's MR into the
	// second half of the peer's.
	const msg, window = 8 << 10, 4
	var stop atomic.Bool
	var done [2]atomic.Int64
	streams := [2]*writeStream{}
	errs := make(chan error, 2)
	var wg sync.WaitGroup
	for i := range 2 {
		streams[i] = &writeStream{src: eps[i], dst: eps[1-i], size: msg, window: window, dstOff: mrBytes / 2,
			stop: &stop, done: &done[i], verify: true, seed: uint64(i+1) << 56, gapMin: 5 * time.Millisecond}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := streams[i].run(); err != nil {
				errs <- fmt.Errorf("stream %s -> %s: %w", names[i], names[1-i], err)
				stop.Store(true)
			}
		}()
	}
	stopped := false
	defer func() { // a failure below must not unmap guest RAM under the streams
		if !stopped {
			stop.Store(true)
			wg.Wait()
		}
	}()

	// Upgrades: A, B, A, A. The stream of the other host's VM is the
	// remote peer of the daemon upgraded.
	type upgrade struct {
		host       int
		from, to   time.Time
		status     string
		pauseMS    float64
		remoteBusy int64 // bytes the remote stream completed during it
	}
	var ups []upgrade
	gen := [2]int{}
	for _, host := range []int{0, 1, 0, 0} {
		time.Sleep(400 * time.Millisecond)
		select {
		case err := <-errs:
			t.Fatal(err)
		default:
		}
		u := upgrade{host: host, from: time.Now()}
		remote := &done[1-host]
		before := remote.Load()
		gen[host]++
		h := upgradeDaemon(t, envs[host].ctl, gen[host])
		u.to, u.pauseMS, u.remoteBusy = time.Now(), h.PauseMS, remote.Load()-before
		u.status = fmt.Sprintf("%+v", h)
		require.GreaterOrEqual(t, h.Continued, 1, "daemon %c's hand-over %d: the RC QP did not keep its connection: %s", 'A'+host, gen[host], u.status)
		require.Zero(t, h.Errored, "daemon %c's hand-over %d: %s", 'A'+host, gen[host], u.status)
		require.Zero(t, h.Lost, "daemon %c's hand-over %d: %s", 'A'+host, gen[host], u.status)
		// The fabric's port 4791 sockets were handed over (what arrived
		// during the pause waited in them), not bound again.
		st, err := envs[host].ctl.Status(context.Background())
		require.NoError(t, err)
		require.Equal(t, uint64(2), st.Counters["wire_rx_sockets_inherited"], "daemon %c's hand-over %d: fabric sockets taken over", 'A'+host, gen[host])
		ups = append(ups, u)
	}
	// Bytes flow both ways after the last upgrade.
	var after [2]int64
	for i := range 2 {
		after[i] = done[i].Load()
	}
	// Both streams go on: each completes four more WRITEs (waited for
	// with a bound that only turns a stall into a failure).
	for i := range 2 {
		require.Eventually(t, func() bool { return done[i].Load() > after[i]+4*msg }, 30*time.Second, 10*time.Millisecond,
			"stream %s -> %s after the last upgrade", names[i], names[1-i])
	}
	stop.Store(true)
	wg.Wait()
	stopped = true
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	for i, p := range eps {
		require.Equal(t, hostverbs.QPStateRTS, p.qp.state(), "VM %s's QP", names[i])
	}
	exchange(t, eps[0], eps[1]) // SENDs too, after all of it
	exchange(t, eps[1], eps[0])

	for i, u := range ups {
		// The remote stream's longest stretch without a completion that
		// overlaps the upgrade (from the request to the new image serving).
		var longest time.Duration
		for _, g := range streams[1-u.host].gaps {
			if g.end.After(u.from) && g.end.Add(-g.d).Before(u.to) {
				longest = max(longest, g.d)
			}
		}
		t.Logf("upgrade %d of daemon %c: pause %.1f ms; remote stream (%s -> %s) longest gap %.1f ms, %d KiB completed during it; %s",
			i+1, 'A'+u.host, u.pauseMS, names[1-u.host], names[u.host], longest.Seconds()*1e3, u.remoteBusy>>10, u.status)
	}
	for i := range 2 {
		t.Logf("stream %s -> %s: %d MiB verified", names[i], names[1-i], done[i].Load()>>20)
	}
}
