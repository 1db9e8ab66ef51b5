//go:build linux

package soft

import (
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Fast registration over the kernel's UDP path: two devices of one fabric
// on a namespace's loopback, local delivery off, so every packet crosses
// port 4791 (IP mode).
func TestFastRegUDPLoopback(t *testing.T) {
	needRoot(t)
	ns := newNetns(t, "lo")
	f := newFabricOn(t, ns, Config{DisableLocalDelivery: true, LinkMTU: 65536}, "udp")
	runFastReg(t, func(t *testing.T) pair {
		a := newEndpoint(t, f, "a", "127.0.0.1", 1<<20)
		b := newEndpoint(t, f, "b", "127.0.0.2", 1<<20)
		qa, qb := connectRC(t, a, b, defaultRC())
		return pair{a, b, qa, qb}
	})
}

// Fast registration in L2 mode: two fabrics with packet wires on two
// bridges joined by a veth pair, MTU 1024.
func TestFastRegL2(t *testing.T) {
	_, _, fx, fy := bridgedFabrics(t)
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	runFastReg(t, func(t *testing.T) pair {
		a := newEndpoint(t, fx, "a", "10.9.0.1", 1<<20)
		b := newEndpoint(t, fy, "bb", "10.9.0.2", 1<<20)
		qa, qb := connectL2(t, a, b, harnessMAC("a"), harnessMAC("bb"), o)
		return pair{a, b, qa, qb}
	})
}
