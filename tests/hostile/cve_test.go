package hostile

import (
	"runtime"
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

// One test per CVE class published against QEMU's former pvrdma device,
// each played by a malicious driver through vfio-user against the
// whole stack, each ending with the daemon serving a fresh pair of VMs
// and the process's goroutines, descriptors and locked memory back to
// their baseline (env.healthy).

// outsideRAM is a page-aligned GPA no DMA_MAP covers.
const outsideRAM = 0x7ff0_0000_000

const (
	eFault = syscall.EFAULT
	eInval = syscall.EINVAL
)

// refusedDSR checks what a driver sees after a DSR the device refused:
// ERR holds errno, no capabilities were written, ACTIVATE fails, and a
// command finds no slots (CVE-2022-1050's guard).
func refusedDSR(t *testing.T, v *vm, errReg uint32, caps abi.Caps, errno syscall.Errno) {
	t.Helper()
	require.EqualValues(t, errno, errReg, "ERR after DSRHIGH")
	require.Equal(t, abi.Caps{}, caps, "no capabilities written for a refused DSR")
	v.setReg(abi.RegIMR, 0)
	v.setReg(abi.RegCtl, abi.CtlActivate)
	require.EqualValues(t, eFault, v.reg(abi.RegErr), "ACTIVATE without a DSR")
	r := v.request(abi.CmdQueryPort)
	require.EqualValues(t, eFault, r.err, "command without a DSR")
}

// CVE-2018-20123: memory leaked after an initialisation error. Every way
// the device's setup can fail (a second QEMU on a VM's socket, a memory
// file too short for its mapping, a DSR the device refuses) is repeated,
// and nothing may accumulate.
func TestCVE_2018_20123_LeakAfterInitError(t *testing.T) {
	e := newEnv(t)
	first := e.connect(vmEvil)
	for i := 0; i < 3; i++ { // each waits for the first to go (backend's reconnectWait)
		_, err := e.dial(vmEvil)
		require.Error(t, err, "a second QEMU on a connected VM's socket is refused")
	}
	first.Close()
	e.idle()

	for i := 0; i < 10; i++ {
		v, err := e.dial(vmEvil)
		require.NoError(t, err)
		fd, _, err := guestRAM(1 << 20)
		require.NoError(t, err)
		err = v.c.DMAMap(0, 2<<20, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, 0)
		require.ErrorIs(t, err, syscall.EINVAL, "mapping past the end of the memory file")
		require.NoError(t, unix.Close(fd))
		v.Close()
	}
	e.idle()

	for i := 0; i < 20; i++ {
		v := e.connect(vmEvil)
		errReg, caps := v.loadDSR(func(d *abi.DSR) { d.CQRing.PDirDMA = outsideRAM })
		refusedDSR(t, v, errReg, caps, eFault)
		v.Close()
		e.idle()
	}
	e.healthy()
}

// CVE-2018-20124: a WQE whose num_sge exceeds the QP's max_sge. It must
// complete with LOC_LEN_ERR without a single SGE being read, consume its
// slot, move the RC QP to ERR, and put nothing on the fabric.
func TestCVE_2018_20124_NumSGE(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	tx := e.d.Status().Counters["local_packets"]
	for i, n := range []uint32{3, 32, 64, 1 << 16, 0xffffffff} {
		q, peer := p.loopPair()
		gpa := q.writeSend(sendWQE(uint64(i)), p.mr.sge(0, 8))
		v.put32(gpa+8, n) // num_sge
		q.ringSend()
		requireCQE(t, p.scq.wait(), q, uint64(i), hostverbs.WCSend, hostverbs.WCLocLenErr)
		require.EqualValues(t, 1, q.sqConsumed(), "the bad WQE consumed its slot")
		require.Equal(t, hostverbs.QPStateErr, q.state(), "num_sge %d", n)
		require.EqualValues(t, 2*i+1, e.counter(vmEvil, "bad_wqes"))

		gpa = peer.writeRecv(uint64(100+i), p.mr.sge(0, 8))
		v.put32(gpa+8, n)
		peer.ringRecv()
		requireCQE(t, p.rcq.wait(), peer, uint64(100+i), hostverbs.WCRecv, hostverbs.WCLocLenErr)
		require.EqualValues(t, 1, peer.rqConsumed())
		p.scq.empty()
		p.rcq.empty()
	}
	require.Equal(t, tx, e.d.Status().Counters["local_packets"], "nothing reached the fabric")

	// QPs asking for more SGEs than the caps offer are refused outright.
	_, req := v.layoutQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeRC,
		sendWR: 4, recvWR: 4, sendSGE: v.caps.MaxSGE + 1, recvSGE: 1, uar: p.uc})
	v.failCmd(abi.CmdCreateQP, req, eInval)
	req.MaxSendSGE, req.MaxRecvSGE = 1, 0xffffffff
	v.failCmd(abi.CmdCreateQP, req, eInval)
	e.healthy()
}

