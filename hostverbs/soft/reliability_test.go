package soft

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

func ctr(e *endpoint, name string) uint64 {
	d := e.dev.(*device)
	return d.f.Counters()[name]
}

// streamCheck sends a stream of SENDs of varying sizes, interleaved with
// RDMA WRITEs and READs, and checks that every message arrives exactly
// once, in order and intact.
func streamCheck(t *testing.T, p pair, msgs int, timeout time.Duration) {
	a, b := p.a, p.b
	const slot = 64 << 10
	const depth = 64
	for i := range depth {
		require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(b, uint64(i)*slot, slot)}))
	}
	src := make([]byte, slot)
	size := func(i int) int { return 4 + (i*7919)%(slot-4) }
	next := 0 // next message expected at b
	posted := 0
	inflight := 0
	deadline := time.After(timeout)
	for next < msgs {
		for posted < msgs && inflight < depth/2 {
			n := size(posted)
			fill(src[:n], uint64(posted))
			binary.LittleEndian.PutUint32(src, uint32(posted))
			off := uint64(depth*slot) + uint64(posted%depth)*slot
			a.write(t, a.iova+off, src[:n])
			require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: uint64(posted), Opcode: hostverbs.WRSend,
				Flags: hostverbs.SendSignaled, SGL: sge(a, off, n)}))
			posted++
			inflight++
		}
		select {
		case wc := <-b.ccq.ch:
			require.Equal(t, hostverbs.WCSuccess, wc.Status, "recv %+v", wc)
			slotIdx := wc.WRID
			got := b.read(t, b.iova+slotIdx*slot, int(wc.ByteLen))
			require.Equal(t, uint32(next), binary.LittleEndian.Uint32(got), "message order")
			want := make([]byte, size(next))
			fill(want, uint64(next))
			binary.LittleEndian.PutUint32(want, uint32(next))
			require.True(t, bytes.Equal(want, got), "message %d differs", next)
			require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: slotIdx, SGL: sge(b, slotIdx*slot, slot)}))
			next++
		case wc := <-a.ccq.ch:
			require.Equal(t, hostverbs.WCSuccess, wc.Status, "send %+v", wc)
			inflight--
		case <-deadline:
			t.Fatalf("stream stalled at message %d of %d", next, msgs)
		}
	}
	for inflight > 0 {
		wc := a.ccq.wait(t, timeout)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "send %+v", wc)
		inflight--
	}
	// No message may arrive twice.
	b.ccq.none(t, 20*time.Millisecond)
}

// bulkCheck moves 1 MiB each way with WRITE and READ and compares.
func bulkCheck(t *testing.T, p pair, timeout time.Duration) {
	a, b := p.a, p.b
	const n = 1 << 20
	src := make([]byte, n)
	fill(src, 99)
	a.write(t, a.iova, src)
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 0, n), RemoteAddr: b.iova + 3<<20, RKey: b.mr.RKey()}))
	wc := a.ccq.wait(t, timeout)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	require.True(t, bytes.Equal(src, b.read(t, b.iova+3<<20, n)))
	fill(src, 100)
	b.write(t, b.iova+5<<20, src)
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 7<<20, n), RemoteAddr: b.iova + 5<<20, RKey: b.mr.RKey()}))
	wc = a.ccq.wait(t, timeout)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	require.True(t, bytes.Equal(src, a.read(t, a.iova+7<<20, n)))
}

