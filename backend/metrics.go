package backend

import (
	"io"
	"log/slog"
	"math"
	"net/http"
	"sort"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/expfmt"

	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// The control socket's GET /metrics is Prometheus' client library over a
// registry of the daemon's own (never the library's global one, so that
// any number of daemons share a process, as the tests run them), with two
// collectors that read the daemon's state at each scrape:
//
//   - statusCollector renders a Status snapshot as the families the
//     daemon always exported (pvrdma_vm_*, pvrdma_qp_rate_bits_per_second,
//     pvrdma_fabric_events_total);
//   - deviceCollector renders the distributions each connected VM's
//     device measures (vdev's Config.Distributions) as histograms: the
//     latency from a send WQE's doorbell to its CQE and the send queue's
//     depth at each send doorbell. The device counts them in lock-free
//     buckets of its own, cheaper per observation than a client_golang
//     Histogram; a VM's series exist while its QEMU is connected and
//     start again with a new connection, as its device counters do.

// The histograms' names.
const (
	metricSendLatency = "pvrdma_vm_doorbell_to_cqe_seconds"
	metricSendDepth   = "pvrdma_vm_send_queue_depth"
)

// newMetricsRegistry returns a daemon's registry.
func newMetricsRegistry(d *Daemon) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newStatusCollector(d.Status), newDeviceCollector(d.devices))
	return reg
}

// vmDevice is a connected VM's device.
type vmDevice struct {
	vm  string
	dev *vdev.Device
}

// devices returns the devices of the VMs connected now, by VM name.
func (d *Daemon) devices() []vmDevice {
	var out []vmDevice
	for _, s := range d.sessions() {
		s.mu.Lock()
		if c := s.conn; c != nil {
			out = append(out, vmDevice{s.name, c.dev})
		}
		s.mu.Unlock()
	}
	return out
}

// deviceCollector exports the distributions of the connected VMs'
// devices as histograms.
type deviceCollector struct {
	devices        func() []vmDevice
	latency, depth *prometheus.Desc
}

func newDeviceCollector(devices func() []vmDevice) *deviceCollector {
	vm := []string{"vm"}
	return &deviceCollector{
		devices: devices,
		latency: prometheus.NewDesc(metricSendLatency,
			"Seconds from the send doorbell that had the device take a send WQE to its CQE in the guest's CQ ring.", vm, nil),
		depth: prometheus.NewDesc(metricSendDepth,
			"Send WQEs posted and not completed on the QP, at each send doorbell.", vm, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *deviceCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.latency
	ch <- c.depth
}

// Collect implements prometheus.Collector.
func (c *deviceCollector) Collect(ch chan<- prometheus.Metric) {
	for _, d := range c.devices() {
		ds := d.dev.Distributions()
		ch <- constHistogram(c.latency, ds.SendLatency, d.vm)
		ch <- constHistogram(c.depth, ds.SendQueueDepth, d.vm)
	}
}

// constHistogram is a device's histogram h as a Prometheus histogram.
func constHistogram(desc *prometheus.Desc, h vdev.Histogram, labels ...string) prometheus.Metric {
	buckets := make(map[float64]uint64, len(h.Bounds))
	var n uint64
	for i, c := range h.Counts {
		n += c
		if i < len(h.Bounds) {
			buckets[h.Bounds[i]] = n // cumulative
		}
	}
	m, err := prometheus.NewConstHistogram(desc, n, h.Sum, buckets, labels...)
	if err != nil {
		return prometheus.NewInvalidMetric(desc, err)
	}
	return m
}

// MetricsGatherer is a Controller with a metrics registry of its own (a
// Daemon): the control socket's GET /metrics serves what it gathers
// instead of rendering the Controller's Status alone.
type MetricsGatherer interface {
	Gatherer() prometheus.Gatherer
}

// Gatherer returns the daemon's metrics registry: the families of its
// Status and the per-VM histograms.
func (d *Daemon) Gatherer() prometheus.Gatherer { return d.metrics }

// metricsHandler serves c's metrics: its own registry if it has one,
// else one rendering c.Status at each scrape. A metric that cannot be
// collected is left out (and logged if log is set) rather than failing
// the scrape.
func metricsHandler(c Controller, log *slog.Logger) http.Handler {
	var g prometheus.Gatherer
	if mg, ok := c.(MetricsGatherer); ok {
		g = mg.Gatherer()
	} else {
		reg := prometheus.NewRegistry()
		reg.MustRegister(newStatusCollector(c.Status))
		g = reg
	}
	opts := promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}
	if log != nil {
		opts.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	}
	return promhttp.HandlerFor(g, opts)
}

// WriteMetrics writes the families of st in the Prometheus text
// exposition format (those GET /metrics serves, less the devices'
// histograms, which a Status does not hold).
func WriteMetrics(w io.Writer, st Status) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newStatusCollector(func() Status { return st }))
	mfs, err := reg.Gather()
	for _, mf := range mfs {
		if _, werr := expfmt.MetricFamilyToText(w, mf); werr != nil {
			return werr
		}
	}
	return err
}

