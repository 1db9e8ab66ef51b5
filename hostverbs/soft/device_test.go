package soft

import (
	"net/netip"
	"strconv"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func newFabric(t *testing.T, cfg Config) *Fabric {
	f, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func openDev(t *testing.T, f *Fabric, lim hostverbs.Limits) hostverbs.Device {
	mem, _ := guestmem.NewFlat(0, 1<<20)
	d, err := f.Open(hostverbs.DeviceConfig{Name: t.Name(), Memory: mem, NodeGUID: 0x5254aaff, Limits: lim})
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func gidOf(s string) hostverbs.GIDEntry {
	return hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(netip.MustParseAddr(s)), Type: hostverbs.GIDTypeRoCEv2}
}

func TestDeviceAttrAndPort(t *testing.T) {
	f := newFabric(t, Config{})
	d := openDev(t, f, hostverbs.Limits{MaxQP: 8, MaxMR: 3})
	a := d.Attr()
	assert.Equal(t, 8, a.MaxQP, "limits cap the advertised maxima")
	assert.Equal(t, 3, a.MaxMR)
	assert.Equal(t, maxCQ, a.MaxCQ)
	assert.Equal(t, uint64(0x5254aaff), a.NodeGUID)
	assert.Equal(t, hostverbs.AtomicHCA, a.AtomicCap)
	assert.Equal(t, gidTableLen, a.GIDTableLen)
	p, err := d.QueryPort(1)
	require.NoError(t, err)
	assert.Equal(t, hostverbs.PortActive, p.State)
	assert.Equal(t, hostverbs.MTU4096, p.MaxMTU)
	assert.Equal(t, hostverbs.MTU4096, p.ActiveMTU, "in process: no link limit")
	_, err = d.QueryPort(2)
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
	for link, want := range map[int]hostverbs.MTU{1500: hostverbs.MTU1024, 9000: hostverbs.MTU4096, 2200: hostverbs.MTU2048, 400: hostverbs.MTU256} {
		f2 := newFabric(t, Config{LinkMTU: link})
		assert.Equal(t, want, f2.ActiveMTU(), "link MTU %d", link)
	}
	_, err = New(Config{LinkMTU: 300})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
}

func TestGIDTable(t *testing.T) {
	f := newFabric(t, Config{})
	a, b := openDev(t, f, hostverbs.Limits{}), openDev(t, f, hostverbs.Limits{})
	g := gidOf("10.1.2.3")
	require.NoError(t, a.SetGID(1, g))
	require.NoError(t, a.SetGID(1, g), "idempotent")
	require.NoError(t, a.SetGID(2, g), "one device may list a GID twice")
	assert.ErrorIs(t, b.SetGID(0, g), hostverbs.ErrBusy, "another device owns it")
	assert.ErrorIs(t, a.SetGID(16, gidOf("10.1.2.4")), hostverbs.ErrInvalid)
	assert.ErrorIs(t, a.SetGID(-1, gidOf("10.1.2.4")), hostverbs.ErrInvalid)
	assert.ErrorIs(t, a.SetGID(3, hostverbs.GIDEntry{Type: hostverbs.GIDTypeRoCEv2}), hostverbs.ErrInvalid)
	assert.ErrorIs(t, a.SetGID(3, hostverbs.GIDEntry{GID: g.GID, Type: hostverbs.GIDTypeRoCEv1}), hostverbs.ErrNotSupported)
	e, err := a.GID(1)
	require.NoError(t, err)
	assert.Equal(t, g, e)
	_, err = a.GID(5)
	assert.ErrorIs(t, err, hostverbs.ErrNotFound)
	require.NoError(t, a.ClearGID(1))
	assert.ErrorIs(t, b.SetGID(0, g), hostverbs.ErrBusy, "still listed at index 2")
	require.NoError(t, a.ClearGID(2))
	assert.ErrorIs(t, a.ClearGID(2), hostverbs.ErrNotFound)
	require.NoError(t, b.SetGID(0, g), "released")
	assert.Same(t, b.(*device), f.lookupGID(g.GID))
	require.NoError(t, b.Close())
	assert.Nil(t, f.lookupGID(g.GID), "closing a device releases its GIDs")
	assert.ErrorIs(t, b.SetGID(0, g), hostverbs.ErrClosed)
}

func TestLimitsAndLifetimes(t *testing.T) {
	f := newFabric(t, Config{})
	d := openDev(t, f, hostverbs.Limits{MaxQP: 2, MaxCQ: 1, MaxPD: 1, MaxMR: 2, MaxSRQ: 1, MaxMRBytes: 8192})
	pd, err := d.AllocPD()
	require.NoError(t, err)
	_, err = d.AllocPD()
	assert.ErrorIs(t, err, hostverbs.ErrNoResources)
	h := newChanCQ()
	cq, err := d.CreateCQ(hostverbs.CQAttr{Depth: 16, Handler: h})
	require.NoError(t, err)
	_, err = d.CreateCQ(hostverbs.CQAttr{Depth: 16, Handler: h})
	assert.ErrorIs(t, err, hostverbs.ErrNoResources)
	_, err = d.CreateCQ(hostverbs.CQAttr{Depth: 16})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid, "a CQ needs a handler")

	pl := func(n int) guestmem.PageList {
		p, err := guestmem.NewPageList(0x1000, uint64(n)*4096, pages(0x1000, uint64(n)*4096))
		require.NoError(t, err)
		return p
	}
	mr1, err := pd.RegMR(hostverbs.MRAttr{Pages: pl(1), Access: hostverbs.AccessLocalWrite})
	require.NoError(t, err)
	assert.Zero(t, mr1.RKey(), "no remote access, no rkey")
	_, err = pd.RegMR(hostverbs.MRAttr{Pages: pl(2), Access: hostverbs.AccessLocalWrite})
	assert.ErrorIs(t, err, hostverbs.ErrNoResources, "MaxMRBytes")
	_, err = pd.RegMR(hostverbs.MRAttr{Pages: pl(1), Access: hostverbs.AccessRemoteWrite})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid, "remote write needs local write")
	_, err = pd.RegMR(hostverbs.MRAttr{Pages: guestmem.PageList{IOVA: 0, Length: 8192, Pages: []guestmem.GPA{0}}})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid, "page count does not cover the length")
	_, err = pd.RegMR(hostverbs.MRAttr{Pages: pl(1), Access: hostverbs.AccessZeroBased})
	assert.ErrorIs(t, err, hostverbs.ErrNotSupported)
	dma, err := pd.RegMR(hostverbs.MRAttr{Pages: guestmem.Identity(), Access: hostverbs.AccessLocalWrite})
	require.NoError(t, err, "a DMA MR counts no bytes")
	_, err = pd.RegMR(hostverbs.MRAttr{Pages: pl(1), Access: hostverbs.AccessLocalWrite})
	assert.ErrorIs(t, err, hostverbs.ErrNoResources, "MaxMR")

	srq, err := pd.CreateSRQ(hostverbs.SRQAttr{MaxWR: 4, MaxSGE: 1})
	require.NoError(t, err)
	_, err = pd.CreateSRQ(hostverbs.SRQAttr{MaxWR: 4, MaxSGE: 1})
	assert.ErrorIs(t, err, hostverbs.ErrNoResources)
	caps := hostverbs.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}
	q1, err := pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: cq, RecvCQ: cq, SRQ: srq, Cap: caps})
	require.NoError(t, err)
	q2, err := pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeGSI, SendCQ: cq, RecvCQ: cq, Cap: caps})
	require.NoError(t, err)
	assert.Equal(t, uint32(1), q2.QPN())
	_, err = pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeUD, SendCQ: cq, RecvCQ: cq, Cap: caps})
	assert.ErrorIs(t, err, hostverbs.ErrNoResources)
	_, err = pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeUC, SendCQ: cq, RecvCQ: cq, Cap: caps})
	assert.ErrorIs(t, err, hostverbs.ErrNotSupported)

	assert.ErrorIs(t, pd.Dealloc(), hostverbs.ErrBusy)
	assert.ErrorIs(t, cq.Destroy(), hostverbs.ErrBusy)
	assert.ErrorIs(t, srq.Destroy(), hostverbs.ErrBusy)
	require.NoError(t, q1.Destroy())
	assert.ErrorIs(t, q1.Destroy(), hostverbs.ErrNotFound)
	require.NoError(t, q2.Destroy())
	require.NoError(t, srq.Destroy())
	require.NoError(t, cq.Destroy())
	require.NoError(t, mr1.Dereg())
	assert.ErrorIs(t, mr1.Dereg(), hostverbs.ErrNotFound)
	require.NoError(t, dma.Dereg())
	require.NoError(t, pd.Dealloc())
	assert.Equal(t, hostverbs.Errno(pd.Dealloc()), hostverbs.Errno(hostverbs.ErrNotFound))
}

