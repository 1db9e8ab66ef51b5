package soft

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// TestSaveRecvsSRQ: SaveRecvs returns the receives of an SRQ no QP has
// taken, oldest first, with their SGEs as posted, and freezes the SRQ: a
// SEND that needs one of them is dropped (not RNR NAKed, nothing taken)
// until ResumeRecvs, and the peer's retransmission then takes the next
// receive. A post or a modify resumes a frozen SRQ too.
func TestSaveRecvsSRQ(t *testing.T) {
	clk := NewManualClock(time.Unix(1000, 0))
	f := newFabric(t, Config{Clock: clk})
	a := newEndpoint(t, f, "a", "10.9.1.1", 1<<20)
	b := newEndpoint(t, f, "b", "10.9.1.2", 1<<20)
	o := defaultRC()
	hs, err := b.pd.CreateSRQ(hostverbs.SRQAttr{MaxWR: 8, MaxSGE: 2})
	require.NoError(t, err)
	qa := createRC(t, a, o)
	qb, err := b.pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: b.cq, RecvCQ: b.cq, SRQ: hs,
		Cap: hostverbs.QPCap{MaxSendWR: 4, MaxSendSGE: 1}})
	require.NoError(t, err)
	require.NoError(t, qb.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1},
		hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
	rtsRC(t, qa, b, qb.QPN(), o.psnB, o.psnA, o)
	rtsRC(t, qb, a, qa.QPN(), o.psnA, o.psnB, o)

	posted := []hostverbs.RecvWR{
		{WRID: 10, SGL: sge(b, 0, 64)},
		{WRID: 11, SGL: sge(b, 64, 64)},
		{WRID: 12, SGL: append(sge(b, 128, 16), sge(b, 512, 48)...)},
		{WRID: 13, SGL: sge(b, 192, 64)},
	}
	for i := range posted {
		require.NoError(t, hs.PostRecv(&posted[i]))
	}
	send := func(wrid uint64) {
		t.Helper()
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: wrid, Opcode: hostverbs.WRSend,
			Flags: hostverbs.SendSignaled, SGL: sge(a, 0, 10)}))
	}
	send(1)
	wc := b.ccq.wait(t, 5*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	require.EqualValues(t, 10, wc.WRID)
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)

	sv, ok := hs.(hostverbs.SRQSaver)
	require.True(t, ok)
	got, err := sv.SaveRecvs()
	require.NoError(t, err)
	assert.Equal(t, posted[1:], got, "the receives not taken, oldest first, as posted")
	again, err := sv.SaveRecvs()
	require.NoError(t, err)
	assert.Equal(t, got, again, "a frozen SRQ saves the same receives again")
	got[0].SGL[0].Length = 1 // the caller's copy

	// Frozen: a's SEND is dropped at b, neither answered nor taken.
	rnr := ctr(b, "tx_rnr_nak")
	send(2)
	assert.Equal(t, uint64(1), ctr(b, "drop_srq_handed_over"))
	assert.Equal(t, rnr, ctr(b, "tx_rnr_nak"), "no RNR NAK")
	b.ccq.none(t, 0)
	a.ccq.none(t, 0)
	again, err = sv.SaveRecvs()
	require.NoError(t, err)
	assert.Equal(t, posted[1:], again, "nothing taken while frozen")

	// Resumed: the retransmission takes the next receive.
	sv.ResumeRecvs()
	clk.Advance(roce.LocalACKTimeout(o.timeout) + time.Millisecond)
	wc = b.ccq.wait(t, 5*time.Second)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	require.EqualValues(t, 11, wc.WRID)
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)

	// A post resumes a frozen SRQ, and so does a modify.
	_, err = sv.SaveRecvs()
	require.NoError(t, err)
	require.NoError(t, hs.PostRecv(&hostverbs.RecvWR{WRID: 14, SGL: sge(b, 256, 64)}))
	send(3)
	wc = b.ccq.wait(t, 5*time.Second)
	require.EqualValues(t, 12, wc.WRID)
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)
	got, err = sv.SaveRecvs()
	require.NoError(t, err)
	assert.Equal(t, []uint64{13, 14}, recvWRIDs(got))
	require.NoError(t, hs.Modify(hostverbs.SRQAttr{Limit: 1}, hostverbs.SRQAttrLimit))
	send(4)
	wc = b.ccq.wait(t, 5*time.Second)
	require.EqualValues(t, 13, wc.WRID)
	require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, 5*time.Second).Status)
	assert.Equal(t, uint64(1), ctr(b, "drop_srq_handed_over"))

	require.NoError(t, b.dev.Close())
	_, err = sv.SaveRecvs()
	assert.ErrorIs(t, err, hostverbs.ErrClosed)
}

func recvWRIDs(wrs []hostverbs.RecvWR) []uint64 {
	var ids []uint64
	for _, w := range wrs {
		ids = append(ids, w.WRID)
	}
	return ids
}
