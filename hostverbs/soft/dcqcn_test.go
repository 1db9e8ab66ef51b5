package soft

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

func testCC(t *testing.T) CongestionConfig {
	c, err := CongestionConfig{LineRate: 10e9}.withDefaults()
	require.NoError(t, err)
	return c
}

// cuts delivers n CNPs one rate reduction period apart from t0, each of
// them a cut, and returns the time of the last.
func cuts(t *testing.T, s *rateState, c *CongestionConfig, t0 time.Time, n int) time.Time {
	at := t0
	for i := range n {
		at = t0.Add(time.Duration(i) * c.RateReductionPeriod)
		require.True(t, s.onCNP(c, at), "CNP %d cuts", i)
	}
	return at
}

// TestDCQCNCut: the first CNP halves the line rate (alpha starts at 1),
// keeps the old rate as the target, and raises alpha by g; a CNP within
// the rate reduction period after a cut is only counted; CNPs a period
// apart keep cutting, never below the minimum rate.
func TestDCQCNCut(t *testing.T) {
	c := testCC(t)
	var s rateState
	t0 := time.Unix(1000, 0)
	assert.Equal(t, c.LineRate, s.rate(&c))
	assert.Zero(t, s.wait(&c, t0), "not limited: no pacing")
	assert.True(t, s.onCNP(&c, t0))
	assert.True(t, s.limited)
	assert.InDelta(t, 5e9, s.rc, 1)
	assert.InDelta(t, 10e9, s.rt, 1)
	assert.InDelta(t, 1.0, s.alpha, 1e-9, "(1-g)*1 + g")
	assert.False(t, s.onCNP(&c, t0.Add(c.RateReductionPeriod-time.Nanosecond)), "within the period")
	assert.InDelta(t, 5e9, s.rc, 1)
	assert.Equal(t, uint64(2), s.cnps)
	assert.True(t, s.onCNP(&c, t0.Add(c.RateReductionPeriod)))
	assert.InDelta(t, 2.5e9, s.rc, 1)
	assert.InDelta(t, 5e9, s.rt, 1)
	cuts(t, &s, &c, t0.Add(2*c.RateReductionPeriod), 100)
	assert.Equal(t, c.MinRate, s.rc)
}

// TestDCQCNAlphaDecay: without CNPs alpha decays by (1-g) per period, so
// a later cut is milder.
func TestDCQCNAlphaDecay(t *testing.T) {
	c := testCC(t)
	var s rateState
	t0 := time.Unix(1000, 0)
	s.onCNP(&c, t0)
	s.advance(&c, t0.Add(100*c.AlphaPeriod))
	want := 1.0
	for range 100 {
		want *= 1 - c.AlphaG
	}
	assert.InDelta(t, want, s.alpha, 1e-9)
}

// TestDCQCNRecovery: after a cut, timer events bring the rate back: fast
// recovery halves the distance to the target F times, then additive
// increase raises the target; a long quiet period brings it back to line
// rate.
func TestDCQCNRecovery(t *testing.T) {
	c := testCC(t)
	var s rateState
	t0 := time.Unix(1000, 0)
	t0 = cuts(t, &s, &c, t0, 2) // the target below line rate: room for additive increase
	rc, rt := s.rc, s.rt
	for i := 1; i <= c.FastRecoverySteps-1; i++ {
		s.advance(&c, t0.Add(time.Duration(i)*c.RateIncreasePeriod))
		rc = (rt + rc) / 2
		assert.InDelta(t, rc, s.rc, 1, "fast recovery step %d", i)
		assert.InDelta(t, rt, s.rt, 1, "target kept")
	}
	s.advance(&c, t0.Add(time.Duration(c.FastRecoverySteps)*c.RateIncreasePeriod))
	assert.InDelta(t, rt+c.AIRate, s.rt, 1, "additive increase (the byte counter has not passed F)")
	s.advance(&c, t0.Add(10*time.Second))
	assert.InDelta(t, c.LineRate, s.rate(&c), 1, "recovered to line rate")
	assert.True(t, s.limited, "and paced at it")
}

// TestDCQCNHyperIncrease: once both the timer and the byte counter passed
// F, the target grows by HAIRate steps.
func TestDCQCNHyperIncrease(t *testing.T) {
	c := testCC(t)
	c.ByteCounter = 1 << 20
	var s rateState
	t0 := time.Unix(1000, 0)
	t0 = cuts(t, &s, &c, t0, 20) // deep cut: room to grow
	for i := 1; i <= c.FastRecoverySteps; i++ {
		s.advance(&c, t0.Add(time.Duration(i)*c.RateIncreasePeriod))
	}
	now := t0.Add(time.Duration(c.FastRecoverySteps) * c.RateIncreasePeriod)
	for range c.FastRecoverySteps - 1 {
		s.sent(&c, now, int(c.ByteCounter))
	}
	rt := s.rt
	s.sent(&c, now, int(c.ByteCounter)) // the byte counter reaches F too
	assert.InDelta(t, rt+c.HAIRate, s.rt, 1, "hyper increase, i = 1")
}

