package hostile

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// TestCrossVMIsolation: a hostile VM on the same daemon tries to take
// another VM's GID and to inject into its connected QP. The GID stays
// with its owner (EBUSY), and requests from anyone but a QP's configured
// peer are dropped and counted, so the victim's receive is untouched and
// the intruder's SEND ends in RETRY_EXC_ERR.
func TestCrossVMIsolation(t *testing.T) {
	e := newEnv(t)
	victim, friend := e.pair(vmPeer, vmFresh) // GIDs 10.77.0.1 and .2
	evil := e.endpoint(vmEvil, 3)
	v := evil.v
	v.failCmd(abi.CmdCreateBind, abi.CreateBind{MTU: 1024, VLAN: 0xfff, Index: 1, NewGID: victim.gid, GIDType: 2}, syscall.EBUSY)
	v.failCmd(abi.CmdCreateBind, abi.CreateBind{MTU: 1024, VLAN: 0xfff, Index: 0, NewGID: friend.gid, GIDType: 2}, syscall.EBUSY)
	gids := e.vmStatus(vmEvil).GIDs
	require.Len(t, gids, 1, "the refused rebind kept index 0's GID")
	require.Equal(t, evil.gid.String(), gids[0].GID)
	v.failCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 0, DestGID: victim.gid}, eInval)

	// The intruder aims a QP at the victim's QP, PSNs and all (they start
	// at 0 here, as easy to guess as they get).
	q := v.createQP(qpSpec{pd: evil.pd, scq: evil.scq, rcq: evil.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4,
		sendSGE: 1, recvSGE: 1, uar: evil.uc})
	q.toRTSRetry(victim.qp.qpn, victim.gid, 12, 7)
	drops := e.d.Status().Counters["drop_bad_address"]
	victim.qp.postRecv(1, victim.mr.sge(0, 64))
	q.postSend(sendWQE(2), evil.mr.sge(0, 8))
	q.postSend(writeWQE(3, victim.mr.iova, victim.mr.rkey), evil.mr.sge(0, 8))
	requireCQE(t, evil.scq.wait(), q, 2, hostverbs.WCSend, hostverbs.WCRetryExcErr)
	requireCQE(t, evil.scq.wait(), q, 3, hostverbs.WCRDMAWrite, hostverbs.WCWRFlushErr)
	require.Greater(t, e.d.Status().Counters["drop_bad_address"], drops)
	time.Sleep(10 * time.Millisecond)
	victim.rcq.empty()
	require.Equal(t, hostverbs.QPStateRTS, victim.qp.state())

	// The victim's own peer still gets through.
	friend.qp.postSend(sendWQE(4), friend.mr.sge(0, 16))
	requireCQE(t, friend.scq.wait(), friend.qp, 4, hostverbs.WCSend, hostverbs.WCSuccess)
	rc := victim.rcq.wait()
	requireCQE(t, rc, victim.qp, 1, hostverbs.WCRecv, hostverbs.WCSuccess)
	require.Equal(t, friend.qp.qpn, rc.SrcQP)
	e.healthy()
}

// gidOf is the GID of an IP address (IPv4-mapped for IPv4).
func gidOf(s string) hostverbs.GID { return hostverbs.GIDFromAddr(netip.MustParseAddr(s)) }

// bindReq is a RoCE v2 CREATE_BIND of gid at index.
func bindReq(index uint32, gid hostverbs.GID) abi.CreateBind {
	return abi.CreateBind{MTU: 1024, VLAN: 0xfff, Index: index, NewGID: gid, GIDType: 2}
}

// TestGIDSquatWhileOwnerAway: a tenant's guest reboots (device reset),
// then its QEMU disconnects; meanwhile a hostile VM tries to take the GID
// it had. The GID stays
// reserved to its owner until the owner is unregistered: the squatter
// gets EBUSY and the refusal shows in its status and the metrics, and
// the owner gets its GID back when it returns.
func TestGIDSquatWhileOwnerAway(t *testing.T) {
	e := newEnv(t)
	owner := e.boot(vmPeer)
	owner.bindGID(0, gidFor(1))
	evil := e.boot(vmEvil)

	// The owner's guest reboots: its driver resets the device, which
	// drops the GID table.
	owner.setReg(abi.RegCtl, abi.CtlReset)
	require.Empty(t, e.vmStatus(vmPeer).GIDs)
	evil.failCmd(abi.CmdCreateBind, bindReq(0, gidFor(1)), syscall.EBUSY)

	// The owner's QEMU goes away.
	owner.Close()
	require.Eventually(t, func() bool { return !e.connected(vmPeer) }, 5*time.Second, 5*time.Millisecond)
	require.Equal(t, []string{"10.77.0.1"}, e.vmStatus(vmPeer).ReservedGIDs, "reserved while away")
	evil.failCmd(abi.CmdCreateBind, bindReq(0, gidFor(1)), syscall.EBUSY)
	st := e.vmStatus(vmEvil)
	require.Equal(t, uint64(2), st.GIDRefusals)
	require.Equal(t, "::ffff:10.77.0.1", st.LastRefusedGID)
	require.Contains(t, st.LastRefusedReason, "reserved by another VM")
	require.Empty(t, st.GIDs)
	m := e.metrics()
	require.Contains(t, m, `pvrdma_vm_gid_refusals_total{vm="evil"} 2`)
	require.Contains(t, m, `pvrdma_vm_reserved_gids{vm="peer"} 1`)

	// The owner reboots and binds its GID again.
	owner = e.boot(vmPeer)
	owner.bindGID(0, gidFor(1))
	require.Len(t, e.vmStatus(vmPeer).GIDs, 1)
	owner.Close()
	evil.Close()
	e.healthy()
}

