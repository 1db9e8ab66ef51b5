//go:build linux

package soft

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// TestKernelWireBoundToNetdev: host A's fabric netdev a0 carries the
// guests' GIDs (10.98.0.0/24); A also sits on another network (a1,
// 10.97.0.0/24, e.g. the VMs' own or a management network). A peer B on
// that other network routes A's GID through it: with Linux's weak host
// model A's kernel accepts the packet on a1. A wire bound to a0
// (UDPWireConfig.Interface, what IP mode uses) ignores it, so only
// the fabric network reaches the guests; unbound, the same packet is
// delivered. Over a0 itself the bound wire works.
func TestKernelWireBoundToNetdev(t *testing.T) {
	needRoot(t)
	a, b := newNetns(t, "a"), newNetns(t, "b")
	run(t, "ip", "link", "add", "a0", "netns", a.name, "type", "veth", "peer", "name", "b0", "netns", b.name)
	run(t, "ip", "link", "add", "a1", "netns", a.name, "type", "veth", "peer", "name", "b1", "netns", b.name)
	for _, x := range []struct {
		ns        *netns
		dev, addr string
	}{{a, "a0", "10.98.0.1/24"}, {a, "a1", "10.97.0.1/24"}, {b, "b0", "10.98.0.2/24"}, {b, "b1", "10.97.0.2/24"}} {
		x.ns.ip(t, "addr", "add", x.addr, "dev", x.dev)
		x.ns.ip(t, "link", "set", x.dev, "up")
	}
	run(t, "ip", "netns", "exec", a.name, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0",
		"net.ipv4.conf.a0.rp_filter=0", "net.ipv4.conf.a1.rp_filter=0")
	// B reaches A's GID through the other network.
	b.ip(t, "route", "add", "10.98.0.1/32", "via", "10.97.0.1", "dev", "b1")

	var bw *wire.UDPWire
	var err error
	b.do(t, func() { bw, err = wire.NewUDPWire(wire.UDPWireConfig{DisableIPv6: true}) })
	require.NoError(t, err)
	fb, err := New(Config{Wire: bw})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fb.Close() })

	// sendToA opens A's fabric (wire bound to iface, or not), sends one
	// message from B and reports whether A received it.
	sendToA := func(t *testing.T, iface string) (bool, map[string]uint64) {
		var aw *wire.UDPWire
		a.do(t, func() { aw, err = wire.NewUDPWire(wire.UDPWireConfig{DisableIPv6: true, Interface: iface}) })
		require.NoError(t, err)
		fa, err := New(Config{Wire: aw})
		require.NoError(t, err)
		t.Cleanup(func() { _ = fa.Close() })
		ea := newEndpoint(t, fa, "a", "10.98.0.1", 1<<16)
		eb := newEndpoint(t, fb, "bb", "10.98.0.2", 1<<16)
		o := defaultRC()
		o.mtu = hostverbs.MTU1024
		qa, qb := connectRC(t, ea, eb, o)
		require.NoError(t, qa.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: sge(ea, 0, 256)}))
		eb.write(t, eb.iova, []byte("to a's GID"))
		require.NoError(t, qb.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
			SGL: sge(eb, 0, 10)}))
		select {
		case wc := <-ea.ccq.ch:
			require.Equal(t, hostverbs.WCSuccess, wc.Status)
			return true, fa.Counters()
		case <-time.After(time.Second):
			return false, fa.Counters()
		}
	}

	t.Run("unbound wire takes it from the other network", func(t *testing.T) {
		got, c := sendToA(t, "")
		assert.True(t, got, "A: %v", nonzero(c))
	})
	t.Run("wire bound to the fabric netdev ignores it", func(t *testing.T) {
		got, c := sendToA(t, "a0")
		assert.False(t, got)
		assert.Zero(t, c["rx_packets"], "A: %v", nonzero(c))
		assert.Positive(t, fb.Counters()["tx_packets"])
	})
	b.ip(t, "route", "del", "10.98.0.1/32")
	t.Run("wire bound to the fabric netdev takes it from the fabric", func(t *testing.T) {
		got, c := sendToA(t, "a0")
		assert.True(t, got, "A: %v", nonzero(c))
	})
}
