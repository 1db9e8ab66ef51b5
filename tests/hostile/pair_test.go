package hostile

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// TestWellBehavedPair is the path every hostile test deviates from: two
// VMs on one daemon probe, connect RC QPs, exchange SENDs and RDMA WRITEs
// both ways, get a CQ notification on an armed CQ, and tear down the way
// rmmod does (every object destroyed, GIDs unbound, CTL RESET).
func TestWellBehavedPair(t *testing.T) {
	e := newEnv(t)
	a, b := e.pair(vmEvil, vmPeer)
	require.EqualValues(t, abi.DeviceVersion, a.v.reg(abi.RegVersion))
	require.Equal(t, hostverbs.QPStateRTS, a.qp.state())

	exchange(t, a, b)
	exchange(t, b, a)

	// An armed CQ: the completion is announced on the CQ-notification
	// ring with vector 2, once (ARM is one-shot).
	b.v.irq(abi.VectorCQ)
	b.rcq.arm()
	b.qp.postRecv(0xb100, b.mr.sge(0, 64))
	b.qp.postRecv(0xb101, b.mr.sge(64, 64))
	a.qp.postSend(sendWQE(0xa100), a.mr.sge(0, 8))
	a.qp.postSend(sendWQE(0xa101), a.mr.sge(0, 8))
	requireCQE(t, b.rcq.wait(), b.qp, 0xb100, hostverbs.WCRecv, hostverbs.WCSuccess)
	requireCQE(t, b.rcq.wait(), b.qp, 0xb101, hostverbs.WCRecv, hostverbs.WCSuccess)
	_, err := b.v.waitIRQ(abi.VectorCQ, irqTimeout)
	require.NoError(t, err)
	require.Equal(t, []uint32{b.rcq.handle}, b.v.notifications())
	requireCQE(t, a.scq.wait(), a.qp, 0xa100, hostverbs.WCSend, hostverbs.WCSuccess)
	requireCQE(t, a.scq.wait(), a.qp, 0xa101, hostverbs.WCSend, hostverbs.WCSuccess)

	st := e.vmStatus(vmEvil)
	require.True(t, st.Connected)
	require.EqualValues(t, ramSize, st.LockedBytes)
	require.Equal(t, e.base.lockedKiB+2*ramSize/1024, vmLck(t), "both guests' RAM is mlocked by the daemon")
	require.Zero(t, st.Counters["bad_doorbells"]+st.Counters["bad_wqes"]+st.Counters["command_errors"])
	// The transport's own statistics for the VM are in its status too.
	require.Positive(t, st.Counters["transport_completions"], "%v", st.Counters)

	// rmmod's teardown.
	for _, p := range []*endpoint{a, b} {
		v := p.v
		v.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: p.qp.handle})
		v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: p.scq.handle})
		v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: p.rcq.handle})
		v.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: p.mr.handle})
		v.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: p.pd})
		v.mustCmd(abi.CmdDestroyUC, abi.DestroyUC{CtxHandle: p.uc})
		v.mustCmd(abi.CmdDestroyBind, abi.DestroyBind{Index: 0, DestGID: p.gid})
		v.setReg(abi.RegIMR, ^uint32(0))
		v.setReg(abi.RegCtl, abi.CtlReset)
		require.EqualValues(t, 0xFFFF, v.reg(abi.RegErr), "ERR reads 0xFFFF again after RESET")
	}
	e.healthy()
}
