package vdev

import (
	"bytes"
	"encoding/binary"
	"math/rand"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Data-path tests on the real provider: two guests, each with its own
// vdev over a device of one in-process soft fabric, moving bytes between
// their guest memories through RoCE v2 RC and UD.

func newSoftFabric(t testing.TB) *soft.Fabric {
	f, err := soft.New(soft.Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// softSide is one guest on the fabric: a user context (UAR page 1) with a
// PD, send and receive CQs, a 256 KiB MR over scattered pages and an RC QP.
type softSide struct {
	g        *guest
	gid      hostverbs.GID
	pd       uint32
	scq, rcq *gcq
	mr       *gmr
	qp       *gqp
}

func newSoftGuest(t testing.TB, f *soft.Fabric, name string, gid hostverbs.GID) *guest {
	return newSoftGuestLimits(t, f, name, gid, Limits{})
}

// newSoftGuestLimits is newSoftGuest with the device's limits.
func newSoftGuestLimits(t testing.TB, f *soft.Fabric, name string, gid hostverbs.GID, lim Limits) *guest {
	// The guest's memory exists first; the provider device maps its MRs
	// onto it, and its events go to the vdev created over it.
	var dev atomic.Pointer[Device]
	g := &guest{t: t, irq: &fakeIRQ{}, next: 1 << 20}
	g.mem, g.raw = guestmem.NewFlat(0, guestRAMSize)
	sd, err := f.Open(hostverbs.DeviceConfig{Name: name, Memory: g.mem, MAC: testMAC,
		Events: func(ev hostverbs.AsyncEvent) {
			if d := dev.Load(); d != nil {
				d.HandleEvent(ev)
			}
		}})
	require.NoError(t, err)
	g.verbs = sd
	d, err := New(Config{Memory: g.mem, Verbs: sd, IRQ: g.irq, MAC: testMAC, Limits: lim})
	require.NoError(t, err)
	dev.Store(d)
	g.dev = d
	t.Cleanup(func() {
		_ = d.Close()
		_ = sd.Close()
	})
	g.probe()
	g.bindGID(0, gid)
	return g
}

func newSoftSide(t testing.TB, f *soft.Fabric, name string, gid hostverbs.GID) *softSide {
	g := newSoftGuest(t, f, name, gid)
	s := &softSide{g: g, gid: gid}
	uc := g.createUC(1)
	s.pd = g.createPD(uc)
	s.scq, s.rcq = g.createCQ(uc, 256), g.createCQ(uc, 256)
	s.mr = g.regMR(s.pd, 0x7f0000000123, 256<<10, 0xf)
	s.qp = g.createQP(qpSpec{pd: s.pd, scq: s.scq, rcq: s.rcq, typ: hostverbs.QPTypeRC, sendWR: 64, recvWR: 64, sendSGE: 2, recvSGE: 2, uar: 1})
	return s
}

func connect(a, b *softSide) {
	a.qp.toRTS(b.qp.qpn, b.gid, 0)
	b.qp.toRTS(a.qp.qpn, a.gid, 0)
}

func (s *softSide) sge(off uint64, n uint32) abi.SGE {
	return abi.SGE{Addr: s.mr.iova + off, Length: n, LKey: s.mr.lkey}
}

// waitCQE polls c until a CQE arrives (completions come from the
// provider's goroutines).
func waitCQE(t testing.TB, c *gcq) abi.CQE {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if e, ok := c.poll(); ok {
			return e
		}
		if time.Now().After(deadline) {
			t.Fatalf("no CQE on CQ %d", c.handle)
		}
		c.g.doorbell(c.uar, abi.UARCQOffset, abi.UARCQPoll|c.handle) // as the provider does on an empty poll
		time.Sleep(50 * time.Microsecond)
	}
}

func randBytes(n int, seed int64) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

func TestSoftRCSendRecv(t *testing.T) {
	f := newSoftFabric(t)
	a, b := newSoftSide(t, f, "vm-a", gidA), newSoftSide(t, f, "vm-b", gidB)
	connect(a, b)
	assert.Equal(t, a.qp.qpn, b.qp.qpn, "QPNs collide across guests; GIDs tell them apart")
	for i, size := range []int{0, 1, 4095, 10000, 64 << 10} {
		data := randBytes(size, int64(i))
		a.mr.write(a.g, 100, data)
		b.qp.postRecv(uint64(1000+i), b.sge(7, 3000), b.sge(3007, 100<<10))
		h := wqe(hostverbs.WRSendWithImm, uint64(i), hostverbs.SendSignaled)
		h.Ex = 0x0a0b0c0d
		a.qp.postSend(h, a.sge(100, uint32(size/2)), a.sge(100+uint64(size/2), uint32(size-size/2)))
		r := waitCQE(t, b.rcq)
		require.EqualValues(t, hostverbs.WCSuccess, r.Status)
		assert.EqualValues(t, 1000+i, r.WRID)
		assert.EqualValues(t, hostverbs.WCRecv, r.Opcode)
		assert.EqualValues(t, size, r.ByteLen)
		assert.EqualValues(t, 0x0a0b0c0d, r.ImmData)
		assert.NotZero(t, r.WCFlags&uint32(hostverbs.WCFlagWithImm))
		assert.EqualValues(t, a.qp.qpn, r.SrcQP)
		assert.EqualValues(t, b.qp.handle, r.QP)
		assert.True(t, bytes.Equal(data, b.mr.read(b.g, 7, uint64(size))), "payload of %d bytes", size)
		s := waitCQE(t, a.scq)
		assert.EqualValues(t, hostverbs.WCSuccess, s.Status)
		assert.EqualValues(t, hostverbs.WCSend, s.Opcode)
		assert.EqualValues(t, i, s.WRID)
		assert.EqualValues(t, a.qp.handle, s.QP)
	}
}

func TestSoftRCWriteReadAtomics(t *testing.T) {
	f := newSoftFabric(t)
	a, b := newSoftSide(t, f, "vm-a", gidA), newSoftSide(t, f, "vm-b", gidB)
	connect(a, b)
	// RDMA WRITE, with the rkey b's guest got from its CREATE_MR, used
	// verbatim by a (as rkeys travel between guests).
	data := randBytes(100<<10, 1)
	a.mr.write(a.g, 0, data)
	h := wqe(hostverbs.WRRDMAWrite, 1, hostverbs.SendSignaled)
	abi.WRRDMA{RemoteAddr: b.mr.iova + 5000, RKey: b.mr.rkey}.Encode(h.WR[:])
	a.qp.postSend(h, a.sge(0, uint32(len(data))))
	e := waitCQE(t, a.scq)
	require.EqualValues(t, hostverbs.WCSuccess, e.Status)
	assert.EqualValues(t, hostverbs.WCRDMAWrite, e.Opcode)
	assert.True(t, bytes.Equal(data, b.mr.read(b.g, 5000, uint64(len(data)))))

	// WRITE_WITH_IMM consumes a receive: opcode RECV_RDMA_WITH_IMM.
	b.qp.postRecv(77)
	h = wqe(hostverbs.WRRDMAWriteWithImm, 2, hostverbs.SendSignaled)
	h.Ex = 0x11223344
	abi.WRRDMA{RemoteAddr: b.mr.iova, RKey: b.mr.rkey}.Encode(h.WR[:])
	a.qp.postSend(h, a.sge(0, 64))
	r := waitCQE(t, b.rcq)
	assert.EqualValues(t, hostverbs.WCRecvRDMAWithImm, r.Opcode)
	assert.EqualValues(t, 0x11223344, r.ImmData)
	assert.EqualValues(t, 64, r.ByteLen)
	assert.EqualValues(t, 77, r.WRID)
	waitCQE(t, a.scq)

	// RDMA READ back into a different place of a's MR.
	h = wqe(hostverbs.WRRDMARead, 3, hostverbs.SendSignaled)
	abi.WRRDMA{RemoteAddr: b.mr.iova + 5000, RKey: b.mr.rkey}.Encode(h.WR[:])
	a.qp.postSend(h, a.sge(128<<10, 60<<10), a.sge(200<<10, 40<<10))
	e = waitCQE(t, a.scq)
	require.EqualValues(t, hostverbs.WCSuccess, e.Status)
	assert.EqualValues(t, hostverbs.WCRDMARead, e.Opcode)
	assert.True(t, bytes.Equal(data[:60<<10], a.mr.read(a.g, 128<<10, 60<<10)))
	assert.True(t, bytes.Equal(data[60<<10:], a.mr.read(a.g, 200<<10, 40<<10)))

	// Atomics on an 8-byte aligned word of b's MR (iova ends in 0x123:
	// offset 0x2dd is aligned).
	const word = 0x2dd
	b.mr.write(b.g, word, binary.LittleEndian.AppendUint64(nil, 40))
	h = wqe(hostverbs.WRAtomicFetchAndAdd, 4, hostverbs.SendSignaled)
	abi.WRAtomic{RemoteAddr: b.mr.iova + word, CompareAdd: 2, RKey: b.mr.rkey}.Encode(h.WR[:])
	a.qp.postSend(h, a.sge(16, 8))
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, a.scq).Status)
	assert.EqualValues(t, 40, binary.LittleEndian.Uint64(a.mr.read(a.g, 16, 8)), "original value returned")
	assert.EqualValues(t, 42, binary.LittleEndian.Uint64(b.mr.read(b.g, word, 8)))
	h = wqe(hostverbs.WRAtomicCmpAndSwp, 5, hostverbs.SendSignaled)
	abi.WRAtomic{RemoteAddr: b.mr.iova + word, CompareAdd: 42, Swap: 7, RKey: b.mr.rkey}.Encode(h.WR[:])
	a.qp.postSend(h, a.sge(24, 8))
	e = waitCQE(t, a.scq)
	assert.EqualValues(t, hostverbs.WCCompSwap, e.Opcode)
	assert.EqualValues(t, 42, binary.LittleEndian.Uint64(a.mr.read(a.g, 24, 8)))
	assert.EqualValues(t, 7, binary.LittleEndian.Uint64(b.mr.read(b.g, word, 8)))
}

