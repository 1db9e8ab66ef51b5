package vdev

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// measured returns a userRC whose device has its distributions on.
func measured(t *testing.T) *userRC {
	u := newUserRC(t)
	u.g.dev.dist = newDistributions()
	return u
}

func (u *userRC) latency() Histogram { return u.g.dev.Distributions().SendLatency }
func (u *userRC) depth() Histogram   { return u.g.dev.Distributions().SendQueueDepth }

// depthCounts returns how many doorbells found each depth bucket's upper
// bound (the buckets that have any).
func depthCounts(h Histogram) map[float64]uint64 {
	m := map[float64]uint64{}
	for i, c := range h.Counts {
		if c == 0 {
			continue
		}
		b := math.Inf(1)
		if i < len(h.Bounds) {
			b = h.Bounds[i]
		}
		m[b] = c
	}
	return m
}

func TestDistributionBuckets(t *testing.T) {
	for _, c := range []struct {
		ns   uint64
		want int
	}{{0, 0}, {1, 0}, {1000, 0}, {1001, 1}, {2000, 1}, {2001, 2}, {4000, 2}, {1000 << 20, 20}, {1000<<20 + 1, 21}} {
		assert.Equal(t, c.want, latencyBucket(c.ns), "%d ns", c.ns)
	}
	assert.Greater(t, latencyBucket(math.MaxUint64), latencyBuckets, "beyond: add puts it in the last bucket")
	for _, c := range []struct {
		n    uint64
		want int
	}{{0, 0}, {1, 0}, {2, 1}, {3, 2}, {4, 2}, {5, 3}, {4096, 12}, {4097, 13}} {
		assert.Equal(t, c.want, depthBucket(c.n), "depth %d", c.n)
	}
	// A value at a bound is in that bound's bucket (Prometheus' le).
	lb, db := SendLatencyBounds(), SendQueueDepthBounds()
	require.Len(t, lb, latencyBuckets)
	require.Len(t, db, depthBuckets)
	for k, b := range lb {
		ns := uint64(math.Round(b * 1e9))
		assert.Equal(t, k, latencyBucket(ns), "bound %g s", b)
		assert.Equal(t, k+1, latencyBucket(ns+1), "just above %g s", b)
	}
	for k, b := range db {
		assert.Equal(t, k, depthBucket(uint64(b)), "bound %g", b)
	}
	assert.Equal(t, 1e-6, lb[0])
	assert.Equal(t, 4096.0, db[len(db)-1])

	// Beyond the last bound: the +Inf bucket.
	h := newHistogram(depthBuckets)
	h.add(depthBucket(1<<20), 1<<20)
	h.add(depthBucket(3), 3)
	s := h.snapshot(db)
	assert.Equal(t, uint64(2), s.Count())
	assert.Equal(t, uint64(1), s.Counts[depthBuckets])
	assert.Equal(t, float64(1<<20+3), s.Sum)
}

func TestConfigDistributions(t *testing.T) {
	fv := newFakeVerbs()
	g := newGuest(t, fv, Limits{})
	d, err := New(Config{Memory: g.mem, Verbs: fv, IRQ: g.irq, Distributions: true})
	require.NoError(t, err)
	defer d.Close()
	ds := d.Distributions()
	assert.Equal(t, SendLatencyBounds(), ds.SendLatency.Bounds)
	assert.Len(t, ds.SendLatency.Counts, latencyBuckets+1)
	assert.Equal(t, SendQueueDepthBounds(), ds.SendQueueDepth.Bounds)
	assert.Zero(t, ds.SendLatency.Count()+ds.SendQueueDepth.Count())

	assert.Equal(t, Distributions{}, g.dev.Distributions(), "off by default")
}

