//go:build linux

package soft

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"golang.org/x/sys/unix"
)

// Benchmarks print ratios against references measured in the same run:
//   - RDMA WRITE 1 MiB and SEND 64 KiB between two endpoints over the
//     kernel's loopback (one fabric, local delivery off: raw sockets out,
//     raw sockets in, ICRC both ways) against a plain UDP blast of
//     datagrams of the same size with the same batching (sendmmsg and
//     recvmmsg of 64), and against memcpy of the message. The transfer
//     and the blast alternate bulkRounds times; x_udp_blast is the median
//     of the adjacent pairs' ratios, with their minimum and maximum;
//   - the same operations in process (the same-host path: one copy from
//     guest memory to guest memory) against memcpy;
//   - 8-byte SEND ping-pong latency over loopback against a plain UDP
//     ping-pong (and one whose readers hand each datagram to another
//     goroutine, the shape of a verbs consumer), alternating bulkRounds
//     times like the transfers; means, medians and 99th percentiles;
//   - heap allocations per packet;
//   - what a full-MTU datagram costs the sending thread on the fabric's
//     wire and on the UDP blast (BenchmarkWireSenderLoopback): the bound
//     of x_udp_blast.
//
// Run: go test -run XXX -bench . -benchtime 3s ./hostverbs/soft/ (root).
// With PVRDMA_BENCH_PROFILE=1 the loopback benchmarks skip their
// references, so that a CPU profile (-cpuprofile, perf record) holds the
// transport alone; they then print no ratios.

// benchProfile is set by PVRDMA_BENCH_PROFILE: no reference runs.
var benchProfile = os.Getenv("PVRDMA_BENCH_PROFILE") != ""

type benchEnv struct {
	ns   *netns
	f    *Fabric
	a, b *endpoint
	p    pair
}

func newBenchEnv(b *testing.B, kernel bool, mtu hostverbs.MTU) *benchEnv {
	return newBenchEnvLayout(b, kernel, mtu, false)
}

func newBenchEnvLayout(b testing.TB, kernel bool, mtu hostverbs.MTU, contiguous bool) *benchEnv {
	b.Helper()
	env := &benchEnv{}
	var f *Fabric
	if kernel {
		needRoot(b)
		env.ns = newNetns(b, "bench")
		f = newKernelFabric(b, env.ns, Config{DisableLocalDelivery: true, LinkMTU: 65536})
	} else {
		var err error
		if f, err = New(Config{}); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = f.Close() })
	}
	env.f = f
	env.a = newEndpointLayout(b, f, "a", "127.0.0.1", 64<<20, contiguous)
	env.b = newEndpointLayout(b, f, "b", "127.0.0.2", 64<<20, contiguous)
	// Real pages with data on both sides (never-written memory would be
	// the kernel's shared zero page, which copies from cache).
	fill(env.a.data, 1)
	fill(env.b.data, 2)
	o := defaultRC()
	o.mtu = mtu
	o.sqDepth, o.rqDepth = 256, 256
	qa, qb := connectRC(b, env.a, env.b, o)
	env.p = pair{env.a, env.b, qa, qb}
	return env
}

