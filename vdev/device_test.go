package vdev

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

func TestPCIDescription(t *testing.T) {
	p := PCI()
	assert.EqualValues(t, 0x15ad, p.VendorID)
	assert.EqualValues(t, 0x0820, p.DeviceID)
	assert.EqualValues(t, 0x028000, p.ClassCode)
	assert.Equal(t, 1, p.Function)
	assert.EqualValues(t, 16<<10, p.BARs[0].Size)
	assert.EqualValues(t, 4<<10, p.BARs[1].Size)
	assert.EqualValues(t, 2<<20, p.BARs[2].Size)
	assert.True(t, p.BARs[2].Is64Bit)
	assert.Equal(t, MSIXInfo{Vectors: 3, BAR: 0, TableOffset: 0, PBAOffset: 0x2000}, p.MSIX)
	assert.Equal(t, uint64(p.BARs[2].Size/abi.UARPageSize), uint64(UARPages))
}

func TestProbeAndCaps(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	c := g.caps
	assert.EqualValues(t, 0x15ad, c.VendorID)
	assert.EqualValues(t, 0x0820, c.VendorPartID)
	assert.EqualValues(t, 512, c.MaxUAR, "2 MiB of UAR pages, a power of two")
	assert.EqualValues(t, 0x505400fffe123456, c.NodeGUID)
	assert.Equal(t, []byte{0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56}, g.bytes(g.dsr+abi.DSRCapsOffset+8, 8))
	// Smallest of provider and limits, powers of two where the driver rounds.
	assert.EqualValues(t, 256, c.MaxQP, "provider 256 < limit 1024")
	assert.EqualValues(t, 4096, c.MaxQPWR, "limit 4096 < provider 8192")
	assert.EqualValues(t, 8, c.MaxSGE)
	assert.EqualValues(t, 16384, c.MaxCQE)
	assert.EqualValues(t, 128, c.MaxSRQ)
	assert.EqualValues(t, 16, c.GIDTblLen)
	assert.EqualValues(t, abi.AtomicOpCompSwap|abi.AtomicOpFetchAdd, c.AtomicOps)
	assert.EqualValues(t, abi.BMMEFlagLocalInv|abi.BMMEFlagRemoteInv|abi.BMMEFlagFastRegWR, c.BMMEFlags,
		"the provider has fast registration: all three bits (the driver then sets MEM_MGT_EXTENSIONS)")
	assert.EqualValues(t, 128, c.MaxFastRegPageListLen, "provider 256, the ABI's page list at most 128")
	// The SRQ caps where the prototype slipped.
	assert.EqualValues(t, 128, g.u32(g.dsr+248))
	assert.EqualValues(t, 4096, g.u32(g.dsr+252))
	assert.EqualValues(t, 8, g.u32(g.dsr+256))
	// Activation announces the active port on the async ring, vector 1.
	assert.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventPortActive), Info: 1}}, g.events())
	assert.EqualValues(t, 1, g.irq.count(abi.VectorAsync))
}

func TestComputeCapsRounding(t *testing.T) {
	a := newFakeVerbs().attr
	a.MaxQPWR, a.MaxCQE, a.MaxSGE, a.MaxSRQWR, a.MaxSRQSGE = 1000, 3000, 6, 100, 3
	c := computeCaps(a, Limits{}.withDefaults(), testMAC)
	assert.EqualValues(t, 512, c.MaxQPWR)
	assert.EqualValues(t, 2048, c.MaxCQE)
	assert.EqualValues(t, 4, c.MaxSGE)
	assert.EqualValues(t, 64, c.MaxSRQWR)
	assert.EqualValues(t, 2, c.MaxSRQSGE)
	a.MaxSRQ = 0
	assert.Zero(t, computeCaps(a, Limits{}.withDefaults(), testMAC).MaxSRQ)
	a = newFakeVerbs().attr
	a.AtomicCap = hostverbs.AtomicNone
	a.MaxQP = 1 << 30
	c = computeCaps(a, Limits{MaxQP: 1 << 30}.withDefaults(), [6]byte{})
	assert.Zero(t, c.AtomicOps)
	assert.EqualValues(t, 1<<16, c.MaxQP, "QP handles must fit qp & 0xFFFF")
	assert.Equal(t, a.NodeGUID, c.NodeGUID, "no MAC: provider GUID")
}