// CVE-2018-20125: guest-controlled nchunks and page counts of CQ and QP
// rings (NULL dereference or a huge allocation in QEMU). Every count is
// checked against what the ring needs and what the caps allow before
// anything is sized by it.
func TestCVE_2018_20125_PageCounts(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	dir := v.pdir(v.pages(2))
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	for _, r := range []abi.CreateCQ{
		{CQE: 16, NChunks: 0},
		{CQE: 16, NChunks: 1},
		{CQE: 16, NChunks: 0xffffffff},
		{CQE: 16, NChunks: 1 << 18},
		{CQE: 0xffffffff, NChunks: 2},
		{CQE: 1 << 30, NChunks: 1<<24 + 1},
		{CQE: 0, NChunks: 2},
		{CQE: 17, NChunks: 2},
	} {
		r.PDirDMA = dir
		v.failCmd(abi.CmdCreateCQ, r, eInval)
	}
	// More pages than the CQEs need are allowed, but each must be RAM.
	v.failCmd(abi.CmdCreateCQ, abi.CreateCQ{CQE: 16, NChunks: 3,
		PDirDMA: v.pdir([]uint64{v.page(), v.page(), outsideRAM})}, eFault)
	cq := v.createCQ(0, 16)
	require.Zero(t, cq.handle, "no CQ handle consumed by the refused ones")
	for _, r := range []abi.CreateQP{
		{TotalChunks: 0, SendChunks: 0},
		{TotalChunks: 0xffff, SendChunks: 0xfffe},
		{TotalChunks: 2, SendChunks: 5},
		{TotalChunks: 3, SendChunks: 0},
		{TotalChunks: 3, SendChunks: 1, MaxSendWR: 1 << 20},
		{TotalChunks: 3, SendChunks: 1, MaxSendWR: 0xffffffff, MaxSendSGE: 0xffffffff},
		{TotalChunks: 3, SendChunks: 1, MaxSendWR: 3},
		{TotalChunks: 3, SendChunks: 1, MaxRecvSGE: 1 << 30},
	} {
		r.PDHandle, r.SendCQHandle, r.RecvCQHandle, r.QPType, r.PDirDMA = pd, cq.handle, cq.handle, uint8(hostverbs.QPTypeRC), dir
		if r.MaxSendWR == 0 {
			r.MaxSendWR, r.MaxSendSGE = 4, 1
		}
		if r.MaxRecvSGE == 0 {
			r.MaxRecvWR, r.MaxRecvSGE = 4, 1
		}
		v.failCmd(abi.CmdCreateQP, r, eInval)
	}
	v.failCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDirDMA: dir, PDHandle: pd, NChunks: 0xffffffff,
		Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: 1}}, eInval)
	v.failCmd(abi.CmdCreateSRQ, abi.CreateSRQ{PDirDMA: dir, PDHandle: pd, NChunks: 0,
		Attrs: abi.SRQAttr{MaxWR: 4, MaxSGE: 1}}, eInval)
	t.Logf("refused up front in %v (logged, not judged: it measures the machine)", time.Since(start))
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	require.Less(t, int64(after.HeapAlloc)-int64(before.HeapAlloc), int64(16<<20), "nothing sized by the guest's counts")
	q := v.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1})
	require.Zero(t, q.handle, "no QP handle consumed by the refused ones")
	e.healthy()
}

