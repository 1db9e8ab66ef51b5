package vdev

import (
	"bytes"
	"encoding/binary"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
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
			RKey:        key}.Encode(h.WR[:])
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

// BenchmarkFastRegInvalidate is what a kernel storage consumer pays per
// I/O for its memory: one REG_MR of 32 pages (128 KiB) and one LOCAL_INV,
// posted by the guest kernel on an RC QP and completed through the device
// onto the soft provider (a signaled LOCAL_INV's CQE polled). x_provider
// is the ratio to the same registration and invalidation straight on the
// provider in the same run; x_cmd_reg the ratio to registering and
// deregistering the same pages with CREATE_MR and DESTROY_MR commands
// (what a device without fast registration would leave), also in the same
// run: below 1 means fast registration is the cheaper way.
func BenchmarkFastRegInvalidate(b *testing.B) {
	const npages = 32
	f := newSoftFabric(b)
	a, c := newSoftKernelSide(b, f, "vm-a", gidA), newSoftKernelSide(b, f, "vm-b", gidB)
	connect(a, c)
	var fr abi.CreateMRResp
	fr.Decode(a.g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: a.pd, Flags: abi.MRFlagFRMR, NChunks: npages}))
	pages := a.g.scatteredPages(npages)
	pdir := a.g.pdir(pages)
	const iova = 0xffff888040000000
	var db [4]byte
	putLE32(db[:], abi.UARQPSend|a.qp.handle)
	st := a.scq.pages[0] + 8
	step := func(i int) {
		key := fr.LKey&^0xff | uint32(i)&0xff
		sq := a.qp.sqState()
		tail := a.g.u32(sq)
		h := wqe(hostverbs.WRRegMR, uint64(i), 0)
		abi.WRFastReg{IOVAStart: iova, PLPDirDMA: pdir, PageShift: 12, PageListLen: npages, Length: npages * 4096,
			AccessFlags: uint32(hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead), RKey: key}.Encode(h.WR[:])
		h.Encode(a.g.raw[a.qp.sqWQE(tail):])
		tail = drvInc(tail, a.qp.sendWR)
		h = wqe(hostverbs.WRLocalInv, uint64(i), hostverbs.SendSignaled)
		h.Ex = key
		h.Encode(a.g.raw[a.qp.sqWQE(tail):])
		a.g.put32(sq, drvInc(tail, a.qp.sendWR))
		if err := a.g.dev.WriteBAR(abi.UARBAR, abi.UARQPOffset, db[:]); err != nil {
			b.Fatal(err)
		}
		for {
			head, _ := a.g.mem.LoadUint32(guestmem.GPA(st + 4))
			tail, _ := a.g.mem.LoadUint32(guestmem.GPA(st))
			if tail != head {
				_ = a.g.mem.StoreUint32(guestmem.GPA(st+4), drvInc(head, a.scq.n))
				return
			}
			runtime.Gosched()
		}
	}
	step(0)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		step(i + 1)
	}
	b.StopTimer()
	if s := a.g.dev.Stats(); s.FastRegRefused != 0 || s.LocalInvRefused != 0 || s.ErrorCQEs != 0 {
		b.Fatalf("refusals in the loop: %+v", s)
	}
	per := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	n := max(b.N, 1000)
	b.ReportMetric(per/directFastRegNS(b, f, n, npages), "x_provider")
	b.ReportMetric(per/cmdRegNS(a, n, npages), "x_cmd_reg")
}

// directFastRegNS is the reference: the same REG_MR and invalidation
// straight on a soft provider device, in ns per pair.
func directFastRegNS(b *testing.B, f *soft.Fabric, n, npages int) float64 {
	mem, _ := guestmem.NewFlat(0, 1<<20)
	d, err := f.Open(hostverbs.DeviceConfig{Name: "ref", Memory: mem})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Close() })
	pd, _ := d.AllocPD()
	fr, err := pd.(hostverbs.FastRegPD).AllocFastRegMR(hostverbs.FastRegAttr{MaxPages: npages})
	if err != nil {
		b.Fatal(err)
	}
	gpas := make([]guestmem.GPA, npages)
	for i := range gpas {
		gpas[i] = guestmem.GPA((npages - 1 - i) * 4096)
	}
	base := fr.LKey()
	start := nanotime()
	for i := 0; i < n; i++ {
		key := base&^0xff | uint32(i)&0xff
		pl, _ := guestmem.NewPageList(0xffff888040000000, uint64(npages)*4096, gpas)
		if err := fr.Register(hostverbs.FastReg{Pages: pl, Access: hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite, Key: key}); err != nil {
			b.Fatal(err)
		}
		if err := fr.Invalidate(key); err != nil {
			b.Fatal(err)
		}
	}
	return float64(nanotime()-start) / float64(n)
}

// cmdRegNS is the other reference: CREATE_MR and DESTROY_MR of npages
// through the device's command channel, in ns per pair.
func cmdRegNS(s *softSide, n, npages int) float64 {
	pages := s.g.scatteredPages(npages)
	pdir := s.g.pdir(pages)
	start := nanotime()
	for i := 0; i < n; i++ {
		var r abi.CreateMRResp
		r.Decode(s.g.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x7f0000000000, Length: uint64(npages) * 4096,
			NChunks: uint32(npages), PDHandle: s.pd, AccessFlags: 7, PDirDMA: pdir}))
		s.g.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: r.MRHandle})
	}
	return float64(nanotime()-start) / float64(n)
}