func TestRegisters(t *testing.T) {
	g := newGuest(t, newFakeVerbs(), Limits{})
	assert.EqualValues(t, 20, g.readReg(abi.RegVersion))
	assert.EqualValues(t, 0xFFFF, g.readReg(abi.RegErr), "ERR reads nonzero before activation")
	assert.EqualValues(t, 0xFFFFFFFF, g.readReg(abi.RegIMR), "interrupts masked at reset")
	assert.EqualValues(t, 0x12005452, g.readReg(abi.RegMACL))
	assert.EqualValues(t, 0x5634, g.readReg(abi.RegMACH))
	require.NoError(t, g.writeReg(abi.RegMACL, 0x11223344))
	assert.EqualValues(t, 0x11223344, g.readReg(abi.RegMACL))
	require.NoError(t, g.writeReg(abi.RegVersion, 99), "read-only registers ignore writes")
	assert.EqualValues(t, 20, g.readReg(abi.RegVersion))

	// Every offset of every BAR answers a read of every size, and never
	// panics (CVE-2018-20191).
	for bar, size := range map[int]uint64{0: BAR0Size, 1: BAR1Size, 2: BAR2Size} {
		for off := uint64(0); off < size; off += 4093 {
			for _, n := range []int{1, 2, 4, 8} {
				p := make([]byte, n)
				if off+uint64(n) > size {
					assert.ErrorIs(t, g.dev.ReadBAR(bar, off, p), ErrAccess)
					continue
				}
				require.NoError(t, g.dev.ReadBAR(bar, off, p), "BAR%d %#x+%d", bar, off, n)
				if bar == abi.UARBAR {
					assert.Equal(t, byte(0xff), p[0])
				}
			}
		}
	}
	var b [8]byte
	require.NoError(t, g.dev.ReadBAR(abi.RegsBAR, 0, b[:]))
	assert.EqualValues(t, 20, binary.LittleEndian.Uint32(b[:]))
	require.NoError(t, g.dev.ReadBAR(abi.RegsBAR, 1, b[:2]), "unaligned reads are answered from the same view")
	assert.ErrorIs(t, g.dev.ReadBAR(3, 0, b[:4]), ErrAccess)
	assert.ErrorIs(t, g.dev.ReadBAR(-1, 0, b[:4]), ErrAccess)
	assert.ErrorIs(t, g.dev.ReadBAR(abi.RegsBAR, BAR1Size, b[:4]), ErrAccess)
	assert.ErrorIs(t, g.dev.ReadBAR(abi.RegsBAR, ^uint64(0)-1, b[:4]), ErrAccess, "offset overflow")
	assert.ErrorIs(t, g.dev.WriteBAR(abi.RegsBAR, 2, b[:4]), ErrAccess)
	assert.ErrorIs(t, g.dev.WriteBAR(abi.RegsBAR, 0, b[:2]), ErrAccess)
	assert.ErrorIs(t, g.dev.WriteBAR(abi.UARBAR, BAR2Size, b[:4]), ErrAccess)
	require.NoError(t, g.dev.WriteBAR(abi.MSIXBAR, MSIXPBA, b[:4]), "PBA writes are dropped")
	require.NoError(t, g.dev.WriteBAR(abi.UARBAR, 12, b[:4]), "unknown UAR offsets are ignored")
	assert.Positive(t, g.dev.Stats().BadDoorbells)

	// ICR is read-to-clear; a pending response hides the other causes
	// (the driver's INTx handler completes commands only on ICR == 1).
	g.dev.raise(abi.VectorCQ)
	assert.EqualValues(t, 4, g.readReg(abi.RegICR))
	assert.EqualValues(t, 0, g.readReg(abi.RegICR))
	g.dev.raise(abi.VectorCQ)
	g.dev.raise(abi.VectorResponse)
	assert.EqualValues(t, 1, g.readReg(abi.RegICR))
	assert.EqualValues(t, 0, g.irq.count(abi.VectorCQ), "IMR masks every vector")
	require.NoError(t, g.writeReg(abi.RegIMR, 0))
	g.dev.raise(abi.VectorCQ)
	assert.EqualValues(t, 1, g.irq.count(abi.VectorCQ))

	require.NoError(t, g.dev.Close())
	assert.ErrorIs(t, g.dev.WriteBAR(abi.RegsBAR, abi.RegIMR, b[:4]), ErrClosed)
	assert.ErrorIs(t, g.dev.ReadBAR(abi.RegsBAR, abi.RegErr, b[:4]), ErrClosed)
}

