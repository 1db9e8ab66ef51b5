package hostile

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// This file is the "verbs" half of the driver: user contexts, PDs, MRs,
// CQs and QPs laid out in guest RAM as rdma-core's vmw_pvrdma provider and
// the kernel driver lay them out (the ABI's headers, and the layouts the
// stock driver was seen to use), WQEs, doorbells and CQ polling.

// Access flags (ib_access_flags).
const (
	accLocalWrite  = uint32(hostverbs.AccessLocalWrite)
	accRemoteWrite = uint32(hostverbs.AccessRemoteWrite)
	accRemoteRead  = uint32(hostverbs.AccessRemoteRead)
	accRW          = accLocalWrite | accRemoteWrite | accRemoteRead
)

// createUC binds a user context to UAR page uar (CREATE_UC with its pfn).
func (v *vm) createUC(uar uint32) uint32 {
	v.t.Helper()
	var r abi.CreateUCResp
	r.Decode(v.mustCmd(abi.CmdCreateUC, abi.CreateUC{PFN: uarPFN + uint64(uar)}))
	require.Equal(v.t, uar, r.CtxHandle)
	return r.CtxHandle
}

func (v *vm) createPD(ctx uint32) uint32 {
	v.t.Helper()
	var r abi.CreatePDResp
	r.Decode(v.mustCmd(abi.CmdCreatePD, abi.CreatePD{CtxHandle: ctx}))
	return r.PDHandle
}

func (v *vm) bindGID(index uint32, gid hostverbs.GID) {
	v.t.Helper()
	v.mustCmd(abi.CmdCreateBind, abi.CreateBind{MTU: 1024, VLAN: 0xfff, Index: index, NewGID: gid, GIDType: 2})
}

// gmr is a guest memory region: the IOVA (a user VA) the guest uses and
// the scattered pages behind it.
type gmr struct {
	handle, lkey, rkey uint32
	iova, length       uint64
	pages              []uint64
}

// gpa translates an IOVA inside the MR.
func (m *gmr) gpa(iova uint64) uint64 { return m.pages[iova>>12-m.iova>>12] + iova&0xfff }

// sge names n bytes at byte offset off of the MR.
func (m *gmr) sge(off uint64, n uint32) abi.SGE {
	return abi.SGE{Addr: m.iova + off, Length: n, LKey: m.lkey}
}

func (m *gmr) write(v *vm, off uint64, data []byte) {
	for len(data) > 0 {
		iova := m.iova + off
		n := min(uint64(len(data)), 4096-iova&0xfff)
		copy(v.ram[m.gpa(iova):], data[:n])
		data, off = data[n:], off+n
	}
}

func (m *gmr) read(v *vm, off, n uint64) []byte {
	out := make([]byte, 0, n)
	for n > 0 {
		iova := m.iova + off
		c := min(n, 4096-iova&0xfff)
		out = append(out, v.ram[m.gpa(iova):m.gpa(iova)+c]...)
		n, off = n-c, off+c
	}
	return out
}

// regMR registers length bytes at iova (page offset kept) in pd.
func (v *vm) regMR(pd uint32, iova, length uint64, access uint32) *gmr {
	v.t.Helper()
	span := int((iova+length-1)>>12 - iova>>12 + 1)
	m := &gmr{iova: iova, length: length, pages: v.scattered(span)}
	var r abi.CreateMRResp
	r.Decode(v.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: iova, Length: length, PDirDMA: v.pdir(m.pages),
		PDHandle: pd, AccessFlags: access, NChunks: uint32(span)}))
	m.handle, m.lkey, m.rkey = r.MRHandle, r.LKey, r.RKey
	return m
}

// gcq is a guest CQ: ring state page (rx half: prod_tail at 8 written by
// the device, cons_head at 12 by the guest), CQEs from page 1.
type gcq struct {
	v      *vm
	handle uint32
	n      uint32
	uar    uint32
	pages  []uint64
}

// cqPages is 1 + the pages n CQEs fill (pvrdma_create_cq).
func cqPages(n uint32) int { return 1 + int((uint64(n)*abi.CQESize+4095)/4096) }

