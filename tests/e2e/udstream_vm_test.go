//go:build vm

package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// udStreams are the two-way UD streams TestUDStream runs: 3000 datagrams of 64 bytes
// each way at once, every one checked on arrival (testdata/udstream.c). With -c a side
// sends only while the peer has a receive posted for the datagram, so none may be lost.
var udStreams = []struct{ name, args string }{
	// A CQ for sends and one for receives, 64 receives, 32 sends in flight.
	{"two-cqs", "-c -n 3000"},
	// One CQ for both, 4 receives and 4 sends: every receive is reposted while
	// datagrams keep coming the other way, and the CQ mixes both.
	{"one-cq-depth-4", "-c -1 -r 4 -t 4 -m 2 -n 3000"},
}

// The lossy stream: 3000 datagrams each way without flow control, each side posting
// 256 receives and reposting until it has posted lossyRecvs in all, then none, so that
// at least udCount - lossyRecvs datagrams each way find no receive, whatever the
// machine's speed: the loss path is exercised by construction, not by chance.
const (
	udCount    = 3000
	lossyRecvs = 1024
)

// udstreamScenario runs the streams on the device dev (GID index of self's address in
// $g), the client side against peer if peer is set, each after "=== NAME" and followed
// by "rc=N"; then one stream without flow control ("lossy"), whose losses it reports.
func udstreamScenario(dev, self, peer string, port int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "g=$(pvt_gid_index %s %s)\n", dev, self)
	run := func(name, args string) {
		fmt.Fprintf(&b, "echo '=== %s %s'\n", dev, name)
		fmt.Fprintf(&b, "if pvt_retry 60 timeout 120 udstream -d %s -g $g -p %d %s %s; then echo rc=0; else echo rc=$?; fi\n", dev, port, args, peer)
		port++
	}
	for _, s := range udStreams {
		run(s.name, s.args)
	}
	run("lossy", fmt.Sprintf("-r 256 -R %d -n %d", lossyRecvs, udCount))
	return b.String()
}

// buildUDStream compiles testdata/udstream.c for the guests (against the host's
// libibverbs headers; the guests' rdma-core provides the library).
func buildUDStream(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "udstream")
	out, err := exec.Command("gcc", "-O2", "-Wall", "-o", bin,
		filepath.Join(repoDir(t), "tests/e2e/testdata/udstream.c"), "-libverbs").CombinedOutput()
	require.NoError(t, err, "build udstream (needs gcc and libibverbs-dev: make deps): %s", out)
	return bin
}

// checkUDStreams asserts that every flow-controlled stream ended OK on every guest
// (all datagrams arrived, once, each completion's wc_flags exactly IBV_WC_GRH), that
// each side of the lossy one sent all its datagrams and received no more than it
// posted receives for, and that the lossy streams over each device lost datagrams (a
// run that lost none did not exercise the loss path); it logs what the lossy one
// received and returns how many datagrams the lossy streams over dev lost in all (what
// was sent minus what arrived, both ways).
func checkUDStreams(t *testing.T, res []vm.Result, devs ...string) map[string]uint64 {
	t.Helper()
	okRE := regexp.MustCompile(`(?m)^udstream: sent 3000 recv 3000 dup 0 flags 0x1 badflags 0 OK$`)
	lineRE := regexp.MustCompile(`(?m)^udstream: sent (\d+) recv (\d+) .*$`)
	lost := map[string]uint64{}
	for _, dev := range devs {
		var sent, recv uint64
		for _, r := range res {
			for _, s := range udStreams {
				sec := vm.Section(r.Output, dev+" "+s.name)
				assert.Regexp(t, okRE, sec, "%s: %s %s (%s)", r.VM, dev, s.name, s.args)
				assert.Contains(t, sec, "rc=0", "%s: %s %s", r.VM, dev, s.name)
			}
			m := lineRE.FindStringSubmatch(vm.Section(r.Output, dev+" lossy"))
			if !assert.NotNil(t, m, "%s: %s lossy printed no result", r.VM, dev) {
				continue
			}
			t.Logf("UDSTREAM lossy (no flow control, 256 receives, %d in all) vm=%s dev=%s: %s", lossyRecvs, r.VM, dev, m[0])
			s, _ := strconv.ParseUint(m[1], 10, 64)
			n, _ := strconv.ParseUint(m[2], 10, 64)
			assert.Equal(t, uint64(udCount), s, "%s: %s lossy: datagrams sent", r.VM, dev)
			assert.LessOrEqual(t, n, uint64(lossyRecvs), "%s: %s lossy: more received than receives posted", r.VM, dev)
			sent, recv = sent+s, recv+n
		}
		if assert.LessOrEqual(t, recv, sent, "%s: more received than sent", dev) {
			lost[dev] = sent - recv
			assert.NotZero(t, lost[dev], "%s: the lossy streams lost nothing: they did not exercise the loss path", dev)
		}
	}
	return lost
}

