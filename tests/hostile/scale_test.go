package hostile

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// BenchmarkScale (make bench-scale) drives one daemon with N VMs of the
// fake driver, each a real vfio-user connection with its own guest-RAM
// memfd, no QEMU. The VMs form N/2 pairs; each VM streams signaled 16 KiB
// RDMA WRITEs into its partner's MR (scaleWindow in flight) for
// scaleRun. Beside them a probe pair measures doorbell-to-CQE latency of
// single 8 B WRITEs. For each N it reports the aggregate throughput,
// Jain's fairness index over the VMs' throughputs, the probe's p50 and
// p99, and what each VM costs the process (the daemon and the fake
// drivers are one process: anonymous RSS, threads, the daemon's
// goroutines, descriptors, locked memory, and the page tables mapping that
// memory per GiB locked), idle and busy; the last line
// compares each N's aggregate with N=8's, measured in the same run.
// Run it with -benchtime 1x (one measurement per N).
func BenchmarkScale(b *testing.B) {
	ns := []int{2, 8, 32, 128}
	if s := os.Getenv("PVRDMA_SCALE_N"); s != "" { // e.g. PVRDMA_SCALE_N=8,32
		ns = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < 2 || n%2 != 0 || n > 200 {
				b.Fatalf("PVRDMA_SCALE_N: %q: want even VM counts of 2..200", f)
			}
			ns = append(ns, n)
		}
	}
	aggregate := map[int]float64{}
	for _, n := range ns {
		b.Run(fmt.Sprintf("vms=%d", n), func(b *testing.B) {
			for range b.N {
				r := runScale(b, n)
				vms := float64(n + 2) // the probe pair too
				aggregate[n] = r.aggregateMBps
				b.ReportMetric(r.aggregateMBps, "MB/s")
				b.ReportMetric(r.jain, "jain")
				b.ReportMetric(r.p50.Seconds()*1e6, "probe_p50_us")
				b.ReportMetric(r.p99.Seconds()*1e6, "probe_p99_us")
				b.ReportMetric(float64(r.idle.anonKiB)/1024/vms, "idle_rss_anon_MiB/vm")
				b.ReportMetric(float64(r.busy.anonKiB)/1024/vms, "busy_rss_anon_MiB/vm")
				b.ReportMetric(float64(r.idle.lockedKiB)/1024/vms, "locked_MiB/vm")
				b.ReportMetric(float64(r.idle.goroutines)/vms, "idle_goroutines/vm")
				b.ReportMetric(float64(r.busy.goroutines)/vms, "busy_goroutines/vm")
				b.ReportMetric(float64(r.busy.threads)/vms, "busy_threads/vm")
				b.ReportMetric(float64(r.idle.fds)/vms, "fds/vm")
				if r.idle.lockedKiB > 0 {
					// The page tables that map the VMs' locked RAM, per GiB locked.
					b.ReportMetric(float64(r.idle.pteKiB)/(float64(r.idle.lockedKiB)/(1<<20)), "pte_KiB/locked_GiB")
				}
				b.Logf("vms=%d: %.0f MB/s aggregate, Jain %.3f, probe p50 %v p99 %v; per connected VM (%d, the probe pair included) idle: %.2f MiB anon RSS, %.1f MiB locked, "+
					"%.1f daemon goroutines, %.1f fds (2 of them the fake driver's); busy: %.2f MiB anon RSS, %.1f goroutines, %.2f threads",
					n, r.aggregateMBps, r.jain, r.p50, r.p99, n+2,
					float64(r.idle.anonKiB)/1024/vms, float64(r.idle.lockedKiB)/1024/vms,
					float64(r.idle.goroutines)/vms, float64(r.idle.fds)/vms,
					float64(r.busy.anonKiB)/1024/vms, float64(r.busy.goroutines)/vms, float64(r.busy.threads)/vms)
			}
		})
	}
	if ref, ok := aggregate[8]; ok && ref > 0 {
		var parts []string
		for _, n := range ns {
			parts = append(parts, fmt.Sprintf("vms=%d %.2fx", n, aggregate[n]/ref))
		}
		// On stdout: a parent benchmark's own log is not printed.
		fmt.Printf("SCALE aggregate against vms=8 (same run): %s (goal: vms=128 >= 0.8x)\n", strings.Join(parts, ", "))
	}
}

const (
	scaleRun    = 3 * time.Second
	scaleMsg    = 16 << 10 // bytes per WRITE
	scaleWindow = 4        // WRITEs in flight per VM
)

type scaleResult struct {
	aggregateMBps float64
	jain          float64
	p50, p99      time.Duration
	idle, busy    scaleCost // increase over the daemon alone
}

type scaleCost struct {
	anonKiB, lockedKiB, pteKiB int64
	goroutines, threads, fds   int
}

func scaleSample(tb testing.TB) scaleCost {
	r := measure(tb)
	return scaleCost{anonKiB: procStatusKB(tb, "RssAnon"), lockedKiB: r.lockedKiB, pteKiB: procStatusKB(tb, "VmPTE"), goroutines: r.daemon,
		threads: int(procStatusKB(tb, "Threads")), fds: r.fds}
}