func TestMemNetImpaired(t *testing.T) {
	for _, tc := range []struct {
		name string
		imp  wire.Impairment
	}{
		{"loss1", wire.Impairment{Loss: 0.01}},
		{"loss5", wire.Impairment{Loss: 0.05}},
		{"reorder", wire.Impairment{Reorder: 0.05, ReorderDepth: 4}},
		{"duplicate", wire.Impairment{Duplicate: 0.05}},
		{"all", wire.Impairment{Loss: 0.02, Reorder: 0.02, Duplicate: 0.02}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := defaultRC()
			o.mtu = hostverbs.MTU1024
			o.timeout = 14 // 67 ms (rc_pingpong's): scheduling stalls on a loaded machine are not loss
			p, net := newMemNetPair(t, o, nil, 42)
			net.SetImpairment(tc.imp)
			streamCheck(t, p, 400, 60*time.Second)
			bulkCheck(t, p, 60*time.Second)
			s := net.Stats()
			t.Logf("memnet %+v; a: timeouts %d nak_seq %d dup_req %d retransmitted %d", s,
				ctr(p.a, "retransmit_timeouts"), ctr(p.a, "rx_nak_psn_sequence"),
				ctr(p.a, "rx_duplicate_requests"), ctr(p.a, "retransmitted_packets"))
			if tc.imp.Loss > 0 {
				assert.NotZero(t, s.Lost)
				assert.NotZero(t, ctr(p.a, "retransmitted_packets"))
			}
			if tc.imp.Duplicate > 0 {
				assert.NotZero(t, ctr(p.b, "rx_duplicate_requests"))
			}
			if tc.imp.Reorder > 0 {
				assert.NotZero(t, s.Reordered)
			}
		})
	}
}

// Manual-clock tests: the network is lossless unless told; timers fire
// only when the test advances the clock.
func newManualPair(t *testing.T, o rcOpts) (pair, *wire.MemNet, *ManualClock) {
	clk := NewManualClock(time.Unix(1000, 0))
	p, net := newMemNetPair(t, o, clk, 7)
	return p, net, clk
}

func TestRNRRetryExceeded(t *testing.T) {
	o := defaultRC()
	o.rnr = 2
	o.minRNR = 14 // 1.28 ms
	p, _, clk := newManualPair(t, o)
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 9, Opcode: hostverbs.WRSend, SGL: sge(p.a, 0, 100)}))
	for i := 1; i <= 3; i++ {
		eventually(t, "RNR NAK", func() bool { return ctr(p.a, "rx_rnr_nak") >= uint64(i) })
		if i < 3 {
			p.a.ccq.none(t, 0)
			clk.Advance(roce.RNRTimer(14))
		}
	}
	wc := p.a.ccq.wait(t, 5*time.Second)
	assert.Equal(t, hostverbs.WCRNRRetryExcErr, wc.Status)
	assert.Equal(t, uint64(9), wc.WRID, "errors complete even unsignaled WRs")
	assert.Equal(t, uint64(1), ctr(p.a, "rnr_retry_exceeded"))
	assert.Equal(t, uint64(3), ctr(p.b, "tx_rnr_nak"))
	q, _ := p.qa.Query()
	assert.Equal(t, hostverbs.QPStateErr, q.State)
}

func TestRNRThenRecvPosted(t *testing.T) {
	o := defaultRC()
	o.rnr = 7 // infinite
	o.minRNR = 1
	p, _, clk := newManualPair(t, o)
	p.a.write(t, p.a.iova, []byte("after the RNR"))
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 9, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 13)}))
	for i := 1; i <= 10; i++ { // infinite retries outlast the count
		eventually(t, "RNR NAK", func() bool { return ctr(p.a, "rx_rnr_nak") >= uint64(i) })
		clk.Advance(time.Millisecond)
	}
	require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: 5, SGL: sge(p.b, 0, 64)}))
	clk.Advance(time.Millisecond)
	wc := p.b.ccq.wait(t, 5*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	assert.Equal(t, []byte("after the RNR"), p.b.read(t, p.b.iova, 13))
	assert.Equal(t, hostverbs.WCSuccess, p.a.ccq.wait(t, 5*time.Second).Status)
}

