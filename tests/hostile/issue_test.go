package hostile

import (
	"encoding/binary"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// The malicious-driver cases of the project's issue that no CVE names:
// bad DSR addresses, stale and out-of-range handles, doorbells for
// unknown handles, odd-size and unaligned BAR accesses. (Zero and huge
// ring page counts, nchunks/length mismatches, num_sge above max,
// commands before the DSR and invalid ring index bits are the CVE tests.)

// TestBadDSRAddresses hands the device DSRs, slots and ring directories
// at addresses it cannot use: outside RAM, straddling its end, misaligned,
// in read-only memory, in memory mapped without a descriptor.
func TestBadDSRAddresses(t *testing.T) {
	e := newEnv(t)
	v := e.connect(vmEvil)
	// A read-only region (QEMU maps ROMs so) and one without a descriptor
	// (QEMU's BIOS ROM, or RAM that is not shared) beyond RAM.
	const roBase, noFDBase = 0x4000_0000, 0x5000_0000
	roFD, roMem, err := guestRAM(1 << 20)
	require.NoError(t, err)
	require.NoError(t, v.c.DMAMap(roBase, 1<<20, vfiouser.DMAFlagRead, roFD, 0))
	require.NoError(t, unix.Close(roFD)) // the mapping keeps the memory
	defer func() { _ = unix.Munmap(roMem) }()
	require.NoError(t, v.c.DMAMap(noFDBase, 1<<20, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, -1, 0))

	refusedAt := func(gpa uint64, errno syscall.Errno) {
		t.Helper()
		v.setReg(abi.RegDSRLow, uint32(gpa))
		v.setReg(abi.RegDSRHigh, uint32(gpa>>32))
		require.EqualValues(t, errno, v.reg(abi.RegErr), "DSR at %#x", gpa)
		v.setReg(abi.RegIMR, 0)
		v.setReg(abi.RegCtl, abi.CtlActivate)
		require.EqualValues(t, eFault, v.reg(abi.RegErr), "ACTIVATE after a DSR at %#x", gpa)
		require.EqualValues(t, eFault, v.request(abi.CmdQueryPort).err)
	}
	refusedAt(outsideRAM, eFault)
	refusedAt(0xffff_ffff_ffff_f000, eFault)
	refusedAt(ramSize-8, eFault)   // the DSR's 280 bytes straddle the end of RAM
	refusedAt(firstPage+4, eInval) // misaligned
	refusedAt(noFDBase, eFault)    // not shared: the device cannot reach it in place
	// A valid DSR in memory the device may only read: it cannot write
	// the caps there.
	d := v.layoutDSR()
	d.Encode(roMem)
	refusedAt(roBase, eFault)

	for _, c := range []struct {
		name   string
		mutate func(*abi.DSR)
		errno  syscall.Errno
	}{
		{"command slot outside RAM", func(d *abi.DSR) { d.CmdSlot = outsideRAM }, eFault},
		{"command slot misaligned", func(d *abi.DSR) { d.CmdSlot += 8 }, eInval},
		{"response slot outside RAM", func(d *abi.DSR) { d.RespSlot = outsideRAM }, eFault},
		{"response slot at the last byte of RAM", func(d *abi.DSR) { d.RespSlot = ramSize - 1 }, eInval},
		{"response slot past the end of RAM", func(d *abi.DSR) { d.RespSlot = ramSize }, eFault},
		{"response slot not shared", func(d *abi.DSR) { d.RespSlot = noFDBase }, eFault},
		{"async directory outside RAM", func(d *abi.DSR) { d.AsyncRing.PDirDMA = outsideRAM }, eFault},
		{"async directory misaligned", func(d *abi.DSR) { d.AsyncRing.PDirDMA += 16 }, eInval},
		{"CQ directory at the wrapping end", func(d *abi.DSR) { d.CQRing.PDirDMA = 0xffff_ffff_ffff_f000 }, eFault},
		{"CQ ring in read-only memory", func(d *abi.DSR) {
			d.CQRing.PDirDMA = v.pdir([]uint64{roBase, roBase + 0x1000, roBase + 0x2000, roBase + 0x3000})
		}, eFault},
	} {
		errReg, caps := v.loadDSR(c.mutate)
		t.Run(c.name, func(t *testing.T) { refusedDSR(t, v, errReg, caps, c.errno) })
	}
	v.probe()
	p := &endpoint{v: v, gid: gidFor(1)}
	v.bindGID(0, p.gid)
	loopbackExchange(t, p)
	e.healthy()
}

// loopbackExchange gives endpoint p (booted, GID bound) objects and runs
// a SEND and an RDMA WRITE between two of its own QPs.
func loopbackExchange(t *testing.T, p *endpoint) {
	t.Helper()
	v := p.v
	p.uc = v.createUC(2)
	p.pd = v.createPD(p.uc)
	p.scq, p.rcq = v.createCQ(p.uc, 64), v.createCQ(p.uc, 64)
	p.mr = v.regMR(p.pd, mrIOVA, mrBytes, accRW)
	a, b := p.loopPair()
	pa := &endpoint{v: v, gid: p.gid, scq: p.scq, rcq: p.rcq, mr: p.mr, qp: a}
	pb := &endpoint{v: v, gid: p.gid, scq: p.scq, rcq: p.rcq, mr: v.regMR(p.pd, mrIOVA+mrBytes, mrBytes, accRW), qp: b}
	exchange(t, pa, pb)
}

// TestStaleAndOutOfRangeHandles uses handles of destroyed objects and
// handles that never existed in every command that takes one, keys of a
// destroyed MR in WQEs, and checks that a QP reusing a destroyed QP's
// handle never sees the old QP's completions.
func TestStaleAndOutOfRangeHandles(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	x, y := p.loopPair()
	// x's SEND finds no receive at y: it stays outstanding (RNR retry 7
	// is forever) while x is destroyed under it.
	x.postSend(sendWQE(0xdead), p.mr.sge(0, 8))
	time.Sleep(20 * time.Millisecond)
	v.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: x.handle})
	bad := e.counter(vmEvil, "bad_doorbells")
	x.ringSend()
	require.Equal(t, bad+1, e.counter(vmEvil, "bad_doorbells"), "doorbell of a destroyed QP")

	// The handle of the destroyed x is reused by z: z's completions are
	// z's, and x's outstanding SEND never completes on anything.
	z, w := p.loopPair()
	require.Equal(t, x.handle, z.handle, "lowest free handle reused")
	y.postRecv(0x7, p.mr.sge(0x1000, 64))
	w.postRecv(0x8, p.mr.sge(0x2000, 64))
	z.postSend(sendWQE(0x9), p.mr.sge(0, 8))
	requireCQE(t, p.scq.wait(), z, 0x9, hostverbs.WCSend, hostverbs.WCSuccess)
	requireCQE(t, p.rcq.wait(), w, 0x8, hostverbs.WCRecv, hostverbs.WCSuccess)
	time.Sleep(50 * time.Millisecond)
	p.scq.empty()
	p.rcq.empty()

	// A QP, a CQ, an MR and a PD that existed: their handles are stale.
	staleQP, _ := p.loopPair()
	v.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: staleQP.handle})
	staleCQ := v.createCQ(p.uc, 16)
	v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: staleCQ.handle})
	staleMR := v.regMR(p.pd, 0x6000_0000, 0x1000, accLocalWrite)
	v.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: staleMR.handle})
	stalePD := v.createPD(p.uc)
	v.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: stalePD})
	never := []uint32{1000, abi.UARHandleMask, 0xffffffff}
	for _, h := range append([]uint32{staleQP.handle}, never...) {
		v.failCmd(abi.CmdModifyQP, abi.ModifyQP{QPHandle: h, AttrMask: 1, Attrs: abi.QPAttr{State: 6}}, eInval)
		v.failCmd(abi.CmdQueryQP, abi.QueryQP{QPHandle: h}, eInval)
		v.failCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: h}, eInval)
	}
	for _, h := range append([]uint32{staleCQ.handle}, never...) {
		v.failCmd(abi.CmdResizeCQ, abi.ResizeCQ{CQHandle: h, CQE: 16}, eInval)
		v.failCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: h}, eInval)
	}
	for _, h := range append([]uint32{staleMR.handle}, never...) {
		v.failCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: h}, eInval)
	}
	for _, h := range append([]uint32{stalePD}, never...) {
		v.failCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: h}, eInval)
		v.failCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: h, Start: 0x1000, Length: 0x1000, NChunks: 1,
			PDirDMA: v.pdir(v.pages(1)), AccessFlags: accLocalWrite}, eInval)
		v.failCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDHandle: h, NChunks: 2, PDirDMA: v.pdir(v.pages(2)),
			Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: 1}}, eInval)
	}
	for _, h := range append([]uint32{0, 3}, never...) { // no SRQ was ever created
		v.failCmd(abi.CmdQuerySRQ, abi.QuerySRQ{SRQHandle: h}, eInval)
		v.failCmd(abi.CmdModifySRQ, abi.ModifySRQ{SRQHandle: h, AttrMask: 2}, eInval)
		v.failCmd(abi.CmdDestroySRQ, abi.DestroySRQ{SRQHandle: h}, eInval)
	}
	for _, h := range append([]uint32{5}, never...) { // contexts: only 1 exists
		v.failCmd(abi.CmdCreatePD, abi.CreatePD{CtxHandle: h}, eInval)
		v.failCmd(abi.CmdCreateCQ, abi.CreateCQ{CtxHandle: h, CQE: 16, NChunks: 2, PDirDMA: v.pdir(v.pages(2))}, eInval)
		v.failCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: h}, eInval)
	}
	for _, idx := range []uint32{1, 16, 255, 0xffffffff} {
		v.failCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: idx, DestGID: p.gid}, eInval)
	}
	for _, idx := range []uint32{v.caps.GIDTblLen, 255, 0xffffffff} {
		v.failCmd(abi.CmdCreateBind, abi.CreateBind{Index: idx, NewGID: gidFor(7), GIDType: 2}, eInval)
	}
	v.failCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 0, DestGID: gidFor(7)}, eInval) // not the bound GID

	// Objects in use cannot go; objects of a QP that does not exist cannot
	// be named.
	v.failCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: p.scq.handle}, syscall.EBUSY)
	v.failCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: p.pd}, syscall.EBUSY)
	cq := v.createCQ(p.uc, 16)
	v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: cq.handle})
	_, req := v.layoutQP(qpSpec{pd: p.pd, scq: cq, rcq: p.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	v.failCmd(abi.CmdCreateQP, req, eInval)
	req.SendCQHandle, req.IsSRQ, req.SRQHandle = p.scq.handle, 1, 3
	v.failCmd(abi.CmdCreateQP, req, eInval)

	// Keys of a destroyed MR: the lkey in a local SGE, the rkey at the
	// target.
	old := v.regMR(p.pd, 0x5000_0000, 0x3000, accRW)
	v.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: old.handle})
	v.failCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: old.handle}, eInval)
	a, _ := p.loopPair()
	a.postSend(sendWQE(1), old.sge(0, 8))
	requireCQE(t, p.scq.wait(), a, 1, hostverbs.WCSend, hostverbs.WCLocProtErr)
	a, b := p.loopPair()
	v.events()
	v.irq(abi.VectorAsync)
	a.postSend(writeWQE(2, old.iova, old.rkey), p.mr.sge(0, 8))
	requireCQE(t, p.scq.wait(), a, 2, hostverbs.WCRDMAWrite, hostverbs.WCRemAccessErr)
	_, err := v.waitIRQ(abi.VectorAsync, irqTimeout)
	require.NoError(t, err)
	require.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPAccessErr), Info: b.handle}}, v.events(),
		"the target QP reports the access error")

	e.healthy()
}

