package vdev

import (
	"encoding/binary"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// This file is a Go stand-in for the guest side: it lays out the DSR,
// command slots, rings and page directories in guest memory the way the
// Linux vmw_pvrdma driver (6.1) and rdma-core's provider do, and drives
// the device through its BARs. Ring arithmetic on the guest side is the
// driver's own (pvrdma_ring.h), not package ringbuf's.

type fakeIRQ struct {
	counts [abi.NumVectors]atomic.Int64
}

func (f *fakeIRQ) Trigger(v int) {
	if v >= 0 && v < abi.NumVectors {
		f.counts[v].Add(1)
	}
}

func (f *fakeIRQ) count(v int) int64 { return f.counts[v].Load() }

// Driver ring arithmetic (pvrdma_ring.h).
func drvValid(idx, max uint32) bool { return idx&^((max<<1)-1) == 0 }
func drvInc(idx, max uint32) uint32 { return (idx + 1) & ((max << 1) - 1) }

// put32 writes v little-endian at b[off:] (records and slots the tests forge).
func put32(b []byte, off int, v uint32) { binary.LittleEndian.PutUint32(b[off:], v) }

const (
	guestRAMSize = 48 << 20
	uarPFN       = 0xfe800 // BAR2 at 0xfe800000
	ringPages    = 4       // PVRDMA_NUM_RING_PAGES
)

type guest struct {
	t      testing.TB
	mem    *guestmem.Memory
	raw    []byte
	dev    *Device
	verbs  hostverbs.Device
	irq    *fakeIRQ
	next   uint64
	dsr    uint64
	cmdGPA uint64
	rspGPA uint64
	async  []uint64 // pages of the async ring, page 0 = state
	cqn    []uint64 // pages of the CQ-notify ring
	key    uint64
	caps   abi.Caps
	gotGID []gidEvent
	// journal holds every command slot that succeeded, in order: what a
	// restarted daemon replays (see rebuild).
	journal [][]byte
}

type gidEvent struct {
	index int
	e     hostverbs.GIDEntry
	bound bool
}

var testMAC = [6]byte{0x52, 0x54, 0x00, 0x12, 0x34, 0x56}

// newGuest creates guest memory and a device over verbs, without probing.
func newGuest(t testing.TB, verbs hostverbs.Device, limits Limits) *guest {
	return newGuestSized(t, verbs, limits, guestRAMSize)
}

func newGuestSized(t testing.TB, verbs hostverbs.Device, limits Limits, size uint64) *guest {
	t.Helper()
	return newGuestBudget(t, verbs, limits, size, nil)
}

// newGuestBudget is newGuestSized with a daemon-wide budget.
func newGuestBudget(t testing.TB, verbs hostverbs.Device, limits Limits, size uint64, budget *Budget) *guest {
	t.Helper()
	mem, raw := guestmem.NewFlat(0, size)
	g := &guest{t: t, mem: mem, raw: raw, verbs: verbs, irq: &fakeIRQ{}, next: 1 << 20}
	dev, err := New(Config{Memory: mem, Verbs: verbs, IRQ: g.irq, MAC: testMAC, Limits: limits, Budget: budget,
		OnGID: func(i int, e hostverbs.GIDEntry, bound bool) { g.gotGID = append(g.gotGID, gidEvent{i, e, bound}) }})
	require.NoError(t, err)
	g.dev = dev
	t.Cleanup(func() { _ = dev.Close() })
	return g
}

// probedGuest is newGuest plus the driver's probe sequence.
func probedGuest(t testing.TB, verbs hostverbs.Device) *guest {
	g := newGuest(t, verbs, Limits{})
	g.probe()
	return g
}

func (g *guest) u32(gpa uint64) uint32      { return binary.LittleEndian.Uint32(g.raw[gpa:]) }
func (g *guest) put32(gpa uint64, v uint32) { binary.LittleEndian.PutUint32(g.raw[gpa:], v) }
func (g *guest) put64(gpa uint64, v uint64) { binary.LittleEndian.PutUint64(g.raw[gpa:], v) }
func (g *guest) bytes(gpa, n uint64) []byte { return g.raw[gpa : gpa+n] }
func (g *guest) page(n int) uint64          { return g.pages(n)[0] }

// pages allocates n zeroed, contiguous guest pages.
func (g *guest) pages(n int) []uint64 {
	g.t.Helper()
	out := make([]uint64, n)
	for i := range out {
		require.Less(g.t, g.next+guestmem.PageSize, uint64(len(g.raw)), "guest out of memory")
		out[i] = g.next
		clear(g.raw[g.next : g.next+guestmem.PageSize])
		g.next += guestmem.PageSize
	}
	return out
}

// scatteredPages allocates n pages in a shuffled order (MR page lists are
// not contiguous in real guests).
func (g *guest) scatteredPages(n int) []uint64 {
	p := g.pages(n)
	for i := 0; i < n/2; i++ {
		p[i], p[n-1-i] = p[n-1-i], p[i]
	}
	return p
}

// pdir builds a page directory naming pages (pvrdma_page_dir_init).
func (g *guest) pdir(pages []uint64) uint64 {
	dir := g.page(1)
	ntables := (len(pages) + 511) / 512
	tables := g.pages(max(ntables, 1))
	for t := 0; t < ntables; t++ {
		g.put64(dir+uint64(t)*8, tables[t])
		for i := 0; i < 512 && t*512+i < len(pages); i++ {
			g.put64(tables[t]+uint64(i)*8, pages[t*512+i])
		}
	}
	return dir
}

func (g *guest) writeReg(off uint64, v uint32) error {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	return g.dev.WriteBAR(abi.RegsBAR, off, b[:])
}

func (g *guest) readReg(off uint64) uint32 {
	g.t.Helper()
	var b [4]byte
	require.NoError(g.t, g.dev.ReadBAR(abi.RegsBAR, off, b[:]))
	return binary.LittleEndian.Uint32(b[:])
}

func (g *guest) doorbell(uar uint32, off uint64, v uint32) {
	g.t.Helper()
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	require.NoError(g.t, g.dev.WriteBAR(abi.UARBAR, uint64(uar)*abi.UARPageSize+off, b[:]))
}

// setupDSR lays out the DSR as pvrdma_pci_probe does.
func (g *guest) setupDSR() {
	g.dsr = g.page(1)
	g.cmdGPA, g.rspGPA = g.page(1), g.page(1)
	g.async, g.cqn = g.pages(ringPages), g.pages(ringPages)
	abi.DSR{
		DriverVersion: abi.DeviceVersion, GOSInfo: 0x46, CmdSlot: g.cmdGPA, RespSlot: g.rspGPA,
		AsyncRing: abi.RingPageInfo{NumPages: ringPages, PDirDMA: g.pdir(g.async)},
		CQRing:    abi.RingPageInfo{NumPages: ringPages, PDirDMA: g.pdir(g.cqn)},
		UARPFN:    uarPFN,
	}.Encode(g.raw[g.dsr:])
}

// probe runs the driver's probe: DSR low then high, read the caps, enable
// interrupts, activate, check ERR.
func (g *guest) probe() {
	g.t.Helper()
	require.EqualValues(g.t, abi.DeviceVersion, g.readReg(abi.RegVersion))
	g.setupDSR()
	require.NoError(g.t, g.writeReg(abi.RegDSRLow, uint32(g.dsr)))
	require.NoError(g.t, g.writeReg(abi.RegDSRHigh, uint32(g.dsr>>32)))
	g.caps.Decode(g.raw[g.dsr+abi.DSRCapsOffset:])
	require.EqualValues(g.t, abi.DeviceModeRoCE, g.caps.Mode)
	require.EqualValues(g.t, abi.GIDTypeFlagRoCEv2, g.caps.GIDTypes, "the driver compares with ==")
	require.NoError(g.t, g.writeReg(abi.RegIMR, 0))
	require.NoError(g.t, g.writeReg(abi.RegCtl, abi.CtlActivate))
	require.Zero(g.t, g.readReg(abi.RegErr))
}

type encoder interface{ Encode([]byte) }

// cmd posts a command the way pvrdma_cmd_post does and returns ERR and a
// copy of the response slot (the union's 176 bytes).
func (g *guest) cmd(code uint32, req encoder) (uint32, []byte) {
	g.t.Helper()
	slot := g.raw[g.cmdGPA : g.cmdGPA+abi.CmdReqSize]
	clear(slot)
	g.key++
	abi.CmdHdr{Response: g.key, Cmd: code}.Encode(slot)
	if req != nil {
		req.Encode(slot)
	}
	rsp := g.raw[g.rspGPA : g.rspGPA+abi.CmdRespSize]
	for i := range rsp {
		rsp[i] = 0xEE
	}
	before := g.irq.count(abi.VectorResponse)
	require.NoError(g.t, g.writeReg(abi.RegRequest, 0))
	errReg := g.readReg(abi.RegErr)
	require.Equal(g.t, before+1, g.irq.count(abi.VectorResponse), "every command raises vector 0")
	if errReg == 0 {
		g.journal = append(g.journal, append([]byte(nil), slot...))
	}
	return errReg, append([]byte(nil), rsp...)
}

// mustCmd posts a command that must succeed and checks the response header.
func (g *guest) mustCmd(code uint32, req encoder) []byte {
	g.t.Helper()
	errReg, rsp := g.cmd(code, req)
	require.Zero(g.t, errReg, "%s failed with ERR %d", CommandName(code), errReg)
	var h abi.RespHdr
	h.Decode(rsp)
	require.Equal(g.t, g.key, h.Response, "response key echoed")
	require.EqualValues(g.t, abi.RespFlag|code, h.Ack)
	require.Zero(g.t, h.Err)
	return rsp
}

func (g *guest) createPD(ctx uint32) uint32 {
	var r abi.CreatePDResp
	r.Decode(g.mustCmd(abi.CmdCreatePD, abi.CreatePD{CtxHandle: ctx}))
	return r.PDHandle
}

func (g *guest) createUC(uar uint32) uint32 {
	var r abi.CreateUCResp
	r.Decode(g.mustCmd(abi.CmdCreateUC, abi.CreateUC{PFN: uarPFN + uint64(uar)}))
	return r.CtxHandle
}

func (g *guest) bindGID(index uint32, gid hostverbs.GID) {
	g.mustCmd(abi.CmdCreateBind, abi.CreateBind{MTU: 1024, VLAN: 0xfff, Index: index, NewGID: gid, GIDType: 2})
}

// gmr is a guest memory region: iova as the guest sees it and the
// scattered pages behind it.
type gmr struct {
	handle, lkey, rkey uint32
	iova, length       uint64
	pages              []uint64
}

// gpa translates an iova inside the MR to a guest-physical address.
func (m *gmr) gpa(iova uint64) uint64 {
	i := iova>>12 - m.iova>>12
	return m.pages[i] + iova&0xfff
}

// write copies data into the MR at byte offset off, page by page.
func (m *gmr) write(g *guest, off uint64, data []byte) {
	for len(data) > 0 {
		iova := m.iova + off
		n := min(uint64(len(data)), 4096-iova&0xfff)
		copy(g.raw[m.gpa(iova):], data[:n])
		data, off = data[n:], off+n
	}
}

// read returns n bytes of the MR at byte offset off.
func (m *gmr) read(g *guest, off, n uint64) []byte {
	out := make([]byte, 0, n)
	for n > 0 {
		iova := m.iova + off
		c := min(n, 4096-iova&0xfff)
		out = append(out, g.raw[m.gpa(iova):m.gpa(iova)+c]...)
		n, off = n-c, off+c
	}
	return out
}

// regMR registers length bytes at iova (a user VA, page offset kept) in pd.
func (g *guest) regMR(pd uint32, iova, length uint64, access uint32) *gmr {
	g.t.Helper()
	span := int((iova+length-1)>>12 - iova>>12 + 1)
	m := &gmr{iova: iova, length: length, pages: g.scatteredPages(span)}
	var r abi.CreateMRResp
	r.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: iova, Length: length, PDirDMA: g.pdir(m.pages),
		PDHandle: pd, AccessFlags: access, NChunks: uint32(span)}))
	m.handle, m.lkey, m.rkey = r.MRHandle, r.LKey, r.RKey
	return m
}

