//go:build linux

package soft

import (
	"context"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/mmsg"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"net/netip"
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

// BenchmarkWireSenderLoopback measures what one full-MTU datagram costs the
// thread that sends it, in CPU time (user and system: over loopback the
// kernel's receive path, up to the receiving socket's queue, runs inside
// the sender's system call), on two paths that alternate bulkRounds times:
//   - the fabric's: KernelWire.Transmit of RDMA WRITE packets, 64 per call,
//     taken in by the wire's own receive sockets (the raw capture the ICRC
//     check needs, plus the UDP 4791 sink) and read by Receive;
//   - the UDP blast's (the bulk benchmarks' reference): datagrams of the
//     same size, 64 per sendmmsg on a connected UDP socket, read by a plain
//     UDP socket.
//
// Both bulk pipelines are bound by their sending thread, so
// x_blast_cost = blast cost / wire cost (median of the pairs) bounds
// x_udp_blast in BenchmarkWrite1MiBLoopback: it is the ratio the transport
// would reach if everything it does besides sending were free.
func BenchmarkWireSenderLoopback(b *testing.B) {
	needRoot(b)
	ns := newNetns(b, "wsc")
	var w *wire.KernelWire
	var err error
	ns.do(b, func() { w, err = wire.NewKernelWire(wire.KernelWireConfig{DisableIPv6: true}) })
	if err != nil {
		b.Fatal(err)
	}

	// One WRITE_MIDDLE packet, sent over and over.
	const mtu = 4096
	src := hostverbs.GIDFromAddr(netip.MustParseAddr("127.0.0.1"))
	dst := hostverbs.GIDFromAddr(netip.MustParseAddr("127.0.0.2"))
	nf := roce.NetFields{Src: src, Dst: dst, HopLimit: 64, SrcPort: roce.SourcePortMin}
	tf := roce.TransportFields{BTH: roce.BTHFields{Opcode: roce.RCWriteMiddle, PKey: roce.DefaultPKey, DestQP: 17}}
	d, off := roce.Build(make([]byte, wire.MaxDatagram), &nf, &tf, mtu)
	fill(d[off:off+mtu], 3)
	roce.SealICRC(d, roce.IPv4HeaderSize)
	batch := make([]wire.Datagram, txMax)
	for i := range batch {
		batch[i] = wire.Datagram{Packet: d}
	}

	// The wire's receiver: Receive and count, nothing else.
	ctx, cancel := context.WithCancel(context.Background())
	var got atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		bufs := make([][]byte, rxBatch)
		for i := range bufs {
			bufs[i] = make([]byte, wire.MaxDatagram)
		}
		out := make([][]byte, rxBatch)
		for {
			n, err := w.Receive(ctx, 0, bufs, out)
			if err != nil {
				return
			}
			got.Add(int64(n))
		}
	}()
	defer func() {
		cancel()
		_ = w.Close() // Receive returns
		wg.Wait()
	}()

	rounds := min(bulkRounds, b.N)
	var ours, blast, ratios, delivered []float64
	b.ResetTimer()
	for r := range rounds {
		n := max(roundShare(b.N, rounds, r), txMax)
		got.Store(0)
		cost, sent := threadCost(func() int {
			sent := 0
			for sent < n {
				k, err := w.Transmit(batch)
				if err != nil {
					b.Fatal(err)
				}
				sent += k
			}
			return sent
		})
		// Let the receiver finish before the next measurement.
		for deadline := time.Now().Add(time.Second); got.Load() < int64(sent) && time.Now().Before(deadline); {
			time.Sleep(100 * time.Microsecond)
		}
		delivered = append(delivered, float64(got.Load())/float64(sent))
		b.StopTimer()
		bc := blastSenderCost(b, ns, len(d)-roce.IPv4HeaderSize-roce.UDPHeaderSize, n)
		b.StartTimer()
		ours = append(ours, cost)
		blast = append(blast, bc)
		ratios = append(ratios, bc/cost)
	}
	b.StopTimer()
	b.ReportMetric(median(ours), "wire_sender_us/pkt")
	b.ReportMetric(median(blast), "blast_sender_us/pkt")
	b.ReportMetric(median(ratios), "x_blast_cost")
	b.ReportMetric(slices.Min(ratios), "x_blast_cost_min")
	b.ReportMetric(slices.Max(ratios), "x_blast_cost_max")
	b.ReportMetric(100*median(delivered), "wire_delivered_%")
}

// threadCost runs send on a thread of its own and returns the thread's CPU
// time per datagram sent (µs) and the datagrams sent.
func threadCost(send func() int) (float64, int) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var r0, r1 unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &r0)
	sent := send()
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &r1)
	cpu := time.Duration(r1.Utime.Nano() + r1.Stime.Nano() - r0.Utime.Nano() - r0.Stime.Nano())
	return cpu.Seconds() * 1e6 / float64(sent), sent
}

// blastSenderCost is threadCost for the UDP blast: n datagrams of dsize
// bytes, 64 per sendmmsg on a connected socket, to a UDP socket that a
// goroutine reads.
func blastSenderCost(b *testing.B, ns *netns, dsize, n int) float64 {
	rx, tx := udpBlastSockets(b, ns, 100*time.Millisecond)
	defer unix.Close(rx)
	defer unix.Close(tx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		hdrs := mmsgBuffers(txMax, dsize)
		for {
			if _, err := recvmmsgBlocking(rx, hdrs); err != nil && err != unix.EINTR {
				return // the timeout: the sender is done
			}
		}
	}()
	hdrs := mmsgBuffers(txMax, dsize)
	cost, _ := threadCost(func() int {
		sent := 0
		for sent < n {
			k, err := mmsg.SendMmsg(tx, hdrs)
			if err != nil {
				if err == unix.EAGAIN || err == unix.ENOBUFS || err == unix.EINTR {
					continue
				}
				b.Fatal(err)
			}
			sent += k
		}
		return sent
	})
	wg.Wait()
	return cost
}

