package soft

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// createRCQPN is createRC with the QPN the QP must get.
func createRCQPN(t testing.TB, e *endpoint, o rcOpts, qpn uint32) hostverbs.QP {
	t.Helper()
	q, err := e.pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: e.cq, RecvCQ: e.cq, QPN: qpn,
		Cap: hostverbs.QPCap{MaxSendWR: o.sqDepth, MaxRecvWR: o.rqDepth, MaxSendSGE: 4, MaxRecvSGE: 4}})
	require.NoError(t, err)
	require.EqualValues(t, qpn, q.QPN())
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, AccessFlags: o.access},
		hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
	return q
}

// reopen is e's guest as a new process sees it after a hand-over: a new
// device on f over the same guest memory, with e's GID, and e's MR
// registered again with its keys. e's device must be closed.
func reopen(t testing.TB, f *Fabric, e *endpoint, name string) *endpoint {
	t.Helper()
	ev := make(chan hostverbs.AsyncEvent, 64)
	dev, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: e.mem, MAC: [6]byte{0x52, 0x54, 0, 0, 1, byte(len(name))},
		Events: func(x hostverbs.AsyncEvent) {
			select {
			case ev <- x:
			default:
			}
		}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = dev.Close() })
	require.NoError(t, dev.SetGID(0, hostverbs.GIDEntry{GID: e.gid, Type: hostverbs.GIDTypeRoCEv2}))
	pd, err := dev.AllocPD()
	require.NoError(t, err)
	ccq := newChanCQ()
	cq, err := dev.CreateCQ(hostverbs.CQAttr{Depth: 1 << 16, Handler: ccq})
	require.NoError(t, err)
	m, err := pd.RegMR(hostverbs.MRAttr{Pages: e.mrPages(t), LKey: e.mr.LKey(), RKey: e.mr.RKey(),
		Access: hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic})
	require.NoError(t, err)
	return &endpoint{dev: dev, mem: e.mem, data: e.data, pd: pd, cq: cq, ccq: ccq, mr: m,
		iova: e.iova, size: e.size, gid: e.gid, events: ev}
}

func saver(t testing.TB, q hostverbs.QP) hostverbs.TransportSaver {
	t.Helper()
	s, ok := q.(hostverbs.TransportSaver)
	require.True(t, ok)
	return s
}

// waitWR waits for a completion on e's CQ with wrid (others may come
// first: they are returned too).
func waitWRs(t testing.TB, e *endpoint, n int) map[uint64]hostverbs.WorkCompletion {
	t.Helper()
	got := map[uint64]hostverbs.WorkCompletion{}
	for len(got) < n {
		wc := e.ccq.wait(t, 10*time.Second)
		require.NotContains(t, got, wc.WRID, "two completions for WR %d", wc.WRID)
		got[wc.WRID] = wc
	}
	return got
}