func TestCommandsBeforeDSR(t *testing.T) {
	// CVE-2022-1050: a guest issuing commands before the DSR (and so the
	// command and response slots) exists gets an error, not a crash.
	g := newGuest(t, newFakeVerbs(), Limits{})
	require.NoError(t, g.writeReg(abi.RegIMR, 0))
	require.NoError(t, g.writeReg(abi.RegRequest, 0))
	assert.EqualValues(t, syscall.EFAULT, g.readReg(abi.RegErr))
	assert.EqualValues(t, 1, g.irq.count(abi.VectorResponse), "the interrupt the driver waits for still comes")
	require.NoError(t, g.writeReg(abi.RegCtl, abi.CtlActivate))
	assert.NotZero(t, g.readReg(abi.RegErr), "ACTIVATE without a DSR fails")
	g.doorbell(0, abi.UARQPOffset, abi.UARQPSend)
	g.doorbell(0, abi.UARCQOffset, abi.UARCQPoll)
	assert.EqualValues(t, 2, g.dev.Stats().BadDoorbells)
	require.NoError(t, g.writeReg(abi.RegCtl, 7))
	assert.EqualValues(t, syscall.EINVAL, g.readReg(abi.RegErr))
}

func TestUnknownCommand(t *testing.T) {
	g := probedGuest(t, newFakeVerbs())
	for _, code := range []uint32{abi.NumCmds, 0x80000000, 0xffffffff} {
		errReg, _ := g.cmd(code, nil)
		assert.EqualValues(t, syscall.EINVAL, errReg)
	}
	assert.EqualValues(t, 3, g.dev.Stats().CommandErrors)
}

func TestQueryPortAndPKey(t *testing.T) {
	g := probedGuest(t, newFakeVerbs())
	var r abi.QueryPortResp
	r.Decode(g.mustCmd(abi.CmdQueryPort, abi.QueryPort{PortNum: 1}))
	assert.EqualValues(t, hostverbs.PortActive, r.Attrs.State)
	assert.EqualValues(t, 16, r.Attrs.GIDTblLen, "the GID table the guest gets, not the provider's")
	assert.EqualValues(t, 1, r.Attrs.PKeyTblLen)
	assert.EqualValues(t, 5, r.Attrs.PhysState)
	assert.EqualValues(t, hostverbs.MTU1024, r.Attrs.ActiveMTU)
	errReg, _ := g.cmd(abi.CmdQueryPort, abi.QueryPort{PortNum: 2})
	assert.EqualValues(t, syscall.EINVAL, errReg)

	var pk abi.QueryPKeyResp
	pk.Decode(g.mustCmd(abi.CmdQueryPKey, abi.QueryPKey{PortNum: 1, Index: 0}))
	assert.EqualValues(t, 0xFFFF, pk.PKey)
	errReg, _ = g.cmd(abi.CmdQueryPKey, abi.QueryPKey{PortNum: 1, Index: 1})
	assert.NotZero(t, errReg)
}

func TestUserContexts(t *testing.T) {
	g := probedGuest(t, newFakeVerbs())
	assert.EqualValues(t, 1, g.createUC(1), "context handle = UAR page index")
	assert.EqualValues(t, 7, g.createUC(7))
	for _, pfn := range []uint64{uarPFN, uarPFN + 1, uarPFN + 512, uarPFN - 1, 0, ^uint64(0)} {
		errReg, rsp := g.cmd(abi.CmdCreateUC, abi.CreateUC{PFN: pfn})
		assert.NotZero(t, errReg, "pfn %#x", pfn)
		var h abi.RespHdr
		h.Decode(rsp)
		assert.EqualValues(t, abi.RespFlag|abi.CmdCreateUC, h.Ack)
		assert.NotZero(t, h.Err)
	}
	g.mustCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: 1})
	assert.EqualValues(t, 1, g.createUC(1), "index reused after DESTROY_UC")
	errReg, _ := g.cmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: 3})
	assert.NotZero(t, errReg)
	errReg, _ = g.cmd(abi.CmdCreatePD, abi.CreatePD{CtxHandle: 3})
	assert.NotZero(t, errReg, "PD in a context that does not exist")
}

