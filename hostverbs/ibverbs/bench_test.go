//go:build linux && cgo

package ibverbs

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/conformance"
)

// chanHandler delivers completions to a channel, stamped with the time
// the handler saw them (in VendorErr's place: microseconds since benchEpoch).
type chanHandler chan hostverbs.WorkCompletion

var benchEpoch = time.Now()

func (c chanHandler) Complete(wc *hostverbs.WorkCompletion) {
	w := *wc
	w.VendorErr = uint32(time.Since(benchEpoch).Microseconds())
	c <- w
}

// benchPair is two relay devices with an RC QP each, connected through
// the host device (the loopback testdata/plainbench.c uses), and MRs
// over memfd guest memory.
type benchPair struct {
	qa, qb   hostverbs.QP
	mra, mrb hostverbs.MR
	cqa, cqb chanHandler
	tick     *time.Ticker // waitLong's deadline checks
}

const benchIOVA = 0x7f5500000000

func newBenchPair(b *testing.B) *benchPair { return newBenchPairDevices(b, false, 0) }

// benchBusyPoll is the relay's Config.BusyPoll in the benchmarks that set
// it: long enough, in a TCG guest, to span one ping-pong iteration.
const benchBusyPoll = 200 * time.Microsecond

// newBenchPairDevices is newBenchPair with both QPs on one device (one
// completion channel and goroutine) when oneDevice is set, and the
// provider's BusyPoll set to busy.
func newBenchPairDevices(b *testing.B, oneDevice bool, busy time.Duration) *benchPair {
	p, gid := testProviderBusy(b, busy)
	bp := &benchPair{cqa: make(chanHandler, 1024), cqb: make(chanHandler, 1024)}
	var shared hostverbs.Device
	mk := func(h chanHandler) (hostverbs.PD, hostverbs.CQ, hostverbs.MR) {
		mem := conformance.MemfdMemory(b, 2<<20)
		d := shared
		if d == nil {
			var err error
			d, err = p.Open(hostverbs.DeviceConfig{Name: "bench", Memory: mem})
			require.NoError(b, err)
			b.Cleanup(func() { _ = d.Close() })
			require.NoError(b, d.SetGID(0, hostverbs.GIDEntry{GID: gid, Type: hostverbs.GIDTypeRoCEv2}))
			if oneDevice {
				shared = d
			}
		}
		pd, err := d.AllocPD()
		require.NoError(b, err)
		cq, err := d.CreateCQ(hostverbs.CQAttr{Depth: 256, Handler: h})
		require.NoError(b, err)
		pages := make([]guestmem.GPA, 512)
		for i := range pages {
			pages[i] = guestmem.GPA((511 - i) * guestmem.PageSize)
		}
		pl, err := guestmem.NewPageList(benchIOVA, 2<<20, pages)
		require.NoError(b, err)
		mr, err := pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite})
		require.NoError(b, err)
		return pd, cq, mr
	}
	pda, cqa, mra := mk(bp.cqa)
	pdb, cqb, mrb := mk(bp.cqb)
	bp.mra, bp.mrb = mra, mrb
	qp := func(pd hostverbs.PD, cq hostverbs.CQ) hostverbs.QP {
		q, err := pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: cq, RecvCQ: cq,
			Cap: hostverbs.QPCap{MaxSendWR: 64, MaxRecvWR: 64, MaxSendSGE: 1, MaxRecvSGE: 1}})
		require.NoError(b, err)
		require.NoError(b, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1,
			AccessFlags: hostverbs.AccessRemoteWrite | hostverbs.AccessLocalWrite},
			hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
		return q
	}
	bp.qa, bp.qb = qp(pda, cqa), qp(pdb, cqb)
	rts := func(q hostverbs.QP, dqpn uint32) {
		require.NoError(b, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024, DestQPN: dqpn,
			MaxDestRdAtomic: 1, MinRNRTimer: 1, AV: hostverbs.AddressVector{DGID: gid, HopLimit: 64}},
			hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|hostverbs.AttrRQPSN|
				hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
		require.NoError(b, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRdAtomic: 1},
			hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|hostverbs.AttrRNRRetry|hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic))
	}
	rts(bp.qa, bp.qb.QPN())
	rts(bp.qb, bp.qa.QPN())
	return bp
}

func (bp *benchPair) wait(b *testing.B, h chanHandler) hostverbs.WorkCompletion {
	var wc hostverbs.WorkCompletion
	select {
	case wc = <-h:
	default: // not there yet: wait, with a deadline
		wc = bp.waitLong(b, h)
	}
	if wc.Status != hostverbs.WCSuccess {
		b.Fatalf("completion %+v", wc)
	}
	return wc
}

// waitLong waits for a completion up to 10 s, allocating nothing (a
// timer per wait would add garbage, hence collections, to the loop).
func (bp *benchPair) waitLong(b *testing.B, h chanHandler) hostverbs.WorkCompletion {
	if bp.tick == nil {
		bp.tick = time.NewTicker(time.Second)
		b.Cleanup(bp.tick.Stop)
	}
	for start := time.Now(); ; {
		select {
		case wc := <-h:
			return wc
		case <-bp.tick.C:
			if time.Since(start) > 10*time.Second {
				b.Fatal("no completion")
			}
		}
	}
}

// BenchmarkRelayWrite64K: 64 KiB RDMA WRITEs through the relay, 16
// outstanding (testdata/plainbench.c does the same with plain libibverbs).
func BenchmarkRelayWrite64K(b *testing.B) { benchWrite64K(b, newBenchPair(b)) }