func TestRetryExceeded(t *testing.T) {
	o := defaultRC()
	o.retry = 3
	o.timeout = 12 // 16.8 ms
	p, net, clk := newManualPair(t, o)
	net.SetImpairment(wire.Impairment{Loss: 1})
	require.NoError(t, p.qa.PostRecv(&hostverbs.RecvWR{WRID: 1, SGL: sge(p.a, 0, 64)}))
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 11, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 5000), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 12, Opcode: hostverbs.WRSend, SGL: sge(p.a, 0, 10)}))
	rto := roce.LocalACKTimeout(12)
	for i := range 3 {
		p.a.ccq.none(t, 0)
		clk.Advance(rto)
		assert.Equal(t, uint64(i+1), ctr(p.a, "retransmit_timeouts"))
	}
	p.a.ccq.none(t, 0)
	clk.Advance(rto)
	wc := p.a.ccq.wait(t, time.Second)
	assert.Equal(t, hostverbs.WCRetryExcErr, wc.Status)
	assert.Equal(t, uint64(11), wc.WRID)
	// Everything behind the failed WR flushes, in order, recv side too.
	wc = p.a.ccq.wait(t, time.Second)
	assert.Equal(t, hostverbs.WCWRFlushErr, wc.Status)
	assert.Equal(t, uint64(12), wc.WRID)
	wc = p.a.ccq.wait(t, time.Second)
	assert.Equal(t, hostverbs.WCWRFlushErr, wc.Status)
	assert.Equal(t, hostverbs.WCRecv, wc.Opcode)
	assert.Equal(t, uint64(1), ctr(p.a, "retry_exceeded"))
	// 2 packets of 4096 at MTU 4096? 5000 bytes: 2 packets, + the SEND,
	// sent once and retransmitted three times.
	assert.Equal(t, uint64(9), ctr(p.a, "retransmitted_packets"))
	assert.Zero(t, clk.Pending(), "timers stop in ERR")
}

// Error NAKs, on both the in-process and the wire path.
func forBothPaths(t *testing.T, o rcOpts, fn func(t *testing.T, p pair)) {
	t.Run("inprocess", func(t *testing.T) { fn(t, newLocalPair(t, o)) })
	t.Run("wire", func(t *testing.T) {
		p, _ := newMemNetPair(t, o, nil, 3)
		fn(t, p)
	})
}

func waitEvent(t *testing.T, e *endpoint, typ hostverbs.EventType) hostverbs.AsyncEvent {
	t.Helper()
	for {
		select {
		case ev := <-e.events:
			if ev.Type == typ {
				return ev
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no %v event", typ)
		}
	}
}

func TestRemoteAccessErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		wr   func(p pair) hostverbs.SendWR
	}{
		{"bad rkey", func(p pair) hostverbs.SendWR {
			return hostverbs.SendWR{Opcode: hostverbs.WRRDMAWrite, SGL: sge(p.a, 0, 10), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey() ^ 0x100}
		}},
		{"stale generation", func(p pair) hostverbs.SendWR {
			return hostverbs.SendWR{Opcode: hostverbs.WRRDMARead, SGL: sge(p.a, 0, 10), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey() + 1}
		}},
		{"beyond the MR", func(p pair) hostverbs.SendWR {
			return hostverbs.SendWR{Opcode: hostverbs.WRRDMAWrite, SGL: sge(p.a, 0, 4096), RemoteAddr: p.b.iova + p.b.size - 100, RKey: p.b.mr.RKey()}
		}},
		{"before the MR", func(p pair) hostverbs.SendWR {
			return hostverbs.SendWR{Opcode: hostverbs.WRRDMARead, SGL: sge(p.a, 0, 16), RemoteAddr: p.b.iova - 8, RKey: p.b.mr.RKey()}
		}},
		{"atomic rkey", func(p pair) hostverbs.SendWR {
			return hostverbs.SendWR{Opcode: hostverbs.WRAtomicFetchAndAdd, SGL: sge(p.a, 0, 8), RemoteAddr: p.b.iova, RKey: 0x4242}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forBothPaths(t, defaultRC(), func(t *testing.T, p pair) {
				wr := tc.wr(p)
				wr.WRID = 31
				require.NoError(t, p.qa.PostSend(&wr))
				wc := p.a.ccq.wait(t, 5*time.Second)
				assert.Equal(t, hostverbs.WCRemAccessErr, wc.Status)
				assert.Equal(t, uint64(31), wc.WRID)
				ev := waitEvent(t, p.b, hostverbs.EventQPAccessErr)
				assert.Equal(t, p.qb.QPN(), ev.QPN)
				qa, _ := p.qa.Query()
				qb, _ := p.qb.Query()
				assert.Equal(t, hostverbs.QPStateErr, qa.State)
				assert.Equal(t, hostverbs.QPStateErr, qb.State)
			})
		})
	}
}

