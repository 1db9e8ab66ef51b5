package backend

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// fullStatus has something in every family the status collector renders.
func fullStatus() Status {
	return Status{
		Transport: "soft",
		Fabric: FabricStatus{Mode: "local", QPRates: []QPRateStatus{
			{VM: "vm1", QPN: 17, RateMbps: 1234.5678},
			{VM: "vm2", QPN: 0x1234, RateMbps: 100000},
		}},
		Counters: map[string]uint64{"rx_packets": 3, "tx_packets": 1 << 40, "refused_peers": 0},
		VMs: []VMStatus{
			{
				Name: "vm1", Connected: true, LockedBytes: 1<<30 + 16<<20,
				GIDs:         []GIDStatus{{Index: 0, GID: "fe80::1", Type: "RoCE v2"}, {Index: 1, GID: "::ffff:10.0.0.1", Type: "RoCE v2"}},
				ReservedGIDs: []string{"10.0.0.1"}, GIDRefusals: 2,
				Resources: map[string]int{"qp": 2, "cq": 4, "mr": 1},
				Counters:  map[string]uint64{"commands": 7, "doorbells": 123456789, "send_wqes": 0},
			},
			{Name: "vm2"},
		},
	}
}

// parseMetrics parses a text exposition as a scraper does.
func parseMetrics(t *testing.T, text string) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(text))
	require.NoError(t, err, "exposition:\n%s", text)
	return mfs
}

// series renders a family's samples as "labels=value" lines, sorted, the
// labels in name order: what a scraper stores.
func series(mf *dto.MetricFamily) []string {
	var out []string
	for _, m := range mf.GetMetric() {
		ls := slices.Clone(m.GetLabel())
		sort.Slice(ls, func(i, j int) bool { return ls[i].GetName() < ls[j].GetName() })
		var b strings.Builder
		for _, l := range ls {
			b.WriteString(l.GetName() + "=" + l.GetValue() + ",")
		}
		var v float64
		switch {
		case m.Gauge != nil:
			v = m.GetGauge().GetValue()
		case m.Counter != nil:
			v = m.GetCounter().GetValue()
		case m.Untyped != nil:
			v = m.GetUntyped().GetValue()
		}
		b.WriteString(" " + model.SampleValue(v).String())
		out = append(out, b.String())
	}
	sort.Strings(out)
	return out
}

// requireSameFamilies checks that got has every family of want with the
// same type, help and samples.
func requireSameFamilies(t *testing.T, want, got map[string]*dto.MetricFamily) {
	t.Helper()
	for name, w := range want {
		g, ok := got[name]
		if !assert.True(t, ok, "family %s is gone", name) {
			continue
		}
		assert.Equal(t, w.GetType(), g.GetType(), "type of %s", name)
		assert.Equal(t, w.GetHelp(), g.GetHelp(), "help of %s", name)
		assert.Equal(t, series(w), series(g), "samples of %s", name)
	}
}

// statusFamilies are the families the control socket exported before it
// used the client library, with their types and label names.
var statusFamilies = map[string]struct {
	typ    dto.MetricType
	labels []string
}{
	"pvrdma_vm_connected":            {dto.MetricType_GAUGE, []string{"vm"}},
	"pvrdma_vm_locked_bytes":         {dto.MetricType_GAUGE, []string{"vm"}},
	"pvrdma_vm_gids":                 {dto.MetricType_GAUGE, []string{"vm"}},
	"pvrdma_vm_gid_refusals_total":   {dto.MetricType_COUNTER, []string{"vm"}},
	"pvrdma_vm_reserved_gids":        {dto.MetricType_GAUGE, []string{"vm"}},
	"pvrdma_vm_resources":            {dto.MetricType_GAUGE, []string{"kind", "vm"}},
	"pvrdma_vm_events_total":         {dto.MetricType_COUNTER, []string{"event", "vm"}},
	"pvrdma_qp_rate_bits_per_second": {dto.MetricType_GAUGE, []string{"qpn", "vm"}},
	"pvrdma_fabric_events_total":     {dto.MetricType_COUNTER, []string{"event"}},
}

func labelNames(m *dto.Metric) []string {
	var ns []string
	for _, l := range m.GetLabel() {
		ns = append(ns, l.GetName())
	}
	sort.Strings(ns)
	return ns
}

// requireStatusFamilies checks that every family of statusFamilies is in
// mfs with its type and label names.
func requireStatusFamilies(t *testing.T, mfs map[string]*dto.MetricFamily, except ...string) {
	t.Helper()
	for name, f := range statusFamilies {
		if slices.Contains(except, name) {
			continue
		}
		mf, ok := mfs[name]
		if !assert.True(t, ok, "family %s", name) {
			continue
		}
		assert.Equal(t, f.typ, mf.GetType(), name)
		require.NotEmpty(t, mf.GetMetric(), name)
		for _, m := range mf.GetMetric() {
			assert.Equal(t, f.labels, labelNames(m), name)
		}
	}
}

func scrape(t *testing.T, h http.Handler) string {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	assert.Contains(t, rec.Header().Get("Content-Type"), "text/plain")
	return rec.Body.String()
}

