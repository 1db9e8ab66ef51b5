package hostile

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Many hosts (issue 25): four hosts, each a network namespace with a
// daemon of its own (a `serve` process), and fake-driver VMs on every host
// that connect an RC QP to every VM of the other hosts and stream verified
// RDMA WRITEs over all of them at once. Two networks carry it:
//
//   - routed (IP mode, --fabric-netdev): hosts h1 and h2 on one subnet, h3
//     and h4 on another, each subnet a bridge in a router namespace that
//     forwards between them; every host's default route is the router.
//     The QPs' traffic class must cross the router: a capture there checks
//     the DSCP of the RoCE packets it forwarded.
//   - vxlan (L2 mode, --fabric-bridge): each host's fabric bridge has a
//     kernel VXLAN port, unicast with a static all-zeros FDB entry per
//     other host (head-end replication), over an underlay namespace's
//     bridge; the VMs' GIDs are one overlay subnet and their frames carry
//     their own MACs. The overlay's MTU is the underlay's less VXLAN's 50
//     bytes, and the ports must report the RoCE MTU that fits it.
const (
	manyHostsN   = 4        // hosts
	manyHostsVMs = 2        // VMs per host
	meshMsg      = 16 << 10 // bytes per WRITE
	meshWindow   = 4        // WRITEs in flight per stream
	meshSlot     = meshWindow * meshMsg
	meshDSCP     = 26 // AF31, RoCE's usual class
	meshTClass   = meshDSCP << 2

	// The routed network: two subnets of two hosts, links of MTU 1500.
	hostsPerSubnet = 2
	routedLinkMTU  = 1500
	routedRoCEMTU  = hostverbs.MTU1024

	// The overlay: VXLAN's overhead is the outer IPv4, UDP and VXLAN
	// headers and the inner Ethernet header. The underlay's MTU is chosen
	// so that each candidate gives another RoCE MTU (rxe's rule: the
	// largest not above the netdev's MTU less 80 bytes of headers): the
	// overlay's 4150 gives 2048, the underlay's own 4200 would give 4096,
	// and a default of 1500 1024.
	underlayMTU    = 4200
	vxlanOverhead  = 50
	overlayRoCEMTU = hostverbs.MTU2048
	vxlanVNI       = "4242"
	vxlanDstPort   = "4789"

	// roceWriteHeaders are the headers over IPv4 of a RoCE v2 WRITE's
	// first packet: IPv4, UDP, BTH, RETH and the ICRC.
	roceWriteHeaders = 20 + 8 + 12 + 16 + 4

	// Every stream must complete meshMinWrites WRITEs; the run goes on
	// past its time, up to meshGrace, until they have.
	meshMinWrites = 2 * meshWindow
	meshGrace     = 20 * time.Second
)

// TestManyHostsRouted: four daemons in IP mode on two subnets joined by a
// router; two VMs per host, each with an RC connection to each of the six
// VMs on the other hosts, stream verified WRITEs for two seconds, all 48
// streams at once (longer if a stream has not completed eight WRITEs by
// then). No WRITE may fail or deliver other bytes, no completion may be
// missing, and every stream must carry data. The QPs' traffic class
// (DSCP 26) must be the DSCP of the RoCE packets the router forwards, both
// ways, with the hop limit less the router's hop as TTL. The aggregate
// throughput and Jain's fairness across hosts and streams are logged.
func TestManyHostsRouted(t *testing.T) {
	r := runManyHosts(t, false, 2*time.Second)
	r.log(t)
}

// TestManyHostsVXLAN is TestManyHostsRouted in L2 mode over a VXLAN
// overlay: the daemons capture and inject frames with the VMs' own MACs on
// their hosts' bridges, and the VMs' ports report the RoCE MTU of the
// overlay's MTU (2048 for 4150), not of the underlay's (4096); the QPs use
// it as their path MTU, so full-size packets cross the overlay.
func TestManyHostsVXLAN(t *testing.T) {
	r := runManyHosts(t, true, 2*time.Second)
	r.log(t)
}