func TestInvalidRequestErrors(t *testing.T) {
	o := defaultRC()
	o.access = hostverbs.AccessRemoteRead // no remote write, no atomics
	forBothPaths(t, o, func(t *testing.T, p pair) {
		require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 41, Opcode: hostverbs.WRRDMAWrite, SGL: sge(p.a, 0, 10),
			RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
		wc := p.a.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCRemInvReqErr, wc.Status)
		waitEvent(t, p.b, hostverbs.EventQPReqErr)
	})
	forBothPaths(t, defaultRC(), func(t *testing.T, p pair) {
		// A SEND longer than the receive buffer.
		require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: 8, SGL: sge(p.b, 0, 100)}))
		require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 42, Opcode: hostverbs.WRSend, SGL: sge(p.a, 0, 5000)}))
		wc := p.a.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCRemInvReqErr, wc.Status)
		rwc := p.b.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCLocLenErr, rwc.Status)
		assert.Equal(t, uint64(8), rwc.WRID)
	})
	forBothPaths(t, defaultRC(), func(t *testing.T, p pair) {
		// A receive WQE whose lkey is bad: remote operational error.
		require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: 9, SGL: []hostverbs.SGE{{Addr: p.b.iova, Length: 64, LKey: 0xdead00}}}))
		require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 43, Opcode: hostverbs.WRSend, SGL: sge(p.a, 0, 10)}))
		assert.Equal(t, hostverbs.WCRemOpErr, p.a.ccq.wait(t, 5*time.Second).Status)
		assert.Equal(t, hostverbs.WCLocProtErr, p.b.ccq.wait(t, 5*time.Second).Status)
	})
	forBothPaths(t, defaultRC(), func(t *testing.T, p pair) {
		// Misaligned atomic target.
		wr := hostverbs.SendWR{WRID: 44, Opcode: hostverbs.WRAtomicCmpAndSwp, Flags: hostverbs.SendSignaled, SGL: sge(p.a, 0, 8), RemoteAddr: p.b.iova + 8, RKey: p.b.mr.RKey()}
		require.NoError(t, p.qa.PostSend(&wr))
		assert.Equal(t, hostverbs.WCSuccess, p.a.ccq.wait(t, 5*time.Second).Status)
		wr.RemoteAddr += 4
		assert.ErrorIs(t, p.qa.PostSend(&wr), hostverbs.ErrInvalid, "rejected at post time")
	})
}

func TestLocalProtectionError(t *testing.T) {
	forBothPaths(t, defaultRC(), func(t *testing.T, p pair) {
		require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 51, Opcode: hostverbs.WRRDMAWrite,
			SGL: []hostverbs.SGE{{Addr: p.a.iova, Length: 10, LKey: p.a.mr.LKey() + 0x100}}, RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
		wc := p.a.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCLocProtErr, wc.Status)
		// A READ into memory outside the local MR.
		p2 := newLocalPair(t, defaultRC())
		require.NoError(t, p2.qa.PostSend(&hostverbs.SendWR{WRID: 52, Opcode: hostverbs.WRRDMARead,
			SGL: sge(p2.a, p2.a.size-4, 16), RemoteAddr: p2.b.iova, RKey: p2.b.mr.RKey()}))
		assert.Equal(t, hostverbs.WCLocProtErr, p2.a.ccq.wait(t, 5*time.Second).Status)
	})
}