func TestSoftRemoteAccessErrorAndFlush(t *testing.T) {
	f := newSoftFabric(t)
	a, b := newSoftSide(t, f, "vm-a", gidA), newSoftSide(t, f, "vm-b", gidB)
	connect(a, b)
	ro := b.g.regMR(b.pd, 0x5000, 4096, uint32(hostverbs.AccessLocalWrite)) // no remote access
	h := wqe(hostverbs.WRRDMAWrite, 1, hostverbs.SendSignaled)
	abi.WRRDMA{RemoteAddr: 0x5000, RKey: ro.rkey}.Encode(h.WR[:])
	a.qp.postSend(h, a.sge(0, 8))
	e := waitCQE(t, a.scq)
	assert.EqualValues(t, hostverbs.WCRemAccessErr, e.Status, "the rkey is checked in the target device")
	a.qp.postSend(wqe(hostverbs.WRSend, 2, 0), a.sge(0, 8))
	assert.EqualValues(t, hostverbs.WCWRFlushErr, waitCQE(t, a.scq).Status)

	// Disconnect as rping does (RTS -> ERR): receives posted to the
	// provider flush with WR_FLUSH_ERR, opcode RECV.
	b.qp.postRecv(10, b.sge(0, 64))
	b.qp.postRecv(11, b.sge(0, 64))
	b.qp.mustModify(hostverbs.AttrState, abi.QPAttr{State: uint32(hostverbs.QPStateErr)})
	for _, want := range []uint64{10, 11} {
		r := waitCQE(t, b.rcq)
		assert.EqualValues(t, want, r.WRID)
		assert.EqualValues(t, hostverbs.WCWRFlushErr, r.Status)
		assert.EqualValues(t, hostverbs.WCRecv, r.Opcode)
	}
}