// BenchmarkManyHosts (make bench-hosts) runs the all-to-all mesh of
// TestManyHostsRouted and TestManyHostsVXLAN for three seconds each and
// reports the aggregate WRITE throughput and Jain's fairness index across
// the hosts (bytes each host's VMs sent) and across the 48 streams. Run it
// with -benchtime 1x.
func BenchmarkManyHosts(b *testing.B) {
	for _, mode := range []struct {
		name string
		l2   bool
	}{{"routed", false}, {"vxlan", true}} {
		b.Run(mode.name, func(b *testing.B) {
			for range b.N {
				r := runManyHosts(b, mode.l2, 3*time.Second)
				b.ReportMetric(r.aggregateMBps, "MB/s")
				b.ReportMetric(r.jainHosts, "jain_hosts")
				b.ReportMetric(r.jainStreams, "jain_streams")
				r.log(b)
			}
		})
	}
}

// hostsNet is a network of manyHostsN hosts, each for a daemon of its own.
type hostsNet struct {
	ns      []string // the hosts' network namespaces
	args    []string // the daemons' fabric flags (device names are the same in every host)
	l2      bool     // L2 mode: the wire carries the VMs' MACs
	wantMTU hostverbs.MTU
	gid     func(host, vm int) netip.Addr

	router     string   // routed: the router's namespace
	routerDevs []string // routed: its bridges, one per subnet
}

// netSeq keeps namespace names of one process unique across benchmark
// iterations.
var netSeq atomic.Int32

