package soft

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// A VM whose RAM is unmapped mid-transfer (it is being torn down) must not
// make the innocent peer on the same host fail: on the in-process path the
// packet is dropped as if lost, the vanished sender's QP times out, and the
// receiver's QP and receive WQEs are untouched. A READ whose responder
// memory vanished fails at the requester as a remote error.
func TestSourceFaultBlamesTheVanishedSide(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })

	t.Run("rc-send", func(t *testing.T) {
		a := newEndpoint(t, f, "a", "10.3.0.1", 1<<20)
		b := newEndpoint(t, f, "bb", "10.3.0.2", 1<<20)
		o := defaultRC()
		o.timeout, o.retry = 8, 1 // ~1 ms local ACK timeout, one retry
		qa, qb := connectRC(t, a, b, o)
		require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 5, SGL: sge(b, 0, 4096)}))
		require.NoError(t, a.mem.RemoveAll()) // a's QEMU went away
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, 4096)}))
		wc := a.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCRetryExcErr, wc.Status, "the vanished sender's own QP fails")
		b.ccq.none(t, 50*time.Millisecond)
		attr, err := qb.Query()
		require.NoError(t, err)
		assert.Equal(t, hostverbs.QPStateRTS, attr.State, "the receiver is untouched")
		assert.Positive(t, f.Counters()["drop_source_unreadable"])
	})

	t.Run("rc-read", func(t *testing.T) {
		a := newEndpoint(t, f, "a", "10.3.1.1", 1<<20)
		b := newEndpoint(t, f, "bb", "10.3.1.2", 1<<20)
		qa, _ := connectRC(t, a, b, defaultRC())
		require.NoError(t, b.mem.RemoveAll()) // the READ target's QEMU went away
		require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, 4096), RemoteAddr: b.iova, RKey: b.mr.RKey()}))
		wc := a.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCRemAccessErr, wc.Status, "the remote side failed, not the requester's memory")
	})

	t.Run("ud", func(t *testing.T) {
		a := newEndpoint(t, f, "a", "10.3.2.1", 1<<20)
		b := newEndpoint(t, f, "bb", "10.3.2.2", 1<<20)
		c := newEndpoint(t, f, "ccc", "10.3.2.3", 1<<20)
		const qkey = 0x11111111
		qa, qb, qc := udQP(t, a, hostverbs.QPTypeUD, qkey), udQP(t, b, hostverbs.QPTypeUD, qkey), udQP(t, c, hostverbs.QPTypeUD, qkey)
		require.NoError(t, qb.PostRecv(&hostverbs.RecvWR{WRID: 77, SGL: sge(b, 0, 2048)}))
		send := func(e *endpoint, q hostverbs.QP) {
			require.NoError(t, q.PostSend(&hostverbs.SendWR{WRID: 9, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
				SGL: sge(e, 0, 256), AV: hostverbs.AddressVector{DGID: b.gid, HopLimit: 64}, RemoteQPN: qb.QPN(), RemoteQKey: qkey}))
		}
		require.NoError(t, a.mem.RemoveAll())
		send(a, qa)
		b.ccq.none(t, 50*time.Millisecond)
		send(c, qc)
		wc := b.ccq.wait(t, 5*time.Second)
		assert.Equal(t, hostverbs.WCSuccess, wc.Status)
		assert.Equal(t, uint64(77), wc.WRID, "the lost datagram left the receive WQE queued")
		assert.Equal(t, uint32(40+256), wc.ByteLen)
	})
}