// TestSendLatencyObserved: every send CQE the device writes is observed
// once; unsignaled sends (no CQE) and receives are not. Each SQ doorbell
// observes the send queue's depth.
func TestSendLatencyObserved(t *testing.T) {
	u := measured(t)
	q := u.qp
	for i := range 3 {
		q.writeSend(wqe(hostverbs.WRSend, uint64(i), hostverbs.SendSignaled), u.sge(0, 64))
	}
	q.g.doorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle)
	assert.Equal(t, map[float64]uint64{4: 1}, depthCounts(u.depth()), "one doorbell, three WQEs outstanding")
	assert.EqualValues(t, 3, u.depth().Sum)
	assert.Zero(t, u.latency().Count(), "nothing completed")

	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	u.scq.mustPoll()
	require.EqualValues(t, 1, u.latency().Count())

	q.postSend(wqe(hostverbs.WRSend, 3, 0), u.sge(0, 64)) // unsignaled
	q.postSend(wqe(hostverbs.WRSend, 4, hostverbs.SendSignaled), u.sge(0, 64))
	assert.Equal(t, map[float64]uint64{4: 3}, depthCounts(u.depth()), "two outstanding and the new one, then one more")
	assert.EqualValues(t, 3+3+4, u.depth().Sum)
	for range 2 {
		u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	}
	u.fq.finish(t, false, 1, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend}) // the unsignaled one retired in silence
	for range 3 {
		u.scq.mustPoll()
	}
	_, ok := u.scq.poll()
	require.False(t, ok)
	lat := u.latency()
	require.EqualValues(t, 4, lat.Count(), "one per send CQE")
	assert.Less(t, lat.Sum, 60.0, "seconds, not nanoseconds")

	q.postRecv(9, u.sge(0, 64))
	u.fq.finish(t, true, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCRecv})
	u.rcq.mustPoll()
	assert.EqualValues(t, 4, u.latency().Count(), "receives are not sends")
	assert.EqualValues(t, 3, u.depth().Count(), "nor are RECV doorbells")

	// The device's own CQEs count too: a flush in ERR.
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
	q.postSend(wqe(hostverbs.WRSend, 5, hostverbs.SendSignaled), u.sge(0, 64))
	e := u.scq.mustPoll()
	assert.EqualValues(t, hostverbs.WCWRFlushErr, e.Status)
	assert.EqualValues(t, 5, u.latency().Count())
}

// TestSendLatencyStall: a WQE a full provider queue left in the ring
// keeps the stamp of the doorbell that found it, and a doorbell on the
// stalled queue still observes its depth.
func TestSendLatencyStall(t *testing.T) {
	u := measured(t)
	u.fv.queueCap = 1
	q := u.qp
	q.writeSend(wqe(hostverbs.WRSend, 1, hostverbs.SendSignaled), u.sge(0, 64))
	q.writeSend(wqe(hostverbs.WRSend, 2, hostverbs.SendSignaled), u.sge(0, 64))
	q.g.doorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle)
	dq, ok := u.g.dev.qps.get(q.handle)
	require.True(t, ok)
	require.True(t, dq.stalledSQ)
	first := dq.sq.slots[0].at
	require.NotZero(t, first)
	require.Equal(t, first, dq.sq.waiting)

	q.postSend(wqe(hostverbs.WRSend, 3, hostverbs.SendSignaled), u.sge(0, 64))
	assert.Equal(t, map[float64]uint64{2: 1, 4: 1}, depthCounts(u.depth()), "the stalled queue's depth is observed")

	// The fake's cap counts the sends not taken: one at a time.
	u.fq.take()
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	u.scq.arm(abi.UARCQPoll) // the driver's poll doorbell resumes the queue
	require.Equal(t, first, dq.sq.slots[1].at, "timed from the doorbell that found it")
	require.True(t, dq.stalledSQ, "one at a time")
	u.fq.take()
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	u.scq.arm(abi.UARCQPoll)
	require.Equal(t, first, dq.sq.slots[2].at, "posted during the stall: an upper bound")
	require.False(t, dq.stalledSQ)
	require.Zero(t, dq.sq.waiting)
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	for range 3 {
		u.scq.mustPoll()
	}
	assert.EqualValues(t, 3, u.latency().Count())
	assert.EqualValues(t, 2, u.depth().Count(), "POLL doorbells are not SQ doorbells")

	// A RESET forgets the stall's stamp with the WQEs.
	u.fv.queueCap = 0
	q.writeSend(wqe(hostverbs.WRSend, 4, hostverbs.SendSignaled), u.sge(0, 64))
	dq.sq.waiting = 12345
	q.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateReset)})
	assert.Zero(t, dq.sq.waiting)
}

// TestNoDistributionsNoStamps: without distributions the device reads
// no clock.
func TestNoDistributionsNoStamps(t *testing.T) {
	u := newUserRC(t)
	u.qp.postSend(wqe(hostverbs.WRSend, 1, hostverbs.SendSignaled), u.sge(0, 64))
	dq, _ := u.g.dev.qps.get(u.qp.handle)
	assert.Zero(t, dq.sq.slots[0].at)
	u.fq.finish(t, false, 0, hostverbs.WorkCompletion{Opcode: hostverbs.WCSend})
	u.scq.mustPoll()
	assert.Zero(t, u.latency().Count())
}