// TestDoorbellsForUnknownHandles rings every doorbell with handles that
// name nothing, at offsets that are no doorbell, on pages of no context:
// each is dropped and counted, nothing else happens, and the device
// keeps working.
func TestDoorbellsForUnknownHandles(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	st := e.vmStatus(vmEvil).Counters
	bells, bad, polls := st["doorbells"], st["bad_doorbells"], st["poll_doorbells"]
	type bell struct {
		page uint32
		off  uint64
		val  uint32
	}
	var unknown []bell
	for _, h := range []uint32{5, 77, 0xffff, abi.UARHandleMask} {
		unknown = append(unknown,
			bell{p.uc, abi.UARQPOffset, abi.UARQPSend | h},
			bell{p.uc, abi.UARQPOffset, abi.UARQPRecv | h},
			bell{p.uc, abi.UARCQOffset, abi.UARCQArm | h},
			bell{p.uc, abi.UARCQOffset, abi.UARCQArmSol | h},
			bell{p.uc, abi.UARSRQOffset, abi.UARSRQRecv | h})
	}
	unknown = append(unknown,
		bell{p.uc, abi.UARCQOffset, abi.UARCQPoll | 55},              // a POLL, counted as such too
		bell{p.uc, abi.UARSRQOffset, abi.UARSRQRecv},                 // SRQ 0: none exists
		bell{p.uc, 12, abi.UARQPSend | p.qp.handle},                  // no doorbell at 12
		bell{p.uc, 0x800, abi.UARQPSend | p.qp.handle},               // nor in the middle
		bell{p.uc, abi.UARPageSize - 4, abi.UARCQArm | p.scq.handle}, // nor at the end
		bell{p.uc + 1, abi.UARQPOffset, abi.UARQPSend | p.qp.handle}, // another page
		bell{vdev.UARPages - 1, abi.UARCQOffset, abi.UARCQArm | p.scq.handle},
	)
	for _, b := range unknown {
		v.doorbell(b.page, b.off, b.val)
	}
	st = e.vmStatus(vmEvil).Counters
	require.Equal(t, bells+uint64(len(unknown)), st["doorbells"])
	require.Equal(t, bad+uint64(len(unknown)), st["bad_doorbells"])
	require.Equal(t, polls+1, st["poll_doorbells"])
	require.Zero(t, st["bad_wqes"]+st["send_wqes"]+st["recv_wqes"])
	// A doorbell with no action bit for a real QP does nothing, and is
	// not an error.
	v.doorbell(p.uc, abi.UARQPOffset, p.qp.handle)
	require.Equal(t, bad+uint64(len(unknown)), e.counter(vmEvil, "bad_doorbells"))
	require.Empty(t, v.events())
	p.scq.empty()
	p.rcq.empty()
	a, b := p.loopPair()
	b.postRecv(1, p.mr.sge(0, 64))
	a.postSend(sendWQE(2), p.mr.sge(0x100, 64))
	requireCQE(t, p.scq.wait(), a, 2, hostverbs.WCSend, hostverbs.WCSuccess)
	requireCQE(t, p.rcq.wait(), b, 1, hostverbs.WCRecv, hostverbs.WCSuccess)
	e.healthy()
}