// stream keeps depth operations of size bytes outstanding until n have
// completed and returns the elapsed time. SENDs need receives at b, which
// are reposted as they complete.
func (env *benchEnv) stream(b testing.TB, op hostverbs.WROpcode, size, depth, n int) time.Duration {
	a, bb, p := env.a, env.b, env.p
	// Work requests are built once and reused, so the harness allocates
	// nothing per operation and allocs/pkt is the provider's alone.
	wrs := make([]hostverbs.SendWR, depth)
	rwrs := make([]hostverbs.RecvWR, depth)
	for i := range depth {
		wrs[i] = hostverbs.SendWR{WRID: uint64(i), Opcode: op, Flags: hostverbs.SendSignaled,
			SGL: sge(a, uint64(i)*uint64(size), size), RemoteAddr: bb.iova + uint64(i)*uint64(size), RKey: bb.mr.RKey()}
		rwrs[i] = hostverbs.RecvWR{WRID: uint64(i), SGL: sge(bb, uint64(i)*uint64(size), size)}
	}
	post := func(i int) {
		if err := p.qa.PostSend(&wrs[i%depth]); err != nil {
			b.Fatal(err)
		}
	}
	recv := func(i int) {
		if err := p.qb.PostRecv(&rwrs[i%depth]); err != nil {
			b.Fatal(err)
		}
	}
	if op == hostverbs.WRSend {
		for i := range depth {
			recv(i)
		}
	}
	watchdog := time.NewTimer(time.Hour)
	defer watchdog.Stop()
	start := time.Now()
	posted, done := 0, 0
	for ; posted < min(depth, n); posted++ {
		post(posted)
	}
	for done < n {
		watchdog.Reset(30 * time.Second)
		select {
		case wc := <-a.ccq.ch:
			if wc.Status != hostverbs.WCSuccess {
				b.Fatalf("completion %+v", wc)
			}
			done++
			if posted < n {
				post(int(wc.WRID))
				posted++
			}
		case wc := <-bb.ccq.ch:
			if wc.Status != hostverbs.WCSuccess {
				b.Fatalf("receive %+v", wc)
			}
			recv(int(wc.WRID))
		case <-watchdog.C:
			b.Fatalf("stalled after %d of %d", done, n)
		}
	}
	elapsed := time.Since(start)
	// Drain the receive completions of the last SENDs.
	for op == hostverbs.WRSend && len(bb.ccq.ch) > 0 {
		<-bb.ccq.ch
	}
	return elapsed
}

// udpBlast sends total bytes in datagrams of dsize through UDP over the
// namespace's loopback, 64 per sendmmsg, and returns the receiver's
// goodput in bytes per second and the fraction of the bytes sent that
// arrived (a blast has no flow control: a receiver that falls behind
// drops).
func udpBlast(b *testing.B, ns *netns, dsize int, total int64) (float64, float64) {
	rx, tx := udpBlastSockets(b, ns, 200*time.Millisecond)
	defer unix.Close(rx)
	defer unix.Close(tx)
	return blast(b, rx, tx, mmsgBuffers(txMax, dsize), mmsgBuffers(txMax, dsize), dsize, total)
}

// gsoSegments is how many datagrams one send of the GSO blast carries
// (issue 13's reference: 15 segments a call).
const gsoSegments = 15

// udpGSOBlast is udpBlast with the kernel's segmentation offload: each
// send carries gsoSegments datagrams of dsize bytes (UDP_SEGMENT), and the
// receiver takes them coalesced (UDP_GRO).
func udpGSOBlast(b *testing.B, ns *netns, dsize int, total int64) (float64, float64) {
	rx, tx := udpBlastSockets(b, ns, 200*time.Millisecond)
	defer unix.Close(rx)
	defer unix.Close(tx)
	if err := unix.SetsockoptInt(tx, unix.SOL_UDP, unix.UDP_SEGMENT, dsize); err != nil {
		b.Skipf("UDP_SEGMENT: %v", err)
	}
	if err := unix.SetsockoptInt(rx, unix.SOL_UDP, unix.UDP_GRO, 1); err != nil {
		b.Skipf("UDP_GRO: %v", err)
	}
	return blast(b, rx, tx, mmsgBuffers(8, 64<<10), mmsgBuffers(txMax/gsoSegments+1, gsoSegments*dsize), gsoSegments*dsize, total)
}

