//go:build linux

package soft

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// newKernelFabric opens a fabric on the default kernel wire (UDPWire)
// inside ns, or on the raw one with PVRDMA_WIRE=raw (to compare).
func newKernelFabric(t testing.TB, ns *netns, cfg Config) *Fabric {
	t.Helper()
	kind := "udp"
	if os.Getenv("PVRDMA_WIRE") == "raw" {
		kind = "raw"
	}
	return newFabricOn(t, ns, cfg, kind)
}

// newFabricOn opens a fabric on a kernel wire of the given kind inside
// ns: "udp" (UDPWire) or "raw" (KernelWire).
func newFabricOn(t testing.TB, ns *netns, cfg Config, kind string) *Fabric {
	t.Helper()
	var w wire.Wire
	var err error
	ns.do(t, func() {
		if kind == "raw" {
			w, err = wire.NewKernelWire(wire.KernelWireConfig{})
		} else {
			// PVRDMA_WIRE_QUEUES sets the receive sockets per family
			// (A/B runs of one binary).
			q, _ := strconv.Atoi(os.Getenv("PVRDMA_WIRE_QUEUES"))
			w, err = wire.NewUDPWire(wire.UDPWireConfig{QueuesPerFamily: q})
		}
	})
	require.NoError(t, err)
	cfg.Wire = w
	f, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// Two devices of one fabric over the kernel's loopback, local delivery
// off: the real kernel path (raw sockets out, raw sockets in, ICRC
// checked), IPv4 and IPv6.
func TestKernelLoopbackAllOps(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct{ kind, a, b string }{
		{"udp", "127.0.0.1", "127.0.0.2"}, {"udp", "fd00::1", "fd00::2"},
		{"raw", "127.0.0.1", "127.0.0.2"}, {"raw", "fd00::1", "fd00::2"},
	} {
		fam := [2]string{tc.a, tc.b}
		t.Run(tc.kind+"/"+fam[0], func(t *testing.T) {
			ns := newNetns(t, "lo")
			ns.ip(t, "addr", "add", "fd00::1/128", "dev", "lo")
			ns.ip(t, "addr", "add", "fd00::2/128", "dev", "lo")
			f := newFabricOn(t, ns, Config{DisableLocalDelivery: true, LinkMTU: 65536}, tc.kind)
			icmp0 := ns.snmp(t, "Icmp", "OutDestUnreachs")
			a := newEndpoint(t, f, "a", fam[0], bufSize+1<<20)
			b := newEndpoint(t, f, "b", fam[1], bufSize+1<<20)
			qa, qb := connectRC(t, a, b, defaultRC())
			runAllOps(t, pair{a, b, qa, qb}, opSizes, 20*time.Second)
			c := f.Counters()
			t.Logf("counters: tx %d rx %d retransmitted %d timeouts %d bad_icrc %d; wire %v", c["tx_packets"], c["rx_packets"],
				c["retransmitted_packets"], c["retransmit_timeouts"], c["drop_bad_icrc"], wireCounters(c))
			assert.NotZero(t, c["tx_packets"])
			assert.Zero(t, c["local_packets"])
			assert.Zero(t, c["drop_bad_icrc"])
			assert.Equal(t, icmp0, ns.snmp(t, "Icmp", "OutDestUnreachs"), "no ICMP port unreachable for RoCE")
		})
	}
}

// wireCounters picks a wire's own counters out of a fabric's.
func wireCounters(c map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range c {
		if strings.HasPrefix(k, "wire_") {
			out[k] = v
		}
	}
	return out
}
