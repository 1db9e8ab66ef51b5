package backend

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParseGIDAllow: any allow list either fails with ErrBadGIDPolicy or
// yields canonical prefixes (masked, IPv4 as IPv4, at most
// maxGIDPrefixes) that survive a format/parse round trip.
func FuzzParseGIDAllow(f *testing.F) {
	for _, s := range []string{PrivateGIDAllow, "none", "10.1.0.0/24,fd00:1::/64", "10.1.2.3", "::ffff:10.0.0.0/104",
		"::ffff:10.0.0.0/64", "10.0.0.1/8", " 10.0.0.0/8 , 192.168.0.0/16", "fe80::1%eth0", "0.0.0.0/0", "::/0", ",", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ps, err := ParseGIDAllow(s)
		if err != nil {
			require.ErrorIs(t, err, ErrBadGIDPolicy)
			return
		}
		require.LessOrEqual(t, len(ps), maxGIDPrefixes)
		for _, p := range ps {
			require.True(t, p.IsValid())
			require.Equal(t, p, p.Masked())
			require.False(t, p.Addr().Is4In6())
			require.Empty(t, p.Addr().Zone())
		}
		if ps == nil {
			return
		}
		again, err := ParseGIDAllow(FormatGIDAllow(ps)...)
		require.NoError(t, err)
		require.True(t, slices.Equal(ps, again), "%v -> %v", ps, again)
	})
}

// FuzzParseVMFlag: a --vm value either fails or gives a valid name, a
// 48-bit MAC or none, and an allow list that parses.
func FuzzParseVMFlag(f *testing.F) {
	for _, s := range []string{"vm1", "vm1=52:54:00:12:34:56", "vm1,gid-allow=10.1.0.0/24,gid-allow=fd00::/64",
		"vm1=52:54:00:12:34:56,gid-allow=none", "vm1,gid-allow=", "vm1,mac=x", "=52:54:00:12:34:56", "vm1=,", "a,gid-allow=1.2.3.4/33",
		"vm1,cgroup=/machine.slice/vm1.scope", "vm1,cgroup=/a/../b", "vm1,cgroup=/", "vm1,uid=1000,cgroup=/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		req, err := ParseVMFlag(s)
		if err != nil {
			return
		}
		require.NoError(t, CheckVMName(req.Name))
		if req.MAC != "" {
			require.Len(t, req.MAC, 17)
		}
		_, err = ParseGIDAllow(req.GIDAllow...)
		require.NoError(t, err)
		if req.QEMUCgroup != "" {
			require.NoError(t, CheckCgroupPath(req.QEMUCgroup))
		}
	})
}

// FuzzGIDPolicy: the policy accepts a GID only if no static rule forbids
// it and it is the VM's own link-local GID or inside an allowed prefix.
func FuzzGIDPolicy(f *testing.F) {
	f.Add([]byte{0xfe, 0x80, 8: 0x50, 0x54, 0, 0xff, 0xfe, 0x12, 0x34, 0x56}, "10.0.0.0/8")
	f.Add([]byte{10: 0xff, 11: 0xff, 12: 10, 13: 1, 14: 2, 15: 3}, "10.0.0.0/8,fd00::/8")
	f.Add([]byte{10: 0xff, 11: 0xff, 12: 169, 13: 254, 14: 169, 15: 254}, "0.0.0.0/0")
	f.Fuzz(func(t *testing.T, gid []byte, allow string) {
		var g [16]byte
		copy(g[:], gid)
		ps, err := ParseGIDAllow(allow)
		if err != nil {
			return
		}
		mac := DefaultMAC("vm")
		pol := gidPolicy{allow: ps, linkLocal: linkLocalGID(mac)}
		a := netip.AddrFrom16(g).Unmap()
		if pol.check(a) != nil {
			return
		}
		require.Empty(t, staticGIDReason(a))
		if a == pol.linkLocal {
			return
		}
		require.False(t, a.IsLinkLocalUnicast(), "%v", a)
		require.True(t, slices.ContainsFunc(ps, func(p netip.Prefix) bool { return p.Contains(a) }), "%v not in %v", a, ps)
	})
}

// TestLinkLocalGID: the VM's own link-local GID is the one the stock
// driver binds at index 0 (seen in our guests: fe80::5054:ff:fe12:3456 for
// 52:54:00:12:34:56).
func TestLinkLocalGID(t *testing.T) {
	mac := []byte{0x52, 0x54, 0, 0x12, 0x34, 0x56}
	require.Equal(t, "fe80::5054:ff:fe12:3456", linkLocalGID(mac).String())
}

// TestGIDReservationsCapped: a VM holds at most maxReservedGIDs
// reservations; a new GID beyond them takes the place of the least
// recently bound one the VM no longer holds, or is refused when it holds
// them all. Another VM's reservations are never touched.
func TestGIDReservationsCapped(t *testing.T) {
	o := newGIDOwners()
	addr := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}) }
	all := func(netip.Addr) bool { return true }
	reserve := func(vm string, a netip.Addr, holding func(netip.Addr) bool) error {
		_, err := o.reserve(vm, a, holding)
		return err
	}
	require.NoError(t, reserve("other", addr(1000), all))
	for i := range maxReservedGIDs {
		require.NoError(t, reserve("vm", addr(i), all))
	}
	require.ErrorIs(t, reserve("vm", addr(500), all), ErrGIDRefused, "all held")
	changed, err := o.reserve("vm", addr(0), all)
	require.NoError(t, err, "rebinding a reserved GID is always fine")
	require.False(t, changed)
	held := func(a netip.Addr) bool { return a != addr(1) && a != addr(0) }
	require.NoError(t, reserve("vm", addr(500), held))
	res := o.reserved("vm")
	require.Len(t, res, maxReservedGIDs)
	require.NotContains(t, res, addr(1), "the least recently bound unheld GID was given up")
	require.Contains(t, res, addr(0), "addr(0) was bound more recently")
	require.ErrorIs(t, reserve("vm", addr(1000), held), ErrGIDRefused, "another VM's")

	// A successor adopting the snapshot keeps the same reservations, in
	// the same order of use.
	snap := o.snapshot()
	o2 := newGIDOwners()
	require.Equal(t, maxReservedGIDs+1, o2.adopt(snap))
	require.Equal(t, snap, o2.snapshot())
	require.ErrorIs(t, func() error { _, err := o2.reserve("other", addr(0), all); return err }(), ErrGIDRefused,
		"adopted reservations are enforced")

	require.True(t, o.release("vm"))
	require.False(t, o.release("vm"))
	require.Empty(t, o.reserved("vm"))
	require.Equal(t, []netip.Addr{addr(1000)}, o.reserved("other"))
}