// blast sends total bytes from tx, each send one batch of txHdrs (of
// perSend bytes each), while a locked thread receives on rx into rxHdrs.
// It returns the goodput in bytes per second and the fraction of the bytes
// sent that arrived (a blast has no flow control: a receiver that falls
// behind drops).
func blast(b *testing.B, rx, tx int, rxHdrs, txHdrs []unix.Mmsghdr, perSend int, total int64) (float64, float64) {
	var got atomic.Int64
	var start, end time.Time
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		runtime.LockOSThread()
		first := true
		for got.Load() < total {
			// Blocking (SO_RCVTIMEO bounds it), unlike the wire's.
			n, err := recvmmsgBlocking(rx, rxHdrs)
			if err != nil {
				if err == unix.EAGAIN || err == unix.EINTR {
					if !first {
						return // the sender is done and the rest was dropped
					}
					continue
				}
				return
			}
			if first {
				start, first = time.Now(), false
			}
			for i := range n {
				got.Add(int64(rxHdrs[i].Len))
			}
			end = time.Now()
		}
	}()
	var sent int64
	for sent < total {
		n, err := mmsg.SendMmsg(tx, txHdrs)
		if err != nil {
			if err == unix.EAGAIN || err == unix.ENOBUFS {
				continue
			}
			b.Fatal(err)
		}
		sent += int64(n * perSend)
	}
	wg.Wait()
	if end.Sub(start) <= 0 {
		return 0, 0
	}
	return float64(got.Load()) / end.Sub(start).Seconds(), float64(got.Load()) / float64(sent)
}

// udpBlastSockets opens the UDP blast's pair in ns: a receiver bound to
// 127.0.0.2 whose blocking reads time out after rcvTimeout, and a sender
// connected to it, both with 8 MiB buffers. The caller closes them.
func udpBlastSockets(b *testing.B, ns *netns, rcvTimeout time.Duration) (rx, tx int) {
	ns.do(b, func() {
		var err error
		if rx, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			b.Fatal(err)
		}
		if tx, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			b.Fatal(err)
		}
	})
	mmsg.SetBuffers(rx, 8<<20)
	mmsg.SetBuffers(tx, 8<<20)
	if err := unix.Bind(rx, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 2}}); err != nil {
		b.Fatal(err)
	}
	sa, _ := unix.Getsockname(rx)
	if err := unix.Connect(tx, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 2}, Port: sa.(*unix.SockaddrInet4).Port}); err != nil {
		b.Fatal(err)
	}
	tv := unix.NsecToTimeval(rcvTimeout.Nanoseconds())
	_ = unix.SetsockoptTimeval(rx, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return rx, tx
}

// mmsgBuffers returns n message headers, each over a buffer of size bytes.
func mmsgBuffers(n, size int) []unix.Mmsghdr {
	hdrs := make([]unix.Mmsghdr, n)
	iovs := make([]unix.Iovec, n)
	for i := range hdrs {
		mmsg.SetIov(&iovs[i], make([]byte, size))
		hdrs[i].Hdr.Iov = &iovs[i]
		hdrs[i].Hdr.SetIovlen(1)
	}
	return hdrs
}

// roundShare is round r's share of total operations split over rounds.
func roundShare(total, rounds, r int) int {
	n := total / rounds
	if r < total%rounds {
		n++
	}
	return n
}

// memcpyRate is the reference: copying the same messages between the
// same number of distinct buffers as the benchmark (so the same cache
// footprint), with Go's copy.
func memcpyRate(size, depth int) float64 {
	src, dst := make([]byte, size*depth), make([]byte, size*depth)
	fill(src, 1)
	n := max(depth, (512<<20)/size)
	start := time.Now()
	for i := range n {
		o := (i % depth) * size
		copy(dst[o:o+size], src[o:o+size])
	}
	return float64(n*size) / time.Since(start).Seconds()
}

func reportThroughput(b *testing.B, name string, bytes int64, d time.Duration) float64 {
	rate := float64(bytes) / d.Seconds()
	b.ReportMetric(rate/1e6, name+"_MB/s")
	return rate
}

// meter accumulates, over the phases it measures, the heap allocations,
// the process CPU time (user+system), the wall time and the packets the
// fabric handled, so that references run between the phases are not
// counted.
type meter struct {
	f             *Fabric
	mallocs, pkts uint64
	cpu, wall     time.Duration
	m0            runtime.MemStats
	cpu0          time.Duration
	t0            time.Time
	c0            map[string]uint64
}

