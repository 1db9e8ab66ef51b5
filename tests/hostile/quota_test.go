package hostile

import (
	"fmt"
	"runtime"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Page directories may name the same guest page many times, so a guest's
// RAM does not bound what its objects make the daemon allocate: the
// per-VM limits must. These tests build the largest objects the caps
// allow from a handful of aliased pages until a limit says ENOMEM, and
// bound what the daemon's heap grew by.

func heapAlloc() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// aliasedDir is a page directory naming n pages, all of them the same
// page, through one page table named by every directory entry.
func (v *vm) aliasedDir(n int) uint64 {
	data, table, dir := v.page(), v.page(), v.page()
	for i := 0; i < 512; i++ {
		v.put64(table+uint64(i)*8, data)
	}
	for t := 0; t < (n+511)/512; t++ {
		v.put64(dir+uint64(t)*8, table)
	}
	return dir
}

// TestQueueMemoryBounded creates QPs of the largest depth and SGE count
// from three guest pages until the VM's byte budget (vdev's
// Limits.MaxBytes) refuses one. Before any budget each cost the daemon
// about 4.6 MiB and the caps allowed 1024 of them (some 4.7 GiB per VM).
func TestQueueMemoryBounded(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	cq := v.createCQ(0, 16)
	wr, sge := v.caps.MaxQPWR, v.caps.MaxSGE
	pages := int(uint64(wr) * uint64(pow2(80+16*sge)) / 4096) // per queue
	dir := v.aliasedDir(1 + 2*pages)
	before := heapAlloc()
	var handles []uint32
	for {
		r := v.post(abi.CmdCreateQP, abi.CreateQP{PDirDMA: dir, PDHandle: pd, SendCQHandle: cq.handle, RecvCQHandle: cq.handle,
			MaxSendWR: wr, MaxRecvWR: wr, MaxSendSGE: sge, MaxRecvSGE: sge, QPType: uint8(hostverbs.QPTypeRC),
			TotalChunks: uint16(1 + 2*pages), SendChunks: uint16(pages)})
		if r.err != 0 {
			require.EqualValues(t, syscall.ENOMEM, r.err)
			break
		}
		var resp abi.CreateQPResp
		resp.Decode(r.resp)
		handles = append(handles, resp.QPHandle)
		require.Less(t, len(handles), int(v.caps.MaxQP), "no limit stopped the QPs")
	}
	grew := heapAlloc() - before
	t.Logf("%d QPs of %d WRs x %d SGEs each way from 3 guest pages: heap +%d MiB", len(handles), wr, sge, grew>>20)
	require.Less(t, grew, vdev.DefaultLimits().MaxBytes+16<<20, "the daemon's memory is bounded by the VM's budget")
	for _, h := range handles {
		v.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: h})
	}
	require.Less(t, heapAlloc(), before+16<<20, "and given back")
	e.healthy()
}

// TestMRMemoryBounded registers 1 GiB memory regions made of one guest
// page each until the registered-bytes quota refuses one.
func TestMRMemoryBounded(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	const gib = 1 << 30
	dir := v.aliasedDir(gib / 4096)
	before := heapAlloc()
	n := 0
	for ; ; n++ {
		r := v.post(abi.CmdCreateMR, abi.CreateMR{Start: uint64(n) * gib, Length: gib, NChunks: gib / 4096, PDHandle: pd,
			AccessFlags: accRW, PDirDMA: dir})
		if r.err != 0 {
			require.EqualValues(t, syscall.ENOMEM, r.err)
			break
		}
		require.Less(t, n, 64, "no limit stopped the MRs")
	}
	grew := heapAlloc() - before
	t.Logf("%d MRs of 1 GiB from 3 guest pages: heap +%d MiB", n, grew>>20)
	require.EqualValues(t, 4, n, "the default 4 GiB quota")
	require.Less(t, grew, uint64(64<<20))
	e.healthy()
}

// TestObjectCosts checks what vdev charges a VM's budget for each kind of
// object against what the daemon's heap really grows by, with the soft
// provider: the charge must never be less (else a guest could exceed its
// budget), for queues large and small, CQs and MRs.
func TestObjectCosts(t *testing.T) {
	e := newEnv(t)
	v := e.boot(vmEvil)
	pd := v.createPD(0)
	cq := v.createCQ(0, 16)
	charged := func() uint64 { return uint64(e.vmStatus(vmEvil).Resources["object_bytes"]) }
	check := func(what string, n int, create func()) {
		t.Helper()
		c0, h0 := charged(), heapAlloc()
		for i := 0; i < n; i++ {
			create()
		}
		heap, charge := (heapAlloc()-h0)/uint64(n), (charged()-c0)/uint64(n)
		t.Logf("%s: heap %d bytes, charged %d", what, heap, charge)
		require.LessOrEqual(t, heap, charge, "%s costs more than it is charged", what)
	}
	for _, sh := range [][2]uint32{{4096, 16}, {4096, 1}, {1024, 4}, {16, 1}} {
		wr, sge := sh[0], sh[1]
		pages := max(1, int(uint64(wr)*uint64(pow2(80+16*sge))/4096))
		dir := v.aliasedDir(1 + 2*pages)
		check(fmt.Sprintf("QP %d WRs x %d SGEs", wr, sge), 4, func() {
			v.mustCmd(abi.CmdCreateQP, abi.CreateQP{PDirDMA: dir, PDHandle: pd, SendCQHandle: cq.handle, RecvCQHandle: cq.handle,
				MaxSendWR: wr, MaxRecvWR: wr, MaxSendSGE: sge, MaxRecvSGE: sge, QPType: uint8(hostverbs.QPTypeRC),
				TotalChunks: uint16(1 + 2*pages), SendChunks: uint16(pages)})
		})
	}
	dir := v.aliasedDir(1 << 18)
	check("CQ of 2 pages", 64, func() {
		v.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: dir, CQE: 16, NChunks: 2})
	})
	check("CQ of 64 pages", 64, func() {
		v.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: dir, CQE: 1024, NChunks: 64})
	})
	n := 0
	check("MR of 1 GiB", 2, func() {
		v.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: uint64(n) << 30, Length: 1 << 30, NChunks: 1 << 18, PDHandle: pd,
			AccessFlags: accRW, PDirDMA: dir})
		n++
	})
	check("MR of 1 page", 64, func() {
		v.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: 1 << 40, Length: 4096, NChunks: 1, PDHandle: pd,
			AccessFlags: accRW, PDirDMA: dir})
	})
	e.healthy()
}