func (c scaleCost) minus(o scaleCost) scaleCost {
	return scaleCost{anonKiB: c.anonKiB - o.anonKiB, lockedKiB: c.lockedKiB - o.lockedKiB, pteKiB: c.pteKiB - o.pteKiB, goroutines: c.goroutines - o.goroutines,
		threads: c.threads - o.threads, fds: c.fds - o.fds}
}

func runScale(b *testing.B, n int) scaleResult {
	names := make([]string, n+2)
	for i := range names {
		names[i] = fmt.Sprintf("s%03d", i)
	}
	e := newEnvConfig(b, vdev.Limits{}, stderrLogger(), func(c *backend.Config) {
		c.VMs = nil
		for _, nm := range names {
			c.VMs = append(c.VMs, backend.VMRequest{Name: nm, MemBytes: ramSize})
		}
	})
	base := scaleSample(b)
	eps := make([]*endpoint, len(names))
	for i := 0; i < len(names); i += 2 {
		eps[i], eps[i+1] = e.pairGIDs(names[i], names[i+1], byte(i+1), byte(i+2), 12, 7)
	}
	idle := scaleSample(b).minus(base)

	var stop atomic.Bool
	bytes := make([]atomic.Int64, n)
	errs := make(chan error, n+1)
	var wg sync.WaitGroup
	for i := range n {
		src, dst := eps[i], eps[i^1]
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := streamWrites(src, dst, &stop, &bytes[i]); err != nil {
				errs <- fmt.Errorf("VM %s: %w", src.v.name, err)
				stop.Store(true)
			}
		}()
	}
	var lat []time.Duration
	wg.Add(1)
	go func() {
		defer wg.Done()
		var err error
		lat, err = probeWrites(eps[n], eps[n+1], &stop)
		if err != nil {
			errs <- fmt.Errorf("probe: %w", err)
			stop.Store(true)
		}
	}()
	start := time.Now()
	time.Sleep(scaleRun / 2)
	busy := scaleSample(b).minus(base)
	time.Sleep(scaleRun - time.Since(start))
	stop.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}

	r := scaleResult{idle: idle, busy: busy}
	var sum float64
	vms := make([]float64, n)
	for i := range bytes {
		vms[i] = float64(bytes[i].Load())
		sum += vms[i]
	}
	r.aggregateMBps = sum / elapsed.Seconds() / 1e6
	r.jain = jain(vms)
	if len(lat) > 0 {
		slices.Sort(lat)
		r.p50, r.p99 = lat[len(lat)/2], lat[len(lat)*99/100]
	}
	for _, p := range eps {
		p.Close()
	}
	return r
}

// jain is Jain's fairness index of xs: (sum x)^2 / (n sum x^2), 1 when all
// are equal, 1/n when one has everything; 0 when all are 0.
func jain(xs []float64) float64 {
	var sum, sumSq float64
	for _, x := range xs {
		sum += x
		sumSq += x * x
	}
	if sumSq == 0 {
		return 0
	}
	return sum * sum / (float64(len(xs)) * sumSq)
}

// streamWrites keeps scaleWindow signaled 16 KiB WRITEs from src into
// dst's MR in flight until stop, counting the bytes of each one that
// completes.
func streamWrites(src, dst *endpoint, stop *atomic.Bool, done *atomic.Int64) error {
	s := writeStream{src: src, dst: dst, size: scaleMsg, window: scaleWindow, stop: stop, done: done}
	return s.run()
}

// writeStream is a stream of signaled RDMA WRITEs from src into dst: window
// WRITEs of size bytes in flight, the i-th in slot i%window of src's MR
// (from srcOff) and of dst's MR (from dstOff), until stop.
type writeStream struct {
	src, dst       *endpoint
	size           uint64
	window         int
	srcOff, dstOff uint64
	stop           *atomic.Bool
	done           *atomic.Int64 // bytes of the WRITEs completed

	// verify stamps each WRITE's payload with the stream's seed and the
	// WRITE's wr_id and checks, when it completes (in order, RC), that its
	// slot of dst's RAM holds exactly that payload: the slot's next WRITE
	// is posted only then.
	verify bool
	seed   uint64

	// gapMin, if not 0, has run record in gaps every time between two
	// completions (or the first post and the first one) above it.
	gapMin time.Duration
	gaps   []streamGap

	// name, if set, prefixes the stream's errors (runStreams).
	name string

	// Progress, kept by step: WRITEs in flight, the last one posted, the
	// oldest in flight, and when the last completion (or the first post)
	// was.
	inflight     int
	wrid, oldest uint64
	last         time.Time
}

// streamGap is a stretch without a completion, ended at end.
type streamGap struct {
	end time.Time
	d   time.Duration
}