// TestGIDForbidden: a hostile VM binds addresses no VM may have: the
// fabric would deliver the host's, everyone's or a link-local service's
// traffic to it (and in IP mode add them to the host). Each is refused
// with EPERM and counted; the VM's own MAC-derived link-local GID (what
// the stock driver binds first) and an address in its allowed prefixes
// are accepted.
func TestGIDForbidden(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	bad := []string{
		"0.0.0.0",                       // unspecified (the zero GID is EINVAL before any policy)
		"127.0.0.1", "127.1.2.3", "::1", // loopback
		"224.0.0.1", "239.1.2.3", "ff02::1", "ff0e::1", // multicast
		"255.255.255.255",                 // limited broadcast
		"169.254.169.254", "169.254.10.1", // link-local services
		"0.1.2.3", "240.0.0.1", "::10.0.0.1", // reserved
		"fe80::1", "fe80::5054:ff:fe00:1", // link-local, not the VM's own
		"8.8.8.8", "2001:db8::1", "100.64.0.1", // outside the default allowed prefixes
	}
	for i, a := range bad {
		v.failCmd(abi.CmdCreateBind, bindReq(uint32(i%16), gidOf(a)), syscall.EPERM)
		require.Equal(t, gidOf(a).String(), e.vmStatus(vmEvil).LastRefusedGID, a)
	}
	st := e.vmStatus(vmEvil)
	require.Equal(t, uint64(len(bad)), st.GIDRefusals)
	require.Equal(t, uint64(len(bad)), st.Counters["gid_refusals"])
	require.Empty(t, st.GIDs, "nothing was bound")
	require.Empty(t, st.ReservedGIDs, "nothing was reserved")

	mac := backend.DefaultMAC(vmEvil)
	own := netip.AddrFrom16([16]byte{0: 0xfe, 1: 0x80, 8: mac[0] ^ 2, 9: mac[1], 10: mac[2], 11: 0xff, 12: 0xfe,
		13: mac[3], 14: mac[4], 15: mac[5]})
	v.bindGID(0, hostverbs.GIDFromAddr(own))
	v.bindGID(1, gidOf("10.77.0.9"))
	v.bindGID(2, gidOf("fd12::9"))
	require.Len(t, e.vmStatus(vmEvil).GIDs, 3)
	v.Close()
	e.healthy()
}

// TestGIDHostAddressAndPolicy: a VM registered (control API) with its own
// allow list that includes the host's address still cannot bind the
// host's address or its subnet's broadcast address, nor anything outside
// its list, though the daemon's default would allow it.
func TestGIDHostAddressAndPolicy(t *testing.T) {
	e := newEnv(t)
	host, bcast := hostIPv4(t)
	allow := []string{netip.PrefixFrom(host, 16).Masked().String(), "10.9.0.0/24"}
	st, err := e.d.AddVM(backend.VMRequest{Name: "tenant", GIDAllow: allow})
	require.NoError(t, err)
	require.Equal(t, allow, st.GIDAllow)
	t.Cleanup(func() { _ = e.d.RemoveVM("tenant") })
	v := e.boot("tenant")
	v.failCmd(abi.CmdCreateBind, bindReq(0, hostverbs.GIDFromAddr(host)), syscall.EPERM)
	require.Contains(t, e.vmStatus("tenant").LastRefusedReason, "an address of the host")
	if bcast.IsValid() {
		v.failCmd(abi.CmdCreateBind, bindReq(0, hostverbs.GIDFromAddr(bcast)), syscall.EPERM)
		require.Contains(t, e.vmStatus("tenant").LastRefusedReason, "broadcast address of one of the host's subnets")
	}
	v.failCmd(abi.CmdCreateBind, bindReq(0, gidOf("10.77.0.5")), syscall.EPERM)
	require.Contains(t, e.vmStatus("tenant").LastRefusedReason, "outside the VM's allowed prefixes")
	v.bindGID(0, gidOf("10.9.0.5"))
	v.Close()
	require.Eventually(t, func() bool { return !e.connected("tenant") }, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, e.d.RemoveVM("tenant"))

	// A bad allow list is refused at registration.
	for _, bad := range [][]string{{"10.0.0.0/33"}, {"none", "10.0.0.0/8"}, {"fe80::1%eth0"}, {"example.com"}, {""}} {
		_, err := e.d.AddVM(backend.VMRequest{Name: "tenant2", GIDAllow: bad})
		require.ErrorIs(t, err, backend.ErrBadGIDPolicy, "%q", bad)
	}
	e.healthy()
}