func (m *meter) start() {
	m.c0 = m.f.Counters()
	runtime.ReadMemStats(&m.m0)
	m.cpu0 = processCPU()
	m.t0 = time.Now()
}

func (m *meter) stop() {
	m.wall += time.Since(m.t0)
	var m1 runtime.MemStats
	cpu := processCPU()
	runtime.ReadMemStats(&m1)
	c1 := m.f.Counters()
	m.pkts += (c1["tx_packets"] - m.c0["tx_packets"]) + (c1["local_packets"] - m.c0["local_packets"])
	m.cpu += cpu - m.cpu0
	m.mallocs += m1.Mallocs - m.m0.Mallocs
}

// report prints the heap allocations per packet, the cores busy on
// average (CPU time over wall time; the machine's whole budget is
// GOMAXPROCS) and the microseconds of CPU per packet.
func (m *meter) report(b *testing.B) {
	if m.wall > 0 {
		b.ReportMetric(m.cpu.Seconds()/m.wall.Seconds(), "cpu_cores")
	}
	if m.pkts > 0 {
		b.ReportMetric(float64(m.mallocs)/float64(m.pkts), "allocs/pkt")
		b.ReportMetric(m.cpu.Seconds()*1e6/float64(m.pkts), "cpu_us/pkt")
	}
}

func benchBulk(b *testing.B, op hostverbs.WROpcode, size int, kernel bool) {
	benchBulkLayout(b, op, size, kernel, false)
}

// bulkRounds is how many times the loopback benchmarks alternate between
// our transfer and the UDP blast reference. The machine's speed drifts
// (other tenants, frequency); the ratio of each adjacent pair is taken,
// and their median reported.
const bulkRounds = 5