func TestFlushOnError(t *testing.T) {
	p := newLocalPair(t, defaultRC())
	for i := range 3 {
		require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(100 + i), SGL: sge(p.b, 0, 64)}))
	}
	require.NoError(t, p.qb.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateErr}, hostverbs.AttrState))
	for i := range 3 {
		wc := p.b.ccq.wait(t, time.Second)
		assert.Equal(t, hostverbs.WCWRFlushErr, wc.Status)
		assert.Equal(t, hostverbs.WCRecv, wc.Opcode)
		assert.Equal(t, uint64(100+i), wc.WRID)
	}
	// Posted in ERR: flushed at once (rping waits for these).
	require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: 200}))
	assert.Equal(t, uint64(200), p.b.ccq.wait(t, time.Second).WRID)
	require.NoError(t, p.qb.PostSend(&hostverbs.SendWR{WRID: 201, Opcode: hostverbs.WRSend}))
	wc := p.b.ccq.wait(t, time.Second)
	assert.Equal(t, hostverbs.WCWRFlushErr, wc.Status)
	assert.Equal(t, uint64(201), wc.WRID)
	// Back through RESET the QP can be reused.
	require.NoError(t, p.qb.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateReset}, hostverbs.AttrState))
	q, err := p.qb.Query()
	require.NoError(t, err)
	assert.Equal(t, hostverbs.QPStateReset, q.State)
	assert.ErrorIs(t, p.qb.PostSend(&hostverbs.SendWR{Opcode: hostverbs.WRSend}), hostverbs.ErrInvalid)
}

// TestReplayCache: a lost atomic ACK makes the requester retry when its
// timer fires; the responder must answer from its replay cache, not add
// twice, and again when that answer is lost too. A lost READ response
// makes the requester ask again from it at once (the next response shows
// the gap), and the responder replays it from memory. The clock is
// manual: each retry happens when the test moves it by the timeout, after
// the loss, so no timer fires early on a slow machine.
func TestReplayCache(t *testing.T) {
	o := defaultRC()
	o.timeout = 10
	p, net, clk := newManualPair(t, o)
	var lostAtomic, lostRead atomic.Int32
	net.SetImpairment(wire.Impairment{Drop: func(pkt []byte) bool {
		var rp roce.Packet
		switch {
		case rp.Parse(pkt) != nil:
		case rp.Op == roce.RCAtomicAcknowledge && lostAtomic.Load() < 2:
			lostAtomic.Add(1)
			return true
		case rp.Op == roce.RCReadResponseMiddle && lostRead.Load() < 1:
			lostRead.Add(1)
			return true
		}
		return false
	}})
	var w [8]byte
	binary.LittleEndian.PutUint64(w[:], 1000)
	p.b.write(t, p.b.iova+128, w[:])
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 61, Opcode: hostverbs.WRAtomicFetchAndAdd, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 8), RemoteAddr: p.b.iova + 128, RKey: p.b.mr.RKey(), CompareAdd: 5}))
	for i := range int32(2) {
		eventually(t, "the atomic's answer lost", func() bool { return lostAtomic.Load() == i+1 })
		p.a.ccq.none(t, 0)
		clk.Advance(roce.LocalACKTimeout(o.timeout))
	}
	require.Equal(t, hostverbs.WCSuccess, p.a.ccq.wait(t, 5*time.Second).Status)
	assert.Equal(t, uint64(1000), binary.LittleEndian.Uint64(p.a.read(t, p.a.iova, 8)))
	assert.Equal(t, uint64(1005), binary.LittleEndian.Uint64(p.b.read(t, p.b.iova+128, 8)), "executed once")
	assert.Equal(t, uint64(2), ctr(p.a, "retransmit_timeouts"))
	assert.Equal(t, uint64(2), ctr(p.b, "rx_duplicate_requests"), "the atomic twice")
	src := make([]byte, 100000)
	fill(src, 7)
	p.b.write(t, p.b.iova+4096, src)
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 62, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 1<<20, len(src)), RemoteAddr: p.b.iova + 4096, RKey: p.b.mr.RKey()}))
	require.Equal(t, hostverbs.WCSuccess, p.a.ccq.wait(t, 5*time.Second).Status)
	assert.True(t, bytes.Equal(src, p.a.read(t, p.a.iova+1<<20, len(src))))
	assert.Equal(t, int32(1), lostRead.Load())
	assert.Equal(t, uint64(3), ctr(p.b, "rx_duplicate_requests"), "and the READ once")
	assert.Equal(t, uint64(2), ctr(p.a, "retransmit_timeouts"), "no timer for the READ")
}