// traffic moves data from src (QP qs) to dst (QP qd): a SEND with
// immediate, an RDMA WRITE, an RDMA READ back and a FETCH_ADD, each
// checked, all successful; base separates the rounds' buffers and WRIDs.
func traffic(t *testing.T, src, dst *endpoint, qs, qd hostverbs.QP, base uint64, size int) {
	t.Helper()
	off := base * uint64(4*size+64)
	buf := make([]byte, size)
	fill(buf, base)
	src.write(t, src.iova+off, buf)
	require.NoError(t, qd.PostRecv(&hostverbs.RecvWR{WRID: base<<8 | 1, SGL: sge(dst, off, size)}))
	require.NoError(t, qs.PostSend(&hostverbs.SendWR{WRID: base<<8 | 2, Opcode: hostverbs.WRSendWithImm,
		Flags: hostverbs.SendSignaled, SGL: sge(src, off, size), ImmData: uint32(base)}))
	wc := dst.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	require.Equal(t, base<<8|1, wc.WRID)
	require.EqualValues(t, size, wc.ByteLen)
	require.Equal(t, uint32(base), wc.ImmData)
	require.True(t, bytes.Equal(buf, dst.read(t, dst.iova+off, size)), "SEND payload")
	wc = src.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)

	fill(buf, base+1000)
	src.write(t, src.iova+off+uint64(size), buf)
	require.NoError(t, qs.PostSend(&hostverbs.SendWR{WRID: base<<8 | 3, Opcode: hostverbs.WRRDMAWrite,
		Flags: hostverbs.SendSignaled, SGL: sge(src, off+uint64(size), size), RemoteAddr: dst.iova + off + uint64(size), RKey: dst.mr.RKey()}))
	wc = src.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	require.True(t, bytes.Equal(buf, dst.read(t, dst.iova+off+uint64(size), size)), "WRITE payload")

	fill(buf, base+2000)
	dst.write(t, dst.iova+off+2*uint64(size), buf)
	require.NoError(t, qs.PostSend(&hostverbs.SendWR{WRID: base<<8 | 4, Opcode: hostverbs.WRRDMARead,
		Flags: hostverbs.SendSignaled, SGL: sge(src, off+2*uint64(size), size), RemoteAddr: dst.iova + off + 2*uint64(size), RKey: dst.mr.RKey()}))
	wc = src.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	require.True(t, bytes.Equal(buf, src.read(t, src.iova+off+2*uint64(size), size)), "READ payload")

	word := (off + 3*uint64(size) + 7) &^ 7
	dst.write(t, dst.iova+word, binary.LittleEndian.AppendUint64(nil, base*10))
	require.NoError(t, qs.PostSend(&hostverbs.SendWR{WRID: base<<8 | 5, Opcode: hostverbs.WRAtomicFetchAndAdd,
		Flags: hostverbs.SendSignaled, SGL: sge(src, word, 8), RemoteAddr: dst.iova + word, RKey: dst.mr.RKey(), CompareAdd: 3}))
	wc = src.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	require.Equal(t, base*10, binary.LittleEndian.Uint64(src.read(t, src.iova+word, 8)))
	require.Equal(t, base*10+3, binary.LittleEndian.Uint64(dst.read(t, dst.iova+word, 8)))
}

// TestTransportHandOverInProcess: two RC QPs of one fabric exchange
// traffic both ways, drain and save their transport state; their devices
// close (the old process ends), new devices over the same guest memory
// get QPs with the same QPNs, brought to RTS as before, and the states
// are restored: traffic goes on both ways, PSNs where they were (across
// the 24-bit wrap), with correct data and no error completion.
func TestTransportHandOverInProcess(t *testing.T) {
	o := defaultRC()
	o.psnA = 0xfffffa // a's PSNs wrap during the first rounds
	f := newFabric(t, Config{})
	a := newEndpoint(t, f, "a", "10.7.0.1", 4<<20)
	b := newEndpoint(t, f, "b", "10.7.0.2", 4<<20)
	qa, qb := connectRC(t, a, b, o)
	for i := range uint64(3) {
		traffic(t, a, b, qa, qb, 1+i, 3000)
		traffic(t, b, a, qb, qa, 11+i, 5000)
	}
	// Receives the guests posted that did not complete: their rings hold
	// them, the new process posts them again.
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 99, SGL: sge(b, 0, 64)}))
	for _, q := range []hostverbs.QP{qa, qb} {
		require.True(t, saver(t, q).SendsDrained())
	}
	sa, err := saver(t, qa).SaveTransport()
	require.NoError(t, err)
	sb, err := saver(t, qb).SaveTransport()
	require.NoError(t, err)
	again, err := saver(t, qa).SaveTransport()
	require.NoError(t, err)
	assert.Equal(t, sa, again, "a frozen QP saves the same state again")
	st, err := decodeTransport(sa)
	require.NoError(t, err)
	assert.True(t, st.reqPSN < 0x100, "the PSNs wrapped: %#x", st.reqPSN)
	assert.Len(t, st.res, 6, "three READs and three atomics of b's to answer again")
	qas := qa.(*qp)
	qas.sqMu.Lock()
	wantReq, wantResp, wantMSN := qas.req.psn, qas.resp.psn, qas.resp.msn
	qas.sqMu.Unlock()

	// The old process ends; the new one opens devices on the fabric.
	require.NoError(t, a.dev.Close())
	require.NoError(t, b.dev.Close())
	a2, b2 := reopen(t, f, a, "a2"), reopen(t, f, b, "b2")
	qa2, qb2 := createRCQPN(t, a2, o, qa.QPN()), createRCQPN(t, b2, o, qb.QPN())
	rtsRC(t, qa2, b2, qb.QPN(), o.psnB, o.psnA, o)
	rtsRC(t, qb2, a2, qa.QPN(), o.psnA, o.psnB, o)
	require.NoError(t, saver(t, qa2).RestoreTransport(sa))
	require.NoError(t, saver(t, qb2).RestoreTransport(sb))
	require.NoError(t, qb2.PostRecv(&hostverbs.RecvWR{WRID: 99, SGL: sge(b2, 0, 64)}))
	q := qa2.(*qp)
	q.sqMu.Lock()
	assert.Equal(t, wantReq, q.req.psn)
	assert.Equal(t, wantReq, q.req.sentHigh)
	assert.Equal(t, wantReq, q.comp.psn)
	assert.Equal(t, wantResp, q.resp.psn)
	assert.Equal(t, wantMSN, q.resp.msn)
	q.sqMu.Unlock()
	// Saved again at once, the state is what was restored.
	back, err := saver(t, qa2).SaveTransport()
	require.NoError(t, err)
	assert.Equal(t, sa, back)
	saver(t, qa2).ResumeTransport()

	// The outstanding receive takes the next SEND.
	a2.write(t, a2.iova+3<<20, []byte("after the hand-over"))
	require.NoError(t, qa2.PostSend(&hostverbs.SendWR{WRID: 7, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(a2, 3<<20, 19)}))
	wc := b2.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	assert.EqualValues(t, 99, wc.WRID)
	assert.Equal(t, []byte("after the hand-over"), b2.read(t, b2.iova, 19))
	require.Equal(t, hostverbs.WCSuccess, a2.ccq.wait(t, 10*time.Second).Status)
	for i := range uint64(3) {
		traffic(t, a2, b2, qa2, qb2, 21+i, 4096)
		traffic(t, b2, a2, qb2, qa2, 31+i, 100)
	}
	a2.ccq.none(t, 0)
	b2.ccq.none(t, 0)
}