func (v *vm) createCQ(ctx, n uint32) *gcq {
	v.t.Helper()
	c := &gcq{v: v, n: n, uar: ctx, pages: v.pages(cqPages(n))}
	var r abi.CreateCQResp
	r.Decode(v.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: v.pdir(c.pages), CtxHandle: ctx, CQE: n,
		NChunks: uint32(len(c.pages))}))
	require.Equal(v.t, n, r.CQE)
	c.handle = r.CQHandle
	return c
}

// poll takes one CQE as pvrdma_poll_one does; false when empty.
func (c *gcq) poll() (abi.CQE, bool) {
	c.v.t.Helper()
	e, ok, err := c.tryPoll()
	require.NoError(c.v.t, err)
	return e, ok
}

// tryPoll is poll for goroutines other than the test's.
func (c *gcq) tryPoll() (abi.CQE, bool, error) {
	state := c.pages[0] + 8
	tail, head := load32(c.v.ram, state), load32(c.v.ram, state+4)
	if !ringValid(tail, c.n) || !ringValid(head, c.n) {
		return abi.CQE{}, false, fmt.Errorf("CQ %d ring state %#x/%#x", c.handle, tail, head)
	}
	if tail == head {
		return abi.CQE{}, false, nil
	}
	off := uint64(head&(c.n-1)) * abi.CQESize
	var e abi.CQE
	e.Decode(c.v.ram[c.pages[1+off/4096]+off%4096:])
	store32(c.v.ram, state+4, ringInc(head, c.n))
	return e, true, nil
}

