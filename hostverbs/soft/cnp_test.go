package soft

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// Forged CNPs (issue 23, tenant isolation). A CNP carries nothing but the
// destination QPN and the addresses, so anyone who can send from a QP's
// peer's address can forge one. Real congestion cuts a QP's rate at most
// once per CNPInterval (the notification point's limit), and only while
// the QP sends ECN-capable packets that a queue can mark. A flood of
// forged CNPs must not do more.

// realCongestion is a reaction point fed by the harshest real congestion:
// the notification point's CNPs, one per CNPInterval, n of them from t0.
func realCongestion(c *CongestionConfig, t0 time.Time, n int) rateState {
	var s rateState
	for k := range n {
		s.onCNP(c, t0.Add(time.Duration(k)*c.CNPInterval))
	}
	return s
}

// oneCutRate is what one real CNP leaves of the line rate: Rc*(1-alpha/2)
// with the initial alpha of 1.
func oneCutRate(c *CongestionConfig) float64 { return c.LineRate * (1 - 1.0/2) }

// TestCNPFloodOneCutPerPeriod: at the reaction point, a burst of 1000 CNPs
// within one CNP interval cuts the rate once; a flood of one CNP per
// microsecond for 8 intervals cuts it no deeper than the notification
// point's one CNP per interval (real congestion at its worst) does.
func TestCNPFloodOneCutPerPeriod(t *testing.T) {
	c := testCC(t)
	t0 := time.Unix(1000, 0)
	var s rateState
	for i := range 1000 {
		s.onCNP(&c, t0.Add(time.Duration(i)*c.CNPInterval/1000))
	}
	assert.GreaterOrEqual(t, s.rate(&c), oneCutRate(&c), "1000 CNPs in one interval: at most one cut")
	assert.Equal(t, uint64(1000), s.cnps, "all of them counted")

	const periods = 8
	var flood rateState
	end := t0
	for at := t0; at.Before(t0.Add(periods * c.CNPInterval)); at = at.Add(time.Microsecond) {
		flood.onCNP(&c, at)
		end = at
	}
	worst := realCongestion(&c, t0, periods)
	worst.advance(&c, end)
	flood.advance(&c, end)
	t.Logf("after %d intervals: flood %.4g b/s, real congestion %.4g b/s (line %.4g, floor %.4g)",
		periods, flood.rate(&c), worst.rate(&c), c.LineRate, c.MinRate)
	require.Greater(t, worst.rate(&c), c.MinRate, "the bound is above the floor")
	assert.GreaterOrEqual(t, flood.rate(&c), worst.rate(&c)*(1-1e-9), "a flood cuts no deeper than real congestion")
}

// cnpFrom is a CNP datagram from src to dst for QP dqpn, with a valid
// ICRC: the strongest forgery (right address, right QPN).
func cnpFrom(src, dst hostverbs.GID, dqpn uint32) []byte {
	tf := roce.TransportFields{BTH: roce.BTHFields{Opcode: roce.CNP, PKey: roce.DefaultPKey, DestQP: dqpn, BECN: true}}
	tr := make([]byte, roce.CNP.Info().Length)
	roce.EncodeTransport(tr, &tf)
	v4 := dst.IsV4()
	h := roce.NetHeaderSize(v4)
	d := make([]byte, h+len(tr)+roce.ICRCSize)
	roce.EncodeNet(d, &roce.NetFields{Src: src, Dst: dst, TClass: cnpTClass, HopLimit: 64, ID: 1, SrcPort: 0xc001},
		len(tr)+roce.ICRCSize)
	copy(d[h:], tr)
	roce.SealICRC(d, h-roce.UDPHeaderSize)
	return d
}

// inject hands n copies of d to f's receive path, advancing clock by step
// after each.
func inject(f *Fabric, clock *ManualClock, d []byte, n int, step time.Duration) {
	tx := newTxBatch(f)
	var rp roce.Packet
	var p packet
	for range n {
		f.receive(tx, d, nil, &rp, &p)
		tx.flush()
		if step > 0 {
			clock.Advance(step)
		}
	}
}

// qpRate returns the congestion state of QP qpn (ok false: never cut).
func qpRate(f *Fabric, qpn uint32) (QPRate, bool) {
	for _, r := range f.QPRates() {
		if r.QPN == qpn {
			return r, true
		}
	}
	return QPRate{}, false
}