// TestTransportHandOverMemNet: b's two QPs are handed over to a new fabric
// on the same network while a goes on, with work of a's in flight: a SEND
// whose ACK, a READ (in window-sized parts) whose first part's responses
// and an atomic whose result b sent and the network lost, and a SEND the
// frozen QP dropped. The restored QPs' NAKs make a resend at once (no
// timer runs: the clock is manual); b answers the duplicate READ from
// memory and the duplicate atomic from its saved result, without adding
// twice; the data is whole and nothing fails.
func TestTransportHandOverMemNet(t *testing.T) {
	clk := NewManualClock(time.Unix(1000, 0))
	net := wire.NewMemNet(11)
	t.Cleanup(net.Close)
	mk := func() *Fabric {
		f, err := New(Config{Wire: net.Attach(), Clock: clk, LinkMTU: 9000, Window: 16})
		require.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	fa, fb := mk(), mk()
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	a := newEndpoint(t, fa, "a", "10.8.0.1", 1<<20)
	b := newEndpoint(t, fb, "b", "10.8.0.2", 1<<20)
	qa1, qb1 := connectRC(t, a, b, o)
	qa2, qb2 := connectRC(t, a, b, o)
	traffic(t, a, b, qa1, qb1, 1, 3000)
	traffic(t, b, a, qb1, qa1, 2, 5000)
	traffic(t, a, b, qa2, qb2, 3, 100)

	// From now on what b sends is lost.
	bIP := netip.MustParseAddr("10.8.0.2").As4()
	var dropB atomic.Bool
	net.SetImpairment(wire.Impairment{Drop: func(pkt []byte) bool {
		return dropB.Load() && len(pkt) > 20 && pkt[0]>>4 == 4 && [4]byte(pkt[12:16]) == bIP
	}})
	dropB.Store(true)
	msn := func(q hostverbs.QP) uint32 {
		s := q.(*qp)
		s.rqMu.Lock()
		defer s.rqMu.Unlock()
		return s.resp.msn
	}
	m1, m2 := msn(qb1), msn(qb2)
	const sendOff, readSrc, readDst, word = 100 << 10, 200 << 10, 300 << 10, 400 << 10
	sendData := make([]byte, 3000)
	fill(sendData, 1)
	a.write(t, a.iova+sendOff, sendData)
	readData := make([]byte, 40<<10) // 40 packets: 3 parts of at most 16
	fill(readData, 2)
	b.write(t, b.iova+readSrc, readData)
	b.write(t, b.iova+word, binary.LittleEndian.AppendUint64(nil, 1000))
	require.NoError(t, qb1.PostRecv(&hostverbs.RecvWR{WRID: 51, SGL: sge(b, sendOff, 4096)}))
	require.NoError(t, qa1.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(a, sendOff, len(sendData))}))
	require.NoError(t, qa1.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
		SGL: sge(a, readDst, len(readData)), RemoteAddr: b.iova + readSrc, RKey: b.mr.RKey()}))
	require.NoError(t, qa2.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRAtomicFetchAndAdd, Flags: hostverbs.SendSignaled,
		SGL: sge(a, word, 8), RemoteAddr: b.iova + word, RKey: b.mr.RKey(), CompareAdd: 5}))
	// b takes the SEND, the READ's first part and the atomic.
	wc := b.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	require.EqualValues(t, 51, wc.WRID)
	eventually(t, "b accepts the READ and the atomic", func() bool {
		return msn(qb1) == m1+2 && msn(qb2) == m2+1 && saver(t, qb1).SendsDrained()
	})
	assert.Equal(t, uint64(1005), binary.LittleEndian.Uint64(b.read(t, b.iova+word, 8)))
	sb1, err := saver(t, qb1).SaveTransport()
	require.NoError(t, err)
	sb2, err := saver(t, qb2).SaveTransport()
	require.NoError(t, err)
	// The frozen QP drops a's next SEND.
	require.NoError(t, qa2.PostSend(&hostverbs.SendWR{WRID: 4, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(a, sendOff, 64)}))
	eventually(t, "the frozen QP drops a's SEND", func() bool { return ctr(b, "drop_qp_handed_over") > 0 })
	a.ccq.none(t, 10*time.Millisecond)

	// The old process ends; the new one's fabric joins the network.
	require.NoError(t, b.dev.Close())
	require.NoError(t, fb.Close())
	b2 := reopen(t, mk(), b, "b2")
	dropB.Store(false)
	qb1n, qb2n := createRCQPN(t, b2, o, qb1.QPN()), createRCQPN(t, b2, o, qb2.QPN())
	rtsRC(t, qb1n, a, qa1.QPN(), o.psnA, o.psnB, o)
	rtsRC(t, qb2n, a, qa2.QPN(), o.psnA, o.psnB, o)
	require.NoError(t, qb2n.PostRecv(&hostverbs.RecvWR{WRID: 52, SGL: sge(b2, 500<<10, 4096)}))
	require.NoError(t, saver(t, qb1n).RestoreTransport(sb1))
	require.NoError(t, saver(t, qb2n).RestoreTransport(sb2))

	got := waitWRs(t, a, 4)
	for id, wc := range got {
		assert.Equal(t, hostverbs.WCSuccess, wc.Status, "WR %d: %+v", id, wc)
	}
	assert.True(t, bytes.Equal(readData, a.read(t, a.iova+readDst, len(readData))), "the READ's data, its first part replayed")
	assert.Equal(t, uint64(1000), binary.LittleEndian.Uint64(a.read(t, a.iova+word, 8)), "the atomic's saved result")
	assert.Equal(t, uint64(1005), binary.LittleEndian.Uint64(b2.read(t, b2.iova+word, 8)), "executed once")
	wc = b2.ccq.wait(t, 10*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	assert.EqualValues(t, 52, wc.WRID)
	assert.EqualValues(t, 64, wc.ByteLen)
	assert.NotZero(t, ctr(b2, "rx_duplicate_requests"))
	assert.Zero(t, ctr(a, "retransmit_timeouts"), "recovered without a timer")

	traffic(t, a, b2, qa1, qb1n, 5, 3000)
	traffic(t, b2, a, qb1n, qa1, 6, 5000)
	traffic(t, a, b2, qa2, qb2n, 7, 2000)
	traffic(t, b2, a, qb2n, qa2, 8, 1)
	a.ccq.none(t, 0)
	b2.ccq.none(t, 0)
}