// gcq is a guest CQ: ring state in page 0 (rx half), CQEs from page 1.
type gcq struct {
	g      *guest
	handle uint32
	n      uint32
	pages  []uint64
	uar    uint32
}

func (g *guest) createCQ(ctx, n uint32) *gcq {
	g.t.Helper()
	c := &gcq{g: g, n: n, uar: ctx, pages: g.pages(int(cqRingPages(n)))}
	var r abi.CreateCQResp
	r.Decode(g.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: g.pdir(c.pages), CtxHandle: ctx, CQE: n, NChunks: uint32(len(c.pages))}))
	require.Equal(g.t, n, r.CQE)
	c.handle = r.CQHandle
	return c
}

func (c *gcq) tail() uint32 { return c.g.load32(c.pages[0] + 8) }
func (c *gcq) head() uint32 { return c.g.load32(c.pages[0] + 12) }

// poll takes one CQE the way pvrdma_poll_one does; ok is false when empty.
func (c *gcq) poll() (abi.CQE, bool) {
	c.g.t.Helper()
	tail, head := c.tail(), c.head()
	require.True(c.g.t, drvValid(tail, c.n) && drvValid(head, c.n), "CQ ring state invalid: %#x %#x", tail, head)
	if tail == head {
		return abi.CQE{}, false
	}
	off := uint64(head&(c.n-1)) * abi.CQESize
	gpa := c.pages[1+off/guestmem.PageSize] + off%guestmem.PageSize
	var e abi.CQE
	e.Decode(c.g.raw[gpa:])
	c.g.store32(c.pages[0]+12, drvInc(head, c.n))
	return e, true
}

