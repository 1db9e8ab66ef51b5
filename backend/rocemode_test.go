package backend

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

func TestParseRoCEMode(t *testing.T) {
	for in, want := range map[string]hostverbs.GIDType{
		"": 0, "v1": hostverbs.GIDTypeRoCEv1, "V2": hostverbs.GIDTypeRoCEv2, "1": hostverbs.GIDTypeRoCEv1,
		"IB/RoCE v1": hostverbs.GIDTypeRoCEv1, "RoCE v2": hostverbs.GIDTypeRoCEv2,
	} {
		got, err := ParseRoCEMode(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, bad := range []string{"v3", "0", "roce", "v1,v2"} {
		_, err := ParseRoCEMode(bad)
		assert.ErrorIs(t, err, ErrBadRoCEMode, bad)
	}
	req, err := ParseVMFlag("vm1,roce=v1,mem=1G")
	require.NoError(t, err)
	assert.Equal(t, "v1", req.RoCEMode)
	_, err = ParseVMFlag("vm1,roce=v9")
	assert.ErrorIs(t, err, ErrBadRoCEMode)
	_, err = ParseVMFlag("vm1,roce=")
	assert.ErrorIs(t, err, ErrBadRoCEMode)
}

// TestRoCEv1NeedsL2: IP mode carries RoCE v2 only, as a fabric default
// and per VM; L2 mode and an in-process fabric take v1.
func TestRoCEv1NeedsL2(t *testing.T) {
	ip := FabricConfig{Netdev: "eth0"}
	assert.ErrorIs(t, ip.checkRoCEMode(hostverbs.GIDTypeRoCEv1), ErrBadRoCEMode)
	assert.NoError(t, ip.checkRoCEMode(hostverbs.GIDTypeRoCEv2))
	assert.NoError(t, FabricConfig{Bridge: "br0"}.checkRoCEMode(hostverbs.GIDTypeRoCEv1))
	assert.NoError(t, FabricConfig{}.checkRoCEMode(hostverbs.GIDTypeRoCEv1))
	assert.ErrorIs(t, FabricConfig{CreateRXE: "eth0"}.checkRoCEMode(hostverbs.GIDTypeRoCEv1), ErrBadRoCEMode)
	ip.RoCEMode = hostverbs.GIDTypeRoCEv1
	_, err := newFabric(ip, nil, slog.Default())
	assert.ErrorIs(t, err, ErrBadRoCEMode)
	assert.ErrorContains(t, err, "not routable")
	_, err = newFabric(FabricConfig{RoCEMode: 7}, nil, slog.Default())
	assert.ErrorIs(t, err, ErrBadRoCEMode)
}

func TestParseCongestion(t *testing.T) {
	c, err := ParseCongestion("off")
	require.NoError(t, err)
	assert.True(t, c.Disabled)
	c, err = ParseCongestion("")
	require.NoError(t, err)
	assert.False(t, c.Disabled)
	c, err = ParseCongestion("line-rate=10G,rate-timer=1ms,g=1/128,f=3,byte-counter=1M,ai-rate=10M,cnp-interval=4us")
	require.NoError(t, err)
	assert.Equal(t, 10e9, c.LineRate)
	assert.Equal(t, time.Millisecond, c.RateIncreasePeriod)
	assert.Equal(t, 1.0/128, c.AlphaG)
	assert.Equal(t, 3, c.FastRecoverySteps)
	assert.Equal(t, uint64(1<<20), c.ByteCounter)
	assert.Equal(t, 10e6, c.AIRate)
	assert.Equal(t, 4*time.Microsecond, c.CNPInterval)
	c, err = ParseCongestion("reduction-period=100us,cnp-window=5ms")
	require.NoError(t, err)
	assert.Equal(t, 100*time.Microsecond, c.RateReductionPeriod)
	assert.Equal(t, 5*time.Millisecond, c.CNPWindow)
	for _, bad := range []string{"fast", "line-rate=-1", "g=1/0", "rate-timer=soon", "x=1"} {
		_, err := ParseCongestion(bad)
		assert.ErrorIs(t, err, ErrBadCongestion, bad)
	}
	// A setting soft rejects fails the fabric.
	c, err = ParseCongestion("g=2")
	require.NoError(t, err)
	_, err = newFabric(FabricConfig{Congestion: c}, nil, slog.Default())
	assert.Error(t, err)
}