func benchWrite64K(b *testing.B, bp *benchPair) {
	const size = 64 << 10
	sge := []hostverbs.SGE{{Addr: benchIOVA, Length: size, LKey: bp.mra.LKey()}}
	posted, done := 0, 0
	b.SetBytes(size)
	b.ResetTimer()
	c0 := contextSwitches()
	start := time.Now()
	var inPost, inWait time.Duration
	for done < b.N {
		for posted < b.N && posted-done < 16 {
			s := time.Now()
			require.NoError(b, bp.qa.PostSend(&hostverbs.SendWR{WRID: uint64(posted), Opcode: hostverbs.WRRDMAWrite,
				Flags: hostverbs.SendSignaled, SGL: sge, RemoteAddr: benchIOVA + uint64(posted%16)*size, RKey: bp.mrb.RKey()}))
			inPost += time.Since(s)
			posted++
		}
		s := time.Now()
		bp.wait(b, bp.cqa)
		inWait += time.Since(s)
		done++
	}
	b.ReportMetric(float64(b.N)*size/time.Since(start).Seconds()/1e6, "MB/s")
	b.ReportMetric(float64(inPost.Microseconds())/float64(b.N), "usec_in_post")
	b.ReportMetric(float64(inWait.Microseconds())/float64(b.N), "usec_in_wait")
	b.ReportMetric(float64(contextSwitches()-c0)/float64(b.N), "switches/op")
}

// BenchmarkRelaySend8: post-to-completion time of one signaled 8 B SEND
// at a time through the relay, between two VMs' devices.
func BenchmarkRelaySend8(b *testing.B) { benchSend8(b, newBenchPair(b)) }

// BenchmarkRelaySend8OneDevice is BenchmarkRelaySend8 with both QPs on one
// device: one completion goroutine instead of two.
func BenchmarkRelaySend8OneDevice(b *testing.B) { benchSend8(b, newBenchPairDevices(b, true, 0)) }

// BenchmarkRelaySend8BusyPoll is BenchmarkRelaySend8 with the relay's
// busy polling on (Config.BusyPoll): no completion event, hence no thread
// woken, while the post is in rxe's system call.
func BenchmarkRelaySend8BusyPoll(b *testing.B) {
	benchSend8(b, newBenchPairDevices(b, false, benchBusyPoll))
}

// BenchmarkRelayWrite64KBusyPoll is BenchmarkRelayWrite64K with busy
// polling on: what the polling costs a stream.
func BenchmarkRelayWrite64KBusyPoll(b *testing.B) {
	benchWrite64K(b, newBenchPairDevices(b, false, benchBusyPoll))
}

func benchSend8(b *testing.B, bp *benchPair) {
	sge := []hostverbs.SGE{{Addr: benchIOVA, Length: 8, LKey: bp.mra.LKey()}}
	rsge := []hostverbs.SGE{{Addr: benchIOVA, Length: 64, LKey: bp.mrb.LKey()}}
	var total, toHandler, inPost time.Duration
	b.ResetTimer()
	for i := range b.N {
		require.NoError(b, bp.qb.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: rsge}))
		s := time.Now()
		require.NoError(b, bp.qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sge}))
		inPost += time.Since(s)
		wc := bp.wait(b, bp.cqa)
		total += time.Since(s)
		toHandler += benchEpoch.Add(time.Duration(wc.VendorErr) * time.Microsecond).Sub(s)
		bp.wait(b, bp.cqb)
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N), "usec/send")
	// How much of it is before the completion reaches the handler (host
	// device, event, poll) and after (hand-off to the consumer).
	b.ReportMetric(float64(toHandler.Microseconds())/float64(b.N), "usec_to_handler")
	b.ReportMetric(float64(inPost.Microseconds())/float64(b.N), "usec_in_post")
}

// BenchmarkCgoCall17us: the wall time of one cgo call that spins 17 us (the
// time rxe's ibv_post_send takes in the guest) against the same spin in Go.
// A larger figure for the cgo call is what the runtime adds to a cgo call
// of that length (it hands the processor to another thread meanwhile).
func BenchmarkCgoCall17us(b *testing.B) { benchCgoCall(b, 17*time.Microsecond) }

// BenchmarkCgoCall60us is BenchmarkCgoCall17us past the runtime's 20 us
// (after which sysmon hands a blocked call's processor to another thread).
func BenchmarkCgoCall60us(b *testing.B) { benchCgoCall(b, 60*time.Microsecond) }

func benchCgoCall(b *testing.B, d time.Duration) {
	var inC, inGo time.Duration
	for range b.N {
		s := time.Now()
		cgoSpin(d)
		inC += time.Since(s)
		s = time.Now()
		for time.Since(s) < d {
		}
		inGo += time.Since(s)
	}
	b.ReportMetric(float64(inC.Microseconds())/float64(b.N), "usec_cgo")
	b.ReportMetric(float64(inGo.Microseconds())/float64(b.N), "usec_go")
}

// contextSwitches is the system's count of context switches so far
// (/proc/stat's ctxt), -1 if it cannot be read: the relay's benchmarks
// report how many a post costs the machine (threads woken by completion
// events and by the runtime's hand-off of a long cgo call's processor).
func contextSwitches() int64 {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return -1
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(l, "ctxt "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return -1
			}
			return n
		}
	}
	return -1
}