// statusCollector exports a Status snapshot, taken at each scrape, as
// the daemon's gauges and counters. Their names, help, types and labels
// are the control socket's from before it used the client library.
type statusCollector struct {
	status func() Status

	connected, locked, gids, refusals, reserved, resources, events, qpRate, fabricEvents, restarts *prometheus.Desc
}

func newStatusCollector(status func() Status) *statusCollector {
	vm := []string{"vm"}
	return &statusCollector{
		status:       status,
		connected:    prometheus.NewDesc("pvrdma_vm_connected", "1 if the VM's QEMU is connected.", vm, nil),
		locked:       prometheus.NewDesc("pvrdma_vm_locked_bytes", "Guest memory bytes mapped and locked for the VM.", vm, nil),
		gids:         prometheus.NewDesc("pvrdma_vm_gids", "GIDs the VM has bound.", vm, nil),
		refusals:     prometheus.NewDesc("pvrdma_vm_gid_refusals_total", "GID binds refused by the VM's GID policy.", vm, nil),
		reserved:     prometheus.NewDesc("pvrdma_vm_reserved_gids", "GIDs reserved to the VM until it is unregistered.", vm, nil),
		resources:    prometheus.NewDesc("pvrdma_vm_resources", "Live device objects by kind.", []string{"vm", "kind"}, nil),
		events:       prometheus.NewDesc("pvrdma_vm_events_total", "Per-VM device counters (commands, doorbells, completions, errors).", []string{"vm", "event"}, nil),
		qpRate:       prometheus.NewDesc("pvrdma_qp_rate_bits_per_second", "Current DCQCN rate of QPs that received a CNP.", []string{"vm", "qpn"}, nil),
		fabricEvents: prometheus.NewDesc("pvrdma_fabric_events_total", "Fabric counters (packets, drops by reason, retransmissions, CNPs, CE-marked packets).", []string{"event"}, nil),
		restarts: prometheus.NewDesc("pvrdma_supervisor_worker_restarts_total",
			"Times the daemon's own supervisor (serve not run by a service manager) started the daemon again after it died, keeping its VMs.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.connected, c.locked, c.gids, c.refusals, c.reserved, c.resources, c.events, c.qpRate, c.fabricEvents, c.restarts} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *statusCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.status()
	put := func(d *prometheus.Desc, t prometheus.ValueType, v float64, labels ...string) {
		m, err := prometheus.NewConstMetric(d, t, v, labels...)
		if err != nil {
			m = prometheus.NewInvalidMetric(d, err)
		}
		ch <- m
	}
	gauge, counter := prometheus.GaugeValue, prometheus.CounterValue
	for _, vm := range st.VMs {
		connected := 0.0
		if vm.Connected {
			connected = 1
		}
		put(c.connected, gauge, connected, vm.Name)
		put(c.locked, gauge, float64(vm.LockedBytes), vm.Name)
		put(c.gids, gauge, float64(len(vm.GIDs)), vm.Name)
		put(c.refusals, counter, float64(vm.GIDRefusals), vm.Name)
		put(c.reserved, gauge, float64(len(vm.ReservedGIDs)), vm.Name)
		for _, k := range sortedKeys(vm.Resources) {
			put(c.resources, gauge, float64(vm.Resources[k]), vm.Name, k)
		}
		for _, k := range sortedKeys(vm.Counters) {
			put(c.events, counter, float64(vm.Counters[k]), vm.Name, k)
		}
	}
	for _, q := range st.Fabric.QPRates {
		put(c.qpRate, gauge, math.Round(q.RateMbps*1e6), q.VM, strconv.FormatUint(uint64(q.QPN), 10))
	}
	for _, k := range sortedKeys(st.Counters) {
		put(c.fabricEvents, counter, float64(st.Counters[k]), k)
	}
	if st.Supervisor != nil {
		put(c.restarts, counter, float64(st.Supervisor.Restarts))
	}
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