// TestOddAndUnalignedBARAccesses sends BAR accesses of every size and
// alignment, to every region, posted and not: register and doorbell
// writes other than aligned dwords are refused without effect, reads of
// any size and alignment are answered, accesses outside a region are
// refused by vfio-user, and posted ones are never answered.
func TestOddAndUnalignedBARAccesses(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	badBefore := e.counter(vmEvil, "bad_bar_accesses")
	bellsBefore := e.counter(vmEvil, "doorbells")
	write := func(region uint32, off uint64, data []byte) error {
		return v.c.RegionWrite(region, off, data, false)
	}
	read := func(region uint32, off uint64, n uint32) ([]byte, error) {
		return v.c.RegionRead(region, off, n)
	}
	// Registers: IMR (0) must survive every malformed write of ~0.
	refused := 0
	for _, w := range []struct {
		off uint64
		n   int
	}{{abi.RegIMR, 1}, {abi.RegIMR, 2}, {abi.RegIMR + 1, 2}, {abi.RegIMR + 1, 4}, {abi.RegICR, 8}, {abi.RegIMR, 3}} {
		data := make([]byte, w.n)
		for i := range data {
			data[i] = 0xff
		}
		require.ErrorIs(t, write(bar1, w.off, data), syscall.EIO, "BAR1 %#x+%d", w.off, w.n)
		refused++
	}
	require.Zero(t, v.reg(abi.RegIMR), "IMR untouched")
	require.ErrorIs(t, write(bar1, abi.RegRequest, []byte{0}), syscall.EIO, "a byte write to REQUEST runs nothing")
	refused++
	require.NoError(t, write(bar1, abi.RegRequest, nil), "an empty write is a no-op")
	// Reads of any size and alignment see the same registers.
	for off := uint64(0); off < 0x28; off++ {
		for _, n := range []uint32{1, 2, 3, 4, 8} {
			b, err := read(bar1, off, n)
			require.NoError(t, err, "BAR1 %#x+%d", off, n)
			for i := range b {
				reg := (off + uint64(i)) &^ 3
				if reg == abi.RegICR {
					continue // read-to-clear
				}
				want := v.reg(reg) >> (8 * ((off + uint64(i)) & 3))
				require.EqualValues(t, byte(want), b[i], "BAR1 %#x+%d byte %d", off, n, i)
			}
		}
	}
	_, err := read(bar1, 0, 16)
	require.ErrorIs(t, err, syscall.EIO, "a 16-byte register read")
	refused++
	_, err = read(bar1, vdev.BAR1Size-2, 4)
	require.ErrorIs(t, err, syscall.EINVAL, "a read straddling the end of BAR1")
	require.ErrorIs(t, write(bar1, vdev.BAR1Size, []byte{0, 0, 0, 0}), syscall.EINVAL)

	// Doorbells: only aligned dwords ring.
	for _, w := range []struct {
		off uint64
		n   int
	}{{0, 1}, {0, 2}, {0, 8}, {1, 4}, {2, 4}, {4, 2}, {6, 2}, {abi.UARPageSize - 2, 2}} {
		data := make([]byte, w.n)
		data[len(data)-1] = 0x40 // the SEND bit of a QP doorbell, wherever it lands
		require.ErrorIs(t, write(bar2, uint64(p.uc)*abi.UARPageSize+w.off, data), syscall.EIO, "UAR %#x+%d", w.off, w.n)
		refused++
	}
	require.Equal(t, bellsBefore, e.counter(vmEvil, "doorbells"), "no doorbell rang")
	require.Equal(t, badBefore+uint64(refused), e.counter(vmEvil, "bad_bar_accesses"))

	// BAR0: the MSI-X table and PBA belong to QEMU and pcidev; writes are
	// absorbed, reads answered.
	require.NoError(t, write(0, vdev.MSIXPBA, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}))
	b, err := read(0, vdev.MSIXPBA, 8)
	require.NoError(t, err)
	require.Equal(t, make([]byte, 8), b, "the PBA is read-only")
	require.NoError(t, write(0, 0x3000, []byte{1, 2, 3}))

	// Regions without a BAR, past the last region, and transfers beyond
	// max_data_xfer_size.
	for _, region := range []uint32{3, 4, 5, vfiouser.RegionROM, vfiouser.RegionVGA, 9, 0xffffffff} {
		_, err := read(region, 0, 4)
		require.ErrorIs(t, err, syscall.EINVAL, "read region %d", region)
		require.ErrorIs(t, write(region, 0, []byte{1, 2, 3, 4}), syscall.EINVAL, "write region %d", region)
	}
	_, err = read(bar2, 0, 2<<20)
	require.ErrorIs(t, err, syscall.E2BIG)
	_, err = read(bar2, ^uint64(0)-1, 4)
	require.ErrorIs(t, err, syscall.EINVAL, "offset wrapping")

	// Posted (no-reply) malformed writes get no answer, and the
	// connection carries on.
	for _, w := range [][]byte{{1}, {1, 2}, {1, 2, 3, 4, 5, 6, 7, 8}} {
		require.NoError(t, v.c.RegionWrite(bar1, abi.RegIMR, w, true))
		require.NoError(t, v.c.RegionWrite(bar2, 2, w, true))
		require.NoError(t, v.c.RegionWrite(9, 0, w, true))
	}
	require.NoError(t, v.c.ExpectSilence(100*time.Millisecond))
	require.Zero(t, v.reg(abi.RegIMR))
	require.EqualValues(t, abi.DeviceVersion, v.reg(abi.RegVersion))

	a, bq := p.loopPair()
	bq.postRecv(1, p.mr.sge(0, 64))
	a.postSend(sendWQE(2), p.mr.sge(0x100, 64))
	requireCQE(t, p.scq.wait(), a, 2, hostverbs.WCSend, hostverbs.WCSuccess)
	requireCQE(t, p.rcq.wait(), bq, 1, hostverbs.WCRecv, hostverbs.WCSuccess)
	e.healthy()
}