// hostIPv4 returns a non-loopback IPv4 address of this host and the
// broadcast address of its subnet (invalid for /31 and /32).
func hostIPv4(t *testing.T) (netip.Addr, netip.Addr) {
	ifaddrs, err := net.InterfaceAddrs()
	require.NoError(t, err)
	for _, ia := range ifaddrs {
		n, ok := ia.(*net.IPNet)
		if !ok || n.IP.To4() == nil || n.IP.IsLoopback() || n.IP.IsLinkLocalUnicast() {
			continue
		}
		a, _ := netip.AddrFromSlice(n.IP.To4())
		ones, _ := n.Mask.Size()
		if ones >= 31 {
			return a, netip.Addr{}
		}
		b := a.As4()
		for i := range 4 {
			b[i] |= ^n.Mask[i]
		}
		return a, netip.AddrFrom4(b)
	}
	// A host with only loopback (a bare container): give it an address on
	// a dummy device of this test's own.
	if os.Geteuid() != 0 {
		t.Skip("no non-loopback IPv4 address on this host, and not root to add one")
	}
	dev := fmt.Sprintf("pvrdmah%d", os.Getpid()%10000)
	for _, args := range [][]string{{"link", "add", dev, "type", "dummy"}, {"addr", "add", "10.254.77.1/24", "dev", dev},
		{"link", "set", dev, "up"}} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			_ = exec.Command("ip", "link", "del", dev).Run()
			t.Skipf("no non-loopback IPv4 address, and ip %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", dev).Run() })
	return netip.MustParseAddr("10.254.77.1"), netip.MustParseAddr("10.254.77.255")
}

// countingHandler counts every record at every level (so that debug
// floods count too) and drops it.
type countingHandler struct{ n *atomic.Int64 }

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(context.Context, slog.Record) error {
	h.n.Add(1)
	return nil
}
func (h countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countingHandler) WithGroup(string) slog.Handler      { return h }

// TestGIDBindFlood: a guest binds and unbinds GIDs in a tight loop,
// reconnecting half-way. Its binds beyond the per-VM burst fail with
// EAGAIN at the bucket's rate (so host address changes in IP mode stay
// bounded: TestGIDBindRateBoundsNetlink), and the daemon writes a bounded
// number of log lines, at every level, however many commands fail.
func TestGIDBindFlood(t *testing.T) {
	var lines atomic.Int64
	e := newEnvLog(t, vdev.Limits{}, slog.New(countingHandler{&lines}))
	const rounds = 3000
	accepted, again := 0, 0
	start := time.Now()
	before := lines.Load()
	v := e.boot(vmEvil)
	for i := range rounds {
		if i == rounds/2 {
			v.Close()
			require.Eventually(t, func() bool { return !e.connected(vmEvil) }, 5*time.Second, 5*time.Millisecond)
			v = e.boot(vmEvil)
		}
		gid := hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 78, 14: byte(i >> 8 & 0x0f), 15: byte(i)}
		r := v.post(abi.CmdCreateBind, bindReq(0, gid))
		switch r.err {
		case 0:
			accepted++
			require.Zero(t, v.post(abi.CmdDestroyBind, abi.DestroyBind{Index: 0, DestGID: gid}).err)
		case uint32(syscall.EAGAIN):
			again++
		default:
			t.Fatalf("bind %d: errno %d", i, r.err)
		}
		// Commands that fail for other reasons log too.
		v.post(abi.CmdDestroyBind, abi.DestroyBind{Index: 5, DestGID: gid})
	}
	elapsed := time.Since(start)
	logged := lines.Load() - before
	t.Logf("%d rounds in %v: %d binds accepted, %d EAGAIN, %d log lines", rounds, elapsed, accepted, again, logged)
	require.GreaterOrEqual(t, accepted, 32, "the burst is available")
	require.LessOrEqual(t, float64(accepted), 32+2*elapsed.Seconds()+1, "binds beyond the bucket")
	require.Equal(t, rounds, accepted+again)
	require.Equal(t, uint64(again), e.vmStatus(vmEvil).GIDRefusals)
	// Per 10 s interval: a handful of keys (command failed, GID refused,
	// GID, connect, disconnect, DSR loaded) for the session and device. A
	// key's interval starts at its first line, so a run slower than 10 s
	// (a loaded machine) may log each key again once per 10 s it lasted.
	intervals := 1 + int64(elapsed/ratelog.DefaultInterval)
	require.Less(t, logged, 40*intervals, "log lines for %d failing commands in %v", 2*rounds, elapsed)
	v.Close()
	e.healthy()
}