func TestGIDBinding(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	ll := hostverbs.GID{0: 0xfe, 1: 0x80, 8: 0x50, 9: 0x54, 11: 0xff, 12: 0xfe, 13: 0x12, 14: 0x34, 15: 0x56}
	v4 := hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 0, 14: 2, 15: 15}
	g.bindGID(0, ll)
	g.bindGID(1, v4)
	assert.Equal(t, hostverbs.GIDEntry{GID: v4, Type: hostverbs.GIDTypeRoCEv2}, fv.gids[1])
	assert.Equal(t, []gidEvent{{0, hostverbs.GIDEntry{GID: ll, Type: 2}, true}, {1, hostverbs.GIDEntry{GID: v4, Type: 2}, true}}, g.gotGID)
	assert.Equal(t, v4, g.dev.GIDs()[1].GID)

	for _, bad := range []abi.CreateBind{
		{Index: 16, NewGID: ll, GIDType: 2},
		{Index: 0xffffffff, NewGID: ll, GIDType: 2},
		{Index: 2, NewGID: ll, GIDType: 3},
		{Index: 2, NewGID: hostverbs.GID{}, GIDType: 2},
	} {
		errReg, _ := g.cmd(abi.CmdCreateBind, bad)
		assert.NotZero(t, errReg, "%+v", bad)
	}
	errReg, _ := g.cmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 1, DestGID: ll})
	assert.NotZero(t, errReg, "wrong GID for the index")
	errReg, _ = g.cmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 5, DestGID: ll})
	assert.NotZero(t, errReg, "unbound index")
	g.mustCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 1, DestGID: v4})
	_, bound := fv.gids[1]
	assert.False(t, bound)
	assert.Equal(t, gidEvent{1, hostverbs.GIDEntry{GID: v4, Type: 2}, false}, g.gotGID[2])

	fv.failNext("SetGID", hostverbs.ErrInvalid)
	errReg, _ = g.cmd(abi.CmdCreateBind, abi.CreateBind{Index: 3, NewGID: v4, GIDType: 2})
	assert.EqualValues(t, syscall.EINVAL, errReg)
	assert.False(t, g.dev.GIDs()[3].GID != hostverbs.GID{}, "a refused bind is not recorded")
}

