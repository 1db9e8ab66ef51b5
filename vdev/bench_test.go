package vdev

import (
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// The reference for doorbell costs is what every doorbell costs anyway:
// one MMIO exit, i.e. a vfio-user REGION_WRITE round trip over a unix
// socket. socketRTT measures a bare 16-byte ping-pong over a socketpair
// in the same run (the floor of that round trip).
func socketRTT(b *testing.B) float64 {
	b.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	const n = 20000
	done := make(chan struct{})
	go func() {
		var buf [16]byte
		for i := 0; i < n; i++ {
			if _, err := unix.Read(fds[1], buf[:]); err != nil {
				break
			}
			_, _ = unix.Write(fds[1], buf[:])
		}
		close(done)
	}()
	var buf [16]byte
	start := nanotime()
	for i := 0; i < n; i++ {
		_, _ = unix.Write(fds[0], buf[:])
		_, _ = unix.Read(fds[0], buf[:])
	}
	el := nanotime() - start
	<-done
	return float64(el) / n
}

// memcpyNS measures copying the bytes a doorbell moves (one WQE with one
// SGE and one CQE) between two buffers: the floor of any device model.
func memcpyNS() float64 {
	src, dst := make([]byte, abi.SQWQEHdrSize+abi.SGESize+abi.CQESize), make([]byte, abi.SQWQEHdrSize+abi.SGESize+abi.CQESize)
	const n = 2000000
	start := nanotime()
	for i := 0; i < n; i++ {
		copy(dst, src)
		src[i%len(src)]++
	}
	return float64(nanotime()-start) / n
}

// BenchmarkPollDoorbell is the provider's empty-poll doorbell (cqn|POLL),
// written on every ibv_poll_cq that finds the CQ empty: thousands per
// second per guest.
func BenchmarkPollDoorbell(b *testing.B) {
	u := newUserRC(b)
	var v [4]byte
	putLE32(v[:], abi.UARCQPoll|u.scq.handle)
	off := uint64(1)*abi.UARPageSize + abi.UARCQOffset
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := u.g.dev.WriteBAR(abi.UARBAR, off, v[:]); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	per := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(per/socketRTT(b), "x_socket_rtt")
}

// BenchmarkDoorbellToCQE is the device's cost per send WQE: the guest
// writes a SEND WQE and rings the SQ doorbell; the device reads and
// validates it (SGE against the MR table), posts it to the provider, the
// provider completes it at once, and the device writes the CQE into the
// guest's CQ ring, which the guest then consumes. The provider here does no
// work, so this is vdev's own cost; the guest side is a few stores.
func BenchmarkDoorbellToCQE(b *testing.B) { benchDoorbellToCQE(b, false) }

// BenchmarkDoorbellToCQEMetrics is BenchmarkDoorbellToCQE with the
// device's distributions on (Config.Distributions, as the daemon runs
// it): per WQE two clock reads and two observations, the cost metrics.go
// adds to the send path. Compare the two in alternating runs.
func BenchmarkDoorbellToCQEMetrics(b *testing.B) { benchDoorbellToCQE(b, true) }

func benchDoorbellToCQE(b *testing.B, metrics bool) {
	l := newSendLoop(b, metrics)
	b.ReportAllocs()
	b.ResetTimer()
	l.run(b.N)
	b.StopTimer()
	if metrics {
		if n := l.u.g.dev.Distributions().SendLatency.Count(); n != uint64(b.N) {
			b.Errorf("%d latency samples for %d WQEs", n, b.N)
		}
	}
	per := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(per/socketRTT(b), "x_socket_rtt")
	b.ReportMetric(per/memcpyNS(), "x_memcpy")
}

// BenchmarkDistributionsAB measures what the distributions cost per send
// WQE on a loaded machine: two devices, one with them and one without,
// run BenchmarkDoorbellToCQE's loop in alternating bursts of
// abBurst WQEs (b.N pairs), so that each pair of bursts shares the
// machine's load of the moment; it reports the median of the pairs'
// ratios (with/without) and of their differences per WQE.
func BenchmarkDistributionsAB(b *testing.B) {
	const abBurst = 2000
	off, on := newSendLoop(b, false), newSendLoop(b, true)
	ratios, extra := make([]float64, 0, b.N), make([]float64, 0, b.N)
	b.ResetTimer()
	for range b.N {
		t0 := nanotime()
		off.run(abBurst)
		t1 := nanotime()
		on.run(abBurst)
		t2 := nanotime()
		ratios = append(ratios, float64(t2-t1)/float64(t1-t0))
		extra = append(extra, float64((t2-t1)-(t1-t0))/abBurst)
	}
	b.StopTimer()
	slices.Sort(ratios)
	slices.Sort(extra)
	b.ReportMetric(ratios[len(ratios)/2], "on/off")
	b.ReportMetric(extra[len(extra)/2], "extra_ns/wqe")
}

// sendLoop is BenchmarkDoorbellToCQE's guest: one signaled SEND WQE per
// SQ doorbell, its CQE consumed at once (the fake provider completes in
// PostSend).
type sendLoop struct {
	tb               testing.TB
	u                *userRC
	w                [abi.SQWQEHdrSize + abi.SGESize]byte
	db               [4]byte
	dbOff            uint64
	sqState, cqState uint64
}

func newSendLoop(tb testing.TB, metrics bool) *sendLoop {
	u := newUserRC(tb)
	u.fv.autoComplete = true
	if metrics {
		u.g.dev.dist = newDistributions()
	}
	l := &sendLoop{tb: tb, u: u}
	h := wqe(hostverbs.WRSend, 0, hostverbs.SendSignaled)
	h.NumSGE = 1
	h.Encode(l.w[:])
	u.sge(0, 4096).Encode(l.w[abi.SQWQEHdrSize:])
	putLE32(l.db[:], abi.UARQPSend|u.qp.handle)
	l.dbOff = uint64(u.qp.uar)*abi.UARPageSize + abi.UARQPOffset
	l.sqState, l.cqState = u.qp.sqState(), u.scq.pages[0]+8
	return l
}

// run posts n WQEs, one doorbell each, and consumes their CQEs.
func (l *sendLoop) run(n int) {
	g, q, cq := l.u.g, l.u.qp, l.u.scq
	for i := 0; i < n; i++ {
		tail := g.u32(l.sqState)
		copy(g.raw[q.sqWQE(tail):], l.w[:])
		g.put32(l.sqState, drvInc(tail, q.sendWR))
		if err := g.dev.WriteBAR(abi.UARBAR, l.dbOff, l.db[:]); err != nil {
			l.tb.Fatal(err)
		}
		head := g.u32(l.cqState + 4)
		if g.u32(l.cqState) == head {
			l.tb.Fatalf("no CQE for WQE %d", i)
		}
		g.put32(l.cqState+4, drvInc(head, cq.n))
	}
}

// BenchmarkRecvDoorbell is the cost per receive WQE (RECV doorbell ->
// validated and posted), as ib_mad's 512 receives at probe. The provider
// completes each at once (a receive holds its ring slot until it
// completes) and the guest consumes the CQE.
func BenchmarkRecvDoorbell(b *testing.B) {
	u := newUserRC(b)
	u.fv.autoComplete = true
	g, q, cq := u.g, u.qp, u.rcq
	cqState := cq.pages[0] + 8
	var w [abi.RQWQEHdrSize + abi.SGESize]byte
	abi.RQWQEHdr{WRID: 1, NumSGE: 1}.Encode(w[:])
	u.sge(0, 4096).Encode(w[abi.RQWQEHdrSize:])
	var db [4]byte
	putLE32(db[:], abi.UARQPRecv|q.handle)
	dbOff := uint64(q.uar)*abi.UARPageSize + abi.UARQPOffset
	rqState := q.rqState()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tail := g.u32(rqState)
		copy(g.raw[q.rqWQE(tail):], w[:])
		g.put32(rqState, drvInc(tail, q.recvWR))
		if err := g.dev.WriteBAR(abi.UARBAR, dbOff, db[:]); err != nil {
			b.Fatal(err)
		}
		head := g.u32(cqState + 4)
		if g.u32(cqState) == head {
			b.Fatalf("no CQE for WQE %d", i)
		}
		g.put32(cqState+4, drvInc(head, cq.n))
	}
}

func putLE32(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}