func TestModifyValidation(t *testing.T) {
	f := newFabric(t, Config{})
	e := newEndpoint(t, f, "a", "10.9.0.1", 1<<20)
	q := createRC(t, e, defaultRC())
	rtr := func(mod func(a *hostverbs.QPAttr)) error {
		a := hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024, DestQPN: 5, RQPSN: 1,
			MaxDestRdAtomic: 1, MinRNRTimer: 1, AV: hostverbs.AddressVector{DGID: gidOf("10.9.0.2").GID}}
		mod(&a)
		return q.Modify(&a, hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|
			hostverbs.AttrRQPSN|hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer)
	}
	for name, mod := range map[string]func(a *hostverbs.QPAttr){
		"mtu":         func(a *hostverbs.QPAttr) { a.PathMTU = 6 },
		"dest qpn":    func(a *hostverbs.QPAttr) { a.DestQPN = 1 << 24 },
		"rq psn":      func(a *hostverbs.QPAttr) { a.RQPSN = 1 << 24 },
		"rd atomic":   func(a *hostverbs.QPAttr) { a.MaxDestRdAtomic = 200 },
		"rnr timer":   func(a *hostverbs.QPAttr) { a.MinRNRTimer = 32 },
		"sgid index":  func(a *hostverbs.QPAttr) { a.AV.SGIDIndex = 7 },
		"family":      func(a *hostverbs.QPAttr) { a.AV.DGID = gidOf("fd00::5").GID },
		"zero dgid":   func(a *hostverbs.QPAttr) { a.AV.DGID = hostverbs.GID{} },
		"av port":     func(a *hostverbs.QPAttr) { a.AV.Port = 2 },
		"cur state":   func(a *hostverbs.QPAttr) {},
		"wrong state": func(a *hostverbs.QPAttr) { a.State = hostverbs.QPStateRTS },
	} {
		err := rtr(mod)
		if name == "cur state" {
			require.NoError(t, err)
			require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateReset}, hostverbs.AttrState))
			require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1},
				hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
			continue
		}
		assert.Error(t, err, name)
		if name != "sgid index" {
			assert.ErrorIs(t, err, hostverbs.ErrInvalid, name)
		}
	}
	err := q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, PKeyIndex: 1}, hostverbs.AttrState|hostverbs.AttrPKeyIndex)
	assert.ErrorIs(t, err, hostverbs.ErrInvalid, "one P_Key")
	err = q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, CurState: hostverbs.QPStateRTS}, hostverbs.AttrState|hostverbs.AttrCurState)
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
	a, err := q.Query()
	require.NoError(t, err)
	assert.Equal(t, hostverbs.QPStateInit, a.State)
	assert.Equal(t, uint32(4), a.Cap.MaxSendSGE)
}