func benchBulkLayout(b *testing.B, op hostverbs.WROpcode, size int, kernel, contiguous bool) {
	env := newBenchEnvLayout(b, kernel, hostverbs.MTU4096, contiguous)
	const depth = 16
	env.stream(b, op, size, depth, 2*depth) // warm up: ARP-free loopback, pools, buffers
	// Datagrams of the size our full-MTU packets have on the wire.
	mtu := hostverbs.MTU4096.Bytes()
	dsize := roce.BTHSize + mtu + roce.ICRCSize
	rounds := 1
	if kernel {
		rounds = min(bulkRounds, b.N)
	}
	m := meter{f: env.f}
	var d, blastCPU, gsoCPU time.Duration
	var blastPkts int64
	ctr0 := env.f.Counters()
	var ratios, blasts, delivered, gsoRatios, gsoBlasts []float64
	b.ResetTimer()
	for r := range rounds {
		n := roundShare(b.N, rounds, r)
		m.start()
		dr := env.stream(b, op, size, depth, n)
		m.stop()
		d += dr
		if !kernel || benchProfile {
			continue
		}
		b.StopTimer()
		ours := float64(n) * float64(size) / dr.Seconds()
		total := max(int64(n)*int64(size), 64<<20)
		c0 := processCPU()
		udp, del := udpBlast(b, env.ns, dsize, total)
		blastCPU += processCPU() - c0
		blastPkts += total / int64(dsize)
		if udp > 0 {
			ratios = append(ratios, ours/udp)
			blasts = append(blasts, udp)
			delivered = append(delivered, del)
		}
		c0 = processCPU()
		gso, _ := udpGSOBlast(b, env.ns, dsize, total)
		gsoCPU += processCPU() - c0
		if gso > 0 {
			gsoRatios = append(gsoRatios, ours/gso)
			gsoBlasts = append(gsoBlasts, gso)
		}
		b.StartTimer()
	}
	b.StopTimer()
	if c1, c0 := env.f.Counters(), ctr0; c1["wire_tx_messages"] > c0["wire_tx_messages"] {
		// Packets per send message (segmentation offload) and per
		// received message (coalescing), ACKs included.
		b.ReportMetric(float64(c1["tx_packets"]-c0["tx_packets"])/float64(c1["wire_tx_messages"]-c0["wire_tx_messages"]), "pkts/tx_msg")
		b.ReportMetric(float64(c1["rx_packets"]-c0["rx_packets"])/float64(c1["wire_rx_messages"]-c0["wire_rx_messages"]), "pkts/rx_msg")
	}
	m.report(b)
	b.SetBytes(int64(size))
	ours := reportThroughput(b, "rdma", int64(b.N)*int64(size), d)
	mem := memcpyRate(size, depth)
	b.ReportMetric(mem/1e6, "memcpy_MB/s")
	b.ReportMetric(ours/mem, "x_memcpy")
	if len(ratios) > 0 {
		b.ReportMetric(median(blasts)/1e6, "udp_blast_MB/s")
		b.ReportMetric(100*median(delivered), "udp_blast_delivered_%")
		b.ReportMetric(median(ratios), "x_udp_blast")
		if len(gsoRatios) > 0 {
			// Issue 13's reference: what the kernel carries with
			// segmentation offload (UDP_SEGMENT, UDP_GRO).
			b.ReportMetric(median(gsoBlasts)/1e6, "gso_blast_MB/s")
			b.ReportMetric(median(gsoRatios), "x_gso_blast")
		}
		dataPkts := float64(b.N) * float64((size+mtu-1)/mtu)
		if gsoCPU > 0 {
			gsoUs := gsoCPU.Seconds() * 1e6 / float64(blastPkts)
			b.ReportMetric(gsoUs, "gso_blast_cpu_us/pkt")
			b.ReportMetric(m.cpu.Seconds()*1e6/dataPkts/gsoUs, "x_gso_blast_cpu")
		}
		b.ReportMetric(slices.Min(ratios), "x_udp_blast_min")
		b.ReportMetric(slices.Max(ratios), "x_udp_blast_max")
		// CPU per full-MTU data packet (ACKs and all) against the blast's
		// per datagram: what the transport's work costs, whatever the
		// scheduling.
		blastUs := blastCPU.Seconds() * 1e6 / float64(blastPkts)
		b.ReportMetric(blastUs, "udp_blast_cpu_us/pkt")
		b.ReportMetric(m.cpu.Seconds()*1e6/dataPkts/blastUs, "x_udp_blast_cpu")
	}
}

// processCPU is the process's user and system CPU time so far.
func processCPU() time.Duration {
	var r unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &r)
	return time.Duration(r.Utime.Nano() + r.Stime.Nano())
}