// CVE-2018-20126: leaks on the error paths of CQ and QP creation. A
// thousand failed creations later, handles start at 0, the objects they
// referenced can still be destroyed (no reference leaked) and the process
// holds nothing more.
func TestCVE_2018_20126_ErrorPathLeaks(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	cq := v.createCQ(0, 16)
	badCQ := v.pdir([]uint64{v.page(), outsideRAM})
	qpPages := v.pages(3)
	qpPages[2] = outsideRAM
	badQP := v.pdir(qpPages)
	for i := 0; i < 500; i++ {
		v.failCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: badCQ, CQE: 16, NChunks: 2}, eFault)
		v.failCmd(abi.CmdCreateQP, abi.CreateQP{PDirDMA: badQP, PDHandle: pd, SendCQHandle: cq.handle,
			RecvCQHandle: cq.handle, MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1,
			QPType: uint8(hostverbs.QPTypeRC), TotalChunks: 3, SendChunks: 1}, eFault)
	}
	require.EqualValues(t, 1000, e.counter(vmEvil, "command_errors"))
	cq2 := v.createCQ(0, 16)
	require.EqualValues(t, 1, cq2.handle)
	v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: cq.handle})
	v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: cq2.handle})
	v.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd})
	e.healthy()
}

// CVE-2018-20191: BAR2 (UAR) had no read handler. Every BAR offset of
// every BAR answers a read of every size the device implements: UAR
// all-ones, BAR0 (MSI-X PBA and the rest) zeros, BAR1 the registers.
func TestCVE_2018_20191_UARRead(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	read := func(bar uint32, off uint64, n uint32) []byte {
		t.Helper()
		b, err := v.c.RegionRead(bar, off, n)
		require.NoError(t, err, "BAR%d %#x+%d", bar, off, n)
		return b
	}
	ones := func(b []byte) bool {
		for _, x := range b {
			if x != 0xff {
				return false
			}
		}
		return true
	}
	for off := uint64(0); off < 2*abi.UARPageSize; off += 4 {
		require.True(t, ones(read(bar2, off, 4)), "UAR %#x", off)
	}
	for pg := uint64(0); pg < vdev.UARPages; pg++ {
		for _, n := range []uint32{1, 2, 4, 8} {
			off := pg*abi.UARPageSize + uint64(abi.UARPageSize) - uint64(n)
			require.True(t, ones(read(bar2, off, n)), "UAR %#x+%d", off, n)
		}
		require.True(t, ones(read(bar2, pg*abi.UARPageSize+3, 4)), "unaligned UAR read in page %d", pg)
	}
	for off := uint64(0); off < vdev.BAR0Size; off += 64 {
		require.Equal(t, make([]byte, 8), read(0, off, 8), "BAR0 %#x", off)
	}
	for off := uint64(0x28); off < vdev.BAR1Size; off += 4 {
		require.Equal(t, make([]byte, 4), read(bar1, off, 4), "unimplemented register %#x", off)
	}
	require.EqualValues(t, abi.DeviceVersion, read(bar1, 0, 1)[0])
	e.healthy()
}

// CVE-2018-20216: ring return values unchecked, an invalid index sent
// QEMU into an endless loop. Invalid producer indices make the doorbell
// return at once with a QP_FATAL event; a corrupted CQ consumer index
// drops completions with a CQ_ERR event; indices the device owns are
// never taken back from guest memory.
func TestCVE_2018_20216_RingIndices(t *testing.T) {
	e := newEnv(t)
	p := e.endpoint(vmEvil, 1)
	v := p.v
	fatal := func(q *gqp) {
		t.Helper()
		_, err := v.waitIRQ(abi.VectorAsync, irqTimeout)
		require.NoError(t, err)
		require.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventQPFatal), Info: q.handle}}, v.events())
		require.Equal(t, hostverbs.QPStateErr, q.state())
	}
	for _, bad := range []uint32{0xffffffff, 2 * qpDepth, qpDepth + 1} {
		q, _ := p.loopPair()
		store32(v.ram, q.sqState(), bad) // not an index, or more than a ring ahead
		start := time.Now()
		q.ringSend()
		t.Logf("doorbell with SQ producer %#x returned in %v", bad, time.Since(start))
		fatal(q)
		require.Zero(t, q.sqConsumed())

		q, _ = p.loopPair()
		store32(v.ram, q.rqState(), bad)
		q.ringRecv()
		fatal(q)
	}
	p.scq.empty()

	// A CQ whose consumer index the guest corrupted: the completion is
	// dropped with CQ_ERR, and so is everything after it.
	q, peer := p.loopPair()
	store32(v.ram, p.rcq.pages[0]+12, 0x12345678)
	peer.postRecv(1, p.mr.sge(0, 64))
	q.postSend(sendWQE(2), p.mr.sge(0, 64))
	requireCQE(t, p.scq.wait(), q, 2, hostverbs.WCSend, hostverbs.WCSuccess)
	_, err := v.waitIRQ(abi.VectorAsync, irqTimeout)
	require.NoError(t, err)
	require.Equal(t, []abi.EQE{{Type: uint32(hostverbs.EventCQErr), Info: p.rcq.handle}}, v.events())
	require.EqualValues(t, 1, e.counter(vmEvil, "cq_overflows"))

	// The guest scribbles over the SQ's cons_head, which the device owns.
	q, peer = p.loopPair2(p.scq, v.createCQ(p.uc, 16))
	store32(v.ram, q.sqState()+4, 9)
	peer.postRecv(3, p.mr.sge(0, 64))
	q.postSend(sendWQE(4), p.mr.sge(0, 64))
	requireCQE(t, p.scq.wait(), q, 4, hostverbs.WCSend, hostverbs.WCSuccess)
	require.EqualValues(t, 1, q.sqConsumed())
	e.healthy()
}

