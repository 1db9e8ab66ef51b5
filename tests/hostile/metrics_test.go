package hostile

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// metrics is the daemon's Prometheus exposition, as GET /metrics on its
// control socket serves it.
func (e *env) metrics() string {
	e.t.Helper()
	ctl := e.ctl
	if ctl == nil {
		ctl = backend.NewControlClient(filepath.Join(filepath.Dir(e.d.SocketPath(vmEvil)), "control.sock"))
		defer ctl.Close() // its connection would count as a leak
	}
	m, err := ctl.Metrics(context.Background())
	require.NoError(e.t, err)
	return m
}

// histogram returns the series of family name for VM vm.
func histogram(t *testing.T, mfs map[string]*dto.MetricFamily, name, vm string) *dto.Histogram {
	t.Helper()
	mf, ok := mfs[name]
	require.True(t, ok, "no family %s", name)
	require.Equal(t, dto.MetricType_HISTOGRAM, mf.GetType(), name)
	for _, m := range mf.GetMetric() {
		if len(m.GetLabel()) == 1 && m.GetLabel()[0].GetName() == "vm" && m.GetLabel()[0].GetValue() == vm {
			return m.GetHistogram()
		}
	}
	t.Fatalf("%s has no series for VM %s", name, vm)
	return nil
}

// requireHistogram checks a scraped histogram's shape: at least min
// samples, cumulative buckets that never decrease, ascending bounds
// ending in +Inf holding every sample, and a positive sum.
func requireHistogram(t *testing.T, h *dto.Histogram, min uint64, what string) {
	t.Helper()
	require.GreaterOrEqual(t, h.GetSampleCount(), min, what)
	require.Positive(t, h.GetSampleSum(), what)
	bs := h.GetBucket()
	require.NotEmpty(t, bs, what)
	for i := 1; i < len(bs); i++ {
		require.Greater(t, bs[i].GetUpperBound(), bs[i-1].GetUpperBound(), what)
		require.GreaterOrEqual(t, bs[i].GetCumulativeCount(), bs[i-1].GetCumulativeCount(), "%s: buckets are cumulative", what)
	}
	require.Equal(t, h.GetSampleCount(), bs[len(bs)-1].GetCumulativeCount(), "%s: +Inf holds every sample", what)
}

// TestMetricsHistograms: two VMs exchange SENDs and RDMA WRITEs through
// the daemon; its control socket's exposition then has, for each VM, the
// doorbell-to-CQE latency of its sends and the depth of its send queue at
// each send doorbell, next to the families it always had.
func TestMetricsHistograms(t *testing.T) {
	e := newEnv(t)
	a, b := e.pair(vmEvil, vmPeer)
	exchange(t, a, b) // two signaled sends from a (SEND, RDMA WRITE)
	exchange(t, b, a)
	exchange(t, a, b)

	text := e.metrics()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(text))
	require.NoError(t, err, text)
	for _, name := range []string{"pvrdma_vm_connected", "pvrdma_vm_locked_bytes", "pvrdma_vm_gids", "pvrdma_vm_gid_refusals_total",
		"pvrdma_vm_reserved_gids", "pvrdma_vm_resources", "pvrdma_vm_events_total", "pvrdma_fabric_events_total"} {
		assert.Contains(t, mfs, name)
	}
	for vm, sends := range map[string]uint64{vmEvil: 4, vmPeer: 2} {
		lat := histogram(t, mfs, "pvrdma_vm_doorbell_to_cqe_seconds", vm)
		requireHistogram(t, lat, sends, vm+" latency")
		require.Less(t, lat.GetSampleSum(), float64(sends)*10, "%s: seconds, not nanoseconds", vm)
		depth := histogram(t, mfs, "pvrdma_vm_send_queue_depth", vm)
		requireHistogram(t, depth, sends, vm+" depth")
		require.GreaterOrEqual(t, depth.GetSampleSum(), float64(sends), "%s: a doorbell finds at least its own WQE", vm)
	}
	for _, name := range []string{"pvrdma_vm_doorbell_to_cqe_seconds", "pvrdma_vm_send_queue_depth"} {
		assert.Len(t, mfs[name].GetMetric(), 2, "%s: only the connected VMs have series", name)
	}
}