// TestMetricsCompatible: the client library's exposition of a Status has
// every family the hand-written one had (testdata/metrics-handwritten.txt,
// what it rendered for fullStatus), with the same types, help, labels and
// values, through GET /metrics and WriteMetrics alike.
func TestMetricsCompatible(t *testing.T) {
	golden, err := os.ReadFile(filepath.Join("testdata", "metrics-handwritten.txt"))
	require.NoError(t, err)
	want := parseMetrics(t, string(golden))
	require.Len(t, want, len(statusFamilies))

	st := fullStatus()
	text := scrape(t, ControlHandler(statusController(st)))
	got := parseMetrics(t, text)
	requireSameFamilies(t, want, got)
	requireStatusFamilies(t, got)

	var b strings.Builder
	require.NoError(t, WriteMetrics(&b, st))
	requireSameFamilies(t, want, parseMetrics(t, b.String()))
	// Single-label samples read as before, byte for byte (tests/hostile
	// and the CLI's tests match them as text).
	for _, s := range []string{`pvrdma_vm_gid_refusals_total{vm="vm1"} 2`, `pvrdma_vm_reserved_gids{vm="vm1"} 1`,
		`pvrdma_vm_connected{vm="vm2"} 0`, `pvrdma_fabric_events_total{event="rx_packets"} 3`} {
		assert.Contains(t, text, s+"\n")
		assert.Contains(t, b.String(), s+"\n")
	}
}

// statusController is a Controller that only reports st.
type statusController Status

func (s statusController) Status() Status                  { return Status(s) }
func (statusController) AddVM(VMRequest) (VMStatus, error) { return VMStatus{}, ErrVMExists }
func (statusController) RemoveVM(string) error             { return ErrNoVM }

// TestDaemonMetrics: the daemon's own registry serves its Status's
// families and, per connected VM, the two histograms, whose series exist
// from the QEMU's connection to its end.
func TestDaemonMetrics(t *testing.T) {
	d, dir, _ := testDaemon(t)
	ctx := context.Background()
	ctl := NewControlClient(filepath.Join(dir, "control.sock"))
	histograms := []string{"pvrdma_vm_doorbell_to_cqe_seconds", "pvrdma_vm_send_queue_depth"}

	text, err := ctl.Metrics(ctx)
	require.NoError(t, err)
	mfs := parseMetrics(t, text)
	// vm1 is registered, not connected: no resources, device counters or
	// histograms; an idle fabric paces no QP.
	requireStatusFamilies(t, mfs, "pvrdma_vm_resources", "pvrdma_vm_events_total", "pvrdma_qp_rate_bits_per_second")
	for _, h := range histograms {
		assert.NotContains(t, mfs, h)
	}

	c := dialVM(t, d.SocketPath("vm1"))
	text, err = ctl.Metrics(ctx)
	require.NoError(t, err)
	mfs = parseMetrics(t, text)
	requireStatusFamilies(t, mfs, "pvrdma_qp_rate_bits_per_second")
	for _, h := range histograms {
		mf, ok := mfs[h]
		require.True(t, ok, "%s once vm1's QEMU is connected", h)
		assert.Equal(t, dto.MetricType_HISTOGRAM, mf.GetType())
		require.Len(t, mf.GetMetric(), 1)
		m := mf.GetMetric()[0]
		assert.Equal(t, []string{"vm"}, labelNames(m))
		assert.Equal(t, "vm1", m.GetLabel()[0].GetValue())
		assert.Zero(t, m.GetHistogram().GetSampleCount())
	}
	wantBuckets := map[string][]float64{histograms[0]: vdev.SendLatencyBounds(), histograms[1]: vdev.SendQueueDepthBounds()}
	for h, want := range wantBuckets {
		var got []float64
		for _, b := range mfs[h].GetMetric()[0].GetHistogram().GetBucket() {
			got = append(got, b.GetUpperBound())
		}
		assert.Equal(t, append(want, math.Inf(1)), got, h)
	}

	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return !d.Status().VMs[0].Connected }, hangBound, 10*time.Millisecond)
	text, err = ctl.Metrics(ctx)
	require.NoError(t, err)
	mfs = parseMetrics(t, text)
	for _, h := range histograms {
		assert.NotContains(t, mfs, h, "the disconnected VM's series are gone")
	}
}

// TestMetricsSupervisor: a daemon run by its own supervisor exports the
// supervisor's restarts of it; one without exports no such family.
func TestMetricsSupervisor(t *testing.T) {
	st := fullStatus()
	var b strings.Builder
	require.NoError(t, WriteMetrics(&b, st))
	assert.NotContains(t, b.String(), "pvrdma_supervisor_")
	st.Supervisor = &SupervisorStatus{PID: 7, Restarts: 3, LastExit: "killed by signal SIGKILL"}
	b.Reset()
	require.NoError(t, WriteMetrics(&b, st))
	assert.Contains(t, b.String(), "# TYPE pvrdma_supervisor_worker_restarts_total counter\npvrdma_supervisor_worker_restarts_total 3\n")
}