// TestFastRegChargedToMRBytes: fast registrations count toward the VM's
// registered bytes (max-mr-bytes) with its plain MRs. With room for two
// 512 KiB registrations beside the guest's plain MR, a third REG_MR
// completes in error (and is counted) and its MR stays free; a LOCAL_INV
// gives its bytes back at once, a peer's SEND with invalidate by the next
// REG_MR that needs them, and destroying a registered MR gives back its
// registration's bytes.
func TestFastRegChargedToMRBytes(t *testing.T) {
	const npages = 128 // 512 KiB
	const regLen = npages * 4096
	f := newSoftFabric(t)
	plain := uint64(256 << 10) // newSoftKernelSide's MR
	g := newSoftGuestLimits(t, f, "vm-a", gidA, Limits{MaxMRBytes: plain + 2*regLen})
	a := &softSide{g: g, gid: gidA}
	a.pd = g.createPD(0)
	a.scq, a.rcq = g.createCQ(0, 256), g.createCQ(0, 256)
	a.mr = g.regMR(a.pd, 0xffff888000010000, plain, 0xf)
	a.qp = g.createQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeRC, sendWR: 64, recvWR: 64, sendSGE: 2, recvSGE: 2})
	b := newSoftKernelSide(t, f, "vm-b", gidB)
	connect(a, b)

	var frs [4]abi.CreateMRResp
	for i := range frs {
		frs[i].Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: a.pd, Flags: abi.MRFlagFRMR, NChunks: npages}))
	}
	assert.EqualValues(t, plain, g.dev.Objects()["mr_bytes"], "allocating fast-reg MRs registers nothing")
	pages := g.scatteredPages(npages)
	pdir := g.pdir(pages)
	const iova = 0xffff888070000000
	key := func(i int, v uint32) uint32 { return frs[i].LKey&^0xff | (frs[i].LKey+v)&0xff }
	reg := func(wrid uint64, k uint32) abi.CQE {
		t.Helper()
		h := wqe(hostverbs.WRRegMR, wrid, hostverbs.SendSignaled)
		abi.WRFastReg{IOVAStart: iova, PLPDirDMA: pdir, PageShift: 12, PageListLen: npages, Length: regLen,
			AccessFlags: uint32(hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead), RKey: k}.Encode(h.WR[:])
		a.qp.postSend(h)
		return waitCQE(t, a.scq)
	}
	localInv := func(wrid uint64, k uint32) {
		t.Helper()
		h := wqe(hostverbs.WRLocalInv, wrid, hostverbs.SendSignaled)
		h.Ex = k
		a.qp.postSend(h)
		require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, a.scq).Status, "LOCAL_INV")
	}

	require.EqualValues(t, hostverbs.WCSuccess, reg(1, key(0, 1)).Status)
	require.EqualValues(t, hostverbs.WCSuccess, reg(2, key(1, 1)).Status)
	assert.EqualValues(t, plain+2*regLen, g.dev.Objects()["mr_bytes"])
	// Full: a plain MR is refused, so is a third registration's REG_MR below.
	errReg, _ := g.cmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x10000, Length: 4096, PDirDMA: g.pdir(g.pages(1)),
		PDHandle: a.pd, AccessFlags: 1, NChunks: 1})
	assert.NotZero(t, errReg, "the quota is full")

	// A LOCAL_INV gives its registration's bytes back at once.
	localInv(3, key(0, 1))
	assert.EqualValues(t, plain+regLen, g.dev.Objects()["mr_bytes"])
	require.EqualValues(t, hostverbs.WCSuccess, reg(4, key(2, 1)).Status)

	// The peer's SEND with invalidate frees MR 1 in the provider; the next
	// REG_MR that needs its bytes gets them.
	a.qp.postRecv(30, a.sge(0, 4096))
	h := wqe(hostverbs.WRSendWithInv, 5, hostverbs.SendSignaled)
	h.Ex = key(1, 1)
	b.qp.postSend(h, b.sge(0, 16))
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, a.rcq).Status)
	require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, b.scq).Status)
	require.EqualValues(t, hostverbs.WCSuccess, reg(6, key(3, 1)).Status)
	assert.EqualValues(t, plain+2*regLen, g.dev.Objects()["mr_bytes"])

	// Over the quota: the REG_MR completes in error, counted, and its key
	// resolves nowhere.
	refusedBefore := g.dev.Stats().FastRegRefused
	e := reg(7, key(0, 2))
	assert.EqualValues(t, hostverbs.WCLocQPOpErr, e.Status, "REG_MR over max-mr-bytes")
	assert.EqualValues(t, hostverbs.WCRegMR, e.Opcode)
	assert.Equal(t, refusedBefore+1, g.dev.Stats().FastRegRefused)
	assert.EqualValues(t, plain+2*regLen, g.dev.Objects()["mr_bytes"])
	g.dev.mu.Lock()
	st, _ := g.dev.frmrs[frs[0].LKey>>8].fr.Registration()
	g.dev.mu.Unlock()
	assert.Equal(t, hostverbs.MRFree, st, "the refused registration's MR stays free")

	// Destroying a registered MR gives its registration's bytes back.
	g.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: frs[2].MRHandle})
	assert.EqualValues(t, plain+regLen, g.dev.Objects()["mr_bytes"])
}