// wait polls until a CQE arrives. Like rdma-core it writes a POLL
// doorbell when it finds the CQ empty (rate-limited here).
func (c *gcq) wait() abi.CQE {
	c.v.t.Helper()
	deadline := time.Now().Add(irqTimeout)
	var lastPoll time.Time
	for {
		if e, ok := c.poll(); ok {
			return e
		}
		if time.Now().After(deadline) {
			c.v.t.Fatalf("VM %s: CQ %d: no completion within %v", c.v.name, c.handle, irqTimeout)
		}
		if time.Since(lastPoll) > 5*time.Millisecond {
			c.v.doorbell(c.uar, abi.UARCQOffset, abi.UARCQPoll|c.handle)
			lastPoll = time.Now()
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// empty asserts that no CQE is pending.
func (c *gcq) empty() {
	c.v.t.Helper()
	e, ok := c.poll()
	require.False(c.v.t, ok, "CQ %d: unexpected CQE %+v", c.handle, e)
}

func (c *gcq) arm() { c.v.doorbell(c.uar, abi.UARCQOffset, abi.UARCQArm|c.handle) }

// gqp is a guest QP laid out as rdma-core and the kernel do: one page
// directory; page 0 ring states (SQ at 0, RQ at 8), SQ WQEs from page 1,
// RQ WQEs from page 1+send_chunks; strides pow2(80+16*sge) and
// pow2(16+16*sge).
type gqp struct {
	v                *vm
	handle, qpn      uint32
	pages            []uint64
	sendWR, recvWR   uint32
	sendSGE, recvSGE uint32
	sstride, rstride uint32
	sendChunks       int
	uar              uint32
}

// qpSpec is what CREATE_QP carries.
type qpSpec struct {
	pd                               uint32
	scq, rcq                         *gcq
	typ                              hostverbs.QPType
	sendWR, recvWR, sendSGE, recvSGE uint32
	uar                              uint32
}

func pow2(x uint32) uint32 {
	p := uint32(1)
	for p < x {
		p <<= 1
	}
	return p
}

// layoutQP allocates the QP's pages and returns the CREATE_QP request.
func (v *vm) layoutQP(s qpSpec) (*gqp, abi.CreateQP) {
	q := &gqp{v: v, sendWR: s.sendWR, recvWR: s.recvWR, sendSGE: s.sendSGE, recvSGE: s.recvSGE, uar: s.uar}
	q.sstride, q.rstride = pow2(80+16*s.sendSGE), pow2(16+16*s.recvSGE)
	q.sendChunks = int((uint64(s.sendWR)*uint64(q.sstride) + 4095) / 4096)
	recvPages := int((uint64(s.recvWR)*uint64(q.rstride) + 4095) / 4096)
	q.pages = v.pages(1 + q.sendChunks + recvPages)
	return q, abi.CreateQP{PDirDMA: v.pdir(q.pages), PDHandle: s.pd, SendCQHandle: s.scq.handle, RecvCQHandle: s.rcq.handle,
		MaxSendWR: s.sendWR, MaxRecvWR: s.recvWR, MaxSendSGE: s.sendSGE, MaxRecvSGE: s.recvSGE,
		QPType: uint8(s.typ), AccessFlags: accLocalWrite,
		TotalChunks: uint16(len(q.pages)), SendChunks: uint16(q.sendChunks)}
}

func (v *vm) createQP(s qpSpec) *gqp {
	v.t.Helper()
	q, req := v.layoutQP(s)
	var r abi.CreateQPResp
	r.Decode(v.mustCmd(abi.CmdCreateQP, req))
	q.handle, q.qpn = r.QPHandle, r.QPN
	return q
}

func (q *gqp) sqState() uint64 { return q.pages[0] }
func (q *gqp) rqState() uint64 { return q.pages[0] + 8 }

// sqConsumed and rqConsumed are the device's cons_head of each ring.
func (q *gqp) sqConsumed() uint32 { return load32(q.v.ram, q.sqState()+4) }
func (q *gqp) rqConsumed() uint32 { return load32(q.v.ram, q.rqState()+4) }

func (q *gqp) sqWQE(idx uint32) uint64 {
	off := uint64(idx&(q.sendWR-1)) * uint64(q.sstride)
	return q.pages[1+off/4096] + off%4096
}

func (q *gqp) rqWQE(idx uint32) uint64 {
	off := uint64(idx&(q.recvWR-1)) * uint64(q.rstride)
	return q.pages[1+q.sendChunks+int(off/4096)] + off%4096
}

// writeSend writes a send WQE at prod_tail and advances it (no doorbell);
// it returns the WQE's address.
func (q *gqp) writeSend(h abi.SQWQEHdr, sges ...abi.SGE) uint64 {
	ram := q.v.ram
	tail := load32(ram, q.sqState())
	gpa := q.sqWQE(tail)
	h.NumSGE = uint32(len(sges))
	h.Encode(ram[gpa:])
	for i, s := range sges {
		s.Encode(ram[gpa+abi.SQWQEHdrSize+uint64(i)*abi.SGESize:])
	}
	store32(ram, q.sqState(), ringInc(tail, q.sendWR))
	return gpa
}

// ringSend and ringRecv are the provider's doorbells.
func (q *gqp) ringSend() { q.v.doorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle) }
func (q *gqp) ringRecv() { q.v.doorbell(q.uar, abi.UARQPOffset, abi.UARQPRecv|q.handle) }

func (q *gqp) postSend(h abi.SQWQEHdr, sges ...abi.SGE) {
	q.writeSend(h, sges...)
	q.ringSend()
}

func (q *gqp) writeRecv(wrid uint64, sges ...abi.SGE) uint64 {
	ram := q.v.ram
	tail := load32(ram, q.rqState())
	gpa := q.rqWQE(tail)
	abi.RQWQEHdr{WRID: wrid, NumSGE: uint32(len(sges))}.Encode(ram[gpa:])
	for i, s := range sges {
		s.Encode(ram[gpa+abi.RQWQEHdrSize+uint64(i)*abi.SGESize:])
	}
	store32(ram, q.rqState(), ringInc(tail, q.recvWR))
	return gpa
}

func (q *gqp) postRecv(wrid uint64, sges ...abi.SGE) {
	q.writeRecv(wrid, sges...)
	q.ringRecv()
}

func (q *gqp) modify(mask hostverbs.AttrMask, a abi.QPAttr) result {
	return q.v.post(abi.CmdModifyQP, abi.ModifyQP{QPHandle: q.handle, AttrMask: uint32(mask), Attrs: a})
}

func (q *gqp) mustModify(mask hostverbs.AttrMask, a abi.QPAttr) {
	q.v.t.Helper()
	q.v.mustCmd(abi.CmdModifyQP, abi.ModifyQP{QPHandle: q.handle, AttrMask: uint32(mask), Attrs: a})
}

// toRTS takes an RC QP through INIT, RTR and RTS with ibv_rc_pingpong's
// masks (as seen from bookworm's), addressing the peer.
func (q *gqp) toRTS(destQPN uint32, dgid hostverbs.GID) { q.toRTSRetry(destQPN, dgid, 12, 7) }

// toRTSRetry is toRTS with the responder's RNR timer code and the
// requester's RNR retry count (7 retries forever, IBA 9.7.5.2.8).
func (q *gqp) toRTSRetry(destQPN uint32, dgid hostverbs.GID, rnrTimer, rnrRetry uint8) {
	q.toRTSPath(destQPN, dgid, defaultPath, rnrTimer, rnrRetry)
}

// rcPath is the part of an RC QP's RTR attributes that applications and
// the guest's network stack choose: the path MTU (ibv_rc_pingpong's 1024,
// or the port's active MTU as perftest takes), the GRH's traffic class
// (DSCP << 2) and the destination MAC, which the guest kernel resolves from
// the peer's GID through its own ARP or ND (ib_resolve_eth_dmac). The fake
// VMs have no NIC, so whoever connects them supplies the MAC their peer
// was registered with; only L2 mode puts it on the wire.
type rcPath struct {
	mtu    hostverbs.MTU
	tclass uint8
	dmac   [6]byte
}

// defaultPath is ibv_rc_pingpong's: MTU 1024, traffic class 0.
var defaultPath = rcPath{mtu: hostverbs.MTU1024}

// qpHopLimit is the GRH hop limit (IPv4 TTL) of every QP's path.
const qpHopLimit = 64

// toRTSPath is toRTSRetry on path p.
func (q *gqp) toRTSPath(destQPN uint32, dgid hostverbs.GID, p rcPath, rnrTimer, rnrRetry uint8) {
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1, AccessFlags: accRW})
	q.mustModify(0x129181, abi.QPAttr{State: 2, PathMTU: uint32(p.mtu), DestQPNum: destQPN, MaxDestRdAtomic: 4, MinRNRTimer: rnrTimer,
		AH: abi.AHAttr{DGID: dgid, SGIDIndex: 0, HopLimit: qpHopLimit, TrafficClass: p.tclass, Flags: abi.AHFlagGRH, PortNum: 1, DMAC: p.dmac}})
	q.mustModify(0x12e01, abi.QPAttr{State: 3, Timeout: 14, RetryCnt: 7, RNRRetry: rnrRetry, MaxRdAtomic: 4})
}