// TestHostileModifyQP sends MODIFY_QP transitions and attributes the
// IB state table forbids, and attributes the device must understand
// itself (port, path MTU, source GID): each is refused with EINVAL in ERR
// and the response, and the QP keeps its state.
func TestHostileModifyQP(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	q := p.qp
	refuse := func(mask hostverbs.AttrMask, a abi.QPAttr, state hostverbs.QPState) {
		t.Helper()
		r := q.modify(mask, a)
		require.EqualValues(t, eInval, r.err, "mask %#x attrs %+v", mask, a)
		r.requireResp(t, eInval)
		require.Equal(t, state, q.state())
	}
	refuse(0x1, abi.QPAttr{State: 3}, hostverbs.QPStateReset)                    // RESET -> RTS
	refuse(0x1, abi.QPAttr{State: 7}, hostverbs.QPStateReset)                    // no such state
	refuse(0x1, abi.QPAttr{State: 0xffffffff}, hostverbs.QPStateReset)           // nor this
	refuse(0x3, abi.QPAttr{State: 1, CurState: 9}, hostverbs.QPStateReset)       // bogus current state
	refuse(1<<21|0x39, abi.QPAttr{State: 1, PortNum: 1}, hostverbs.QPStateReset) // undefined mask bit
	refuse(0x39, abi.QPAttr{State: 1, PortNum: 2}, hostverbs.QPStateReset)       // port 2
	refuse(0x31, abi.QPAttr{State: 1, PortNum: 1}, hostverbs.QPStateReset)       // INIT without access flags
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1, AccessFlags: accRW})
	rtr := abi.QPAttr{State: 2, PathMTU: 3, DestQPNum: 5, MaxDestRdAtomic: 1, MinRNRTimer: 12,
		AH: abi.AHAttr{DGID: p.gid, HopLimit: 64, Flags: abi.AHFlagGRH, PortNum: 1}}
	for _, bad := range []func(a *abi.QPAttr){
		func(a *abi.QPAttr) { a.PathMTU = 0 },
		func(a *abi.QPAttr) { a.PathMTU = 6 },
		func(a *abi.QPAttr) { a.AH.SGIDIndex = 1 },   // not bound
		func(a *abi.QPAttr) { a.AH.SGIDIndex = 255 }, // beyond the table
		func(a *abi.QPAttr) { a.AH.PortNum = 3 },
	} {
		a := rtr
		bad(&a)
		refuse(0x129181, a, hostverbs.QPStateInit)
	}
	refuse(0x1, abi.QPAttr{State: 2}, hostverbs.QPStateInit) // RTR without its required attributes
	q.mustModify(0x129181, rtr)
	refuse(0x1, abi.QPAttr{State: 3}, hostverbs.QPStateRTR) // RTS without SQ PSN etc.
	require.Empty(t, v.events())
	e.healthy()
}