// TestDCQCNPacing: a limited QP's packets are spaced at its rate after a
// burst allowance.
func TestDCQCNPacing(t *testing.T) {
	c := testCC(t)
	var s rateState
	t0 := time.Unix(1000, 0)
	t0 = cuts(t, &s, &c, t0, 10)
	rate := s.rc
	sent := 0
	for s.wait(&c, t0) == 0 {
		s.sent(&c, t0, 1000)
		sent += 1000
		require.Less(t, sent, 1<<20)
	}
	assert.InDelta(t, max(paceBurst, rate*paceBurstTime.Seconds()/8), sent, 1000, "a burst's worth goes at once")
	w := s.wait(&c, t0)
	assert.Positive(t, w)
	t1 := t0.Add(w)
	require.Zero(t, s.wait(&c, t1))
	rate = s.rc // (a rate increase event may have come due by t1)
	s.sent(&c, t1, 1000)
	assert.InDelta(t, float64(1000*8)/rate*1e9, float64(s.wait(&c, t1)), float64(time.Microsecond), "then one packet per size/rate")
}

func TestCongestionConfigChecks(t *testing.T) {
	for _, c := range []CongestionConfig{
		{LineRate: 1}, {AlphaG: 1.5}, {MinRate: 1e12, LineRate: 1e9}, {AlphaPeriod: time.Nanosecond}, {FastRecoverySteps: -1},
		{RateReductionPeriod: -1}, {CNPWindow: -1},
	} {
		_, err := c.withDefaults()
		assert.ErrorIs(t, err, hostverbs.ErrInvalid, "%+v", c)
	}
	_, err := New(Config{Congestion: CongestionConfig{AlphaG: 2}})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
}

// TestCongestionReductionPeriodDefault: the rate reduction period is the
// CNP interval unless set, the configured one too; DefaultCongestion
// holds the values withDefaults fills in.
func TestCongestionReductionPeriodDefault(t *testing.T) {
	d := DefaultCongestion()
	assert.Equal(t, d.CNPInterval, d.RateReductionPeriod)
	assert.Equal(t, 20*time.Millisecond, d.CNPWindow)
	c, err := CongestionConfig{}.withDefaults()
	require.NoError(t, err)
	assert.Equal(t, d, c)
	c, err = CongestionConfig{CNPInterval: time.Millisecond}.withDefaults()
	require.NoError(t, err)
	assert.Equal(t, time.Millisecond, c.RateReductionPeriod)
	c, err = CongestionConfig{RateReductionPeriod: 10 * time.Microsecond, CNPWindow: time.Second}.withDefaults()
	require.NoError(t, err)
	assert.Equal(t, 10*time.Microsecond, c.RateReductionPeriod)
	assert.Equal(t, time.Second, c.CNPWindow)
}

// TestRNRIsNotCongestion: between two VMs of one fabric there is no queue
// to mark. A receiver out of receive WQEs answers RNR, which already
// throttles the sender; it is not a congestion point too (tried: a CNP
// with each in-process RNR NAK cut 64 KiB SENDs in process from about
// 23 GB/s to 9 MB/s, DCQCN's cuts compounding on RNR's waits).
func TestRNRIsNotCongestion(t *testing.T) {
	f, err := New(Config{Congestion: CongestionConfig{LineRate: 1e9}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	a := newEndpoint(t, f, "a", "10.1.0.1", 1<<20)
	b := newEndpoint(t, f, "bb", "10.1.0.2", 1<<20)
	o := defaultRC()
	o.rnr = 7 // retry for ever
	o.minRNR = 1
	qa, qb := connectRC(t, a, b, o)
	const n = 32
	for i := range n {
		a.write(t, a.iova+uint64(i)*64, []byte{byte(i)})
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
			SGL: sge(a, uint64(i)*64, 1)}))
	}
	eventually(t, "an RNR NAK", func() bool { return ctr(a, "tx_rnr_nak") > 0 })
	for i := range n {
		require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(b, 1<<19+uint64(i)*64, 64)}))
	}
	for i := range n {
		wc := b.ccq.wait(t, 10*time.Second)
		require.Equal(t, hostverbs.WCSuccess, wc.Status)
		require.Equal(t, uint64(i), wc.WRID)
		assert.Equal(t, []byte{byte(i)}, b.read(t, b.iova+1<<19+uint64(i)*64, 1))
	}
	assert.Zero(t, ctr(a, "tx_cnp"))
	assert.Empty(t, f.QPRates(), "no QP paced")
}
