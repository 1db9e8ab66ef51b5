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

// TestDCQCNCut: the first CNP halves the line rate (alpha starts at 1),
// keeps the old rate as the target, and raises alpha by g; CNPs in a row
// keep cutting, never below the minimum rate.
func TestDCQCNCut(t *testing.T) {
	c := testCC(t)
	var s rateState
	t0 := time.Unix(1000, 0)
	assert.Equal(t, c.LineRate, s.rate(&c))
	assert.Zero(t, s.wait(&c, t0), "not limited: no pacing")
	s.onCNP(&c, t0)
	assert.True(t, s.limited)
	assert.InDelta(t, 5e9, s.rc, 1)
	assert.InDelta(t, 10e9, s.rt, 1)
	assert.InDelta(t, 1.0, s.alpha, 1e-9, "(1-g)*1 + g")
	s.onCNP(&c, t0.Add(time.Microsecond))
	assert.InDelta(t, 2.5e9, s.rc, 1)
	assert.InDelta(t, 5e9, s.rt, 1)
	for i := range 100 {
		s.onCNP(&c, t0.Add(time.Duration(2+i)*time.Microsecond))
	}
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
	s.onCNP(&c, t0)
	s.onCNP(&c, t0) // the target below line rate: room for additive increase
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
	for range 20 {
		s.onCNP(&c, t0) // deep cut: room to grow
	}
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
	for range 10 {
		s.onCNP(&c, t0)
	}
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
	} {
		_, err := c.withDefaults()
		assert.ErrorIs(t, err, hostverbs.ErrInvalid, "%+v", c)
	}
	_, err := New(Config{Congestion: CongestionConfig{AlphaG: 2}})
	assert.ErrorIs(t, err, hostverbs.ErrInvalid)
}
