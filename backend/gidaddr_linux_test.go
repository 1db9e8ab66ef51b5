package backend

import (
	"net/netip"
	"os"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
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