func TestSoftEventMode(t *testing.T) {
	f := newSoftFabric(t)
	a, b := newSoftSide(t, f, "vm-a", gidA), newSoftSide(t, f, "vm-b", gidB)
	connect(a, b)
	b.g.notifications()
	for i := 0; i < 20; i++ {
		b.qp.postRecv(uint64(i), b.sge(0, 64))
		b.rcq.arm(abi.UARCQArm)
		before := b.g.irq.count(abi.VectorCQ)
		a.qp.postSend(wqe(hostverbs.WRSend, uint64(i), 0), a.sge(0, 64))
		deadline := time.Now().Add(5 * time.Second)
		for b.g.irq.count(abi.VectorCQ) == before && time.Now().Before(deadline) {
			time.Sleep(20 * time.Microsecond)
		}
		require.Equal(t, before+1, b.g.irq.count(abi.VectorCQ), "vector 2 for an armed CQ")
		require.Equal(t, []uint32{b.rcq.handle}, b.g.notifications())
		assert.EqualValues(t, i, waitCQE(t, b.rcq).WRID)
	}
}

// TestSoftUDAndGSI runs UD and the kernel's GSI QP (QPN 1) between the two
// guests: the receiver gets a 40-byte GRH before the payload, with an IPv4
// header for v4-mapped GIDs (the delivery the guest's rdma_cm was seen to
// accept).
func TestSoftUDAndGSI(t *testing.T) {
	f := newSoftFabric(t)
	ga, gb := newSoftGuest(t, f, "vm-a", gidA), newSoftGuest(t, f, "vm-b", gidB)
	type kside struct {
		g   *guest
		mr  abi.CreateMRResp
		cq  *gcq
		gsi *gqp
		buf uint64
		gid hostverbs.GID
		pd  uint32
	}
	mk := func(g *guest, gid hostverbs.GID) *kside {
		k := &kside{g: g, gid: gid, pd: g.createPD(0)}
		k.mr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: k.pd, AccessFlags: 1, Flags: abi.MRFlagDMA}))
		k.cq = g.createCQ(0, 1024)
		k.gsi = g.createQP(qpSpec{pd: k.pd, scq: k.cq, rcq: k.cq, typ: hostverbs.QPTypeGSI, sendWR: 128, recvWR: 512, sendSGE: 2, recvSGE: 1, sigAll: true})
		require.EqualValues(t, 1, k.gsi.qpn)
		k.gsi.mustModify(0x51, abi.QPAttr{State: 1, QKey: 0x80010000})
		k.gsi.mustModify(0x1, abi.QPAttr{State: 2})
		k.gsi.mustModify(0x10001, abi.QPAttr{State: 3})
		k.buf = g.page(4)
		return k
	}
	a, b := mk(ga, gidA), mk(gb, gidB)
	for i := 0; i < 4; i++ {
		b.gsi.postRecv(uint64(i), abi.SGE{Addr: b.buf + uint64(i)*512, Length: 296, LKey: b.mr.LKey})
	}
	mad := randBytes(256, 9)
	copy(ga.raw[a.buf:], mad)
	h := wqe(hostverbs.WRSend, 0xffff888000001234, hostverbs.SendSignaled)
	abi.WRUD{RemoteQPN: 1, RemoteQKey: 0x80010000, AV: abi.AV{PortPD: 1<<24 | a.pd, DGID: gidB, GIDIndex: 0, HopLimit: 64,
		SrcPathBits: 0x80}}.Encode(h.WR[:])
	a.gsi.postSend(h, abi.SGE{Addr: a.buf, Length: 24, LKey: a.mr.LKey}, abi.SGE{Addr: a.buf + 24, Length: 232, LKey: a.mr.LKey})
	s := waitCQE(t, a.cq)
	assert.EqualValues(t, hostverbs.WCSuccess, s.Status)
	assert.Equal(t, uint64(0xffff888000001234), s.WRID)
	r := waitCQE(t, b.cq)
	require.EqualValues(t, hostverbs.WCSuccess, r.Status)
	assert.EqualValues(t, 296, r.ByteLen, "40-byte GRH + 256-byte MAD")
	assert.EqualValues(t, 1, r.SrcQP)
	assert.EqualValues(t, hostverbs.WCFlagGRH|hostverbs.WCFlagWithNetworkHdrTyp, r.WCFlags)
	assert.EqualValues(t, hostverbs.NetworkIPv4, r.NetworkHdrType)
	assert.Zero(t, r.SL, "a kernel QP's sl stays the provider's: the kernel reads network_hdr_type")
	grh := gb.raw[b.buf : b.buf+40]
	assert.EqualValues(t, 0x45, grh[20], "IPv4 header at GRH offset 20")
	assert.Equal(t, gidA[12:], grh[20+12:20+16], "source address")
	assert.Equal(t, mad, gb.raw[b.buf+40:b.buf+296])

	// Plain UD between user QPs, with immediate data (udaddy replies to
	// wc.imm_data).
	ua, ub := newSoftSide(t, f, "ud-a", hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 15: 3}), newSoftSide(t, f, "ud-b", hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 15: 4})
	qa := ua.g.createQP(qpSpec{pd: ua.pd, scq: ua.scq, rcq: ua.rcq, typ: hostverbs.QPTypeUD, sendWR: 1, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	qb := ub.g.createQP(qpSpec{pd: ub.pd, scq: ub.scq, rcq: ub.rcq, typ: hostverbs.QPTypeUD, sendWR: 1, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	qa.udToRTS(0x11111111)
	qb.udToRTS(0x11111111)
	qb.postRecv(5, ub.sge(0, 40+512))
	payload := randBytes(512, 3)
	ua.mr.write(ua.g, 0, payload)
	h = wqe(hostverbs.WRSendWithImm, 6, hostverbs.SendSignaled)
	h.Ex = qa.qpn
	abi.WRUD{RemoteQPN: qb.qpn, RemoteQKey: 0x11111111, AV: abi.AV{PortPD: 1<<24 | ua.pd, DGID: ub.gid, HopLimit: 1}}.Encode(h.WR[:])
	qa.postSend(h, ua.sge(0, 512))
	r = waitCQE(t, ub.rcq)
	require.EqualValues(t, hostverbs.WCSuccess, r.Status)
	assert.EqualValues(t, 552, r.ByteLen)
	assert.EqualValues(t, qa.qpn, r.ImmData)
	assert.NotZero(t, r.WCFlags&uint32(hostverbs.WCFlagWithImm))
	assert.EqualValues(t, qb.handle, r.QP)
	assert.Equal(t, payload, ub.mr.read(ub.g, 40, 512))
	assert.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, ua.scq).Status)
}

func TestSoftSRQ(t *testing.T) {
	f := newSoftFabric(t)
	a, b := newSoftSide(t, f, "vm-a", gidA), newSoftSide(t, f, "vm-b", gidB)
	s := b.g.createSRQ(b.pd, 64, 1, 0, 1)
	qb := b.g.createQP(qpSpec{pd: b.pd, scq: b.scq, rcq: b.rcq, srq: s, typ: hostverbs.QPTypeRC, sendWR: 16, sendSGE: 1, uar: 1})
	a.qp.toRTS(qb.qpn, b.gid, 0)
	qb.toRTS(a.qp.qpn, a.gid, 0)
	for i := 0; i < 8; i++ {
		s.postRecv(uint64(100+i), b.sge(uint64(i)*1024, 1024))
	}
	for i := 0; i < 8; i++ {
		a.mr.write(a.g, 0, []byte{byte(i), 1, 2, 3})
		a.qp.postSend(wqe(hostverbs.WRSend, uint64(i), 0), a.sge(0, 4))
		r := waitCQE(t, b.rcq)
		require.EqualValues(t, hostverbs.WCSuccess, r.Status)
		assert.EqualValues(t, 100+i, r.WRID)
		assert.EqualValues(t, qb.handle, r.QP)
		assert.Equal(t, []byte{byte(i), 1, 2, 3}, b.mr.read(b.g, uint64(i)*1024, 4))
	}
}