// TestPostedWriteFlood sends the device tens of thousands of posted
// (unanswered) doorbells and commands, as QEMU does without
// x-no-posted-writes: they are handled in order, never answered, and the
// next non-posted access is answered promptly.
func TestPostedWriteFlood(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	var b [4]byte
	commands := e.counter(vmEvil, "commands")
	start := time.Now()
	for i := 0; i < 20000; i++ {
		binary.LittleEndian.PutUint32(b[:], abi.UARCQPoll|p.scq.handle)
		require.NoError(t, v.c.RegionWrite(bar2, uint64(p.uc)*abi.UARPageSize+abi.UARCQOffset, b[:], true))
		if i%1000 == 0 {
			require.NoError(t, v.c.RegionWrite(bar1, abi.RegRequest, make([]byte, 4), true))
		}
	}
	require.EqualValues(t, abi.DeviceVersion, v.reg(abi.RegVersion))
	t.Logf("20000 posted doorbells and 20 posted commands in %v", time.Since(start))
	require.EqualValues(t, 20000, e.counter(vmEvil, "poll_doorbells"))
	require.NoError(t, v.c.ExpectSilence(50*time.Millisecond), "posted writes are never answered")
	require.EqualValues(t, 20, e.counter(vmEvil, "commands")-commands, "every posted REQUEST ran")
	// Their response interrupts may coalesce (one per signaller wake-up).
	n, err := v.waitIRQ(abi.VectorResponse, irqTimeout)
	require.NoError(t, err)
	require.NotZero(t, n)
	require.LessOrEqual(t, n, uint64(20))
	e.healthy()
}