// state queries the QP's state (QUERY_QP).
func (q *gqp) state() hostverbs.QPState {
	q.v.t.Helper()
	var r abi.QueryQPResp
	r.Decode(q.v.mustCmd(abi.CmdQueryQP, abi.QueryQP{QPHandle: q.handle, AttrMask: 1}))
	return hostverbs.QPState(r.Attrs.State)
}

// endpoint is a booted VM with one RC QP ready to be connected: GID bound
// at index 0, a user context on UAR page 1, a PD, send and receive CQs and
// a 64 KiB MR with local and remote access.
type endpoint struct {
	v        *vm
	gid      hostverbs.GID
	uc, pd   uint32
	scq, rcq *gcq
	mr       *gmr
	qp       *gqp
	// mac is the MAC of the VM's NIC, to which a peer's ARP resolves
	// gid (connectRCPath): what it was registered with in L2 mode,
	// zero where no wire looks at it.
	mac [6]byte
}

const (
	mrIOVA  = 0x7f3a_1234_5000 // a user VA
	mrBytes = 64 << 10
	qpDepth = 32
)

func gidFor(n byte) hostverbs.GID { return gidV4(netip.AddrFrom4([4]byte{10, 77, 0, n})) }

// gidV4 is the IPv4-mapped GID (::ffff:a.b.c.d) of IPv4 address a, as
// the driver binds a guest's IPv4 address.
func gidV4(a netip.Addr) hostverbs.GID { return hostverbs.GID(netip.AddrFrom4(a.As4()).As16()) }