func (c *gcq) mustPoll() abi.CQE {
	c.g.t.Helper()
	e, ok := c.poll()
	require.True(c.g.t, ok, "CQ %d empty", c.handle)
	return e
}

func (c *gcq) arm(flag uint32) { c.g.doorbell(c.uar, abi.UARCQOffset, c.handle|flag) }

// gqp is a guest QP laid out as rdma-core/kernel do: one page directory,
// page 0 ring states (SQ at 0, RQ at 8), SQ WQEs from page 1, RQ WQEs from
// page 1+send_chunks.
type gqp struct {
	g                *guest
	handle, qpn      uint32
	pages            []uint64
	sendWR, recvWR   uint32
	sendSGE, recvSGE uint32
	sstride, rstride uint32
	sendChunks       int
	uar              uint32
}

type qpSpec struct {
	pd                               uint32
	scq, rcq                         *gcq
	srq                              *gsrq
	typ                              hostverbs.QPType
	sendWR, recvWR, sendSGE, recvSGE uint32
	uar                              uint32
	sigAll                           bool
}

func (g *guest) createQP(s qpSpec) *gqp {
	g.t.Helper()
	q, errReg := g.tryCreateQP(s)
	require.Zero(g.t, errReg)
	return q
}

func (g *guest) tryCreateQP(s qpSpec) (*gqp, uint32) {
	q := &gqp{g: g, sendWR: s.sendWR, recvWR: s.recvWR, sendSGE: s.sendSGE, recvSGE: s.recvSGE, uar: s.uar}
	q.sstride, q.rstride = pow2Ceil(80+16*s.sendSGE), pow2Ceil(16+16*s.recvSGE)
	q.sendChunks = int((uint64(s.sendWR)*uint64(q.sstride) + 4095) / 4096)
	recvPages := 0
	req := abi.CreateQP{PDHandle: s.pd, SendCQHandle: s.scq.handle, RecvCQHandle: s.rcq.handle,
		MaxSendWR: s.sendWR, MaxRecvWR: s.recvWR, MaxSendSGE: s.sendSGE, MaxRecvSGE: s.recvSGE,
		QPType: uint8(s.typ), AccessFlags: 1}
	if s.srq != nil {
		req.IsSRQ, req.SRQHandle, req.MaxRecvWR, req.MaxRecvSGE = 1, s.srq.handle, 0, 0
	} else {
		recvPages = int((uint64(s.recvWR)*uint64(q.rstride) + 4095) / 4096)
	}
	if s.sigAll {
		req.SQSigAll = 1
	}
	q.pages = g.pages(1 + q.sendChunks + recvPages)
	req.PDirDMA, req.TotalChunks, req.SendChunks = g.pdir(q.pages), uint16(len(q.pages)), uint16(q.sendChunks)
	errReg, rsp := g.cmd(abi.CmdCreateQP, req)
	if errReg != 0 {
		return nil, errReg
	}
	var r abi.CreateQPResp
	r.Decode(rsp)
	q.handle, q.qpn = r.QPHandle, r.QPN
	return q, 0
}