// TestForgedCNPFlood: a QP that has just sent a 1 MiB WRITE over the wire
// (ECN-capable) at line rate gets forged CNPs from its peer's address,
// with its QPN: 1000 at one instant leave at least what one real CNP
// leaves; a flood of one per microsecond for 8 CNP intervals, no less
// than the notification point's one per interval would.
func TestForgedCNPFlood(t *testing.T) {
	clock := NewManualClock(time.Unix(1000, 0))
	p, _ := newMemNetPair(t, defaultRC(), clock, 1)
	fa := p.a.dev.(*device).f
	c := fa.cc
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 1<<20), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
	require.Equal(t, hostverbs.WCSuccess, p.a.ccq.wait(t, 10*time.Second).Status)
	require.NotZero(t, fa.Counters()["tx_packets"], "the WRITE went over the wire")
	forged := cnpFrom(p.b.gid, p.a.gid, p.qa.QPN())

	inject(fa, clock, forged, 1000, 0)
	r, ok := qpRate(fa, p.qa.QPN())
	require.True(t, ok, "the first CNP is taken: the QP sent ECN-capable traffic to that peer just now")
	t.Logf("after 1000 forged CNPs at once: %.4g b/s (one real cut: %.4g, floor %.4g)", r.Rate, oneCutRate(&c), c.MinRate)
	assert.GreaterOrEqual(t, r.Rate, oneCutRate(&c), "1000 forged CNPs at once: no more than one cut")
	cn := fa.Counters()
	assert.Equal(t, uint64(1000), cn["rx_cnp"], "every CNP counted")
	assert.Equal(t, uint64(999), cn["rx_cnp_coalesced"], "all but the first within the reduction period")

	// The flood goes on, one per microsecond, for 8 intervals from the
	// first CNP; real congestion would have sent one per interval.
	const periods = 8
	start := clock.Now()
	inject(fa, clock, forged, periods*int(c.CNPInterval/time.Microsecond)-1, time.Microsecond)
	r, _ = qpRate(fa, p.qa.QPN())
	worst := realCongestion(&c, start, periods)
	worst.advance(&c, clock.Now())
	t.Logf("after %d intervals of flood: %.4g b/s, real congestion: %.4g b/s", periods, r.Rate, worst.rate(&c))
	require.Greater(t, worst.rate(&c), c.MinRate, "the bound is above the floor")
	assert.GreaterOrEqual(t, r.Rate, worst.rate(&c)*(1-1e-9), "a flood cuts no deeper than real congestion")
}

// TestUnsolicitedCNP: CNPs, forged from the peer's address with the
// QP's number, for a QP that has sent nothing ECN-capable (never sent,
// or idle for a second) are dropped: its rate is untouched and
// rx_cnp_unsolicited counts them.
// writeOnce has the pair's QP a write 64 KiB to QP b and waits for its
// completion: ECN-capable traffic to the peer, all of it acknowledged.
func writeOnce(t *testing.T, p pair) {
	t.Helper()
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 64<<10), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
	require.Equal(t, hostverbs.WCSuccess, p.a.ccq.wait(t, 10*time.Second).Status)
}

func TestUnsolicitedCNP(t *testing.T) {
	t.Run("never sent", func(t *testing.T) {
		clock := NewManualClock(time.Unix(1000, 0))
		p, _ := newMemNetPair(t, defaultRC(), clock, 1)
		fa := p.a.dev.(*device).f
		inject(fa, clock, cnpFrom(p.b.gid, p.a.gid, p.qa.QPN()), 40, 0)
		_, cut := qpRate(fa, p.qa.QPN())
		assert.False(t, cut, "rate untouched")
		assert.Equal(t, uint64(40), fa.Counters()["rx_cnp_unsolicited"])
		assert.Equal(t, uint64(40), fa.Counters()["rx_cnp"])
	})
	t.Run("idle", func(t *testing.T) {
		clock := NewManualClock(time.Unix(1000, 0))
		p, _ := newMemNetPair(t, defaultRC(), clock, 1)
		fa := p.a.dev.(*device).f
		writeOnce(t, p)
		require.Less(t, fa.cc.CNPWindow, time.Second)
		clock.Advance(time.Second)
		inject(fa, clock, cnpFrom(p.b.gid, p.a.gid, p.qa.QPN()), 40, time.Microsecond)
		_, cut := qpRate(fa, p.qa.QPN())
		assert.False(t, cut, "rate untouched")
		assert.Equal(t, uint64(40), fa.Counters()["rx_cnp_unsolicited"])
	})
	t.Run("from another address", func(t *testing.T) {
		clock := NewManualClock(time.Unix(1000, 0))
		p, _ := newMemNetPair(t, defaultRC(), clock, 1)
		fa := p.a.dev.(*device).f
		writeOnce(t, p)
		other := hostverbs.GIDFromAddr(netip.MustParseAddr("10.0.0.9"))
		inject(fa, clock, cnpFrom(other, p.a.gid, p.qa.QPN()), 40, 0)
		_, cut := qpRate(fa, p.qa.QPN())
		assert.False(t, cut, "rate untouched")
		assert.Equal(t, uint64(40), fa.Counters()["drop_bad_address"])
	})
}

// TestCNPWhileRequestsOutstanding: a QP whose requests are still
// unacknowledged takes CNPs however long ago it sent them (they may sit
// in a congested queue), one cut per reduction period; once nothing is
// outstanding and CNPWindow has passed, CNPs are unsolicited.
func TestCNPWhileRequestsOutstanding(t *testing.T) {
	clock := NewManualClock(time.Unix(1000, 0))
	o := defaultRC()
	o.timeout = 0 // no retransmission: the WRITE stays outstanding, nothing more is sent
	p, net := newMemNetPair(t, o, clock, 1)
	fa := p.a.dev.(*device).f
	c := fa.cc
	net.SetImpairment(wire.Impairment{Loss: 1})
	require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(p.a, 0, 64<<10), RemoteAddr: p.b.iova, RKey: p.b.mr.RKey()}))
	require.Less(t, c.CNPWindow, time.Second)
	clock.Advance(time.Second)
	inject(fa, clock, cnpFrom(p.b.gid, p.a.gid, p.qa.QPN()), 40, 0)
	r, cut := qpRate(fa, p.qa.QPN())
	require.True(t, cut, "requests outstanding: the CNP is taken")
	assert.Equal(t, oneCutRate(&c), r.Rate, "once")
	cn := fa.Counters()
	assert.Zero(t, cn["rx_cnp_unsolicited"])
	assert.Equal(t, uint64(39), cn["rx_cnp_coalesced"])
}
