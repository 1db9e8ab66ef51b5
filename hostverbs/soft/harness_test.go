package soft

import (
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/stretchr/testify/require"
)

// chanCQ collects completions in a channel (the handler must not block:
// the channel is deep).
type chanCQ struct{ ch chan hostverbs.WorkCompletion }

func newChanCQ() *chanCQ { return &chanCQ{ch: make(chan hostverbs.WorkCompletion, 1<<16)} }

func (c *chanCQ) Complete(wc *hostverbs.WorkCompletion) { c.ch <- *wc }

func (c *chanCQ) wait(t testing.TB, timeout time.Duration) hostverbs.WorkCompletion {
	t.Helper()
	select {
	case wc := <-c.ch:
		return wc
	case <-time.After(timeout):
		t.Fatalf("no completion within %v", timeout)
	}
	return hostverbs.WorkCompletion{}
}

func (c *chanCQ) none(t testing.TB, d time.Duration) {
	t.Helper()
	select {
	case wc := <-c.ch:
		t.Fatalf("unexpected completion %+v", wc)
	case <-time.After(d):
	}
}

// endpoint is one device with a guest memory, a PD, a CQ and one MR that
// maps a user-VA-like IOVA range onto the guest's pages in scrambled order.
type endpoint struct {
	dev    hostverbs.Device
	mem    *guestmem.Memory
	data   []byte
	pd     hostverbs.PD
	cq     hostverbs.CQ
	ccq    *chanCQ
	mr     hostverbs.MR
	iova   uint64
	size   uint64
	gid    hostverbs.GID
	events chan hostverbs.AsyncEvent
}

const testIOVA = 0x7f1200000000

func newEndpoint(t testing.TB, f *Fabric, name, ip string, size uint64) *endpoint {
	t.Helper()
	return newEndpointLayout(t, f, name, ip, size, false)
}

// newEndpointLayout is newEndpoint with the MR's pages in guest-physical
// order (contiguous) or reversed (every page boundary a discontinuity).
func newEndpointLayout(t testing.TB, f *Fabric, name, ip string, size uint64, contiguous bool) *endpoint {
	t.Helper()
	return newEndpointMode(t, f, name, ip, size, contiguous, hostverbs.GIDTypeRoCEv2)
}

// newEndpointMode is newEndpointLayout for a device of the given RoCE mode.
func newEndpointMode(t testing.TB, f *Fabric, name, ip string, size uint64, contiguous bool, mode hostverbs.GIDType) *endpoint {
	t.Helper()
	size = (size + guestmem.PageSize - 1) &^ (guestmem.PageSize - 1)
	mem, data := guestmem.NewFlat(0, size)
	ev := make(chan hostverbs.AsyncEvent, 64)
	dev, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: mem, MAC: [6]byte{0x52, 0x54, 0, 0, 0, byte(len(name))},
		RoCEMode: mode,
		Events: func(e hostverbs.AsyncEvent) {
			select {
			case ev <- e:
			default:
			}
		}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = dev.Close() })
	g := hostverbs.GIDFromAddr(netip.MustParseAddr(ip))
	require.NoError(t, dev.SetGID(0, hostverbs.GIDEntry{GID: g, Type: mode}))
	pd, err := dev.AllocPD()
	require.NoError(t, err)
	ccq := newChanCQ()
	cq, err := dev.CreateCQ(hostverbs.CQAttr{Depth: 1 << 16, Handler: ccq})
	require.NoError(t, err)
	npages := size / guestmem.PageSize
	pages := make([]guestmem.GPA, npages)
	for i := range pages {
		// Reverse order: every page boundary is a discontinuity.
		pages[i] = guestmem.GPA((npages - 1 - uint64(i)) * guestmem.PageSize)
		if contiguous {
			pages[i] = guestmem.GPA(uint64(i) * guestmem.PageSize)
		}
	}
	pl, err := guestmem.NewPageList(testIOVA, size, pages)
	require.NoError(t, err)
	mr, err := pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite |
		hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic})
	require.NoError(t, err)
	return &endpoint{dev: dev, mem: mem, data: data, pd: pd, cq: cq, ccq: ccq, mr: mr,
		iova: testIOVA, size: size, gid: g, events: ev}
}

// write and read access the endpoint's MR by IOVA.
func (e *endpoint) write(t testing.TB, iova uint64, b []byte) {
	t.Helper()
	pl := e.mrPages(t)
	require.NoError(t, pl.WriteAt(e.mem, b, iova))
}

func (e *endpoint) read(t testing.TB, iova uint64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, e.mrPages(t).ReadAt(e.mem, b, iova))
	return b
}

func (e *endpoint) mrPages(t testing.TB) guestmem.PageList {
	m, ok := e.mr.(*mr)
	require.True(t, ok)
	return m.pages
}

// rcOpts tweak connectRC.
type rcOpts struct {
	mtu        hostverbs.MTU
	timeout    uint8
	retry, rnr uint8
	minRNR     uint8
	access     hostverbs.Access
	sqDepth    uint32
	rqDepth    uint32
	rdAtomic   uint8
	psnA, psnB uint32
	tclass     uint8 // the address vectors' traffic class
}

func defaultRC() rcOpts {
	return rcOpts{mtu: hostverbs.MTU4096, timeout: 14, retry: 7, rnr: 7, minRNR: 1,
		access:  hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic,
		sqDepth: 1024, rqDepth: 1024, rdAtomic: 16, psnA: 0xfffff0, psnB: 0x123}
}

func createRC(t testing.TB, e *endpoint, o rcOpts) hostverbs.QP {
	t.Helper()
	q, err := e.pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: e.cq, RecvCQ: e.cq,
		Cap: hostverbs.QPCap{MaxSendWR: o.sqDepth, MaxRecvWR: o.rqDepth, MaxSendSGE: 4, MaxRecvSGE: 4}})
	require.NoError(t, err)
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, AccessFlags: o.access},
		hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
	return q
}

// rtsRC moves q to RTS towards the remote QP.
func rtsRC(t testing.TB, q hostverbs.QP, remote *endpoint, rqpn uint32, rqpsn, sqpsn uint32, o rcOpts) {
	t.Helper()
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: o.mtu, DestQPN: rqpn,
		RQPSN: rqpsn, MaxDestRdAtomic: o.rdAtomic, MinRNRTimer: o.minRNR,
		AV: hostverbs.AddressVector{DGID: remote.gid, HopLimit: 64, Port: 1}},
		hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|
			hostverbs.AttrRQPSN|hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: o.timeout,
		RetryCnt: o.retry, RNRRetry: o.rnr, SQPSN: sqpsn, MaxRdAtomic: o.rdAtomic},
		hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|hostverbs.AttrRNRRetry|
			hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic))
}

// connectRC creates a connected RC pair between a and b.
func connectRC(t testing.TB, a, b *endpoint, o rcOpts) (qa, qb hostverbs.QP) {
	t.Helper()
	qa, qb = createRC(t, a, o), createRC(t, b, o)
	rtsRC(t, qa, b, qb.QPN(), o.psnB, o.psnA, o)
	rtsRC(t, qb, a, qa.QPN(), o.psnA, o.psnB, o)
	return qa, qb
}

func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		b[i], b[i+1], b[i+2], b[i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
		b[i+4], b[i+5], b[i+6], b[i+7] = byte(v>>32), byte(v>>40), byte(v>>48), byte(v>>56)
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
}

func sge(e *endpoint, off uint64, n int) []hostverbs.SGE {
	return []hostverbs.SGE{{Addr: e.iova + off, Length: uint32(n), LKey: e.mr.LKey()}}
}