func (q *gqp) sqState() uint64 { return q.pages[0] }
func (q *gqp) rqState() uint64 { return q.pages[0] + 8 }

func (q *gqp) sqWQE(idx uint32) uint64 {
	off := uint64(idx&(q.sendWR-1)) * uint64(q.sstride)
	return q.pages[1+off/4096] + off%4096
}

func (q *gqp) rqWQE(idx uint32) uint64 {
	off := uint64(idx&(q.recvWR-1)) * uint64(q.rstride)
	return q.pages[1+q.sendChunks+int(off/4096)] + off%4096
}

// writeSend writes a send WQE at the SQ's prod_tail and advances it,
// without ringing the doorbell.
func (q *gqp) writeSend(h abi.SQWQEHdr, sges ...abi.SGE) {
	g := q.g
	tail := g.u32(q.sqState())
	gpa := q.sqWQE(tail)
	h.NumSGE = uint32(len(sges))
	h.Encode(g.raw[gpa:])
	for i, s := range sges {
		s.Encode(g.raw[gpa+abi.SQWQEHdrSize+uint64(i)*abi.SGESize:])
	}
	g.put32(q.sqState(), drvInc(tail, q.sendWR))
}

func (q *gqp) postSend(h abi.SQWQEHdr, sges ...abi.SGE) {
	q.writeSend(h, sges...)
	q.g.doorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle)
}