// nsRun runs a command that takes a network namespace by name (ip -n NS,
// bridge -n NS) and returns its output.
func nsRun(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// ipIn runs `ip -n ns args...`.
func ipIn(tb testing.TB, ns string, args ...string) {
	tb.Helper()
	_, err := nsRun("ip", append([]string{"-n", ns}, args...)...)
	require.NoError(tb, err)
}

// inNetns runs fn on a thread of its own in network namespace ns: the
// sockets fn opens are ns's, and so is /proc/sys/net. The thread comes
// back to this namespace afterwards and is unlocked: a goroutine that ends
// locked takes its thread with it, and a daemon that serveProcess started
// from that thread before would get its parent-death signal (which is per
// thread). Only if the way back fails does the thread end.
func inNetns(ns string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		home, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer home.Close()
		err = func() error {
			h, err := netns.GetFromName(ns)
			if err != nil {
				return err
			}
			defer h.Close()
			if err := netns.Set(h); err != nil {
				return fmt.Errorf("setns %s: %w", ns, err)
			}
			return fn()
		}()
		if back := netns.Set(home); back != nil {
			errc <- errors.Join(err, fmt.Errorf("back from %s: %w", ns, back))
			return // still locked: the thread ends with the goroutine
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// setSysctl writes val to /proc/sys/<key> in network namespace ns.
func setSysctl(tb testing.TB, ns, key, val string) {
	tb.Helper()
	require.NoError(tb, inNetns(ns, func() error { return os.WriteFile("/proc/sys/"+key, []byte(val), 0) }),
		"sysctl %s=%s in %s", key, val, ns)
}

// newHost creates host h's namespace (tag "m<seq>-h<h+1>") with its
// loopback up and arp_ignore=1, as the daemon wants on a host whose
// fabric netdev gets guests' addresses.
func (n *hostsNet) newHost(tb testing.TB, seq int32, h int) string {
	tb.Helper()
	ns := netnsName(fmt.Sprintf("m%d-h%d", seq, h+1))
	newNetns(tb, ns)
	ipIn(tb, ns, "link", "set", "lo", "up")
	setSysctl(tb, ns, "net/ipv4/conf/all/arp_ignore", "1")
	n.ns = append(n.ns, ns)
	return ns
}

// routedAddr is address .host of subnet s (0 or 1) of the routed network.
func routedAddr(s, host int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 212, byte(s + 1), byte(host)})
}

// newRoutedHosts builds the routed network: a router namespace with one
// bridge per subnet (10.212.1.0/24 and 10.212.2.0/24, the router .1 on
// each) and ip_forward on; host h's uplink up0 is a veth into the bridge of
// subnet h/2, with address .101+h and a default route via the router. The
// VMs' GIDs are .11, .12 (h1), .21, .22 (h2) and so on in their host's
// subnet: the daemons add them to up0.
func newRoutedHosts(tb testing.TB) *hostsNet {
	tb.Helper()
	needNetns(tb)
	seq := netSeq.Add(1)
	// The fabric's pool: IP mode assigns guests no address without one.
	n := &hostsNet{args: []string{"--fabric-netdev", "up0", "--gid-allow", "10.212.0.0/16"}, wantMTU: routedRoCEMTU,
		router: netnsName(fmt.Sprintf("m%d-r", seq))}
	n.gid = func(h, v int) netip.Addr { return routedAddr(h/hostsPerSubnet, 10*(h+1)+v+1) }
	newNetns(tb, n.router)
	ipIn(tb, n.router, "link", "set", "lo", "up")
	setSysctl(tb, n.router, "net/ipv4/ip_forward", "1")
	for s := range manyHostsN / hostsPerSubnet {
		br := fmt.Sprintf("sub%c", 'a'+s)
		ipIn(tb, n.router, "link", "add", br, "type", "bridge")
		ipIn(tb, n.router, "addr", "add", routedAddr(s, 1).String()+"/24", "dev", br)
		ipIn(tb, n.router, "link", "set", br, "up")
		n.routerDevs = append(n.routerDevs, br)
	}
	for h := range manyHostsN {
		ns := n.newHost(tb, seq, h)
		s, port := h/hostsPerSubnet, fmt.Sprintf("h%d", h+1)
		ipIn(tb, ns, "link", "add", "up0", "mtu", fmt.Sprint(routedLinkMTU), "type", "veth", "peer", "name", port, "netns", n.router)
		ipIn(tb, n.router, "link", "set", port, "master", n.routerDevs[s], "up")
		ipIn(tb, ns, "addr", "add", routedAddr(s, 101+h).String()+"/24", "dev", "up0")
		ipIn(tb, ns, "link", "set", "up0", "up")
		ipIn(tb, ns, "route", "add", "default", "via", routedAddr(s, 1).String())
	}
	return n
}

// newVXLANHosts builds the VXLAN network: an underlay namespace with a
// bridge, and per host a veth ul0 into it (MTU underlayMTU, address
// 10.213.0.1+h/24), a VXLAN device vx0 on ul0 (VNI 4242, UDP 4789,
// learning) with an all-zeros FDB entry for every other host, and the
// fabric bridge br0 with vx0 as its port, whose MTU it takes. The VMs'
// GIDs are 10.214.0.11, .12 (h1), .21, .22 (h2) and so on; no host has an
// address in the overlay. It skips tb if the kernel has no VXLAN.
func newVXLANHosts(tb testing.TB) *hostsNet {
	tb.Helper()
	needNetns(tb)
	if _, err := exec.LookPath("bridge"); err != nil {
		tb.Skip("needs bridge (iproute2) for the VXLAN FDB")
	}
	seq := netSeq.Add(1)
	n := &hostsNet{args: []string{"--fabric-bridge", "br0"}, l2: true, wantMTU: overlayRoCEMTU}
	n.gid = func(h, v int) netip.Addr { return netip.AddrFrom4([4]byte{10, 214, 0, byte(10*(h+1) + v + 1)}) }
	under := func(h int) string { return netip.AddrFrom4([4]byte{10, 213, 0, byte(1 + h)}).String() }
	u := netnsName(fmt.Sprintf("m%d-u", seq))
	newNetns(tb, u)
	ipIn(tb, u, "link", "add", "ul", "type", "bridge")
	ipIn(tb, u, "link", "set", "ul", "up")
	for h := range manyHostsN {
		ns := n.newHost(tb, seq, h)
		port := fmt.Sprintf("h%d", h+1)
		mtu := fmt.Sprint(underlayMTU)
		ipIn(tb, ns, "link", "add", "ul0", "mtu", mtu, "type", "veth", "peer", "name", port, "mtu", mtu, "netns", u)
		ipIn(tb, u, "link", "set", port, "master", "ul", "up")
		ipIn(tb, ns, "addr", "add", under(h)+"/24", "dev", "ul0")
		ipIn(tb, ns, "link", "set", "ul0", "up")
		out, err := nsRun("ip", "-n", ns, "link", "add", "vx0", "type", "vxlan", "id", vxlanVNI,
			"local", under(h), "dev", "ul0", "dstport", vxlanDstPort, "learning")
		if err != nil && (strings.Contains(out, "Unknown device type") || strings.Contains(out, "not supported")) {
			tb.Skipf("the kernel has no VXLAN: %v", err)
		}
		require.NoError(tb, err)
		for p := range manyHostsN {
			if p != h {
				_, err := nsRun("bridge", "-n", ns, "fdb", "append", "00:00:00:00:00:00", "dev", "vx0", "dst", under(p))
				require.NoError(tb, err)
			}
		}
		ipIn(tb, ns, "link", "add", "br0", "type", "bridge")
		ipIn(tb, ns, "link", "set", "vx0", "master", "br0", "up")
		ipIn(tb, ns, "link", "set", "br0", "up")
		var mtuBr int
		require.NoError(tb, inNetns(ns, func() error {
			ifi, err := net.InterfaceByName("br0")
			if err == nil {
				mtuBr = ifi.MTU
			}
			return err
		}))
		require.Equal(tb, underlayMTU-vxlanOverhead, mtuBr, "host %d: the fabric bridge's MTU is its VXLAN port's", h+1)
	}
	return n
}

// meshVM is one VM of the mesh: booted, its GID bound at index 0, a user
// context, a PD, a receive CQ and one MR with a slot of meshSlot bytes per
// peer each way (its streams' sources, then its peers' destinations), and
// a connection per peer: an endpoint sharing all of that with an RC QP
// and a send CQ of its own.
type meshVM struct {
	host  int
	base  *endpoint
	mtu   hostverbs.MTU // its port's active MTU
	peers int
	conns []*endpoint // in the order of connect
}

// newMeshVM boots VM name of e's daemon on host host, with GID gid and
// (L2 mode) NIC MAC mac, for peers connections.
func newMeshVM(e *env, host int, name string, gid hostverbs.GID, mac [6]byte, peers int) *meshVM {
	e.t.Helper()
	v := e.boot(name)
	v.bindGID(0, gid)
	p := &endpoint{v: v, gid: gid, mac: mac}
	p.uc = v.createUC(1)
	p.pd = v.createPD(p.uc)
	p.rcq = v.createCQ(p.uc, 64)
	p.mr = v.regMR(p.pd, mrIOVA, uint64(2*peers*meshSlot), accRW)
	return &meshVM{host: host, base: p, mtu: hostverbs.MTU(v.queryPort().ActiveMTU), peers: peers}
}

// connect creates the VM's next connection and returns it with its index,
// which is its slot in each half of the MR.
func (m *meshVM) connect() (*endpoint, int) {
	c := *m.base
	c.scq = c.v.createCQ(c.uc, 64)
	c.qp = c.rcQP(c.scq, c.rcq)
	m.conns = append(m.conns, &c)
	return &c, len(m.conns) - 1
}

// mesh is every VM and, for every two VMs on different hosts, an RC
// connection between them and a verified WRITE stream each way.
type mesh struct {
	vms     []*meshVM
	streams [][]*writeStream // by source VM
	stop    atomic.Bool
}

// newMesh connects every two VMs of different hosts with path MTU the
// smaller of their ports' active MTUs and traffic class tclass.
func newMesh(vms []*meshVM, tclass uint8) *mesh {
	m := &mesh{vms: vms, streams: make([][]*writeStream, len(vms))}
	for i, a := range vms {
		for j := i + 1; j < len(vms); j++ {
			b := vms[j]
			if a.host == b.host {
				continue
			}
			ca, ka := a.connect()
			cb, kb := b.connect()
			connectRCPath(ca, cb, min(a.mtu, b.mtu), tclass, 12, 7)
			m.streams[i] = append(m.streams[i], m.stream(ca, cb, ka, kb, b.peers, uint64(i)<<56|uint64(j)<<48))
			m.streams[j] = append(m.streams[j], m.stream(cb, ca, kb, ka, a.peers, uint64(j)<<56|uint64(i)<<48))
		}
	}
	return m
}

// stream is the stream from connection src, in its VM's outgoing slot ks,
// into connection dst, in its VM's incoming slot kd (the incoming slots
// follow the dstPeers outgoing ones).
func (m *mesh) stream(src, dst *endpoint, ks, kd, dstPeers int, seed uint64) *writeStream {
	return &writeStream{src: src, dst: dst, size: meshMsg, window: meshWindow,
		srcOff: uint64(ks) * meshSlot, dstOff: uint64(dstPeers+kd) * meshSlot,
		stop: &m.stop, done: new(atomic.Int64), verify: true, seed: seed,
		name: fmt.Sprintf("stream %s -> %s", src.v.name, dst.v.name)}
}

// run streams on every connection, each VM's streams on one goroutine,
// for d and then until every stream has completed meshMinWrites WRITEs
// (a machine this busy may take the first round of doorbells slowly),
// but not longer than meshGrace past d; then it stops them and waits
// until nothing is in flight. It returns how long they ran and every
// stream's error.
func (m *mesh) run(d time.Duration) (time.Duration, []error) {
	errs := make(chan error, len(m.vms))
	var wg sync.WaitGroup
	for i := range m.vms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := runStreams(m.streams[i]); err != nil { // named by its stream
				errs <- err
				m.stop.Store(true)
			}
		}()
	}
	start := time.Now()
	for !m.stop.Load() { // a stream's error stops them all early
		if el := time.Since(start); el >= d+meshGrace || el >= d && m.slowest() >= meshMinWrites*meshMsg {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	m.stop.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	var out []error
	for err := range errs {
		out = append(out, err)
	}
	return elapsed, out
}

// slowest is the fewest bytes a stream has completed.
func (m *mesh) slowest() int64 {
	least := int64(-1)
	for _, ss := range m.streams {
		for _, s := range ss {
			if x := s.done.Load(); least < 0 || x < least {
				least = x
			}
		}
	}
	return least
}

// meshResult is what a run of the mesh moved.
type meshResult struct {
	mode          string
	elapsed       time.Duration
	hostBytes     []float64 // bytes each host's VMs sent
	streams       int
	minStream     float64 // the fewest bytes a stream moved
	aggregateMBps float64
	jainHosts     float64
	jainStreams   float64
	fabric        []string // each daemon's fabric counters, as logged
}

// log logs the run's figures and each daemon's counters.
func (r meshResult) log(tb testing.TB) {
	tb.Helper()
	hosts := make([]string, len(r.hostBytes))
	for h, x := range r.hostBytes {
		hosts[h] = fmt.Sprintf("h%d %.0f", h+1, x/r.elapsed.Seconds()/1e6)
	}
	tb.Logf("%s: %d hosts, %d VMs, %d streams for %v: %.0f MB/s aggregate, Jain %.3f across hosts, %.3f across streams; "+
		"MB/s sent by host: %s; the slowest stream %.1f MB/s",
		r.mode, manyHostsN, manyHostsN*manyHostsVMs, r.streams, r.elapsed.Round(time.Millisecond), r.aggregateMBps,
		r.jainHosts, r.jainStreams, strings.Join(hosts, ", "), r.minStream/r.elapsed.Seconds()/1e6)
	for h, f := range r.fabric {
		tb.Logf("%s: daemon of h%d: %s", r.mode, h+1, f)
	}
}

// meshVMName is the name of VM v of host h: h1a, h1b, h2a...
func meshVMName(h, v int) string { return fmt.Sprintf("h%d%c", h+1, 'a'+v) }

// vmMAC is the MAC VM v of host h is registered with in L2 mode
// (locally administered).
func vmMAC(h, v int) [6]byte { return [6]byte{0x02, 0x00, 0x00, 0xd6, byte(h + 1), byte(v + 1)} }

// runManyHosts builds the routed (l2 false) or the VXLAN network, starts
// a daemon per host with manyHostsVMs VMs, checks their ports' active MTU,
// connects the mesh with traffic class meshTClass and streams for d
// (mesh.run). It fails tb on any stream's error, on a stream that
// completed fewer than meshMinWrites WRITEs, on a QP not in RTS after it,
// on packets smaller than the path MTU implies, and in the routed network
// on the router's forwarded packets' DSCP and TTL.
func runManyHosts(tb testing.TB, l2 bool, d time.Duration) meshResult {
	var n *hostsNet
	r := meshResult{mode: "routed"}
	if l2 {
		n, r.mode = newVXLANHosts(tb), "vxlan"
	} else {
		n = newRoutedHosts(tb)
	}
	bin := daemonBinary(tb)
	envs := make([]*env, manyHostsN)
	for h := range manyHostsN {
		var flags []string
		for v := range manyHostsVMs {
			f := meshVMName(h, v)
			if n.l2 {
				mac := vmMAC(h, v)
				f += "=" + net.HardwareAddr(mac[:]).String()
			}
			flags = append(flags, f)
		}
		dir := serveProcess(tb, flags, daemonOpts{bin: bin, netns: n.ns[h], args: n.args})
		envs[h] = externalEnv(tb, dir)
	}
	peers := (manyHostsN - 1) * manyHostsVMs
	var vms []*meshVM
	for h := range manyHostsN {
		for v := range manyHostsVMs {
			name := meshVMName(h, v)
			var mac [6]byte
			if n.l2 {
				mac = vmMAC(h, v)
			}
			m := newMeshVM(envs[h], h, name, gidV4(n.gid(h, v)), mac, peers)
			require.Equal(tb, n.wantMTU, m.mtu, "VM %s: the port's active MTU", name)
			vms = append(vms, m)
		}
	}
	m := newMesh(vms, meshTClass)
	var capt *forwardCapture
	if !n.l2 {
		capt = startForwardCapture(tb, n.router, n.routerDevs, 4000)
	}
	var errs []error
	r.elapsed, errs = m.run(d)
	for _, err := range errs {
		tb.Error(err)
	}
	if len(errs) > 0 {
		tb.FailNow()
	}

	r.hostBytes = make([]float64, manyHostsN)
	var streams []float64
	var sum float64
	for i, ss := range m.streams {
		for _, s := range ss {
			x := float64(s.done.Load())
			require.GreaterOrEqual(tb, x, float64(meshMinWrites*meshMsg), "%s: bytes completed in %v", s.name, r.elapsed)
			r.hostBytes[vms[i].host] += x
			streams = append(streams, x)
			sum += x
		}
	}
	require.Len(tb, streams, manyHostsN*manyHostsVMs*peers, "a stream each way between every two VMs of different hosts")
	r.streams, r.minStream = len(streams), slices.Min(streams)
	r.aggregateMBps = sum / r.elapsed.Seconds() / 1e6
	r.jainHosts, r.jainStreams = jain(r.hostBytes), jain(streams)
	for _, v := range vms {
		for _, c := range v.conns {
			require.Equal(tb, hostverbs.QPStateRTS, c.qp.state(), "VM %s's QP %d", v.base.v.name, c.qp.qpn)
		}
	}
	// The QPs' packets fill the path MTU: what each daemon sent (data,
	// and an ACK at most per message) averages more than the largest
	// packet of the next smaller MTU.
	smaller := float64((n.wantMTU - 1).Bytes() + roceWriteHeaders)
	for h, e := range envs {
		c := e.status().Counters
		avg := float64(c["tx_bytes"]) / float64(max(c["tx_packets"], 1))
		r.fabric = append(r.fabric, fmt.Sprintf("tx %d rx %d packets (%.0f bytes on average), %d retransmitted, %d retransmit timeouts, "+
			"%d dropped for another GID, %d for another MAC, %d oversize",
			c["tx_packets"], c["rx_packets"], avg, c["retransmitted_packets"], c["retransmit_timeouts"],
			c["drop_unknown_gid"], c["drop_wrong_mac"], c["tx_drop_oversize"]))
		require.Zero(tb, c["tx_drop_oversize"], "host %d: packets above the link's MTU", h+1)
		require.Greater(tb, avg, smaller, "host %d: the average packet sent, against the largest of MTU %d", h+1, (n.wantMTU - 1).Bytes())
	}
	if capt != nil {
		capt.check(tb, meshDSCP, qpHopLimit-1)
	}
	return r
}

// forwardCapture records the RoCE v2 packets over IPv4 (UDP 4791) that a
// namespace transmits on some of its devices: on a router's devices, the
// packets it forwarded. It reads up to limit of them, then closes its
// socket.
type forwardCapture struct {
	fd    int
	devs  map[int]string // by ifindex
	limit int
	stop  atomic.Bool
	done  chan struct{}

	// The reader's, read after done.
	seen map[captured]int
	err  error
}

// captured is one kind of packet forwarded: the device it left on, its
// TOS and TTL, and what it is by its BTH opcode: "write" (an RC RDMA
// WRITE's packet), "ack", "cnp" (which has a DSCP of its own) or "other".
type captured struct {
	dev      string
	tos, ttl uint8
	kind     string
}

// bthKind classifies a BTH opcode for captured.
func bthKind(op byte) string {
	switch {
	case op >= 0x06 && op <= 0x0b: // RC RDMA WRITE First ... Only with Immediate
		return "write"
	case op == 0x11:
		return "ack"
	case op == 0x81:
		return "cnp"
	}
	return "other"
}

// roceFilter is a classic BPF program for IPv4 UDP datagrams to port 4791
// without IP options (as Linux sends them) in Ethernet frames: the first
// 64 bytes of each, enough for the IP, UDP and BTH headers.
var roceFilter = []unix.SockFilter{
	{Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 12}, // EtherType
	{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jf: 5, K: unix.ETH_P_IP},
	{Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 14 + 9}, // IP protocol
	{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jf: 3, K: unix.IPPROTO_UDP},
	{Code: unix.BPF_LD | unix.BPF_H | unix.BPF_ABS, K: 14 + 20 + 2}, // UDP destination port
	{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jf: 1, K: 4791},
	{Code: unix.BPF_RET | unix.BPF_K, K: 64},
	{Code: unix.BPF_RET | unix.BPF_K, K: 0},
}

// startForwardCapture opens an AF_PACKET socket in namespace ns and
// records what leaves its devices devs until limit packets or cleanup.
func startForwardCapture(tb testing.TB, ns string, devs []string, limit int) *forwardCapture {
	tb.Helper()
	c := &forwardCapture{fd: -1, devs: map[int]string{}, limit: limit, done: make(chan struct{}), seen: map[captured]int{}}
	err := inNetns(ns, func() error {
		for _, d := range devs {
			ifi, err := net.InterfaceByName(d)
			if err != nil {
				return err
			}
			c.devs[ifi.Index] = d
		}
		// Protocol 0 takes nothing until bind: the filter is in place first.
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("packet socket: %w", err)
		}
		c.fd = fd
		prog := unix.SockFprog{Len: uint16(len(roceFilter)), Filter: &roceFilter[0]}
		if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog); err != nil {
			return fmt.Errorf("filter: %w", err)
		}
		tv := unix.Timeval{Usec: 50_000} // the reader's check of stop
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL)})
	})
	if err != nil && c.fd >= 0 {
		unix.Close(c.fd)
	}
	require.NoError(tb, err, "capture in %s", ns)
	go c.read()
	tb.Cleanup(func() { c.finish() })
	return c
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// read records packets until stop or limit, then closes the socket.
func (c *forwardCapture) read() {
	defer close(c.done)
	defer unix.Close(c.fd)
	buf := make([]byte, 128)
	for total := 0; total < c.limit && !c.stop.Load(); {
		n, from, err := unix.Recvfrom(c.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			c.err = err
			return
		}
		ll, ok := from.(*unix.SockaddrLinklayer)
		if !ok || ll.Pkttype != unix.PACKET_OUTGOING {
			continue
		}
		dev, ok := c.devs[ll.Ifindex]
		const ip, bth = 14, 14 + 20 + 8
		if !ok || n <= bth || buf[ip] != 0x45 {
			continue
		}
		c.seen[captured{dev: dev, tos: buf[ip+1], ttl: buf[ip+8], kind: bthKind(buf[bth])}]++
		total++
	}
}