func TestUDAndGSI(t *testing.T) {
	for _, fam := range [][2]string{{"10.1.0.1", "10.1.0.2"}, {"fd00::1", "fd00::2"}} {
		for _, overWire := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s-wire=%v", fam[0], overWire), func(t *testing.T) {
				var fa, fb *Fabric
				if overWire {
					net := wire.NewMemNet(1)
					t.Cleanup(net.Close)
					fa, _ = New(Config{Wire: net.Attach()})
					fb, _ = New(Config{Wire: net.Attach()})
				} else {
					fa, _ = New(Config{})
					fb = fa
				}
				t.Cleanup(func() { _ = fa.Close(); _ = fb.Close() })
				a := newEndpoint(t, fa, "a", fam[0], 1<<20)
				b := newEndpoint(t, fb, "b", fam[1], 1<<20)
				udTest(t, a, b, hostverbs.QPTypeUD)
				udTest(t, a, b, hostverbs.QPTypeGSI)
			})
		}
	}
}

func udQP(t *testing.T, e *endpoint, typ hostverbs.QPType, qkey uint32) hostverbs.QP {
	q, err := e.pd.CreateQP(hostverbs.QPInitAttr{Type: typ, SendCQ: e.cq, RecvCQ: e.cq,
		Cap: hostverbs.QPCap{MaxSendWR: 128, MaxRecvWR: 128, MaxSendSGE: 2, MaxRecvSGE: 2}})
	require.NoError(t, err)
	mask := hostverbs.AttrState | hostverbs.AttrPKeyIndex | hostverbs.AttrQKey
	if typ == hostverbs.QPTypeUD {
		mask |= hostverbs.AttrPort
	}
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, QKey: qkey}, mask))
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR}, hostverbs.AttrState))
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, SQPSN: 0}, hostverbs.AttrState|hostverbs.AttrSQPSN))
	return q
}