// BenchmarkGSOZeroCopyLoopback answers whether MSG_ZEROCOPY would lower
// what the UDP wire's sends cost over loopback: the GSO blast (full-MTU
// RoCE-sized segments, 15 per send, received coalesced) with and without
// MSG_ZEROCOPY, alternating bulkRounds times, in process CPU time per
// datagram (sender, receiver and the kernel's work on their behalf).
// Loopback delivers to a local socket, which cannot keep pages a sender
// still owns: the kernel copies them after all (the completions say so:
// zerocopy_copied_%), on top of pinning them and queueing a completion.
func BenchmarkGSOZeroCopyLoopback(b *testing.B) {
	needRoot(b)
	ns := newNetns(b, "zc")
	dsize := roce.BTHSize + hostverbs.MTU4096.Bytes() + roce.ICRCSize
	rounds := min(bulkRounds, b.N)
	var zc, plain, ratios, copied []float64
	b.ResetTimer()
	for r := range rounds {
		n := max(roundShare(b.N, rounds, r), 64) * gsoSegments
		p, _ := gsoSendCost(b, ns, dsize, n, false)
		z, c := gsoSendCost(b, ns, dsize, n, true)
		plain, zc = append(plain, p), append(zc, z)
		ratios = append(ratios, z/p)
		copied = append(copied, c)
	}
	b.StopTimer()
	b.ReportMetric(median(plain), "copy_cpu_us/pkt")
	b.ReportMetric(median(zc), "zerocopy_cpu_us/pkt")
	b.ReportMetric(median(ratios), "x_zerocopy_cpu")
	b.ReportMetric(100*median(copied), "zerocopy_copied_%")
}

// gsoSendCost sends n datagrams of dsize bytes, gsoSegments per send, from
// a connected UDP socket with UDP_SEGMENT (and MSG_ZEROCOPY if zerocopy)
// to a UDP_GRO receiver, and returns the process CPU time per datagram in
// microseconds and the fraction of zerocopy sends the kernel reported as
// copied.
func gsoSendCost(b *testing.B, ns *netns, dsize, n int, zerocopy bool) (float64, float64) {
	rx, tx := udpBlastSockets(b, ns, 100*time.Millisecond)
	defer unix.Close(rx)
	defer unix.Close(tx)
	if err := unix.SetsockoptInt(tx, unix.SOL_UDP, unix.UDP_SEGMENT, dsize); err != nil {
		b.Skipf("UDP_SEGMENT: %v", err)
	}
	if err := unix.SetsockoptInt(rx, unix.SOL_UDP, unix.UDP_GRO, 1); err != nil {
		b.Skipf("UDP_GRO: %v", err)
	}
	flags := 0
	if zerocopy {
		if err := unix.SetsockoptInt(tx, unix.SOL_SOCKET, unix.SO_ZEROCOPY, 1); err != nil {
			b.Skipf("SO_ZEROCOPY: %v", err)
		}
		flags = unix.MSG_ZEROCOPY
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		hdrs := mmsgBuffers(8, 64<<10)
		for {
			if _, err := recvmmsgBlocking(rx, hdrs); err != nil && err != unix.EINTR {
				return // the timeout: the sender is done
			}
		}
	}()
	buf := make([]byte, gsoSegments*dsize)
	fill(buf, 5)
	var done, copiedSends, pending int
	oob := make([]byte, unix.CmsgSpace(int(unsafe.Sizeof(unix.SockExtendedErr{}))+unix.SizeofSockaddrInet6))
	// reap reads zerocopy completions (each covers a range of sends).
	reap := func(wait bool) {
		for pending > 0 {
			if wait {
				pfd := []unix.PollFd{{Fd: int32(tx), Events: unix.POLLERR}}
				_, _ = unix.Poll(pfd, 100)
			}
			_, oobn, _, _, err := unix.Recvmsg(tx, nil, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
			if err != nil {
				if !wait {
					return
				}
				continue
			}
			mmsg.Cmsgs(oob[:oobn], func(level, typ int32, data []byte) {
				if len(data) < int(unsafe.Sizeof(unix.SockExtendedErr{})) {
					return
				}
				ee := (*unix.SockExtendedErr)(unsafe.Pointer(&data[0]))
				if ee.Origin != unix.SO_EE_ORIGIN_ZEROCOPY {
					return
				}
				k := int(ee.Data-ee.Info) + 1 // sends lo..hi
				pending -= k
				if ee.Code&unix.SO_EE_CODE_ZEROCOPY_COPIED != 0 {
					copiedSends += k
				}
			})
		}
	}
	c0 := processCPU()
	sends := 0
	for done < n {
		_, err := unix.SendmsgN(tx, buf, nil, nil, flags)
		switch err {
		case nil:
			done += gsoSegments
			sends++
			if zerocopy {
				pending++
				if pending >= 64 {
					reap(false)
				}
			}
		case unix.EAGAIN, unix.EINTR:
		case unix.ENOBUFS:
			reap(true) // the completions hold the socket's option memory
		default:
			b.Fatal(err)
		}
	}
	reap(true)
	cpu := processCPU() - c0
	wg.Wait()
	frac := 0.0
	if zerocopy && sends > 0 {
		frac = float64(copiedSends) / float64(sends)
	}
	return cpu.Seconds() * 1e6 / float64(done), frac
}