// median returns the median of v (which it sorts).
func median(v []float64) float64 {
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

func BenchmarkWrite1MiBLoopback(b *testing.B)  { benchBulk(b, hostverbs.WRRDMAWrite, 1<<20, true) }
func BenchmarkSend64KiBLoopback(b *testing.B)  { benchBulk(b, hostverbs.WRSend, 64<<10, true) }
func BenchmarkRead1MiBLoopback(b *testing.B)   { benchBulk(b, hostverbs.WRRDMARead, 1<<20, true) }
func BenchmarkWrite1MiBInProcess(b *testing.B) { benchBulk(b, hostverbs.WRRDMAWrite, 1<<20, false) }
func BenchmarkSend64KiBInProcess(b *testing.B) { benchBulk(b, hostverbs.WRSend, 64<<10, false) }

// The MRs above map every page out of order (the worst case); here they
// are physically contiguous, as huge-page-backed guest buffers are.
func BenchmarkWrite1MiBInProcessContiguous(b *testing.B) {
	benchBulkLayout(b, hostverbs.WRRDMAWrite, 1<<20, false, true)
}

// pingPongResponder answers every 8-byte SEND at b with one from b, from
// its own goroutine (completion handlers must not call the provider), and
// polls its CQ the way RDMA applications do.
func benchPingPong(b *testing.B, kernel bool) {
	env := newBenchEnv(b, kernel, hostverbs.MTU4096)
	a, bb, p := env.a, env.b, env.p
	const size = 8
	for i := range 64 {
		if err := p.qa.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(a, 4096, size)}); err != nil {
			b.Fatal(err)
		}
		if err := p.qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(bb, 4096, size)}); err != nil {
			b.Fatal(err)
		}
	}
	sendA := hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(a, 0, size)}
	sendB := hostverbs.SendWR{Opcode: hostverbs.WRSend, SGL: sge(bb, 0, size)}
	recvA := hostverbs.RecvWR{SGL: sge(a, 4096, size)}
	recvB := hostverbs.RecvWR{SGL: sge(bb, 4096, size)}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case wc := <-bb.ccq.ch:
				if wc.Opcode == hostverbs.WCRecv {
					_ = p.qb.PostRecv(&recvB)
					_ = p.qb.PostSend(&sendB)
				}
			case <-stop:
				return
			}
		}
	}()
	round := func() {
		if err := p.qa.PostSend(&sendA); err != nil {
			b.Fatal(err)
		}
		for {
			wc := <-a.ccq.ch
			if wc.Opcode == hostverbs.WCRecv {
				_ = p.qa.PostRecv(&recvA)
				return
			}
		}
	}
	for range 100 {
		round()
	}
	// Over loopback, our rounds and the UDP references alternate
	// bulkRounds times (the machine's speed drifts); x_udp_pingpong is
	// the median of the adjacent pairs' ratios of mean round trips.
	rounds := 1
	if kernel {
		rounds = min(bulkRounds, b.N)
	}
	rtts := make([]time.Duration, b.N)
	var ratios, ratiosH, udpMeans, udpHandoffs []float64
	var udpCPU time.Duration
	udpRounds := 0
	var udpRTTs []time.Duration
	m := meter{f: env.f}
	var d time.Duration
	done := 0
	b.ResetTimer()
	for r := range rounds {
		n := roundShare(b.N, rounds, r)
		m.start()
		start := time.Now()
		t0 := start
		for i := done; i < done+n; i++ {
			round()
			t1 := time.Now()
			rtts[i], t0 = t1.Sub(t0), t1
		}
		dr := time.Since(start)
		m.stop()
		d += dr
		done += n
		if !kernel || benchProfile {
			continue
		}
		b.StopTimer()
		ours := dr.Seconds() / float64(n) * 1e6
		c0 := processCPU()
		udp, u := udpPingPong(b, env.ns, 2000, false)
		udpCPU += processCPU() - c0
		udpRounds += len(u) + 100 // and its warm-up
		// The same program shape over UDP: each side's reader hands the
		// datagram to another goroutine, which answers (what a verbs
		// consumer does with a completion).
		udpH, _ := udpPingPong(b, env.ns, 2000, true)
		ratios = append(ratios, ours/udp)
		ratiosH = append(ratiosH, ours/udpH)
		udpMeans = append(udpMeans, udp)
		udpHandoffs = append(udpHandoffs, udpH)
		udpRTTs = append(udpRTTs, u...)
		b.StartTimer()
	}
	b.StopTimer()
	close(stop)
	wg.Wait()
	m.report(b)
	ours := d.Seconds() / float64(b.N) * 1e6
	b.ReportMetric(ours, "rtt_us")
	p50, p99 := percentiles(rtts)
	b.ReportMetric(p50, "rtt_p50_us")
	b.ReportMetric(p99, "rtt_p99_us")
	if kernel && !benchProfile {
		u50, u99 := percentiles(udpRTTs)
		b.ReportMetric(median(udpMeans), "udp_rtt_us")
		b.ReportMetric(u50, "udp_rtt_p50_us")
		b.ReportMetric(u99, "udp_rtt_p99_us")
		b.ReportMetric(median(udpHandoffs), "udp_handoff_rtt_us")
		b.ReportMetric(median(ratios), "x_udp_pingpong")
		b.ReportMetric(slices.Min(ratios), "x_udp_pingpong_min")
		b.ReportMetric(slices.Max(ratios), "x_udp_pingpong_max")
		b.ReportMetric(p50/u50, "x_udp_pingpong_p50")
		b.ReportMetric(p99/u99, "x_udp_pingpong_p99")
		b.ReportMetric(median(ratiosH), "x_udp_handoff")
		// CPU per round trip, both ends and the kernel's work for them:
		// what the transport's round trip costs beside plain UDP's,
		// whatever the scheduling.
		ourCPU := m.cpu.Seconds() * 1e6 / float64(b.N)
		udpUs := udpCPU.Seconds() * 1e6 / float64(udpRounds)
		b.ReportMetric(ourCPU, "cpu_us/rtt")
		b.ReportMetric(udpUs, "udp_cpu_us/rtt")
		b.ReportMetric(ourCPU/udpUs, "x_udp_pingpong_cpu")
	}
}