// checkUDDrops asserts that the daemons counted every datagram the lossy streams over
// our device lost as dropped for want of a posted receive, and nothing else as dropped.
func checkUDDrops(t *testing.T, lost uint64, counters ...map[string]uint64) {
	t.Helper()
	drops := map[string]uint64{}
	for _, c := range counters {
		for k, v := range c {
			if strings.HasPrefix(k, "drop_") && v != 0 {
				drops[k] += v
			}
		}
	}
	t.Logf("UDSTREAM lossy over our device: %d lost, daemon drops %v", lost, drops)
	want := map[string]uint64{}
	if lost != 0 {
		want["drop_ud_no_recv_wqe"] = lost
	}
	assert.Equal(t, want, drops, "every datagram lost is counted as dropped for want of a receive")
}

// TestUDStream: two stock guests on one daemon stream small UD datagrams at each other,
// both ways at once, over our device and then over kernel rxe on their vmxnet3 NICs (the
// control), with a CQ per direction and with one CQ and queues of four. Every datagram
// must arrive, and every receive completion must carry wc_flags IBV_WC_GRH and nothing
// else, as rxe's do (the device gave user QPs the kernel's GRH | NETWORK_HDR_TYPE, 0x41,
// which is GRH | TM_DATA_VALID to libibverbs). A stream without flow control, whose
// receivers stop reposting after lossyRecvs receives, must lose datagrams on both
// devices (no receive posted when one arrives: rxe drops them, and the daemon counts
// every one lost over ours as drop_ud_no_recv_wqe and nothing else).
func TestUDStream(t *testing.T) {
	img := image(t)
	bin := buildUDStream(t)
	d := daemon(t, backend.Config{}, "uds1", "uds2")
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	scen := func(self, peer string) string {
		return "pvt_rxe eth0\n" + udstreamScenario("vmw_pvrdma0", self, peer, 18600) + udstreamScenario("rxe0", self, peer, 18700)
	}
	a := pvrdmaGuest(d, "uds1", "10.77.0.1/24", scen("10.77.0.1", ""))
	b := pvrdmaGuest(d, "uds2", "10.77.0.2/24", scen("10.77.0.2", "10.77.0.1"))
	for _, c := range []*vm.Config{&a, &b} {
		c.Modules = append(vm.DefaultModules(), "crc32_generic", "udp_tunnel", "ip6_udp_tunnel", "rdma_rxe")
		c.HostFiles = map[string]string{"/usr/bin/udstream": bin}
	}
	res := runGuests(context.Background(), t, img, nw, 10*time.Minute, a, b)
	lost := checkUDStreams(t, res, "vmw_pvrdma0", "rxe0")
	t.Logf("daemon counters: %v", nonzero(d.Status().Counters))
	checkUDDrops(t, lost["vmw_pvrdma0"], d.Status().Counters)
}

// TestUDStreamTwoHosts is TestUDStream's streams between two daemons (IP mode, the UDP
// wire between them, as TestTwoHosts sets up), over our device only.
func TestUDStreamTwoHosts(t *testing.T) {
	img := image(t)
	bin := buildUDStream(t)
	nwA, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	nwB, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	linkNetworks(t, nwA, nwB, "vmnetA", "vmnetB")
	fabricLink(t, nwA, nwB, "10.77.0.0/24")
	for _, nw := range []*vm.Network{nwA, nwB} {
		require.NoError(t, nw.Do(func() error {
			return os.WriteFile("/proc/sys/net/ipv4/conf/all/arp_ignore", []byte("1"), 0o644)
		}))
	}
	dA := daemonIn(t, nwA, backend.FabricConfig{Netdev: "fabA"}, "ha1")
	dB := daemonIn(t, nwB, backend.FabricConfig{Netdev: "fabB"}, "hb1")
	a := pvrdmaGuest(dA, "ha1", "10.77.0.1/24", udstreamScenario("vmw_pvrdma0", "10.77.0.1", "", 18600))
	b := pvrdmaGuest(dB, "hb1", "10.77.0.2/24", udstreamScenario("vmw_pvrdma0", "10.77.0.2", "10.77.0.1", 18600))
	for _, c := range []*vm.Config{&a, &b} {
		c.HostFiles = map[string]string{"/usr/bin/udstream": bin}
		c.NoErrExit, c.Timeout = true, 10*time.Minute
	}
	ctx := context.Background()
	va, err := vm.Start(ctx, t, img, nwA, a)
	require.NoError(t, err)
	vb, err := vm.Start(ctx, t, img, nwB, b)
	require.NoError(t, err)
	res, err := vm.WaitAll(ctx, va, vb)
	require.NoError(t, err)
	lost := checkUDStreams(t, res, "vmw_pvrdma0")
	t.Logf("daemon A counters: %v", nonzero(dA.Status().Counters))
	t.Logf("daemon B counters: %v", nonzero(dB.Status().Counters))
	checkUDDrops(t, lost["vmw_pvrdma0"], dA.Status().Counters, dB.Status().Counters)
}