// payload is the stamped payload of WRITE wrid: 8-byte words unique to
// the stream, the WRITE and the word's place.
func (s *writeStream) payload(wrid uint64) []byte {
	b := make([]byte, s.size)
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], s.seed^wrid*0x9e3779b97f4a7c15^uint64(i)<<40)
	}
	return b
}

// run streams until stop; it returns the first error: a failed doorbell
// or poll, an error completion, a completion out of order, a payload that
// differs or no completion for irqTimeout.
func (s *writeStream) run() error { return runStreams([]*writeStream{s}) }

// runStreams runs streams of one VM (whose vfio-user connection takes one
// caller at a time) on this goroutine until stop and until nothing is in
// flight, and returns the first error of any, prefixed with its name if
// it has one. Each round steps every stream; one that found its CQ empty
// writes the CQ's POLL doorbell (rdma-core's empty poll), and a round in
// which no stream took a completion yields for 50 µs.
func runStreams(streams []*writeStream) error {
	for {
		active, took := false, false
		for _, s := range streams {
			if s.finished() {
				continue
			}
			active = true
			ok, err := s.step()
			if err == nil && !ok && !s.finished() {
				cq := s.src.scq
				err = s.src.v.tryDoorbell(cq.uar, abi.UARCQOffset, abi.UARCQPoll|cq.handle)
			}
			if err != nil {
				if s.name != "" {
					err = fmt.Errorf("%s: %w", s.name, err)
				}
				return err
			}
			took = took || ok
		}
		if !active {
			return nil
		}
		if !took {
			time.Sleep(50 * time.Microsecond)
		}
	}
}

// finished reports whether the stream was stopped and has nothing in
// flight any more.
func (s *writeStream) finished() bool { return s.inflight == 0 && s.stop.Load() }

// step fills the window with WRITEs (unless stopped) and takes the
// stream's next completion if there is one, checking it; it reports
// whether it took one.
func (s *writeStream) step() (bool, error) {
	q, cq := s.src.qp, s.src.scq
	w := uint64(s.window)
	if s.last.IsZero() {
		s.last = time.Now()
	}
	for !s.stop.Load() && s.inflight < s.window {
		s.wrid++
		off := s.wrid % w * s.size
		if s.verify {
			s.src.mr.write(s.src.v, s.srcOff+off, s.payload(s.wrid))
		}
		q.writeSend(writeWQE(s.wrid, s.dst.mr.iova+s.dstOff+off, s.dst.mr.rkey), s.src.mr.sge(s.srcOff+off, uint32(s.size)))
		if err := s.src.v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle); err != nil {
			return false, err
		}
		if s.inflight == 0 {
			s.oldest = s.wrid
		}
		s.inflight++
	}
	if s.inflight == 0 {
		return false, nil
	}
	e, ok, err := cq.tryPoll()
	switch {
	case err != nil:
		return false, err
	case ok && e.Status != uint32(hostverbs.WCSuccess):
		return false, fmt.Errorf("WRITE %d: status %d", e.WRID, e.Status)
	case ok:
		if s.verify {
			if e.WRID != s.oldest {
				return false, fmt.Errorf("WRITE %d completed, %d is the oldest in flight", e.WRID, s.oldest)
			}
			got := s.dst.mr.read(s.dst.v, s.dstOff+s.oldest%w*s.size, s.size)
			if !bytes.Equal(got, s.payload(s.oldest)) {
				return false, fmt.Errorf("WRITE %d completed, but the peer's memory holds other bytes", s.oldest)
			}
		}
		s.oldest++
		s.inflight--
		s.done.Add(int64(s.size))
		if d := time.Since(s.last); s.gapMin != 0 && d > s.gapMin {
			s.gaps = append(s.gaps, streamGap{end: time.Now(), d: d})
		}
		s.last = time.Now()
		return true, nil
	case time.Since(s.last) > irqTimeout:
		return false, fmt.Errorf("no completion for %v", irqTimeout)
	}
	return false, nil
}

// probeWrites posts one 8 B WRITE at a time from src to dst until stop
// and returns each doorbell-to-CQE time (the CQ spun on, no sleeping).
func probeWrites(src, dst *endpoint, stop *atomic.Bool) ([]time.Duration, error) {
	q, cq := src.qp, src.scq
	var lat []time.Duration
	for wrid := uint64(1); !stop.Load(); wrid++ {
		q.writeSend(writeWQE(wrid, dst.mr.iova, dst.mr.rkey), src.mr.sge(0, 8))
		t0 := time.Now()
		if err := src.v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle); err != nil {
			return lat, err
		}
		for {
			e, ok, err := cq.tryPoll()
			if err != nil {
				return lat, err
			}
			if ok {
				if e.Status != uint32(hostverbs.WCSuccess) {
					return lat, fmt.Errorf("probe WRITE: status %d", e.Status)
				}
				lat = append(lat, time.Since(t0))
				break
			}
			if time.Since(t0) > irqTimeout {
				return lat, fmt.Errorf("probe: no completion for %v", irqTimeout)
			}
		}
		time.Sleep(time.Millisecond)
	}
	return lat, nil
}