func TestPostValidation(t *testing.T) {
	f := newFabric(t, Config{})
	a := newEndpoint(t, f, "a", "10.8.0.1", 1<<20)
	b := newEndpoint(t, f, "b", "10.8.0.2", 1<<20)
	o := defaultRC()
	o.sqDepth = 2
	q := createRC(t, a, o)
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend}), hostverbs.ErrInvalid, "INIT")
	qb := createRC(t, b, o)
	rtsRC(t, q, b, qb.QPN(), 0, 0, o)
	rtsRC(t, qb, a, q.QPN(), 0, 0, o)
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: make([]hostverbs.SGE, 5)}), hostverbs.ErrInvalid)
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, Flags: hostverbs.SendInline}), hostverbs.ErrNotSupported)
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRLocalInv}), hostverbs.ErrNotSupported)
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRAtomicFetchAndAdd, SGL: sge(a, 0, 4)}), hostverbs.ErrInvalid)
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: []hostverbs.SGE{{Length: 1 << 31}, {Length: 1 << 31}}}), hostverbs.ErrInvalid)
	// The peer has no receive WQE: the SENDs stay queued (RNR) and fill
	// the two-deep send queue.
	require.NoError(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 8)}))
	require.NoError(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 8)}))
	assert.ErrorIs(t, q.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 8)}), hostverbs.ErrQueueFull)
	ud := udQP(t, a, hostverbs.QPTypeUD, 1)
	assert.ErrorIs(t, ud.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 5000)}), hostverbs.ErrInvalid, "UD above the MTU")
	assert.ErrorIs(t, ud.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRRDMAWrite}), hostverbs.ErrInvalid)
	assert.ErrorIs(t, ud.PostRecv(&hostverbs.RecvWR{SGL: make([]hostverbs.SGE, 3)}), hostverbs.ErrInvalid)
}

