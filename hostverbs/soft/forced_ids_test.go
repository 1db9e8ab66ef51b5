package soft

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// TestForcedQPN: a QP created with QPInitAttr.QPN gets exactly that
// number; a number in use is refused with ErrBusy, one outside the user
// QPNs (or not 1 for the GSI QP) with ErrNotSupported; QPN 0 keeps the
// device's own numbering, which continues after the forced numbers.
func TestForcedQPN(t *testing.T) {
	f := newFabric(t, Config{})
	e := newEndpoint(t, f, "a", "10.9.1.1", 1<<20)
	cap := hostverbs.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}
	create := func(typ hostverbs.QPType, qpn uint32) (hostverbs.QP, error) {
		return e.pd.CreateQP(hostverbs.QPInitAttr{Type: typ, SendCQ: e.cq, RecvCQ: e.cq, Cap: cap, QPN: qpn})
	}

	first, err := create(hostverbs.QPTypeRC, 0)
	require.NoError(t, err)
	require.EqualValues(t, firstUserQPN, first.QPN(), "0 keeps today's numbering")

	q, err := create(hostverbs.QPTypeRC, 0x1234)
	require.NoError(t, err)
	require.EqualValues(t, 0x1234, q.QPN())
	ud, err := create(hostverbs.QPTypeUD, 0x40)
	require.NoError(t, err)
	require.EqualValues(t, 0x40, ud.QPN())

	_, err = create(hostverbs.QPTypeUD, 0x1234)
	require.ErrorIs(t, err, hostverbs.ErrBusy, "a QPN in use")
	_, err = create(hostverbs.QPTypeRC, first.QPN())
	require.ErrorIs(t, err, hostverbs.ErrBusy)
	for _, bad := range []uint32{2, firstUserQPN - 1, qpnSpace, 0xFFFFFFFF} {
		_, err = create(hostverbs.QPTypeRC, bad)
		require.ErrorIs(t, err, hostverbs.ErrNotSupported, "QPN %#x", bad)
	}
	_, err = create(hostverbs.QPTypeGSI, 7)
	require.ErrorIs(t, err, hostverbs.ErrNotSupported, "the GSI QP is QP1")
	gsi, err := create(hostverbs.QPTypeGSI, gsiQPN)
	require.NoError(t, err)
	require.EqualValues(t, gsiQPN, gsi.QPN())
	_, err = create(hostverbs.QPTypeGSI, gsiQPN)
	require.ErrorIs(t, err, hostverbs.ErrBusy)

	next, err := create(hostverbs.QPTypeRC, 0)
	require.NoError(t, err)
	require.EqualValues(t, 0x1235, next.QPN(), "allocation continues after the forced QPNs")

	// A destroyed QP's number may be forced again.
	require.NoError(t, q.Destroy())
	again, err := create(hostverbs.QPTypeRC, 0x1234)
	require.NoError(t, err)
	require.EqualValues(t, 0x1234, again.QPN())
}

// TestForcedKeys: an MR registered with MRAttr.LKey (and RKey equal or
// zero) gets that key; a key whose index is in use is refused with
// ErrBusy, keys outside the table or two different keys with
// ErrNotSupported; keys 0 keep the random keys, which never collide with
// forced ones.
func TestForcedKeys(t *testing.T) {
	f := newFabric(t, Config{})
	e := newEndpoint(t, f, "a", "10.9.1.2", 1<<20)
	d := e.dev.(*device)
	remote := hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite
	reg := func(acc hostverbs.Access, lkey, rkey uint32) (hostverbs.MR, error) {
		return e.pd.RegMR(hostverbs.MRAttr{Pages: e.mrPages(t), Access: acc, LKey: lkey, RKey: rkey})
	}

	m, err := reg(remote, 0x4217, 0x4217)
	require.NoError(t, err)
	require.EqualValues(t, 0x4217, m.LKey())
	require.EqualValues(t, 0x4217, m.RKey())
	require.Same(t, m.(*mr), d.keys.lookup(0x4217))

	local, err := reg(hostverbs.AccessLocalWrite, 0x0903, 0)
	require.NoError(t, err)
	require.EqualValues(t, 0x0903, local.LKey())
	require.Zero(t, local.RKey(), "no remote access, no rkey")

	_, err = reg(remote, 0x42aa, 0)
	require.ErrorIs(t, err, hostverbs.ErrBusy, "index 0x42 is taken, whatever the key byte")
	_, err = reg(remote, 0x5000, 0x5001)
	require.ErrorIs(t, err, hostverbs.ErrNotSupported, "one key serves both")
	_, err = reg(remote, 0, 0x5000)
	require.ErrorIs(t, err, hostverbs.ErrNotSupported)
	_, err = reg(remote, 0x00ff, 0)
	require.ErrorIs(t, err, hostverbs.ErrNotSupported, "index 0 is never a key")
	_, err = reg(remote, uint32(d.attr.MaxMR+1)<<8, 0)
	require.ErrorIs(t, err, hostverbs.ErrNotSupported, "beyond the key table")

	// Provider-chosen keys fill the indices skipped over and never take
	// a forced one.
	seen := map[uint32]bool{0x42: true, 0x09: true}
	for range 0x50 {
		k, err := reg(hostverbs.AccessLocalWrite, 0, 0)
		require.NoError(t, err)
		idx := k.LKey() >> 8
		require.False(t, seen[idx], "index %#x handed out twice", idx)
		seen[idx] = true
	}
	// A forced key freed and taken again, then freed: alloc reuses it once.
	require.NoError(t, m.Dereg())
	m2, err := reg(remote, 0x4233, 0)
	require.NoError(t, err)
	require.EqualValues(t, 0x4233, m2.LKey())
	require.Nil(t, d.keys.lookup(0x4217), "the old key no longer resolves")
	require.NoError(t, m2.Dereg())
	used := map[uint32]bool{}
	for range 8 {
		k, err := reg(hostverbs.AccessLocalWrite, 0, 0)
		require.NoError(t, err)
		require.False(t, used[k.LKey()>>8])
		used[k.LKey()>>8] = true
	}
}
