package hostile

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// TestCrossVMIsolation: a hostile VM on the same daemon tries to take
// another VM's GID and to inject into its connected QP. The GID stays
// with its owner (EBUSY), and requests from anyone but a QP's configured
// peer are dropped and counted, so the victim's receive is untouched and
// the intruder's SEND ends in RETRY_EXC_ERR.
func TestCrossVMIsolation(t *testing.T) {
	e := newEnv(t)
	victim, friend := e.pair(vmPeer, vmFresh) // GIDs 10.77.0.1 and .2
	evil := e.endpoint(vmEvil, 3)
	v := evil.v
	v.failCmd(vdev.CmdCreateBind, vdev.CreateBind{MTU: 1024, VLAN: 0xfff, Index: 1, NewGID: victim.gid, GIDType: 2}, syscall.EBUSY)
	v.failCmd(vdev.CmdCreateBind, vdev.CreateBind{MTU: 1024, VLAN: 0xfff, Index: 0, NewGID: friend.gid, GIDType: 2}, syscall.EBUSY)
	gids := e.vmStatus(vmEvil).GIDs
	require.Len(t, gids, 1, "the refused rebind kept index 0's GID")
	require.Equal(t, evil.gid.String(), gids[0].GID)
	v.failCmd(vdev.CmdDestroyBind, vdev.DestroyBind{Index: 0, DestGID: victim.gid}, eInval)

	// The intruder aims a QP at the victim's QP, PSNs and all (they start
	// at 0 here, as easy to guess as they get).
	q := v.createQP(qpSpec{pd: evil.pd, scq: evil.scq, rcq: evil.rcq, typ: hostverbs.QPTypeRC, sendWR: 4, recvWR: 4,
		sendSGE: 1, recvSGE: 1, uar: evil.uc})
	q.toRTSRetry(victim.qp.qpn, victim.gid, 12, 7)
	drops := e.d.Status().Counters["drop_bad_address"]
	victim.qp.postRecv(1, victim.mr.sge(0, 64))
	q.postSend(sendWQE(2), evil.mr.sge(0, 8))
	q.postSend(writeWQE(3, victim.mr.iova, victim.mr.rkey), evil.mr.sge(0, 8))
	requireCQE(t, evil.scq.wait(), q, 2, hostverbs.WCSend, hostverbs.WCRetryExcErr)
	requireCQE(t, evil.scq.wait(), q, 3, hostverbs.WCRDMAWrite, hostverbs.WCWRFlushErr)
	require.Greater(t, e.d.Status().Counters["drop_bad_address"], drops)
	time.Sleep(10 * time.Millisecond)
	victim.rcq.empty()
	require.Equal(t, hostverbs.QPStateRTS, victim.qp.state())

	// The victim's own peer still gets through.
	friend.qp.postSend(sendWQE(4), friend.mr.sge(0, 16))
	requireCQE(t, friend.scq.wait(), friend.qp, 4, hostverbs.WCSend, hostverbs.WCSuccess)
	rc := victim.rcq.wait()
	requireCQE(t, rc, victim.qp, 1, hostverbs.WCRecv, hostverbs.WCSuccess)
	require.Equal(t, friend.qp.qpn, rc.SrcQP)
	e.healthy()
}
