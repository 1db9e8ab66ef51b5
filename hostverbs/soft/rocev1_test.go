package soft

import (
	"bytes"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// TestRoCEv1InProcess: two RoCE v1 devices of one fabric run RC (WRITE,
// SEND) and UD/GSI with v1 GRHs; a v2 device's packets to a v1 device
// are dropped and counted as a version mismatch, and so are a v1
// device's to a v2 device.
func TestRoCEv1InProcess(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	a := newEndpointMode(t, f, "a", "10.1.0.1", 1<<20, false, hostverbs.GIDTypeRoCEv1)
	b := newEndpointMode(t, f, "bb", "fe80::2", 1<<20, false, hostverbs.GIDTypeRoCEv1)
	assert.Equal(t, hostverbs.GIDTypeRoCEv1, a.dev.Attr().GIDType)

	qa, qb := connectRC(t, a, b, defaultRC())
	src := make([]byte, 100<<10)
	fill(src, 3)
	a.write(t, a.iova, src)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 0, len(src)), RemoteAddr: b.iova + 8192, RKey: b.mr.RKey()}))
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)
	assert.True(t, bytes.Equal(src, b.read(t, b.iova+8192, len(src))))
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 2, SGL: sge(b, 512<<10, 4096)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 0, 1000)}))
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)
	require.Equal(t, hostverbs.WCSuccess, b.ccq.wait(t, 5*time.Second).Status)
	assert.Equal(t, src[:1000], b.read(t, b.iova+512<<10, 1000))
	udTest(t, a, b, hostverbs.QPTypeUD)
	udTest(t, a, b, hostverbs.QPTypeGSI)
	assert.Zero(t, ctr(a, "drop_roce_version_mismatch"), "%v", nonzero(f.Counters()))

	// A v2 device sends UD to a's GID: a never sees it.
	c := newEndpoint(t, f, "ccc", "10.1.0.3", 1<<20)
	qc, qav := udQP(t, c, hostverbs.QPTypeUD, 7), udQP(t, a, hostverbs.QPTypeUD, 7)
	udSendToPostedRecv(t, c, qc, a, qav, 9)
	eventually(t, "version mismatch drop", func() bool { return ctr(a, "drop_roce_version_mismatch") == 1 })
	a.ccq.none(t, 50*time.Millisecond)
	// And the other way.
	qcu := udQP(t, c, hostverbs.QPTypeUD, 7)
	udSendToPostedRecv(t, a, qav, c, qcu, 11)
	eventually(t, "version mismatch drop", func() bool { return ctr(c, "drop_roce_version_mismatch") == 2 })
	c.ccq.none(t, 50*time.Millisecond)
}

// TestRoCEv1Config: a v1 device takes v1 GIDs only (and a v2 device v2
// GIDs only), and a fabric whose wire is IP refuses v1 devices: v1 has no
// IP header to route by.
func TestRoCEv1Config(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	mem, _ := guestmem.NewFlat(0, 1<<20)
	d1, err := f.Open(hostverbs.DeviceConfig{Name: "v1", Memory: mem, RoCEMode: hostverbs.GIDTypeRoCEv1})
	require.NoError(t, err)
	defer d1.Close()
	g := hostverbs.GIDFromAddr(mustAddr("10.2.0.1"))
	assert.ErrorIs(t, d1.SetGID(0, hostverbs.GIDEntry{GID: g, Type: hostverbs.GIDTypeRoCEv2}), hostverbs.ErrNotSupported)
	assert.NoError(t, d1.SetGID(0, hostverbs.GIDEntry{GID: g, Type: hostverbs.GIDTypeRoCEv1}))
	d2, err := f.Open(hostverbs.DeviceConfig{Name: "v2", Memory: mem})
	require.NoError(t, err)
	defer d2.Close()
	assert.Equal(t, hostverbs.GIDTypeRoCEv2, d2.Attr().GIDType)
	assert.ErrorIs(t, d2.SetGID(0, hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(mustAddr("10.2.0.2")), Type: hostverbs.GIDTypeRoCEv1}), hostverbs.ErrNotSupported)
	_, err = f.Open(hostverbs.DeviceConfig{Name: "v3", Memory: mem, RoCEMode: 3})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)

	n := wire.NewMemNet(1)
	t.Cleanup(n.Close)
	fip, err := New(Config{Wire: n.Attach()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fip.Close() })
	_, err = fip.Open(hostverbs.DeviceConfig{Name: "v1ip", Memory: mem, RoCEMode: hostverbs.GIDTypeRoCEv1})
	assert.ErrorIs(t, err, hostverbs.ErrNotSupported)
	assert.ErrorContains(t, err, "cannot be routed")
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

// TestCountersOutliveDevices: a device's statistics stay in the fabric's
// after it closes (a VM that disconnects does not take its drops with it:
// the fabric's counters, and the metrics made of them, never go back).
func TestCountersOutliveDevices(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	a := newEndpointMode(t, f, "a", "10.1.0.1", 1<<20, false, hostverbs.GIDTypeRoCEv1)
	c := newEndpoint(t, f, "ccc", "10.1.0.3", 1<<20)
	qc, qa := udQP(t, c, hostverbs.QPTypeUD, 7), udQP(t, a, hostverbs.QPTypeUD, 7)
	udSendToPostedRecv(t, c, qc, a, qa, 1)
	eventually(t, "version mismatch drop", func() bool { return f.Counters()["drop_roce_version_mismatch"] == 1 })
	before := f.Counters()
	require.NoError(t, qa.Destroy())
	require.NoError(t, qc.Destroy())
	require.NoError(t, a.dev.Close())
	require.NoError(t, c.dev.Close())
	after := f.Counters()
	for k, v := range before {
		assert.GreaterOrEqual(t, after[k], v, k)
	}
	assert.Equal(t, uint64(1), after["drop_roce_version_mismatch"])
}

// udSendToPostedRecv posts a receive (WRID wrid) on UD QP qto of to, sends
// it 64 bytes from UD QP qfrom of from (QKey 7, WRID wrid+1) and waits for
// the send's successful completion.
func udSendToPostedRecv(t *testing.T, from *endpoint, qfrom hostverbs.QP, to *endpoint, qto hostverbs.QP, wrid uint64) {
	t.Helper()
	require.NoError(t, qto.PostRecv(&hostverbs.RecvWR{WRID: wrid, SGL: sge(to, 0, 4096)}))
	require.NoError(t, qfrom.PostSend(&hostverbs.SendWR{WRID: wrid + 1, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(from, 0, 64), AV: hostverbs.AddressVector{DGID: to.gid}, RemoteQPN: qto.QPN(), RemoteQKey: 7}))
	require.Equal(t, hostverbs.WCSuccess, from.ccq.wait(t, 5*time.Second).Status)
}
