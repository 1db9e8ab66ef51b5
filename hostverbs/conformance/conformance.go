// Package conformance is one suite of behaviour every hostverbs provider
// must show: the soft transport runs it on the host, the ibverbs relay over
// kernel rxe inside a test-bed guest. Two devices of the provider under
// test talk to each other: every opcode, sizes up to 1 MiB over scattered
// guest pages, error statuses, flushes, RNR and limits.
package conformance

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Env is the provider under test.
type Env struct {
	// Open returns a new device over mem with lim and events as its
	// asynchronous event callback, and the GID it installed at index 0
	// (for ibverbs: one the host GID table holds).
	Open func(t *testing.T, name string, mem *guestmem.Memory, lim hostverbs.Limits, events func(hostverbs.AsyncEvent)) (hostverbs.Device, hostverbs.GID)
	// Timeout bounds each wait for a completion (default 10 s).
	Timeout time.Duration
}

// cases are the suite's cases in the order they run.
var cases = []struct {
	name string
	run  func(*testing.T, Env)
}{
	{"DeviceAndPort", testDeviceAndPort},
	{"SendRecvSizes", testSendRecvSizes},
	{"WriteReadImm", testWriteReadImm},
	{"Atomics", testAtomics},
	{"UD", testUD},
	{"RemoteAccessError", testRemoteAccessError},
	{"LocalLengthError", testLocalLengthError},
	{"RNRRetryExceeded", testRNR},
	{"FlushOnError", testFlush},
	{"Limits", testLimits},
	{"SRQ", testSRQ},
	{"SRQLimitEvent", testSRQLimit},
	{"FastRegistration", testFastReg},
}

// Names lists the suite's cases (a test that runs the suite elsewhere,
// in a guest for instance, checks that each of them passed).
func Names() []string {
	names := make([]string, len(cases))
	for i, c := range cases {
		names[i] = c.name
	}
	return names
}

// Run runs the suite.
func Run(t *testing.T, env Env) {
	if env.Timeout == 0 {
		env.Timeout = 10 * time.Second
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, env) })
	}
}

// chanCQ collects completions (the handler must not block: deep channel).
type chanCQ struct{ ch chan hostverbs.WorkCompletion }

func (c *chanCQ) Complete(wc *hostverbs.WorkCompletion) { c.ch <- *wc }

// ep is one device with a memfd-backed guest memory, a PD, a CQ and an MR
// whose IOVA range maps the guest pages in reverse order.
type ep struct {
	env  Env
	dev  hostverbs.Device
	gid  hostverbs.GID
	mem  *guestmem.Memory
	pd   hostverbs.PD
	cq   hostverbs.CQ
	ccq  *chanCQ
	mr   hostverbs.MR
	pl   guestmem.PageList
	iova uint64
	ev   chan hostverbs.AsyncEvent
}

const (
	memSize  = 4 << 20
	iovaBase = 0x7f3400000000
)

// MemfdMemory returns size bytes of guest memory at GPA 0 backed by a memfd,
// as QEMU's is (the ibverbs relay maps MR pages again from the file).
func MemfdMemory(t testing.TB, size uint64) *guestmem.Memory {
	t.Helper()
	fd, err := unix.MemfdCreate("conformance", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, int64(size)))
	spec, err := guestmem.MapFD(0, size, guestmem.ProtRead|guestmem.ProtWrite, fd, 0)
	if err != nil {
		unix.Close(fd)
		t.Fatalf("map guest memory: %v", err)
	}
	m := guestmem.New()
	require.NoError(t, m.Add(spec))
	t.Cleanup(func() { _ = m.RemoveAll() })
	return m
}

func newEP(t *testing.T, env Env, name string, lim hostverbs.Limits) *ep {
	t.Helper()
	mem := MemfdMemory(t, memSize)
	ev := make(chan hostverbs.AsyncEvent, 64)
	dev, gid := env.Open(t, name, mem, lim, func(e hostverbs.AsyncEvent) {
		select {
		case ev <- e:
		default:
		}
	})
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	pd, err := dev.AllocPD()
	require.NoError(t, err)
	ccq := &chanCQ{ch: make(chan hostverbs.WorkCompletion, 1<<14)}
	cq, err := dev.CreateCQ(hostverbs.CQAttr{Depth: 4096, Handler: ccq})
	require.NoError(t, err)
	n := memSize / guestmem.PageSize
	pages := make([]guestmem.GPA, n)
	for i := range pages {
		pages[i] = guestmem.GPA((n - 1 - i) * guestmem.PageSize)
	}
	pl, err := guestmem.NewPageList(iovaBase, memSize, pages)
	require.NoError(t, err)
	mr, err := pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite |
		hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic})
	require.NoError(t, err)
	return &ep{env: env, dev: dev, gid: gid, mem: mem, pd: pd, cq: cq, ccq: ccq, mr: mr, pl: pl, iova: iovaBase, ev: ev}
}