// CVE-2021-3582: CREATE_MR with length and nchunks that disagree (QEMU
// remapped past the page list). nchunks must be exactly the pages
// [start, start+length) spans.
func TestCVE_2021_3582_MRLengthVsNChunks(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	dir := v.pdir(v.pages(4))
	for _, r := range []abi.CreateMR{
		{Start: 0x1000, Length: 3 * 4096, NChunks: 2},
		{Start: 0x1000, Length: 3 * 4096, NChunks: 4},
		{Start: 0x1010, Length: 3 * 4096, NChunks: 3}, // unaligned: spans 4 pages
		{Start: 0x1000, Length: 1, NChunks: 0},
		{Start: 0x1000, Length: 0, NChunks: 0},
		{Start: 0xfffffffffffff000, Length: 0x2000, NChunks: 2}, // wraps
		{Start: 0, Length: 1 << 62, NChunks: 4},
		{Start: 0, Length: 4 << 30, NChunks: 1 << 20},
		{Start: 0, Length: 0x1000, NChunks: 0xffffffff},
	} {
		r.PDHandle, r.AccessFlags, r.PDirDMA = pd, accLocalWrite, dir
		v.failCmd(abi.CmdCreateMR, r, eInval)
	}
	bad := v.pages(2)
	bad[1] = outsideRAM
	v.failCmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x1000, Length: 0x2000, NChunks: 2, PDHandle: pd,
		AccessFlags: accLocalWrite, PDirDMA: v.pdir(bad)}, eFault)
	r := v.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: 0x1010, Length: 3 * 4096, NChunks: 4, PDHandle: pd,
		AccessFlags: accLocalWrite, PDirDMA: dir})
	var mr abi.CreateMRResp
	mr.Decode(r)
	require.Zero(t, mr.MRHandle)
	e.healthy()
}

// CVE-2021-3607: DSR rings with 0 or a huge number of pages (integer
// overflow, huge allocation). Either ring, any such count: the DSR is
// refused with EINVAL.
func TestCVE_2021_3607_RingPageCount(t *testing.T) {
	e := newEnv(t)
	for _, n := range []uint32{0, 1, 513, 1 << 20, 0x80000000, 0xffffffff} {
		for _, ring := range []string{"async", "cq"} {
			v := e.connect(vmEvil)
			errReg, caps := v.loadDSR(func(d *abi.DSR) {
				if ring == "async" {
					d.AsyncRing.NumPages = n
				} else {
					d.CQRing.NumPages = n
				}
			})
			refusedDSR(t, v, errReg, caps, eInval)
			v.Close()
		}
	}
	e.healthy()
}