// TestKernelGSIProbe replays what ib_core's MAD agent does at probe (as
// seen from the 6.1 driver): PD, DMA MR, CQ of 1024 in 17 pages, the GSI QP
// (wr 128/512, sge 2/1, 9 pages with 4 send pages), three MODIFY_QPs, an
// ARM and 512 single-WQE RECV doorbells.
func TestKernelGSIProbe(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	pd := g.createPD(0)
	var mr abi.CreateMRResp
	mr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, AccessFlags: 1, Flags: abi.MRFlagDMA}))
	cq := g.createCQ(0, 1024)
	require.Len(t, cq.pages, 17)
	cq.arm(abi.UARCQArm)
	q := g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeGSI, sendWR: 128, recvWR: 512, sendSGE: 2, recvSGE: 1, sigAll: true})
	assert.EqualValues(t, 1, q.qpn, "the GSI QP is QPN 1")
	assert.Len(t, q.pages, 9)
	assert.Equal(t, 4, q.sendChunks)
	q.mustModify(0x51, abi.QPAttr{State: 1, PKeyIndex: 0, QKey: 0x80010000})
	q.mustModify(0x1, abi.QPAttr{State: 2})
	q.mustModify(0x10001, abi.QPAttr{State: 3})
	for i := 0; i < 512; i++ {
		q.postRecv(uint64(0xffff888000000000)+uint64(i), abi.SGE{Addr: 0x2000000 + uint64(i)*296, Length: 296, LKey: mr.LKey})
	}
	fq := fv.qps[0]
	assert.Equal(t, hostverbs.QPTypeGSI, fq.init.Type)
	assert.True(t, fq.init.SigAll)
	_, recvs := fq.take()
	require.Len(t, recvs, 512)
	assert.Equal(t, hostverbs.SGE{Addr: 0x2000000 + 511*296, Length: 296, LKey: mr.LKey}, recvs[511].SGL[0])
	assert.EqualValues(t, 0, q.rqConsumed(), "all 512 posted, none completed: the ring is full of outstanding work")
	assert.Equal(t, 512, fq.outstanding(true))

	// A CM MAD sent on QP1: 2 SGEs in the DMA MR, UD AV to the peer.
	g.bindGID(1, hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 15: 1})
	var h abi.SQWQEHdr
	h.Opcode, h.SendFlags, h.WRID = uint32(hostverbs.WRSend), uint32(hostverbs.SendSignaled), 0xffff888011112222
	peer := hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 15: 2}
	abi.WRUD{RemoteQPN: 1, RemoteQKey: 0x80010000, AV: abi.AV{PortPD: 0x01000000 | pd, SLTClassFlowLabel: 0x3c90a,
		DGID: peer, SrcPathBits: 0x80, GIDIndex: 1, HopLimit: 64, DMAC: [6]byte{0x52, 0x54, 0, 0x77, 0, 2}}}.Encode(h.WR[:])
	q.postSend(h, abi.SGE{Addr: 0x3000000, Length: 24, LKey: mr.LKey}, abi.SGE{Addr: 0x3000018, Length: 232, LKey: mr.LKey})
	sends, _ := fq.take()
	require.Len(t, sends, 1)
	s := sends[0]
	assert.Equal(t, hostverbs.WRSend, s.Opcode)
	assert.EqualValues(t, 1, s.RemoteQPN)
	assert.EqualValues(t, 0x80010000, s.RemoteQKey)
	assert.Equal(t, peer, s.AV.DGID)
	assert.EqualValues(t, 1, s.AV.SGIDIndex)
	assert.EqualValues(t, 64, s.AV.HopLimit)
	assert.EqualValues(t, 0x3c90a, s.AV.FlowLabel)
	assert.EqualValues(t, 1, s.AV.Port)
	assert.Len(t, s.SGL, 2)
}

func TestLimitsAndHandles(t *testing.T) {
	fv := newFakeVerbs()
	g := newGuest(t, fv, Limits{MaxPD: 2, MaxCQ: 2, MaxQP: 2, MaxMR: 3, MaxMRBytes: 64 << 10})
	g.probe()
	require.EqualValues(t, 2, g.caps.MaxPD)
	pd0, pd1 := g.createPD(0), g.createPD(0)
	assert.Equal(t, []uint32{0, 1}, []uint32{pd0, pd1}, "handles start at 0, below max_pd")
	errReg, rsp := g.cmd(abi.CmdCreatePD, abi.CreatePD{})
	assert.EqualValues(t, syscall.ENOMEM, errReg, "over the quota: an error status, not host exhaustion")
	var h abi.RespHdr
	h.Decode(rsp)
	assert.EqualValues(t, syscall.ENOMEM, h.Err)
	assert.Equal(t, 2, fv.count("pd"), "no provider PD leaked by the refused command")
	g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd0})
	assert.EqualValues(t, 0, g.createPD(0), "lowest free handle reused")

	m := g.regMR(pd1, 0x7f0000000000, 48<<10, 1)
	errReg, _ = g.cmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x10000, Length: 32 << 10, PDHandle: pd1, AccessFlags: 1,
		NChunks: 8, PDirDMA: g.pdir(g.pages(8))})
	assert.EqualValues(t, syscall.ENOMEM, errReg, "registered-bytes quota")
	g.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: m.handle})
	g.regMR(pd1, 0x10000, 32<<10, 1)

	cq1, cq2 := g.createCQ(0, 16), g.createCQ(0, 16)
	errReg, _ = g.cmd(abi.CmdCreateCQ, abi.CreateCQ{CQE: 16, NChunks: 2, PDirDMA: g.pdir(g.pages(2))})
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	assert.Equal(t, 2, fv.count("cq"))
	spec := qpSpec{pd: pd1, scq: cq1, rcq: cq2, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1}
	g.createQP(spec)
	g.createQP(spec)
	_, errReg = g.tryCreateQP(spec)
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	assert.Equal(t, 2, fv.count("qp"))
	errReg, _ = g.cmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: cq1.handle})
	assert.EqualValues(t, syscall.EBUSY, errReg, "CQ in use by QPs")
	errReg, _ = g.cmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd1})
	assert.EqualValues(t, syscall.EBUSY, errReg, "PD in use")
}