func TestCommEstAndSQDrained(t *testing.T) {
	f := newFabric(t, Config{})
	a := newEndpoint(t, f, "a", "10.7.0.1", 1<<20)
	b := newEndpoint(t, f, "b", "10.7.0.2", 1<<20)
	o := defaultRC()
	qa, qb := createRC(t, a, o), createRC(t, b, o)
	rtsRC(t, qa, b, qb.QPN(), o.psnB, o.psnA, o)
	// qb only to RTR: a request makes its connection established.
	require.NoError(t, qb.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: o.mtu, DestQPN: qa.QPN(),
		RQPSN: o.psnA, MaxDestRdAtomic: 1, MinRNRTimer: 1, AV: hostverbs.AddressVector{DGID: a.gid}},
		hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|hostverbs.AttrRQPSN|
			hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: sge(b, 0, 64)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 10)}))
	ev := waitEvent(t, b, hostverbs.EventCommEst)
	assert.Equal(t, qb.QPN(), ev.QPN)
	assert.Equal(t, hostverbs.WCSuccess, b.ccq.wait(t, time.Second).Status)
	// RTS -> SQD with notification: drained at once (nothing outstanding).
	require.NoError(t, qa.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateSQD, EnSQDAsyncNotify: true},
		hostverbs.AttrState|hostverbs.AttrEnSQDAsyncNotify))
	waitEvent(t, a, hostverbs.EventSQDrained)
	// Posted in SQD: queued, not sent, until back in RTS.
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 2, SGL: sge(b, 0, 64)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sge(a, 0, 10)}))
	b.ccq.none(t, 20*time.Millisecond)
	require.NoError(t, qa.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS}, hostverbs.AttrState))
	assert.Equal(t, uint64(2), b.ccq.wait(t, time.Second).WRID)
	assert.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, time.Second).Status)

	// Work outstanding at RTS -> SQD: the event waits until it is done.
	// The peer has no receive WQE yet, so the SEND sits in RNR.
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 10)}))
	require.NoError(t, qa.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateSQD, EnSQDAsyncNotify: true},
		hostverbs.AttrState|hostverbs.AttrEnSQDAsyncNotify))
	q, err := qa.Query()
	require.NoError(t, err)
	assert.True(t, q.SQDraining)
	select {
	case ev := <-a.events:
		t.Fatalf("drained while a SEND is outstanding: %+v", ev)
	case <-time.After(20 * time.Millisecond):
	}
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 3, SGL: sge(b, 0, 64)}))
	waitEvent(t, a, hostverbs.EventSQDrained)
}