func udTest(t *testing.T, a, b *endpoint, typ hostverbs.QPType) {
	qkey := uint32(0x11111111)
	if typ == hostverbs.QPTypeGSI {
		qkey = roce.GSIQKey
	}
	qa, qb := udQP(t, a, typ, qkey), udQP(t, b, typ, qkey)
	defer qa.Destroy()
	defer qb.Destroy()
	if typ == hostverbs.QPTypeGSI {
		assert.Equal(t, uint32(1), qb.QPN())
	}
	msg := bytes.Repeat([]byte("MAD!"), 64)
	a.write(t, a.iova+8192, msg)
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 7, SGL: sge(b, 0, 1024)}))
	send := func(rqkey uint32, imm bool) {
		wr := hostverbs.SendWR{WRID: 70, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sge(a, 8192, len(msg)),
			AV: hostverbs.AddressVector{DGID: b.gid, HopLimit: 9, TrafficClass: 0x20}, RemoteQPN: qb.QPN(), RemoteQKey: rqkey}
		if imm {
			wr.Opcode, wr.ImmData = hostverbs.WRSendWithImm, uint32(qa.QPN())
		}
		require.NoError(t, qa.PostSend(&wr))
		assert.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status, "UD sends complete at once")
	}
	send(0x1234, false) // wrong Q_Key: dropped
	eventually(t, "qkey drop", func() bool { return ctr(b, "drop_bad_qkey") >= 1 })
	b.ccq.none(t, 10*time.Millisecond)
	send(0x80000000, true) // high bit: use the sender QP's own Q_Key
	wc := b.ccq.wait(t, 5*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
	assert.Equal(t, uint32(40+len(msg)), wc.ByteLen)
	assert.Equal(t, qa.QPN(), wc.SrcQP)
	assert.Equal(t, hostverbs.WCFlagGRH|hostverbs.WCFlagWithNetworkHdrTyp|hostverbs.WCFlagWithImm, wc.Flags)
	assert.Equal(t, qa.QPN(), wc.ImmData)
	got := b.read(t, b.iova, 40+len(msg))
	assert.Equal(t, msg, got[40:])
	if b.dev.Attr().GIDType == hostverbs.GIDTypeRoCEv1 {
		// RoCE v1: the GRH itself (IBA 8.3), next header 0x1B.
		assert.Equal(t, hostverbs.NetworkIB, wc.NetworkHdrType)
		assert.Equal(t, uint32(6<<28|0x20<<20), binary.BigEndian.Uint32(got[0:])&0xfff00000)
		assert.Equal(t, uint16(roce.PacketSizeV1(roce.UDSendOnlyImm, len(msg))-roce.GRHSize), binary.BigEndian.Uint16(got[4:]))
		assert.Equal(t, byte(0x1b), got[6])
		assert.Equal(t, byte(9), got[7])
		assert.Equal(t, a.gid[:], got[8:24])
		assert.Equal(t, b.gid[:], got[24:40])
	} else if a.gid.IsV4() {
		assert.Equal(t, hostverbs.NetworkIPv4, wc.NetworkHdrType)
		assert.Equal(t, make([]byte, 20), got[:20])
		h := got[20:40]
		assert.Equal(t, byte(0x45), h[0])
		assert.Equal(t, byte(9), h[8], "ttl = hop limit")
		assert.Equal(t, byte(17), h[9])
		assert.Equal(t, a.gid[12:], h[12:16])
		assert.Equal(t, b.gid[12:], h[16:20])
		assert.Equal(t, binary.BigEndian.Uint16(h[10:]), roce.IPv4Checksum(h), "valid header checksum")
	} else {
		assert.Equal(t, hostverbs.NetworkIPv6, wc.NetworkHdrType)
		assert.Equal(t, byte(0x60), got[0]&0xf0)
		assert.Equal(t, byte(17), got[6])
		assert.Equal(t, byte(9), got[7])
		assert.Equal(t, a.gid[:], got[8:24])
		assert.Equal(t, b.gid[:], got[24:40])
	}
	// No receive WQE: dropped and counted, nothing completes.
	before := ctr(b, "drop_ud_no_recv_wqe")
	send(qkey, false)
	eventually(t, "no-recv drop", func() bool { return ctr(b, "drop_ud_no_recv_wqe") > before })
	// A receive buffer too small for GRH + payload completes in error.
	require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 8, SGL: sge(b, 0, 100)}))
	send(qkey, false)
	wc = b.ccq.wait(t, 5*time.Second)
	assert.Equal(t, hostverbs.WCLocLenErr, wc.Status)
	assert.Equal(t, uint64(8), wc.WRID)
}

// An MR deregistered in the middle of a multi-packet RDMA WRITE takes no
// more of it: the remaining packets get a remote access NAK.
func TestDeregDuringWrite(t *testing.T) {
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	p, net := newMemNetPair(t, o, nil, 9)
	var once bool
	var deregErr error
	net.SetImpairment(wire.Impairment{Drop: func(pkt []byte) bool {
		var rp roce.Packet
		if rp.Parse(pkt) == nil && rp.Op == roce.RCWriteMiddle && !once {
			once = true
			deregErr = p.b.mr.Dereg() // between the first and the next packets
		}
		return false
	}})
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 71, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 8192), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
	wc := p.a.ccq.wait(t, 5*time.Second)
	require.NoError(t, deregErr)
	assert.Equal(t, hostverbs.WCRemAccessErr, wc.Status)
	waitEvent(t, p.b, hostverbs.EventQPAccessErr)
	assert.Equal(t, make([]byte, 4096), p.b.read(t, p.b.iova+4096, 4096), "nothing after the first packet landed")
}