// endpoint boots VM name and creates its objects, its GID gidFor(n).
func (e *env) endpoint(name string, n byte) *endpoint {
	e.t.Helper()
	return e.endpointGID(name, gidFor(n))
}

// endpointGID is endpoint with GID gid.
func (e *env) endpointGID(name string, gid hostverbs.GID) *endpoint {
	e.t.Helper()
	v := e.boot(name)
	p := &endpoint{v: v, gid: gid}
	v.bindGID(0, p.gid)
	p.uc = v.createUC(1)
	p.pd = v.createPD(p.uc)
	p.scq, p.rcq = v.createCQ(p.uc, 64), v.createCQ(p.uc, 64)
	p.mr = v.regMR(p.pd, mrIOVA, mrBytes, accRW)
	p.qp = p.rcQP(p.scq, p.rcq)
	return p
}

// rcQP creates an RC QP of qpDepth WRs and two SGEs each way in p's PD on
// the given CQs.
func (p *endpoint) rcQP(scq, rcq *gcq) *gqp {
	p.v.t.Helper()
	return p.v.createQP(qpSpec{pd: p.pd, scq: scq, rcq: rcq, typ: hostverbs.QPTypeRC,
		sendWR: qpDepth, recvWR: qpDepth, sendSGE: 2, recvSGE: 2, uar: p.uc})
}

// queryPort is QUERY_PORT of port 1.
func (v *vm) queryPort() abi.PortAttr {
	v.t.Helper()
	var r abi.QueryPortResp
	r.Decode(v.mustCmd(abi.CmdQueryPort, abi.QueryPort{PortNum: 1}))
	return r.Attrs
}

// pair boots two endpoints and connects their QPs.
func (e *env) pair(a, b string) (*endpoint, *endpoint) { return e.pairRetry(a, b, 12, 7) }

// pairRetry is pair with an RNR timer and retry count.
func (e *env) pairRetry(a, b string, rnrTimer, rnrRetry uint8) (*endpoint, *endpoint) {
	e.t.Helper()
	return e.pairGIDs(a, b, 1, 2, rnrTimer, rnrRetry)
}

// pairGIDs is pairRetry with the endpoints' GIDs gidFor(na) and
// gidFor(nb). A GID stays reserved to the first VM that binds it, so
// different VMs need different GIDs within one daemon.
func (e *env) pairGIDs(a, b string, na, nb byte, rnrTimer, rnrRetry uint8) (*endpoint, *endpoint) {
	e.t.Helper()
	pa, pb := e.endpoint(a, na), e.endpoint(b, nb)
	connectRC(pa, pb, rnrTimer, rnrRetry)
	return pa, pb
}

// connectRC connects the QPs of a and b, which may be VMs of different
// daemons: each QP learns the other's QPN and GID (as an application
// exchanges them out of band) and goes to RTS.
func connectRC(a, b *endpoint, rnrTimer, rnrRetry uint8) {
	connectRCPath(a, b, defaultPath.mtu, defaultPath.tclass, rnrTimer, rnrRetry)
}

// connectRCPath is connectRC with path MTU mtu and traffic class tclass
// both ways; each QP's destination MAC is the other endpoint's mac.
func connectRCPath(a, b *endpoint, mtu hostverbs.MTU, tclass uint8, rnrTimer, rnrRetry uint8) {
	a.qp.toRTSPath(b.qp.qpn, b.gid, rcPath{mtu: mtu, tclass: tclass, dmac: b.mac}, rnrTimer, rnrRetry)
	b.qp.toRTSPath(a.qp.qpn, a.gid, rcPath{mtu: mtu, tclass: tclass, dmac: a.mac}, rnrTimer, rnrRetry)
}