func (q *gqp) writeRecv(wrid uint64, sges ...abi.SGE) {
	g := q.g
	tail := g.u32(q.rqState())
	gpa := q.rqWQE(tail)
	abi.RQWQEHdr{WRID: wrid, NumSGE: uint32(len(sges))}.Encode(g.raw[gpa:])
	for i, s := range sges {
		s.Encode(g.raw[gpa+abi.RQWQEHdrSize+uint64(i)*abi.SGESize:])
	}
	g.put32(q.rqState(), drvInc(tail, q.recvWR))
}

func (q *gqp) postRecv(wrid uint64, sges ...abi.SGE) {
	q.writeRecv(wrid, sges...)
	q.g.doorbell(q.uar, abi.UARQPOffset, abi.UARQPRecv|q.handle)
}

// providerWRID is the WRID the device posts the WQE at ring index idx of
// the SQ (or RQ) with, before any RESET of the QP.
func (q *gqp) providerWRID(recv bool, idx uint32) uint64 {
	v := wridMagic | uint64(idx)
	if recv {
		v |= wridRecv
	}
	return v
}

// sqConsumed reports the device's cons_head of the SQ: the WQEs before it
// have completed.
func (q *gqp) sqConsumed() uint32 { return q.g.u32(q.sqState() + 4) }
func (q *gqp) rqConsumed() uint32 { return q.g.u32(q.rqState() + 4) }

func (q *gqp) modify(mask hostverbs.AttrMask, a abi.QPAttr) (uint32, abi.RespHdr) {
	errReg, rsp := q.g.cmd(abi.CmdModifyQP, abi.ModifyQP{QPHandle: q.handle, AttrMask: uint32(mask), Attrs: a})
	var h abi.RespHdr
	h.Decode(rsp)
	return errReg, h
}

func (q *gqp) mustModify(mask hostverbs.AttrMask, a abi.QPAttr) {
	q.g.t.Helper()
	errReg, h := q.modify(mask, a)
	require.Zero(q.g.t, errReg)
	require.Zero(q.g.t, h.Err)
}

// toRTS takes an RC QP through INIT, RTR and RTS with the masks
// ibv_rc_pingpong uses (as seen from bookworm's), addressing the peer.
func (q *gqp) toRTS(destQPN uint32, dgid hostverbs.GID, sgid uint8) {
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1, AccessFlags: 0xf})
	q.mustModify(0x129181, abi.QPAttr{State: 2, PathMTU: 3, DestQPNum: destQPN, MaxDestRdAtomic: 1, MinRNRTimer: 12,
		AH: abi.AHAttr{DGID: dgid, SGIDIndex: sgid, HopLimit: 64, Flags: 1, PortNum: 1}})
	q.mustModify(0x12e01, abi.QPAttr{State: 3, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRdAtomic: 1})
}