// TestSaveTransportRefused: a QP with sends in flight is busy (and not
// frozen); UD QPs have no transport state; a QP not connected cannot be
// saved; a frozen QP drops what it receives until it is resumed, and then
// recovers what it dropped.
func TestSaveTransportRefused(t *testing.T) {
	clk := NewManualClock(time.Unix(1000, 0))
	f := newFabric(t, Config{Clock: clk})
	a := newEndpoint(t, f, "a", "10.9.0.1", 1<<20)
	b := newEndpoint(t, f, "b", "10.9.0.2", 1<<20)
	o := defaultRC()
	o.minRNR = 14
	qa, qb := connectRC(t, a, b, o)

	// No receive at b: the SEND waits for an RNR timer.
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sge(a, 0, 10)}))
	assert.False(t, saver(t, qa).SendsDrained())
	_, err := saver(t, qa).SaveTransport()
	require.ErrorIs(t, err, hostverbs.ErrBusy)
	assert.False(t, qa.(*qp).frozen.Load())
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 2, SGL: sge(b, 0, 64)}))
	clk.Advance(roce.RNRTimer(14))
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)
	require.Equal(t, hostverbs.WCSuccess, b.ccq.wait(t, 5*time.Second).Status)
	assert.True(t, saver(t, qa).SendsDrained())

	// A message partly received.
	qbs := qb.(*qp)
	qbs.rqMu.Lock()
	qbs.resp.inMsg = msgSend
	qbs.rqMu.Unlock()
	_, err = saver(t, qb).SaveTransport()
	require.ErrorIs(t, err, hostverbs.ErrBusy)
	qbs.rqMu.Lock()
	qbs.resp.inMsg = msgNone
	qbs.rqMu.Unlock()

	ud, err := a.pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeUD, SendCQ: a.cq, RecvCQ: a.cq,
		Cap: hostverbs.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}})
	require.NoError(t, err)
	_, err = saver(t, ud).SaveTransport()
	require.ErrorIs(t, err, hostverbs.ErrNotSupported)
	assert.True(t, saver(t, ud).SendsDrained())
	idle := createRC(t, a, o)
	_, err = saver(t, idle).SaveTransport()
	require.ErrorIs(t, err, hostverbs.ErrInvalid, "INIT: not connected")

	// Frozen, b drops a's SEND; resumed, it takes the retransmission.
	_, err = saver(t, qb).SaveTransport()
	require.NoError(t, err)
	require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sge(a, 0, 10)}))
	assert.Equal(t, uint64(1), ctr(b, "drop_qp_handed_over"))
	a.ccq.none(t, 0)
	saver(t, qb).ResumeTransport()
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 4, SGL: sge(b, 0, 64)}))
	clk.Advance(roce.LocalACKTimeout(o.timeout) + time.Millisecond)
	require.Equal(t, hostverbs.WCSuccess, b.ccq.wait(t, 5*time.Second).Status)
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)

	// A post resumes a frozen QP.
	_, err = saver(t, qb).SaveTransport()
	require.NoError(t, err)
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 5, SGL: sge(b, 0, 64)}))
	assert.False(t, qbs.frozen.Load())
}