func (p *endpoint) Close() { p.v.Close() }

// loopPair creates two RC QPs in p's VM connected to each other through
// the VM's own GID (the fabric loops them back), on p's CQs.
func (p *endpoint) loopPair() (*gqp, *gqp) { return p.loopPair2(p.scq, p.rcq) }

// loopPair2 is loopPair on the given send and receive CQs.
func (p *endpoint) loopPair2(scq, rcq *gcq) (*gqp, *gqp) {
	p.v.t.Helper()
	a, b := p.rcQP(scq, rcq), p.rcQP(scq, rcq)
	a.toRTS(b.qpn, p.gid)
	b.toRTS(a.qpn, p.gid)
	return a, b
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>8)
	}
	return b
}

// sendWQE and writeWQE build signaled SEND and RDMA WRITE headers.
func sendWQE(wrid uint64) abi.SQWQEHdr {
	return abi.SQWQEHdr{WRID: wrid, Opcode: uint32(hostverbs.WRSend), SendFlags: uint32(hostverbs.SendSignaled)}
}

func writeWQE(wrid, raddr uint64, rkey uint32) abi.SQWQEHdr {
	h := abi.SQWQEHdr{WRID: wrid, Opcode: uint32(hostverbs.WRRDMAWrite), SendFlags: uint32(hostverbs.SendSignaled)}
	abi.WRRDMA{RemoteAddr: raddr, RKey: rkey}.Encode(h.WR[:])
	return h
}

// requireCQE checks a completion's identity and status.
func requireCQE(t testing.TB, e abi.CQE, q *gqp, wrid uint64, op hostverbs.WCOpcode, st hostverbs.WCStatus) {
	t.Helper()
	require.Equal(t, wrid, e.WRID, "wr_id of %+v", e)
	require.EqualValues(t, q.handle, e.QP, "qp of %+v", e)
	require.EqualValues(t, op, e.Opcode, "opcode of %+v", e)
	require.EqualValues(t, st, e.Status, "status of %+v", e)
}

// exchange runs an RC SEND from a to b and an RDMA WRITE from a into b's
// MR, checking both CQEs and the bytes that arrived.
func exchange(t testing.TB, a, b *endpoint) {
	t.Helper()
	msg := pattern(3000, 0x11)
	a.mr.write(a.v, 0x100, msg)
	b.qp.postRecv(0xb001, b.mr.sge(0x10, 2000), b.mr.sge(0x3000, 2000))
	a.qp.postSend(sendWQE(0xa001), a.mr.sge(0x100, uint32(len(msg))))
	requireCQE(t, a.scq.wait(), a.qp, 0xa001, hostverbs.WCSend, hostverbs.WCSuccess)
	rc := b.rcq.wait()
	requireCQE(t, rc, b.qp, 0xb001, hostverbs.WCRecv, hostverbs.WCSuccess)
	require.EqualValues(t, len(msg), rc.ByteLen)
	require.Equal(t, a.qp.qpn, rc.SrcQP)
	got := append(b.mr.read(b.v, 0x10, 2000), b.mr.read(b.v, 0x3000, 1000)...)
	require.True(t, bytes.Equal(msg, got), "SEND payload differs")

	data := pattern(10000, 0x5a) // spans three of b's scattered pages
	a.mr.write(a.v, 0x2000, data)
	a.qp.postSend(writeWQE(0xa002, b.mr.iova+0x4321, b.mr.rkey), a.mr.sge(0x2000, 6000), a.mr.sge(0x2000+6000, 4000))
	requireCQE(t, a.scq.wait(), a.qp, 0xa002, hostverbs.WCRDMAWrite, hostverbs.WCSuccess)
	require.True(t, bytes.Equal(data, b.mr.read(b.v, 0x4321, uint64(len(data)))), "RDMA WRITE payload differs")
	a.scq.empty()
	b.rcq.empty()
}