func (e *ep) write(t *testing.T, off uint64, b []byte) {
	t.Helper()
	require.NoError(t, e.pl.WriteAt(e.mem, b, e.iova+off))
}

func (e *ep) read(t *testing.T, off uint64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, e.pl.ReadAt(e.mem, b, e.iova+off))
	return b
}

func (e *ep) sge(off uint64, n int) []hostverbs.SGE {
	return []hostverbs.SGE{{Addr: e.iova + off, Length: uint32(n), LKey: e.mr.LKey()}}
}

func (e *ep) wait(t *testing.T) hostverbs.WorkCompletion {
	t.Helper()
	select {
	case wc := <-e.ccq.ch:
		return wc
	case <-time.After(e.env.Timeout):
		t.Fatalf("no completion within %v", e.env.Timeout)
	}
	return hostverbs.WorkCompletion{}
}

// waitOK waits for a successful completion of the given opcode.
func (e *ep) waitOK(t *testing.T, op hostverbs.WCOpcode) hostverbs.WorkCompletion {
	t.Helper()
	wc := e.wait(t)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "completion %+v", wc)
	require.Equal(t, op, wc.Opcode, "completion %+v", wc)
	return wc
}

type rcOpts struct {
	rnrRetry uint8
	retry    uint8
	access   hostverbs.Access
	srq      hostverbs.SRQ
}

func defaultRC() rcOpts {
	return rcOpts{rnrRetry: 7, retry: 7, access: hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic}
}

func (e *ep) createQP(t *testing.T, typ hostverbs.QPType, o rcOpts) hostverbs.QP {
	t.Helper()
	q, err := e.pd.CreateQP(hostverbs.QPInitAttr{Type: typ, SendCQ: e.cq, RecvCQ: e.cq, SRQ: o.srq,
		Cap: hostverbs.QPCap{MaxSendWR: 256, MaxRecvWR: 256, MaxSendSGE: 4, MaxRecvSGE: 4}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = q.Destroy() })
	attr := &hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, AccessFlags: o.access, QKey: 0x11111111}
	mask := hostverbs.AttrState | hostverbs.AttrPKeyIndex | hostverbs.AttrPort
	if typ == hostverbs.QPTypeUD {
		mask |= hostverbs.AttrQKey
	} else {
		mask |= hostverbs.AttrAccessFlags
	}
	require.NoError(t, q.Modify(attr, mask))
	return q
}

func rts(t *testing.T, q hostverbs.QP, remote *ep, rqpn uint32, o rcOpts) {
	t.Helper()
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024, DestQPN: rqpn,
		RQPSN: 0x100, MaxDestRdAtomic: 4, MinRNRTimer: 1,
		AV: hostverbs.AddressVector{DGID: remote.gid, SGIDIndex: 0, HopLimit: 64, Port: 1}},
		hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|
			hostverbs.AttrRQPSN|hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: 14, RetryCnt: o.retry,
		RNRRetry: o.rnrRetry, SQPSN: 0x100, MaxRdAtomic: 4},
		hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|hostverbs.AttrRNRRetry|
			hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic))
}

// pair returns two endpoints with a connected RC QP each.
func pair(t *testing.T, env Env, o rcOpts) (a, b *ep, qa, qb hostverbs.QP) {
	t.Helper()
	a, b = newEP(t, env, "confa", hostverbs.Limits{}), newEP(t, env, "confb", hostverbs.Limits{})
	qa, qb = a.createQP(t, hostverbs.QPTypeRC, o), b.createQP(t, hostverbs.QPTypeRC, o)
	rts(t, qa, b, qb.QPN(), o)
	rts(t, qb, a, qa.QPN(), o)
	return a, b, qa, qb
}