// CVE-2021-3608: a ring init that failed half-way freed pointers it never
// set. A DSR whose ring names a page outside RAM is refused as a whole,
// and a good DSR on the same connection afterwards starts from scratch.
func TestCVE_2021_3608_RingInitFailure(t *testing.T) {
	e := newEnv(t)
	v := e.connect(vmEvil)
	for i := 0; i < 3; i++ {
		errReg, caps := v.loadDSR(func(d *abi.DSR) {
			pages := v.pages(ringPages)
			pages[i+1] = outsideRAM
			d.CQRing.PDirDMA = v.pdir(pages)
		})
		refusedDSR(t, v, errReg, caps, eFault)
		errReg, caps = v.loadDSR(func(d *abi.DSR) {
			pages := v.pages(ringPages)
			pages[i+1] = 0x1234 // not page-aligned
			d.AsyncRing.PDirDMA = v.pdir(pages)
		})
		refusedDSR(t, v, errReg, caps, eInval)
	}
	v.probe()
	require.Zero(t, v.createPD(0))
	require.Zero(t, v.createCQ(0, 16).handle)
	e.healthy()
}

// CVE-2022-1050: commands before the DSR (and its slots) exist. REQUEST,
// ACTIVATE and doorbells before the DSR, after CTL RESET and after a
// vfio-user DEVICE_RESET all fail cleanly: ERR EFAULT and vector 0 for
// REQUEST, dropped and counted doorbells.
func TestCVE_2022_1050_CommandBeforeDSR(t *testing.T) {
	e := newEnv(t)
	v := e.connect(vmEvil)
	beforeDSR := func(what string) {
		t.Helper()
		v.setReg(abi.RegIMR, 0)
		bad := e.counter(vmEvil, "bad_doorbells")
		for i := 0; i < 3; i++ {
			r := v.request(abi.CmdCreatePD)
			require.EqualValues(t, eFault, r.err, "%s: REQUEST", what)
			v.doorbell(0, abi.UARQPOffset, abi.UARQPSend|uint32(i))
			v.doorbell(1, abi.UARCQOffset, abi.UARCQArm|uint32(i))
		}
		require.Equal(t, bad+6, e.counter(vmEvil, "bad_doorbells"), "%s: doorbells", what)
		v.setReg(abi.RegCtl, abi.CtlActivate)
		require.EqualValues(t, eFault, v.reg(abi.RegErr), "%s: ACTIVATE", what)
		v.setReg(abi.RegCtl, abi.CtlUnquiesce)
		require.EqualValues(t, eFault, v.reg(abi.RegErr), "%s: UNQUIESCE", what)
	}
	beforeDSR("fresh device")

	v.probe()
	v.createPD(0)
	v.setReg(abi.RegCtl, abi.CtlReset)
	beforeDSR("after CTL RESET")

	v.probe()
	v.createPD(0)
	require.NoError(t, v.c.Reset())
	// A reset function has decode, bus mastering and MSI-X off: BAR
	// accesses are dropped until the driver sets it up again.
	x, err := v.c.Read32(bar1, abi.RegErr)
	require.NoError(t, err)
	require.EqualValues(t, 0xffffffff, x, "decode off after DEVICE_RESET")
	v.pciSetup()
	beforeDSR("after DEVICE_RESET")
	v.probe()
	require.Zero(t, v.createPD(0), "the reset dropped the old PD")
	e.healthy()
}

// CVE-2023-1544: device rings larger than one page table (512 entries
// including the state page) made QEMU read past it. 513 pages are
// refused, 512 accepted.
func TestCVE_2023_1544_RingBeyondOnePageTable(t *testing.T) {
	e := newEnv(t)
	for _, ring := range []string{"async", "cq"} {
		v := e.connect(vmEvil)
		errReg, caps := v.loadDSR(func(d *abi.DSR) {
			info := abi.RingPageInfo{NumPages: 513, PDirDMA: v.pdir(v.pages(513))}
			if ring == "async" {
				d.AsyncRing = info
			} else {
				d.CQRing = info
			}
		})
		refusedDSR(t, v, errReg, caps, eInval)
		errReg, caps = v.loadDSR(func(d *abi.DSR) {
			info := abi.RingPageInfo{NumPages: 512, PDirDMA: v.pdir(v.pages(512))}
			if ring == "async" {
				d.AsyncRing = info
			} else {
				d.CQRing = info
			}
		})
		_ = errReg // still the refusal's: a good DSR leaves ERR to ACTIVATE
		require.EqualValues(t, abi.GIDTypeFlagRoCEv2, caps.GIDTypes, "%s ring of one full page table", ring)
		v.setReg(abi.RegCtl, abi.CtlActivate)
		require.Zero(t, v.reg(abi.RegErr))
		v.Close()
	}
	e.healthy()
}
