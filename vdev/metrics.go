package vdev

import (
	"math"
	"math/bits"
	"sync/atomic"
	"time"
)

// The device's distributions (Config.Distributions, Device.Distributions),
// for the daemon's Prometheus histograms.
//
// Send latency: each SQ doorbell pass that takes WQEs from the ring
// (postSends) reads the clock once, and every WQE it takes keeps that
// stamp in its wqSlot, the device's own record of the WQE (never guest
// memory, which the guest could rewrite). When the CQE of a send WQE is
// published in the guest's CQ ring (cq.put, after Commit), the time since
// its stamp is observed. WQEs that complete without a CQE (unsignaled
// successes) are not observed; the device's own completions (flushes,
// local operations, refused WQEs) are, being CQEs the guest waits for. A
// WQE that a full provider queue left in the ring keeps the stamp of the
// pass that stalled (workQueue.waiting), so its wait in the device counts;
// WQEs the guest posts while the queue is stalled get that stamp too, an
// upper bound for them.
//
// Send queue depth: at each SQ doorbell the guest rings, the WQEs posted
// and not yet completed (prod_tail - cons_head, which pending reads under
// the CQ lock anyway) are observed, also on a stalled queue, where the
// depth matters most.
//
// Cost: per send doorbell one clock read and one observation, per send
// CQE one clock read and one observation. An observation is two atomic
// adds to fixed buckets (the bucket of a value is one bit length), with
// no lock and no allocation, cheaper than a client_golang Histogram's
// Observe (docs/ARCHITECTURE.md, The daemon, Metrics, has the figures;
// BenchmarkDistributionsAB measures them). Without Config.Distributions
// no clock is read and every stamp is 0.

// Bucket layouts: upper bounds base·2^k for k below the count, and one
// bucket above them all (+Inf).
const (
	latencyBaseNS  = 1000 // 1 µs
	latencyBuckets = 21   // to 2^20 µs, about 1 s
	depthBuckets   = 13   // 1 to 4096 WQEs (the default Limits.MaxQPWR)
)

// SendLatencyBounds returns the upper bounds of
// Distributions.SendLatency, in seconds: 1 µs to about 1 s, doubling.
func SendLatencyBounds() []float64 { return bounds(1e-6, latencyBuckets) }

// SendQueueDepthBounds returns the upper bounds of
// Distributions.SendQueueDepth, in WQEs: 1 to 4096, doubling.
func SendQueueDepthBounds() []float64 { return bounds(1, depthBuckets) }

func bounds(base float64, n int) []float64 {
	b := make([]float64, n)
	for k := range b {
		b[k] = math.Ldexp(base, k)
	}
	return b
}

// Histogram is a snapshot of one of the device's distributions.
type Histogram struct {
	// Bounds are the buckets' upper bounds, ascending, in the
	// distribution's unit. Counts[i] is how many observations were at
	// most Bounds[i] (and above Bounds[i-1]); Counts[len(Bounds)] how many
	// were above every bound. Counts are not cumulative.
	Bounds []float64
	Counts []uint64
	// Sum is the sum of the observations, in the unit.
	Sum float64
}

// Count returns how many observations the histogram holds.
func (h Histogram) Count() uint64 {
	var n uint64
	for _, c := range h.Counts {
		n += c
	}
	return n
}

// Distributions are snapshots of what the device measures when
// Config.Distributions is on (empty histograms when it is off).
type Distributions struct {
	// SendLatency is, for every send WQE whose CQE the device wrote, the
	// seconds from the SQ doorbell that had the device take the WQE from
	// the ring to the CQE's publication in the guest's CQ ring.
	SendLatency Histogram
	// SendQueueDepth is, at every SQ doorbell, the WQEs of the QP's send
	// queue the guest had posted and the device not completed.
	SendQueueDepth Histogram
}

// Distributions returns a snapshot of the device's distributions. It
// takes no lock and may be called at any time, also after Close.
func (d *Device) Distributions() Distributions {
	if d.dist == nil {
		return Distributions{}
	}
	lat := d.dist.latency.snapshot(SendLatencyBounds())
	lat.Sum *= 1e-9 // nanoseconds
	return Distributions{SendLatency: lat, SendQueueDepth: d.dist.depth.snapshot(SendQueueDepthBounds())}
}

// distributions is what the device measures (Config.Distributions).
type distributions struct {
	epoch   time.Time // the origin of latency stamps (now)
	latency histogram // nanoseconds
	depth   histogram // WQEs
}

func newDistributions() *distributions {
	return &distributions{epoch: time.Now(), latency: newHistogram(latencyBuckets), depth: newHistogram(depthBuckets)}
}

// histogram counts observations of a non-negative integer quantity by
// bucket (the bucket index is the caller's, see latencyBucket and
// depthBucket) and sums them: lock-free, allocation-free.
type histogram struct {
	counts []atomic.Uint64 // one per bound, and the last above them all
	sum    atomic.Uint64
}

func newHistogram(n int) histogram { return histogram{counts: make([]atomic.Uint64, n+1)} }

// add counts v in bucket k (beyond the last bound: the last bucket).
func (h *histogram) add(k int, v uint64) {
	if k >= len(h.counts) {
		k = len(h.counts) - 1
	}
	h.counts[k].Add(1)
	h.sum.Add(v)
}

// snapshot reads the counts and the sum. Against concurrent observations
// the counts are each exact and the sum may hold one more or less of
// them.
func (h *histogram) snapshot(bounds []float64) Histogram {
	s := Histogram{Bounds: bounds, Counts: make([]uint64, len(h.counts))}
	for i := range h.counts {
		s.Counts[i] = h.counts[i].Load()
	}
	s.Sum = float64(h.sum.Load())
	return s
}

// latencyBucket is the bucket of a latency of ns nanoseconds: the first
// k with ns <= 1 µs·2^k.
func latencyBucket(ns uint64) int {
	if ns <= latencyBaseNS {
		return 0
	}
	return bits.Len64((ns - 1) / latencyBaseNS)
}

// depthBucket is the bucket of a depth of n WQEs: the first k with
// n <= 2^k.
func depthBucket(n uint64) int {
	if n <= 1 {
		return 0
	}
	return bits.Len64(n - 1)
}

// now is the device's clock for latency stamps: nanoseconds since New on
// the monotonic clock, never 0 (0 is "not stamped"). d.dist set.
func (d *Device) now() int64 { return int64(time.Since(d.dist.epoch)) | 1 }

// sendStamp returns the stamp of a send doorbell pass over w: 0 without
// distributions, the stalled pass's stamp for WQEs a stall left in the
// ring, else now. BAR goroutine.
func (d *Device) sendStamp(w *workQueue) int64 {
	switch {
	case d.dist == nil:
		return 0
	case w.waiting != 0:
		return w.waiting
	}
	return d.now()
}

// observeSend observes the latency of a send WQE stamped at (0: none)
// whose CQE was just published. c.mu held.
func (d *Device) observeSend(at int64) {
	if at != 0 {
		ns := uint64(max(d.now()-at, 0))
		d.dist.latency.add(latencyBucket(ns), ns)
	}
}

// observeDepth observes a send queue's depth at an SQ doorbell.
func (d *Device) observeDepth(n uint32) {
	d.dist.depth.add(depthBucket(uint64(n)), uint64(n))
}