// udToRTS takes a UD (or GSI) QP to RTS.
func (q *gqp) udToRTS(qkey uint32) {
	q.mustModify(0x71, abi.QPAttr{State: 1, PortNum: 1, QKey: qkey})
	q.mustModify(0x1, abi.QPAttr{State: 2})
	q.mustModify(0x10001, abi.QPAttr{State: 3})
}

// gsrq is a guest SRQ: ring state page 0 (rx half), WQEs from page 1.
type gsrq struct {
	g              *guest
	handle         uint32
	n, sge, stride uint32
	pages          []uint64
	uar            uint32
}

func (g *guest) createSRQ(pd, n, sge, limit, uar uint32) *gsrq {
	g.t.Helper()
	s := &gsrq{g: g, n: n, sge: sge, stride: pow2Ceil(16 + 16*sge), uar: uar}
	s.pages = g.pages(1 + int((uint64(n)*uint64(s.stride)+4095)/4096))
	var r abi.CreateSRQResp
	r.Decode(g.mustCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDirDMA: g.pdir(s.pages), PDHandle: pd, NChunks: uint32(len(s.pages)),
		Attrs: abi.SRQAttr{MaxWR: n, MaxSGE: sge, SRQLimit: limit}}))
	s.handle = r.SRQN
	return s
}

func (s *gsrq) postRecv(wrid uint64, sges ...abi.SGE) {
	s.writeRecv(wrid, sges...)
	s.g.doorbell(s.uar, abi.UARSRQOffset, abi.UARSRQRecv|s.handle)
}

// writeRecv writes a receive in the SRQ's ring without ringing its
// doorbell.
func (s *gsrq) writeRecv(wrid uint64, sges ...abi.SGE) {
	g := s.g
	state := s.pages[0] + 8
	tail := g.u32(state)
	off := uint64(tail&(s.n-1)) * uint64(s.stride)
	gpa := s.pages[1+off/4096] + off%4096
	abi.RQWQEHdr{WRID: wrid, NumSGE: uint32(len(sges))}.Encode(g.raw[gpa:])
	for i, sg := range sges {
		sg.Encode(g.raw[gpa+abi.RQWQEHdrSize+uint64(i)*abi.SGESize:])
	}
	g.put32(state, drvInc(tail, s.n))
}

// events drains the async event ring with the driver's arithmetic
// ((pages-1)*4096/8 slots, not a power of two).
func (g *guest) events() []abi.EQE {
	slots := uint32((ringPages - 1) * 4096 / abi.EQESize)
	state := g.async[0] + 8
	var out []abi.EQE
	for {
		tail, head := g.load32(state), g.load32(state+4)
		require.True(g.t, drvValid(tail, slots) && drvValid(head, slots))
		if tail == head {
			return out
		}
		i := uint64(head&(slots-1)) * abi.EQESize
		var e abi.EQE
		gpa := g.async[1+i/4096] + i%4096
		e.Decode(g.raw[gpa:])
		out = append(out, e)
		g.store32(state+4, drvInc(head, slots))
	}
}

// notifications drains the CQ-notification ring ((pages-1)*4096/4 slots).
func (g *guest) notifications() []uint32 {
	slots := uint32((ringPages - 1) * 4096 / abi.CQNESize)
	state := g.cqn[0] + 8
	var out []uint32
	for {
		tail, head := g.load32(state), g.load32(state+4)
		require.True(g.t, drvValid(tail, slots) && drvValid(head, slots), "tail %#x head %#x", tail, head)
		if tail == head {
			return out
		}
		i := uint64(head&(slots-1)) * abi.CQNESize
		out = append(out, g.u32(g.cqn[1+i/4096]+i%4096))
		g.store32(state+4, drvInc(head, slots))
	}
}

// load32 and store32 access ring indices the device updates concurrently
// (completions arrive on provider goroutines), as the driver's atomic_t.
func (g *guest) load32(gpa uint64) uint32 {
	v, err := g.mem.LoadUint32(guestmem.GPA(gpa))
	require.NoError(g.t, err)
	return v
}

func (g *guest) store32(gpa uint64, v uint32) {
	require.NoError(g.t, g.mem.StoreUint32(guestmem.GPA(gpa), v))
}