func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed*31+7))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func testDeviceAndPort(t *testing.T, env Env) {
	e := newEP(t, env, "conf", hostverbs.Limits{})
	a := e.dev.Attr()
	require.Positive(t, a.MaxQP)
	require.Positive(t, a.MaxQPWR)
	require.GreaterOrEqual(t, a.MaxSGE, 4)
	require.Positive(t, a.MaxCQE)
	pa, err := e.dev.QueryPort(1)
	require.NoError(t, err)
	require.Equal(t, hostverbs.PortActive, pa.State)
	require.True(t, pa.ActiveMTU.Valid(), "active MTU %d", pa.ActiveMTU)
	_, err = e.dev.QueryPort(2)
	require.ErrorIs(t, err, hostverbs.ErrInvalid)
	g, err := e.dev.GID(0)
	require.NoError(t, err)
	require.Equal(t, e.gid, g.GID)
	require.NotZero(t, e.mr.LKey())
}

func testSendRecvSizes(t *testing.T, env Env) {
	a, b, qa, qb := pair(t, env, defaultRC())
	for i, n := range []int{1, 63, 4096, 4097, 65536, 1 << 20} {
		data := pattern(n, uint64(i+1))
		a.write(t, 0, data)
		require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(100 + i), SGL: b.sge(2<<20, n)}))
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRSend,
			Flags: hostverbs.SendSignaled, SGL: a.sge(0, n)}))
		wc := a.waitOK(t, hostverbs.WCSend)
		require.Equal(t, uint64(i), wc.WRID)
		wc = b.waitOK(t, hostverbs.WCRecv)
		require.Equal(t, uint64(100+i), wc.WRID)
		require.Equal(t, uint32(n), wc.ByteLen)
		require.Equal(t, qb.QPN(), wc.QPN)
		require.True(t, bytes.Equal(data, b.read(t, 2<<20, n)), "%d bytes differ", n)
	}
}

func testWriteReadImm(t *testing.T, env Env) {
	a, b, qa, qb := pair(t, env, defaultRC())
	const n = 300000
	data := pattern(n, 7)
	a.write(t, 0, data)
	// RDMA WRITE into b at an unaligned offset.
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, n), RemoteAddr: b.iova + 1<<20 + 13, RKey: b.mr.RKey()}))
	a.waitOK(t, hostverbs.WCRDMAWrite)
	require.True(t, bytes.Equal(data, b.read(t, 1<<20+13, n)))
	// RDMA READ it back into a.
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
		SGL: a.sge(2<<20, n), RemoteAddr: b.iova + 1<<20 + 13, RKey: b.mr.RKey()}))
	a.waitOK(t, hostverbs.WCRDMARead)
	require.True(t, bytes.Equal(data, a.read(t, 2<<20, n)))
	// WRITE WITH IMM consumes a receive and carries the immediate.
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 9}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRRDMAWriteWithImm, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 4096), RemoteAddr: b.iova, RKey: b.mr.RKey(), ImmData: 0xdeadbeef}))
	a.waitOK(t, hostverbs.WCRDMAWrite)
	wc := b.waitOK(t, hostverbs.WCRecvRDMAWithImm)
	require.Equal(t, uint64(9), wc.WRID)
	require.NotZero(t, wc.Flags&hostverbs.WCFlagWithImm)
	require.Equal(t, uint32(0xdeadbeef), wc.ImmData)
	require.Equal(t, uint32(4096), wc.ByteLen)
	// SEND WITH IMM.
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 10, SGL: b.sge(3<<20, 64)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 4, Opcode: hostverbs.WRSendWithImm, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 64), ImmData: 0x01020304}))
	a.waitOK(t, hostverbs.WCSend)
	wc = b.waitOK(t, hostverbs.WCRecv)
	require.Equal(t, uint32(0x01020304), wc.ImmData)
	require.NotZero(t, wc.Flags&hostverbs.WCFlagWithImm)
}