func TestProviderFailuresLeakNothing(t *testing.T) {
	// CVE-2018-20123/20126 class: every error path releases what it took.
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	fv.failNext("AllocPD", hostverbs.ErrNoResources)
	errReg, _ := g.cmd(abi.CmdCreatePD, abi.CreatePD{})
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	pd := g.createPD(0)
	assert.EqualValues(t, 0, pd, "the failed PD's handle was released")

	fv.failNext("CreateCQ", hostverbs.ErrInvalid)
	errReg, _ = g.cmd(abi.CmdCreateCQ, abi.CreateCQ{CQE: 16, NChunks: 2, PDirDMA: g.pdir(g.pages(2))})
	assert.EqualValues(t, syscall.EINVAL, errReg)
	cq := g.createCQ(0, 16)
	assert.EqualValues(t, 0, cq.handle)

	fv.failNext("RegMR", hostverbs.ErrNoResources)
	errReg, _ = g.cmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x1000, Length: 4096, PDHandle: pd, AccessFlags: 1, NChunks: 1, PDirDMA: g.pdir(g.pages(1))})
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	assert.EqualValues(t, 0, g.regMR(pd, 0x1000, 4096, 1).handle)

	fv.failNext("CreateQP", hostverbs.ErrNoResources)
	spec := qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1}
	_, errReg = g.tryCreateQP(spec)
	assert.EqualValues(t, syscall.ENOMEM, errReg)
	q := g.createQP(spec)
	assert.EqualValues(t, 0, q.handle)
	assert.Equal(t, 1, fv.count("qp"))
	errReg, _ = g.cmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd})
	assert.EqualValues(t, syscall.EBUSY, errReg, "refcounts survived the failures exactly")

	fv.failNext("Modify", hostverbs.ErrInvalid)
	errReg, h := q.modify(0x39, abi.QPAttr{State: 1, PortNum: 1})
	assert.EqualValues(t, syscall.EINVAL, errReg)
	assert.EqualValues(t, syscall.EINVAL, h.Err, "MODIFY_QP reports in the response too")
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1})
}

func TestBadHandles(t *testing.T) {
	g := probedGuest(t, newFakeVerbs())
	for _, c := range []struct {
		code uint32
		req  encoder
	}{
		{abi.CmdDestroyPD, abi.DestroyPD{PDHandle: 5}},
		{abi.CmdCreateMR, abi.CreateMR{PDHandle: 9, Flags: abi.MRFlagDMA}},
		{abi.CmdDestroyMR, abi.DestroyMR{MRHandle: 0}},
		{abi.CmdCreateCQ, abi.CreateCQ{CtxHandle: 77, CQE: 16, NChunks: 2}},
		{abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: 3, CQE: 16}},
		{abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: 0xffffff}},
		{abi.CmdCreateQP, abi.CreateQP{PDHandle: 1, QPType: 2, MaxSendWR: 1, MaxRecvWR: 1, MaxSendSGE: 1, MaxRecvSGE: 1}},
		{abi.CmdModifyQP, abi.ModifyQP{QPHandle: 0, AttrMask: 1}},
		{abi.CmdQueryQP, abi.QueryQP{QPHandle: 1 << 31}},
		{abi.CmdDestroyQP, abi.DestroyQP{QPHandle: 0}},
		{abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: 0, AttrMask: 2}},
		{abi.CmdQuerySRQ, abi.QuerySRQ{SRQHandle: 0}},
		{abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: 0}},
		{abi.CmdCreateSRQ, abi.CreateSRQ{PDHandle: 4, Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: 1}}},
	} {
		errReg, rsp := g.cmd(c.code, c.req)
		assert.NotZero(t, errReg, CommandName(c.code))
		assert.Less(t, errReg, uint32(256), "ERR holds a small positive errno")
		var h abi.RespHdr
		h.Decode(rsp)
		assert.EqualValues(t, abi.RespFlag|c.code, h.Ack, CommandName(c.code))
		assert.NotZero(t, h.Err, CommandName(c.code))
	}
}

