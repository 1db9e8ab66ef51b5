package vdev

import (
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// countCQ is a completion handler that only counts (the reference path).
type countCQ struct{ n atomic.Int64 }

func (c *countCQ) Complete(*hostverbs.WorkCompletion) { c.n.Add(1) }

// directSendRecvNS measures the same 64-byte SEND/RECV exchange straight
// on the soft provider, without the device model: the reference for
// BenchmarkSoftSendRecv.
func directSendRecvNS(b *testing.B, n int) float64 {
	f := newSoftFabric(b)
	type side struct {
		mem  *guestmem.Memory
		dev  hostverbs.Device
		qp   hostverbs.QP
		cq   *countCQ
		lkey uint32
	}
	mk := func(name string, gid hostverbs.GID) *side {
		mem, _ := guestmem.NewFlat(0, 1<<20)
		d, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: mem})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = d.Close() })
		if err := d.SetGID(0, hostverbs.GIDEntry{GID: gid, Type: hostverbs.GIDTypeRoCEv2}); err != nil {
			b.Fatal(err)
		}
		pd, _ := d.AllocPD()
		pl, _ := guestmem.NewPageList(0x10000, 4096, []guestmem.GPA{0x10000})
		mr, err := pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite})
		if err != nil {
			b.Fatal(err)
		}
		s := &side{mem: mem, dev: d, cq: &countCQ{}, lkey: mr.LKey()}
		cq, _ := d.CreateCQ(hostverbs.CQAttr{Depth: 256, Handler: s.cq})
		s.qp, err = pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: cq, RecvCQ: cq,
			Cap: hostverbs.QPCap{MaxSendWR: 64, MaxRecvWR: 64, MaxSendSGE: 1, MaxRecvSGE: 1}})
		if err != nil {
			b.Fatal(err)
		}
		return s
	}
	a, c := mk("ref-a", gidA), mk("ref-b", gidB)
	up := func(s *side, peer uint32, dgid hostverbs.GID) {
		steps := []struct {
			m hostverbs.AttrMask
			a hostverbs.QPAttr
		}{
			{0x39, hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, AccessFlags: 0xf}},
			{0x129181, hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024, DestQPN: peer,
				MaxDestRdAtomic: 1, MinRNRTimer: 12, AV: hostverbs.AddressVector{DGID: dgid, HopLimit: 64, Port: 1}}},
			{0x12e01, hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRdAtomic: 1}},
		}
		for _, st := range steps {
			if err := s.qp.Modify(&st.a, st.m); err != nil {
				b.Fatal(err)
			}
		}
	}
	up(a, c.qp.QPN(), gidB)
	up(c, a.qp.QPN(), gidA)
	sgl := []hostverbs.SGE{{Addr: 0x10000, Length: 64, LKey: a.lkey}}
	rsgl := []hostverbs.SGE{{Addr: 0x10000, Length: 64, LKey: c.lkey}}
	swr := hostverbs.SendWR{Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled, SGL: sgl}
	rwr := hostverbs.RecvWR{SGL: rsgl}
	start := nanotime()
	for i := 0; i < n; i++ {
		if err := c.qp.PostRecv(&rwr); err != nil {
			b.Fatal(err)
		}
		if err := a.qp.PostSend(&swr); err != nil {
			b.Fatal(err)
		}
		for a.cq.n.Load() <= int64(i) || c.cq.n.Load() <= int64(i) {
			runtime.Gosched()
		}
	}
	return float64(nanotime()-start) / float64(n)
}

// BenchmarkSoftSendRecv is one 64-byte SEND from guest A to guest B
// through both device models and the soft fabric, as rc_pingpong does it:
// B posts a receive (RQ WQE + RECV doorbell), A posts a send (SQ WQE +
// SEND doorbell), and both guests poll their CQEs. x_direct is the ratio
// to the same exchange on the provider alone in the same run.
func BenchmarkSoftSendRecv(b *testing.B) {
	f := newSoftFabric(b)
	a, c := newSoftSide(b, f, "vm-a", gidA), newSoftSide(b, f, "vm-b", gidB)
	connect(a, c)
	var sw [abi.SQWQEHdrSize + abi.SGESize]byte
	h := wqe(hostverbs.WRSend, 0, hostverbs.SendSignaled)
	h.NumSGE = 1
	h.Encode(sw[:])
	a.sge(0, 64).Encode(sw[abi.SQWQEHdrSize:])
	var rw [abi.RQWQEHdrSize + abi.SGESize]byte
	abi.RQWQEHdr{NumSGE: 1}.Encode(rw[:])
	c.sge(0, 64).Encode(rw[abi.RQWQEHdrSize:])
	var sdb, rdb [4]byte
	putLE32(sdb[:], abi.UARQPSend|a.qp.handle)
	putLE32(rdb[:], abi.UARQPRecv|c.qp.handle)
	poll := func(s *softSide, cq *gcq) {
		st := cq.pages[0] + 8
		for {
			head, _ := s.g.mem.LoadUint32(guestmem.GPA(st + 4))
			tail, _ := s.g.mem.LoadUint32(guestmem.GPA(st))
			if tail != head {
				_ = s.g.mem.StoreUint32(guestmem.GPA(st+4), drvInc(head, cq.n))
				return
			}
			runtime.Gosched()
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rq := c.qp.rqState()
		tail := c.g.u32(rq)
		copy(c.g.raw[c.qp.rqWQE(tail):], rw[:])
		c.g.put32(rq, drvInc(tail, c.qp.recvWR))
		if err := c.g.dev.WriteBAR(abi.UARBAR, abi.UARPageSize+abi.UARQPOffset, rdb[:]); err != nil {
			b.Fatal(err)
		}
		sq := a.qp.sqState()
		tail = a.g.u32(sq)
		copy(a.g.raw[a.qp.sqWQE(tail):], sw[:])
		a.g.put32(sq, drvInc(tail, a.qp.sendWR))
		if err := a.g.dev.WriteBAR(abi.UARBAR, abi.UARPageSize+abi.UARQPOffset, sdb[:]); err != nil {
			b.Fatal(err)
		}
		poll(c, c.rcq)
		poll(a, a.scq)
	}
	b.StopTimer()
	per := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(per/directSendRecvNS(b, max(b.N, 1000)), "x_direct")
	b.ReportMetric(per/socketRTT(b), "x_socket_rtt")
}
