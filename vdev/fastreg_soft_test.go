package vdev

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// newSoftKernelSide is newSoftSide for the guest kernel: PD, CQs and QP of
// no user context (UAR page 0), which fast registration needs.
func newSoftKernelSide(t testing.TB, f *soft.Fabric, name string, gid hostverbs.GID) *softSide {
	g := newSoftGuest(t, f, name, gid)
	s := &softSide{g: g, gid: gid}
	s.pd = g.createPD(0)
	s.scq, s.rcq = g.createCQ(0, 256), g.createCQ(0, 256)
	s.mr = g.regMR(s.pd, 0xffff888000010000, 256<<10, 0xf)
	s.qp = g.createQP(qpSpec{pd: s.pd, scq: s.scq, rcq: s.rcq, typ: hostverbs.QPTypeRC, sendWR: 64, recvWR: 64, sendSGE: 2, recvSGE: 2})
	return s
}

// TestSoftFastRegistration: the path kernel consumers (nvme-rdma, xprtrdma)
// take, through the device onto the soft provider. Guest a fast-registers
// scattered pages under its key (base key + consumer byte, as
// ib_update_fast_reg_key makes it); guest b WRITEs, READs and adds through
// that rkey; a invalidates it locally and registers again under the next
// byte; b's SEND with invalidate frees it, a's receive CQE says so with
// the key; b's next WRITE through it is a remote access error.
func TestSoftFastRegistration(t *testing.T) {
	f := newSoftFabric(t)
	a, b := newSoftKernelSide(t, f, "vm-a", gidA), newSoftKernelSide(t, f, "vm-b", gidB)
	connect(a, b)
	require.EqualValues(t, fastRegBMME, a.g.dev.Caps().BMMEFlags, "the soft provider's fast registration is advertised")
	var fr abi.CreateMRResp
	fr.Decode(a.g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: a.pd, Flags: abi.MRFlagFRMR, NChunks: 32}))
	pages := a.g.scatteredPages(3)
	const iova = 0xffff888012340200
	const length = 3*4096 - 0x200
	region := &gmr{iova: iova, length: length, pages: pages}
	reg := func(wrid uint64, key uint32) {
		t.Helper()
		h := wqe(hostverbs.WRRegMR, wrid, hostverbs.SendSignaled)
		abi.WRFastReg{IOVAStart: iova, PLPDirDMA: a.g.pdir(pages), PageShift: 12, PageListLen: 3, Length: length,
			AccessFlags: uint32(hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic),
			RKey: key}.Encode(h.WR[:])
		a.qp.postSend(h)
		e := waitCQE(t, a.scq)
		require.EqualValues(t, hostverbs.WCSuccess, e.Status, "REG_MR")
		require.EqualValues(t, hostverbs.WCRegMR, e.Opcode)
	}
	write := func(wrid uint64, key uint32, data []byte) abi.CQE {
		t.Helper()
		b.mr.write(b.g, 0, data)
		h := wqe(hostverbs.WRRDMAWrite, wrid, hostverbs.SendSignaled)
		abi.WRRDMA{RemoteAddr: iova, RKey: key}.Encode(h.WR[:])
		b.qp.postSend(h, b.sge(0, uint32(len(data))))
		return waitCQE(t, b.scq)
	}
	variant := func(k uint32, v uint32) uint32 { return k&^0xff | (k+v)&0xff }

	k1 := variant(fr.LKey, 1)
	reg(1, k1)
	data := randBytes(length, 1)
	e := write(10, k1, data)
	require.EqualValues(t, hostverbs.WCSuccess, e.Status)
	assert.True(t, bytes.Equal(data, region.read(a.g, 0, length)), "b's WRITE landed on a's registered pages")

	h := wqe(hostverbs.WRLocalInv, 2, hostverbs.SendSignaled)
	h.Ex = k1
	a.qp.postSend(h)
	e = waitCQE(t, a.scq)
	require.EqualValues(t, hostverbs.WCSuccess, e.Status, "LOCAL_INV")
	require.EqualValues(t, hostverbs.WCLocalInv, e.Opcode)

	k2 := variant(fr.LKey, 2)
	reg(3, k2)
	data = randBytes(length, 2)
	require.EqualValues(t, hostverbs.WCSuccess, write(11, k2, data).Status)
	assert.True(t, bytes.Equal(data, region.read(a.g, 0, length)))
	h = wqe(hostverbs.WRRDMARead, 12, hostverbs.SendSignaled)
	abi.WRRDMA{RemoteAddr: iova + 100, RKey: k2}.Encode(h.WR[:])
	b.qp.postSend(h, b.sge(64<<10, 5000))
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, b.scq).Status)
	assert.True(t, bytes.Equal(data[100:5100], b.mr.read(b.g, 64<<10, 5000)))
	word := uint64(4096 - 0x200 + 16)
	region.write(a.g, word, binary.LittleEndian.AppendUint64(nil, 40))
	h = wqe(hostverbs.WRAtomicFetchAndAdd, 13, hostverbs.SendSignaled)
	abi.WRAtomic{RemoteAddr: iova + word, CompareAdd: 2, RKey: k2}.Encode(h.WR[:])
	b.qp.postSend(h, b.sge(128<<10, 8))
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, b.scq).Status)
	assert.EqualValues(t, 42, binary.LittleEndian.Uint64(region.read(a.g, word, 8)))

	// SEND with invalidate: a's receive CQE carries WITH_INVALIDATE and
	// the key (the kernel driver gives it as wc.ex.invalidate_rkey).
	a.qp.postRecv(20, a.sge(0, 4096))
	h = wqe(hostverbs.WRSendWithInv, 14, hostverbs.SendSignaled)
	h.Ex = k2
	b.qp.postSend(h, b.sge(0, 64))
	r := waitCQE(t, a.rcq)
	require.EqualValues(t, hostverbs.WCSuccess, r.Status)
	assert.EqualValues(t, hostverbs.WCRecv, r.Opcode)
	assert.NotZero(t, r.WCFlags&uint32(hostverbs.WCFlagWithInvalidate), "flags %#x", r.WCFlags)
	assert.Equal(t, k2, r.ImmData, "the invalidated rkey")
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, b.scq).Status)

	// The key is dead: b's WRITE is a remote access error, a's pages untouched.
	before := region.read(a.g, 0, length)
	e = write(15, k2, randBytes(256, 3))
	assert.EqualValues(t, hostverbs.WCRemAccessErr, e.Status)
	assert.Equal(t, before, region.read(a.g, 0, length))
	st := a.g.dev.Stats()
	assert.EqualValues(t, 2, st.FastRegs)
	assert.EqualValues(t, 1, st.LocalInvs)
	c := f.Counters()
	assert.EqualValues(t, 1, c["remote_invalidations"])
	assert.EqualValues(t, 1, c["rkey_rejected"])
}

// TestFastRegNotOffered: a provider without fast registration (the
// ibverbs relay) makes the device advertise none, and a fast-reg MR the
// guest asks for anyway is refused (EOPNOTSUPP) and counted.
func TestFastRegNotOffered(t *testing.T) {
	fv := newFakeVerbs()
	fv.attr.DeviceCapFlags = 0
	g := probedGuest(t, fv)
	c := g.dev.Caps()
	assert.Zero(t, c.BMMEFlags)
	assert.Zero(t, c.MaxFastRegPageListLen)
	pd := g.createPD(0)
	errReg, _ := g.cmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: pd, Flags: abi.MRFlagFRMR, NChunks: 16})
	assert.EqualValues(t, 95, errReg, "EOPNOTSUPP")
	assert.EqualValues(t, 1, g.dev.Stats().FRMRRefused)
}