// finish stops the reader and waits for it.
func (c *forwardCapture) finish() {
	c.stop.Store(true)
	<-c.done
}

// check stops the capture and requires WRITE packets and ACKs forwarded
// onto every device, and every packet but CNPs with DSCP dscp (any ECN
// bits) and TTL ttl.
func (c *forwardCapture) check(tb testing.TB, dscp, ttl uint8) {
	tb.Helper()
	c.finish()
	require.NoError(tb, c.err, "capture")
	seen := map[[2]string]int{} // by device and kind
	var kinds []string
	for k, n := range c.seen {
		kinds = append(kinds, fmt.Sprintf("%s %s tos %#02x ttl %d: %d", k.dev, k.kind, k.tos, k.ttl, n))
		seen[[2]string{k.dev, k.kind}] += n
	}
	slices.Sort(kinds)
	tb.Logf("RoCE packets the router forwarded (device, kind, TOS, TTL: packets): %s", strings.Join(kinds, "; "))
	for _, d := range c.devs {
		require.Positive(tb, seen[[2]string{d, "write"}], "no WRITE packet forwarded onto %s", d)
		require.Positive(tb, seen[[2]string{d, "ack"}], "no ACK forwarded onto %s", d)
	}
	for k, n := range c.seen {
		if k.kind == "cnp" {
			continue
		}
		require.Equal(tb, dscp, k.tos>>2, "DSCP of %d %s packets forwarded onto %s (TOS %#02x)", n, k.kind, k.dev, k.tos)
		require.Equal(tb, ttl, k.ttl, "TTL of %d %s packets forwarded onto %s", n, k.kind, k.dev)
	}
}