func testAtomics(t *testing.T, env Env) {
	if env.Open == nil {
		t.Fatal("no env")
	}
	a, b, qa, _ := pair(t, env, defaultRC())
	var v [8]byte
	putU64(v[:], 5000)
	b.write(t, 4096, v[:])
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRAtomicFetchAndAdd, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 8), RemoteAddr: b.iova + 4096, RKey: b.mr.RKey(), CompareAdd: 7}))
	a.waitOK(t, hostverbs.WCFetchAdd)
	require.Equal(t, uint64(5000), getU64(a.read(t, 0, 8)))
	require.Equal(t, uint64(5007), getU64(b.read(t, 4096, 8)))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRAtomicCmpAndSwp, Flags: hostverbs.SendSignaled,
		SGL: a.sge(8, 8), RemoteAddr: b.iova + 4096, RKey: b.mr.RKey(), CompareAdd: 5007, Swap: 42}))
	a.waitOK(t, hostverbs.WCCompSwap)
	require.Equal(t, uint64(5007), getU64(a.read(t, 8, 8)))
	require.Equal(t, uint64(42), getU64(b.read(t, 4096, 8)))
	// A failing compare leaves the value and returns it.
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRAtomicCmpAndSwp, Flags: hostverbs.SendSignaled,
		SGL: a.sge(16, 8), RemoteAddr: b.iova + 4096, RKey: b.mr.RKey(), CompareAdd: 1, Swap: 99}))
	a.waitOK(t, hostverbs.WCCompSwap)
	require.Equal(t, uint64(42), getU64(a.read(t, 16, 8)))
	require.Equal(t, uint64(42), getU64(b.read(t, 4096, 8)))
}

func putU64(b []byte, v uint64) {
	for i := range 8 {
		b[i] = byte(v >> (8 * i))
	}
}

func getU64(b []byte) uint64 {
	var v uint64
	for i := range 8 {
		v |= uint64(b[i]) << (8 * i)
	}
	return v
}

func testUD(t *testing.T, env Env) {
	a, b := newEP(t, env, "uda", hostverbs.Limits{}), newEP(t, env, "udb", hostverbs.Limits{})
	qa, qb := a.createQP(t, hostverbs.QPTypeUD, defaultRC()), b.createQP(t, hostverbs.QPTypeUD, defaultRC())
	for _, q := range []hostverbs.QP{qa, qb} {
		require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR}, hostverbs.AttrState))
		require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, SQPSN: 1}, hostverbs.AttrState|hostverbs.AttrSQPSN))
	}
	const n = 512
	data := pattern(n, 3)
	a.write(t, 0, data)
	// A UD receive buffer starts with 40 bytes for the GRH.
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 5, SGL: b.sge(8192, 40+n)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 6, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, n), AV: hostverbs.AddressVector{DGID: b.gid, HopLimit: 64, Port: 1},
		RemoteQPN: qb.QPN(), RemoteQKey: 0x11111111}))
	a.waitOK(t, hostverbs.WCSend)
	wc := b.waitOK(t, hostverbs.WCRecv)
	require.Equal(t, uint32(40+n), wc.ByteLen)
	require.Equal(t, qa.QPN(), wc.SrcQP)
	require.NotZero(t, wc.Flags&hostverbs.WCFlagGRH)
	require.True(t, bytes.Equal(data, b.read(t, 8192+40, n)))
}

func testRemoteAccessError(t *testing.T, env Env) {
	a, b, qa, _ := pair(t, env, defaultRC())
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 64), RemoteAddr: b.iova, RKey: b.mr.RKey() ^ 0x100}))
	wc := a.wait(t)
	require.Equal(t, hostverbs.WCRemAccessErr, wc.Status, "%+v", wc)
	// Out of the MR's range with the right key fails too.
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 64), RemoteAddr: b.iova + memSize - 32, RKey: b.mr.RKey()}))
	wc = a.wait(t)
	require.Equal(t, hostverbs.WCWRFlushErr, wc.Status, "the QP is in error after the first failure: %+v", wc)
}

func testLocalLengthError(t *testing.T, env Env) {
	a, b, qa, qb := pair(t, env, defaultRC())
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: b.sge(0, 100)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: a.sge(0, 200)}))
	// IBA: a Local Length Error at the responder, an Invalid Request NAK
	// to the requester; kernel rxe reports a local QP operation error and a
	// Remote Operational Error. Either way both sides fail the message.
	wc := b.wait(t)
	require.Contains(t, []hostverbs.WCStatus{hostverbs.WCLocLenErr, hostverbs.WCLocQPOpErr}, wc.Status, "%+v", wc)
	wc = a.wait(t)
	require.Contains(t, []hostverbs.WCStatus{hostverbs.WCRemInvReqErr, hostverbs.WCRemOpErr}, wc.Status, "%+v", wc)
}

func testRNR(t *testing.T, env Env) {
	o := defaultRC()
	o.rnrRetry = 0
	a, _, qa, _ := pair(t, env, o)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: a.sge(0, 64)}))
	wc := a.wait(t)
	require.Equal(t, hostverbs.WCRNRRetryExcErr, wc.Status, "%+v", wc)
}