// transportFixture is a connected pair whose QP a has a saved state with
// READ and atomic resources to restore into a QP created like it.
type transportFixture struct {
	o      rcOpts
	fresh  int // QPs fresh made
	f      *Fabric
	a, b   *endpoint
	qa, qb hostverbs.QP
	blob   []byte
}

func newTransportFixture(t testing.TB) *transportFixture {
	fx := &transportFixture{o: defaultRC()}
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	fx.f = f
	fx.a = newEndpoint(t, f, "a", "10.10.0.1", 1<<20)
	fx.b = newEndpoint(t, f, "b", "10.10.0.2", 1<<20)
	fx.qa, fx.qb = connectRC(t, fx.a, fx.b, fx.o)
	// Reads and atomics of b's leave resources in a's responder.
	for i := range uint64(3) {
		require.NoError(t, fx.qb.PostSend(&hostverbs.SendWR{WRID: i, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
			SGL: sge(fx.b, 0, 1000), RemoteAddr: fx.a.iova + 4096*i, RKey: fx.a.mr.RKey()}))
		require.NoError(t, fx.qb.PostSend(&hostverbs.SendWR{WRID: 10 + i, Opcode: hostverbs.WRAtomicCmpAndSwp, Flags: hostverbs.SendSignaled,
			SGL: sge(fx.b, 64, 8), RemoteAddr: fx.a.iova + 8*i, RKey: fx.a.mr.RKey(), CompareAdd: 0, Swap: i + 1}))
	}
	for range 6 {
		require.Equal(t, hostverbs.WCSuccess, fx.b.ccq.wait(t, 5*time.Second).Status)
	}
	fx.blob, err = saver(t, fx.qa).SaveTransport()
	require.NoError(t, err)
	saver(t, fx.qa).ResumeTransport()
	return fx
}