// TestAliasedGuestPages hands the device structures that overlap: a CQ
// whose ring state is a QP's ring state, a QP whose receive queue is its
// send queue, an MR over the command slot and the DSR that a peer then
// writes into. The guest only hurts itself: every access returns, ERR
// stays an errno, and the daemon serves on.
func TestAliasedGuestPages(t *testing.T) {
	e := newEnv(t)
	a, b := e.pair(vmEvil, vmPeer)
	v := a.v
	// A QP whose page directory names the same page for everything.
	pg := v.page()
	_, req := v.layoutQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: a.uc})
	req.PDirDMA = v.pdir([]uint64{pg, pg, pg})
	var r abi.CreateQPResp
	r.Decode(v.mustCmd(abi.CmdCreateQP, req))
	q := &gqp{v: v, handle: r.QPHandle, qpn: r.QPN, pages: []uint64{pg, pg, pg}, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1,
		sstride: 128, rstride: 32, sendChunks: 1, uar: a.uc}
	q.toRTS(b.qp.qpn, b.gid)
	// A CQ whose ring state is that same page: its prod_tail is the
	// QP's receive prod_tail.
	var c abi.CreateCQResp
	c.Decode(v.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: v.pdir([]uint64{pg, pg}), CtxHandle: a.uc, CQE: 16, NChunks: 2}))
	for i := 0; i < 8; i++ {
		q.postRecv(uint64(i), a.mr.sge(0, 64))
		q.postSend(sendWQE(uint64(i)), a.mr.sge(0, 8))
		v.doorbell(a.uc, abi.UARCQOffset, abi.UARCQArm|c.CQHandle)
	}
	// An MR over the DSR and the command and response slots, written by
	// the peer.
	var mr abi.CreateMRResp
	mr.Decode(v.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x1000, Length: 3 * 4096, NChunks: 3, PDHandle: a.pd,
		AccessFlags: accRW, PDirDMA: v.pdir([]uint64{v.dsr, v.cmdSlot, v.respSlot})}))
	junk := pattern(3*4096, 0x99)
	b.mr.write(b.v, 0, junk)
	b.qp.postSend(writeWQE(1, 0x1000, mr.RKey), b.mr.sge(0, 3*4096))
	requireCQE(t, b.scq.wait(), b.qp, 1, hostverbs.WCRDMAWrite, hostverbs.WCSuccess)
	require.Equal(t, junk[4096:8192], v.ram[v.cmdSlot:v.cmdSlot+4096], "the peer overwrote the command slot")
	v.setReg(abi.RegRequest, 0) // whatever the peer wrote there
	require.Less(t, v.reg(abi.RegErr), uint32(256))
	require.EqualValues(t, abi.DeviceVersion, v.reg(abi.RegVersion))
	e.healthy()
}