func testFlush(t *testing.T, env Env) {
	_, b, _, qb := pair(t, env, defaultRC())
	for i := range 3 {
		require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: b.sge(0, 64)}))
	}
	require.NoError(t, qb.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateErr}, hostverbs.AttrState))
	for i := range 3 {
		wc := b.wait(t)
		require.Equal(t, hostverbs.WCWRFlushErr, wc.Status)
		require.Equal(t, uint64(i), wc.WRID)
	}
	attr, err := qb.Query()
	require.NoError(t, err)
	require.Equal(t, hostverbs.QPStateErr, attr.State)
}

func testLimits(t *testing.T, env Env) {
	e := newEP(t, env, "lim", hostverbs.Limits{MaxQP: 2, MaxCQ: 2, MaxMR: 2})
	q1 := e.createQP(t, hostverbs.QPTypeRC, defaultRC())
	_ = e.createQP(t, hostverbs.QPTypeRC, defaultRC())
	_, err := e.pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: e.cq, RecvCQ: e.cq,
		Cap: hostverbs.QPCap{MaxSendWR: 16, MaxRecvWR: 16, MaxSendSGE: 1, MaxRecvSGE: 1}})
	require.ErrorIs(t, err, hostverbs.ErrNoResources)
	_, err = e.dev.CreateCQ(hostverbs.CQAttr{Depth: 16, Handler: e.ccq})
	require.NoError(t, err)
	_, err = e.dev.CreateCQ(hostverbs.CQAttr{Depth: 16, Handler: e.ccq})
	require.ErrorIs(t, err, hostverbs.ErrNoResources)
	// A CQ in use cannot go; a PD in use cannot go.
	require.ErrorIs(t, e.cq.Destroy(), hostverbs.ErrBusy)
	require.ErrorIs(t, e.pd.Dealloc(), hostverbs.ErrBusy)
	// Bad arguments are refused, not passed on.
	_, err = e.dev.CreateCQ(hostverbs.CQAttr{Depth: -1, Handler: e.ccq})
	require.Error(t, err)
	// A destroyed QP takes no more work.
	require.NoError(t, q1.Destroy())
	sgl := []hostverbs.SGE{{Addr: e.iova, Length: 8, LKey: e.mr.LKey()}}
	require.ErrorIs(t, q1.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sgl}), hostverbs.ErrClosed)
	require.ErrorIs(t, q1.PostRecv(&hostverbs.RecvWR{SGL: sgl}), hostverbs.ErrClosed)
}

// srqPair connects an RC QP of a new endpoint a to one of b that receives
// from an SRQ of b made with attr.
func srqPair(t *testing.T, env Env, attr hostverbs.SRQAttr) (a, b *ep, srq hostverbs.SRQ, qa, qb hostverbs.QP) {
	t.Helper()
	a, b = newEP(t, env, "srqa", hostverbs.Limits{}), newEP(t, env, "srqb", hostverbs.Limits{})
	srq, err := b.pd.CreateSRQ(attr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = srq.Destroy() })
	o := defaultRC()
	qa = a.createQP(t, hostverbs.QPTypeRC, o)
	o.srq = srq
	qb = b.createQP(t, hostverbs.QPTypeRC, o)
	rts(t, qa, b, qb.QPN(), defaultRC())
	rts(t, qb, a, qa.QPN(), defaultRC())
	return a, b, srq, qa, qb
}

func testSRQ(t *testing.T, env Env) {
	a, b, srq, qa, qb := srqPair(t, env, hostverbs.SRQAttr{MaxWR: 64, MaxSGE: 2})
	for i := range 4 {
		require.NoError(t, srq.PostRecv(&hostverbs.RecvWR{WRID: uint64(50 + i), SGL: b.sge(uint64(i)*4096, 4096)}))
	}
	require.ErrorIs(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: b.sge(0, 64)}), hostverbs.ErrInvalid)
	for i := range 4 {
		data := pattern(1000+i, uint64(i))
		a.write(t, 1<<20, data)
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: a.sge(1<<20, len(data))}))
		a.waitOK(t, hostverbs.WCSend)
		wc := b.waitOK(t, hostverbs.WCRecv)
		require.Equal(t, uint64(50+i), wc.WRID)
		require.True(t, bytes.Equal(data, b.read(t, uint64(i)*4096, len(data))))
	}
	require.ErrorIs(t, srq.Destroy(), hostverbs.ErrBusy)
	attr, err := srq.Query()
	require.NoError(t, err)
	require.GreaterOrEqual(t, attr.MaxWR, uint32(64))
}