// newQP returns a QP with qa's QPN on a new device connected to qb, as
// the new process creates it (qa's device stays: the new device has
// another GID).
func (fx *transportFixture) newQP(t testing.TB) hostverbs.QP {
	t.Helper()
	fx.fresh++
	e := newEndpoint(t, fx.f, fmt.Sprintf("a-new-%d", fx.fresh), fmt.Sprintf("10.10.1.%d", fx.fresh), 1<<20)
	q := createRCQPN(t, e, fx.o, fx.qa.QPN())
	rtsRC(t, q, fx.b, fx.qb.QPN(), fx.o.psnB, fx.o.psnA, fx.o)
	return q
}

// mutate returns blob with f applied to a copy.
func mutate(blob []byte, f func(b []byte) []byte) []byte {
	return f(append([]byte(nil), blob...))
}

// TestRestoreTransportHostile: blobs of another version or length, with
// values out of range or inconsistent, or for another QP, are refused
// with ErrInvalid and leave the QP as it was; the intact blob then
// restores; a QP with work posted refuses with ErrBusy.
func TestRestoreTransportHostile(t *testing.T) {
	fx := newTransportFixture(t)
	st, err := decodeTransport(fx.blob)
	require.NoError(t, err)
	require.Len(t, st.res, 6)
	le := binary.LittleEndian
	put := func(off int, v uint32) func([]byte) []byte {
		return func(b []byte) []byte { le.PutUint32(b[off:], v); return b }
	}
	res := func(i, off int, v uint32) func([]byte) []byte {
		return put(transportHdrSize+i*transportResSize+off, v)
	}
	bad := map[string][]byte{
		"empty":             nil,
		"short":             fx.blob[:transportHdrSize-1],
		"one more byte":     append(append([]byte(nil), fx.blob...), 0),
		"one byte less":     fx.blob[:len(fx.blob)-1],
		"magic":             mutate(fx.blob, put(0, 0x12345678)),
		"version":           mutate(fx.blob, func(b []byte) []byte { b[4] = transportVersion + 1; return b }),
		"UD":                mutate(fx.blob, func(b []byte) []byte { b[5] = byte(hostverbs.QPTypeUD); return b }),
		"state INIT":        mutate(fx.blob, func(b []byte) []byte { b[6] = byte(hostverbs.QPStateInit); return b }),
		"state RTR":         mutate(fx.blob, func(b []byte) []byte { b[6] = byte(hostverbs.QPStateRTR); return b }),
		"flags":             mutate(fx.blob, func(b []byte) []byte { b[7] |= 0x80; return b }),
		"another QPN":       mutate(fx.blob, put(8, fx.qa.QPN()+1)),
		"QPN too large":     mutate(fx.blob, put(8, 1<<24)),
		"another peer":      mutate(fx.blob, put(12, fx.qb.QPN()+1)),
		"PSN of 25 bits":    mutate(fx.blob, put(16, 1<<24|1)),
		"not drained":       mutate(fx.blob, put(24, uint32(st.reqPSN.Sub(1)))),
		"sent ahead":        mutate(fx.blob, put(20, uint32(st.reqPSN.Add(5)))),
		"resources":         mutate(fx.blob, func(b []byte) []byte { le.PutUint16(b[36:], 8); return b }),
		"more carried":      mutate(fx.blob, func(b []byte) []byte { le.PutUint16(b[38:], 7); return b }),
		"too many":          mutate(fx.blob, func(b []byte) []byte { le.PutUint16(b[36:], 0xffff); return b }),
		"kind":              mutate(fx.blob, func(b []byte) []byte { b[transportHdrSize] = 3; return b }),
		"reserved":          mutate(fx.blob, func(b []byte) []byte { b[transportHdrSize+2] = 1; return b }),
		"ahead of PSN":      mutate(fx.blob, res(5, 8, uint32(st.respPSN))),
		"out of order":      mutate(fx.blob, res(1, 4, uint32(st.res[0].firstPSN))),
		"last before first": mutate(fx.blob, res(0, 8, uint32(st.res[0].firstPSN.Sub(1)))),
		"atomic with a key": mutate(fx.blob, func(b []byte) []byte {
			for i, r := range st.res {
				if r.atomic {
					le.PutUint32(b[transportHdrSize+i*transportResSize+12:], 7)
				}
			}
			return b
		}),
		"READ with a result": mutate(fx.blob, func(b []byte) []byte {
			for i, r := range st.res {
				if !r.atomic {
					le.PutUint64(b[transportHdrSize+i*transportResSize+28:], 7)
				}
			}
			return b
		}),
		"READ wrapping": mutate(fx.blob, func(b []byte) []byte {
			for i, r := range st.res {
				if !r.atomic {
					le.PutUint64(b[transportHdrSize+i*transportResSize+20:], ^uint64(0)-10)
				}
			}
			return b
		}),
	}
	q := fx.newQP(t)
	qs := q.(*qp)
	snapshot := func() [4]uint32 {
		qs.sqMu.Lock()
		defer qs.sqMu.Unlock()
		return [4]uint32{uint32(qs.req.psn), uint32(qs.comp.psn), uint32(qs.resp.psn), qs.resp.msn}
	}
	before := snapshot()
	for name, b := range bad {
		t.Run(name, func(t *testing.T) {
			err := saver(t, q).RestoreTransport(b)
			require.ErrorIs(t, err, hostverbs.ErrInvalid)
			t.Log(err)
			assert.Equal(t, before, snapshot(), "the QP is untouched")
		})
	}
	require.NoError(t, saver(t, q).RestoreTransport(fx.blob))
	assert.Equal(t, [4]uint32{uint32(st.reqPSN), uint32(st.comp), uint32(st.respPSN), st.msn}, snapshot())

	// Work posted already: busy.
	busy := fx.newQP(t)
	require.NoError(t, busy.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSend})) // b drops it: another peer's
	require.ErrorIs(t, saver(t, busy).RestoreTransport(fx.blob), hostverbs.ErrBusy)
}