// percentiles returns the median and the 99th percentile of d (which it
// sorts), in microseconds.
func percentiles(d []time.Duration) (p50, p99 float64) {
	if len(d) == 0 {
		return 0, 0
	}
	slices.Sort(d)
	us := func(x time.Duration) float64 { return float64(x) / float64(time.Microsecond) }
	return us(d[len(d)/2]), us(d[len(d)*99/100])
}

// udpPingPong measures the round trip of an 8-byte UDP datagram over the
// namespace's loopback through Go's net package, echoed by a goroutine,
// and returns its mean in microseconds and each round trip. With handoff,
// each side's reader passes the datagram through a channel to the
// goroutine that answers, as a verbs consumer gets completions.
func udpPingPong(b *testing.B, ns *netns, n int, handoff bool) (float64, []time.Duration) {
	var ca, cb *net.UDPConn
	ns.do(b, func() {
		var err error
		if cb, err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)}); err != nil {
			b.Fatal(err)
		}
		if ca, err = net.DialUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}, cb.LocalAddr().(*net.UDPAddr)); err != nil {
			b.Fatal(err)
		}
	})
	defer ca.Close()
	defer cb.Close()
	type msg struct {
		n    int
		from *net.UDPAddr
	}
	bq := make(chan msg, 64)
	go func() {
		buf := make([]byte, 64)
		for {
			n, from, err := cb.ReadFromUDP(buf)
			if err != nil {
				close(bq)
				return
			}
			if !handoff {
				if _, err := cb.WriteToUDP(buf[:n], from); err != nil {
					return
				}
				continue
			}
			bq <- msg{n, from}
		}
	}()
	if handoff {
		go func() {
			out := make([]byte, 8)
			for m := range bq {
				if _, err := cb.WriteToUDP(out[:m.n], m.from); err != nil {
					return
				}
			}
		}()
	}
	aq := make(chan int, 64)
	if handoff {
		go func() {
			buf := make([]byte, 64)
			for {
				n, err := ca.Read(buf)
				if err != nil {
					close(aq)
					return
				}
				aq <- n
			}
		}()
	}
	buf := make([]byte, 8)
	round := func() {
		if _, err := ca.Write(buf); err != nil {
			b.Fatal(err)
		}
		if handoff {
			<-aq
		} else if _, err := ca.Read(buf); err != nil {
			b.Fatal(err)
		}
	}
	for range 100 {
		round()
	}
	rtts := make([]time.Duration, n)
	start := time.Now()
	t0 := start
	for i := range n {
		round()
		t1 := time.Now()
		rtts[i], t0 = t1.Sub(t0), t1
	}
	return time.Since(start).Seconds() / float64(n) * 1e6, rtts
}

func BenchmarkPingPong8BLoopback(b *testing.B)  { benchPingPong(b, true) }
func BenchmarkPingPong8BInProcess(b *testing.B) { benchPingPong(b, false) }

func recvmmsgBlocking(fd int, hdrs []unix.Mmsghdr) (int, error) {
	n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hdrs[0])),
		uintptr(len(hdrs)), unix.MSG_WAITFORONE, 0, 0)
	if e != 0 {
		return int(n), e
	}
	return int(n), nil
}