func TestResetDropsEverything(t *testing.T) {
	fv := newFakeVerbs()
	g := probedGuest(t, fv)
	g.bindGID(0, hostverbs.GID{0: 0xfe, 1: 0x80, 15: 1})
	uc := g.createUC(1)
	pd := g.createPD(uc)
	cq := g.createCQ(uc, 64)
	g.regMR(pd, 0x1000, 8192, 7)
	srq := g.createSRQ(pd, 16, 1, 0, 1)
	g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, srq: srq, typ: hostverbs.QPTypeRC, sendWR: 8, sendSGE: 1, uar: 1})
	for _, k := range []string{"pd", "cq", "mr", "srq", "qp"} {
		require.Equal(t, 1, fv.count(k), k)
	}
	require.NoError(t, g.writeReg(abi.RegCtl, abi.CtlReset))
	for _, k := range []string{"pd", "cq", "mr", "srq", "qp"} {
		assert.Equal(t, 0, fv.count(k), k)
	}
	assert.Empty(t, fv.gids)
	assert.False(t, g.gotGID[len(g.gotGID)-1].bound, "GIDs unbound")
	assert.EqualValues(t, 0xFFFF, g.readReg(abi.RegErr))
	require.NoError(t, g.writeReg(abi.RegIMR, 0))
	errReg, _ := g.cmd(abi.CmdCreatePD, abi.CreatePD{})
	assert.EqualValues(t, syscall.EFAULT, errReg, "no DSR after reset")
	// The guest probes again on the same device (QMP system_reset).
	g.probe()
	assert.EqualValues(t, 0, g.createPD(0))
}

func TestNotSharedMemoryIsRefused(t *testing.T) {
	mem := guestmem.New()
	require.NoError(t, mem.Add(guestmem.RegionSpec{Base: 0, Size: 1 << 20, Prot: guestmem.ProtRead | guestmem.ProtWrite, FD: -1}))
	irq := &fakeIRQ{}
	d, err := New(Config{Memory: mem, Verbs: newFakeVerbs(), IRQ: irq, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], 0x1000)
	require.NoError(t, d.WriteBAR(abi.RegsBAR, abi.RegDSRLow, b[:]))
	binary.LittleEndian.PutUint32(b[:], 0)
	require.NoError(t, d.WriteBAR(abi.RegsBAR, abi.RegDSRHigh, b[:]))
	require.NoError(t, d.WriteBAR(abi.RegsBAR, abi.RegCtl, b[:]))
	require.NoError(t, d.ReadBAR(abi.RegsBAR, abi.RegErr, b[:]))
	assert.NotZero(t, binary.LittleEndian.Uint32(b[:]), "a VM whose RAM has no fd cannot activate the device")
	_, err = mem.Uint32(0x1000)
	assert.ErrorIs(t, err, guestmem.ErrNotShared)
	assert.Contains(t, err.Error(), "memory-backend-memfd", "the error names the QEMU options to fix it")
	assert.ErrorIs(t, d.Fault(), guestmem.ErrNotShared, "the operator can ask the device why")
	assert.Contains(t, d.Fault().Error(), "share=on")
}

func TestNewValidatesConfig(t *testing.T) {
	_, err := New(Config{})
	assert.True(t, errors.Is(err, hostverbs.ErrInvalid))
}

// TestCapsGIDTypes: a device offers exactly one GID type, the provider's
// (the stock driver refuses a device offering both).
func TestCapsGIDTypes(t *testing.T) {
	a := newFakeVerbs().attr
	assert.EqualValues(t, abi.GIDTypeFlagRoCEv2, computeCaps(a, Limits{}.withDefaults(), testMAC).GIDTypes)
	a.GIDType = hostverbs.GIDTypeRoCEv1
	assert.EqualValues(t, abi.GIDTypeFlagRoCEv1, computeCaps(a, Limits{}.withDefaults(), testMAC).GIDTypes)
}