// testSRQLimit: an armed SRQ limit raises one SRQ_LIMIT_REACHED event,
// carrying the SRQ's context, when fewer WRs than the limit remain.
func testSRQLimit(t *testing.T, env Env) {
	a, b, srq, qa, _ := srqPair(t, env, hostverbs.SRQAttr{MaxWR: 16, MaxSGE: 1, Context: 0xabc})
	for i := range 8 {
		require.NoError(t, srq.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: b.sge(uint64(i)*64, 64)}))
	}
	require.NoError(t, srq.Modify(hostverbs.SRQAttr{Limit: 4}, hostverbs.SRQAttrLimit))
	for i := range 5 {
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: a.sge(0, 32)}))
		a.waitOK(t, hostverbs.WCSend)
		b.waitOK(t, hostverbs.WCRecv)
	}
	select {
	case e := <-b.ev:
		require.Equal(t, hostverbs.EventSRQLimitReached, e.Type, "%+v", e)
		require.Equal(t, uint64(0xabc), e.Context)
	case <-time.After(env.Timeout):
		t.Fatal("no SRQ limit event")
	}
}

// testFastReg: a provider that advertises fast registration
// (DeviceCapMemMgtExtensions) serves it: its PDs implement FastRegPD, a
// registration under the consumer's key is what a peer's WRITE and READ
// resolve, a SEND with invalidate frees it (the receive completion says so
// with the key) and the key is refused afterwards. A provider that does
// not advertise it must not half-offer it: MaxFastRegPageListLen is 0.
func testFastReg(t *testing.T, env Env) {
	a, b, qa, qb := pair(t, env, defaultRC())
	attr := b.dev.Attr()
	if attr.DeviceCapFlags&hostverbs.DeviceCapMemMgtExtensions == 0 {
		require.Zero(t, attr.MaxFastRegPageListLen, "no fast registration advertised, no page list length either")
		t.Log("the provider does not advertise fast registration")
		return
	}
	require.Positive(t, attr.MaxFastRegPageListLen)
	fpd, ok := b.pd.(hostverbs.FastRegPD)
	require.True(t, ok, "fast registration advertised: the PDs implement FastRegPD")
	fr, err := fpd.AllocFastRegMR(hostverbs.FastRegAttr{MaxPages: 4})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fr.Dereg() })
	key := fr.LKey()&^0xff | (fr.LKey()+1)&0xff
	pages := []guestmem.GPA{0x5000, 0x2000, 0x9000}
	const iova = 0xffff888000000100
	const length = 3*4096 - 0x100
	pl, err := guestmem.NewPageList(iova, length, pages)
	require.NoError(t, err)
	require.NoError(t, fr.Register(hostverbs.FastReg{Pages: pl, Access: hostverbs.AccessLocalWrite |
		hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead, Key: key}))
	data := pattern(length, 9)
	a.write(t, 0, data)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, length), RemoteAddr: iova, RKey: key}))
	a.waitOK(t, hostverbs.WCRDMAWrite)
	got := make([]byte, length)
	require.NoError(t, pl.ReadAt(b.mem, got, iova))
	require.True(t, bytes.Equal(data, got), "the WRITE landed on the registration's pages")
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
		SGL: a.sge(64<<10, length), RemoteAddr: iova, RKey: key}))
	a.waitOK(t, hostverbs.WCRDMARead)
	require.True(t, bytes.Equal(data, a.read(t, 64<<10, length)))
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 3, SGL: b.sge(0, 4096)}))
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 4, Opcode: hostverbs.WRSendWithInv, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 32), ImmData: key}))
	wc := b.waitOK(t, hostverbs.WCRecv)
	require.NotZero(t, wc.Flags&hostverbs.WCFlagWithInvalidate, "%+v", wc)
	require.Equal(t, key, wc.ImmData, "the invalidated key")
	a.waitOK(t, hostverbs.WCSend)
	st, _ := fr.Registration()
	require.Equal(t, hostverbs.MRFree, st)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 5, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: a.sge(0, 64), RemoteAddr: iova, RKey: key}))
	wc = a.wait(t)
	require.Equal(t, hostverbs.WCRemAccessErr, wc.Status, "the invalidated key is refused: %+v", wc)
}