// FuzzRestoreTransport: RestoreTransport takes any bytes without
// panicking; a blob it accepts is what SaveTransport returns for the QP
// right after (nothing is dropped or invented).
func FuzzRestoreTransport(f *testing.F) {
	fx := newTransportFixture(f)
	for _, s := range transportSeeds(fx) {
		f.Add(s)
	}
	q := fx.newQP(f)
	ts := saver(f, q)
	f.Fuzz(func(t *testing.T, b []byte) {
		if _, err := decodeTransport(b); err != nil {
			require.Error(t, ts.RestoreTransport(b))
			return
		}
		if err := ts.RestoreTransport(b); err != nil {
			require.ErrorIs(t, err, hostverbs.ErrInvalid)
			return
		}
		back, err := ts.SaveTransport()
		require.NoError(t, err)
		ts.ResumeTransport()
		require.True(t, bytes.Equal(b, back), "saved %x\nrestored %x", back, b)
	})
}

// transportSeeds are the fixture's state, one without resources and a few
// damaged ones.
func transportSeeds(fx *transportFixture) map[string][]byte {
	none := mutate(fx.blob[:transportHdrSize], func(b []byte) []byte { binary.LittleEndian.PutUint16(b[38:], 0); return b })
	return map[string][]byte{
		"state":         fx.blob,
		"no-resources":  none,
		"short":         fx.blob[:transportHdrSize+5],
		"wrong-version": mutate(fx.blob, func(b []byte) []byte { b[4]++; return b }),
		"another-qp":    mutate(fx.blob, func(b []byte) []byte { b[8]++; return b }),
	}
}

// TestTransportSeeds writes testdata/fuzz/FuzzRestoreTransport when
// PVRDMA_UPDATE_SEEDS is set.
func TestTransportSeeds(t *testing.T) {
	if os.Getenv("PVRDMA_UPDATE_SEEDS") == "" {
		t.Skip("PVRDMA_UPDATE_SEEDS=1 rewrites the seeds")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzRestoreTransport")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for name, b := range transportSeeds(newTransportFixture(t)) {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%s)\n", strconv.Quote(string(b)))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
}