func TestSRQ(t *testing.T) {
	f := newFabric(t, Config{})
	a := newEndpoint(t, f, "a", "10.6.0.1", 1<<20)
	b := newEndpoint(t, f, "b", "10.6.0.2", 1<<20)
	srq, err := b.pd.CreateSRQ(hostverbs.SRQAttr{MaxWR: 8, MaxSGE: 1, Limit: 3, Context: 77})
	require.NoError(t, err)
	_, err = b.pd.CreateSRQ(hostverbs.SRQAttr{MaxWR: 8, MaxSGE: 1, Limit: 9})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
	o := defaultRC()
	var qbs []hostverbs.QP
	var qas []hostverbs.QP
	for range 2 {
		qa := createRC(t, a, o)
		qb, err := b.pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: b.cq, RecvCQ: b.cq, SRQ: srq,
			Cap: hostverbs.QPCap{MaxSendWR: 4, MaxSendSGE: 1}})
		require.NoError(t, err)
		require.NoError(t, qb.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1},
			hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
		rtsRC(t, qa, b, qb.QPN(), o.psnB, o.psnA, o)
		rtsRC(t, qb, a, qa.QPN(), o.psnA, o.psnB, o)
		assert.ErrorIs(t, qb.PostRecv(&hostverbs.RecvWR{}), hostverbs.ErrInvalid, "receives go to the SRQ")
		qas, qbs = append(qas, qa), append(qbs, qb)
	}
	for i := range 5 {
		require.NoError(t, srq.PostRecv(&hostverbs.RecvWR{WRID: uint64(10 + i), SGL: sge(b, uint64(i)*64, 64)}))
	}
	for i := range 3 {
		require.NoError(t, qas[i%2].PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, 10)}))
		wc := b.ccq.wait(t, time.Second)
		require.Equal(t, hostverbs.WCSuccess, wc.Status)
		assert.Equal(t, uint64(10+i), wc.WRID, "SRQ WQEs in order across QPs")
		assert.Equal(t, qbs[i%2].QPN(), wc.QPN)
	}
	ev := waitEvent(t, b, hostverbs.EventSRQLimitReached)
	assert.Equal(t, uint64(77), ev.Context)
	q, err := srq.Query()
	require.NoError(t, err)
	assert.Zero(t, q.Limit, "the limit disarms when it fires")
	require.NoError(t, srq.Modify(hostverbs.SRQAttr{Limit: 2}, hostverbs.SRQAttrLimit))
	assert.ErrorIs(t, srq.Modify(hostverbs.SRQAttr{MaxWR: 16}, hostverbs.SRQAttrMaxWR), hostverbs.ErrNotSupported)
	require.NoError(t, qbs[0].Modify(&hostverbs.QPAttr{State: hostverbs.QPStateErr}, hostverbs.AttrState))
	waitEvent(t, b, hostverbs.EventQPLastWQEReach)
}

// TestKeysUnpredictable: memory keys carry a random byte. Two devices (two
// VMs, or the same VM after a restart) registering the same MRs in the same
// order get different keys, and a deregistered MR's key never names the MR
// that reuses its index.
func TestKeysUnpredictable(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	keys := func(name string) []uint32 {
		e := newEndpoint(t, f, name, "10.9.0."+strconv.Itoa(len(name)), 1<<20)
		var ks []uint32
		for range 8 {
			m, err := e.pd.RegMR(hostverbs.MRAttr{Pages: e.mrPages(t), Access: hostverbs.AccessLocalWrite})
			require.NoError(t, err)
			ks = append(ks, m.LKey())
		}
		return ks
	}
	a, b := keys("a"), keys("bb")
	same := 0
	for i := range a {
		if a[i] == b[i] {
			same++
		}
	}
	assert.Less(t, same, 3, "keys of two devices: %x and %x", a, b)

	e := newEndpoint(t, f, "ccc", "10.9.0.3", 1<<20)
	for range 300 {
		m, err := e.pd.RegMR(hostverbs.MRAttr{Pages: e.mrPages(t), Access: hostverbs.AccessLocalWrite})
		require.NoError(t, err)
		old := m.LKey()
		require.NoError(t, m.Dereg())
		d := e.dev.(*device)
		m2, err := e.pd.RegMR(hostverbs.MRAttr{Pages: e.mrPages(t), Access: hostverbs.AccessLocalWrite})
		require.NoError(t, err)
		require.Nil(t, d.keys.lookup(old), "the stale key %#x resolves", old)
		require.NoError(t, m2.Dereg())
	}
}
