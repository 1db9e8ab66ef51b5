package soft

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// opSizes covers empty, sub-packet, page and MTU edges, multi-packet and
// 16 MiB messages.
var opSizes = []int{0, 1, 7, 4095, 4096, 4097, 65536, 1<<20 + 3, 16 << 20}

const bufSize = 16<<20 + 8192

// pair is two connected endpoints on some fabric arrangement.
type pair struct {
	a, b   *endpoint
	qa, qb hostverbs.QP
}

// runAllOps drives every RC opcode at every size from a to b and compares
// bytes.
func runAllOps(t *testing.T, p pair, sizes []int, timeout time.Duration) {
	a, b := p.a, p.b
	src := make([]byte, bufSize)
	for _, n := range sizes {
		t.Run(fmt.Sprintf("send-%d", n), func(t *testing.T) {
			fill(src[:n], uint64(n))
			a.write(t, a.iova, src[:n])
			require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: 77, SGL: sge(b, 4096, bufSize-4096)}))
			require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSendWithImm,
				Flags: hostverbs.SendSignaled, SGL: sge(a, 0, n), ImmData: 0xa1b2c3d4}))
			wc := b.ccq.wait(t, timeout)
			require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
			assert.Equal(t, uint64(77), wc.WRID)
			assert.Equal(t, hostverbs.WCRecv, wc.Opcode)
			assert.Equal(t, uint32(n), wc.ByteLen)
			assert.Equal(t, uint32(0xa1b2c3d4), wc.ImmData)
			assert.Equal(t, hostverbs.WCFlagWithImm, wc.Flags)
			assert.Equal(t, p.qa.QPN(), wc.SrcQP)
			assert.Equal(t, p.qb.QPN(), wc.QPN)
			sw := a.ccq.wait(t, timeout)
			require.Equal(t, hostverbs.WCSuccess, sw.Status)
			assert.Equal(t, hostverbs.WCSend, sw.Opcode)
			assert.Equal(t, uint32(n), sw.ByteLen)
			require.True(t, bytes.Equal(src[:n], b.read(t, b.iova+4096, n)), "payload differs")
		})
		t.Run(fmt.Sprintf("write-%d", n), func(t *testing.T) {
			fill(src[:n], uint64(n)+1)
			a.write(t, a.iova+100, src[:n])
			require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMAWrite,
				Flags: hostverbs.SendSignaled, SGL: sge(a, 100, n), RemoteAddr: b.iova + 333, RKey: b.mr.RKey()}))
			sw := a.ccq.wait(t, timeout)
			require.Equal(t, hostverbs.WCSuccess, sw.Status, "%+v", sw)
			assert.Equal(t, hostverbs.WCRDMAWrite, sw.Opcode)
			require.True(t, bytes.Equal(src[:n], b.read(t, b.iova+333, n)), "payload differs")
			b.ccq.none(t, 0)
		})
		t.Run(fmt.Sprintf("write-imm-%d", n), func(t *testing.T) {
			fill(src[:n], uint64(n)+2)
			a.write(t, a.iova, src[:n])
			require.NoError(t, p.qb.PostRecv(&hostverbs.RecvWR{WRID: 78}))
			require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRRDMAWriteWithImm,
				Flags: hostverbs.SendSignaled | hostverbs.SendSolicited, SGL: sge(a, 0, n), RemoteAddr: b.iova + 8,
				RKey: b.mr.RKey(), ImmData: 0x01020304}))
			wc := b.ccq.wait(t, timeout)
			require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
			assert.Equal(t, hostverbs.WCRecvRDMAWithImm, wc.Opcode)
			assert.Equal(t, uint32(n), wc.ByteLen)
			assert.Equal(t, uint32(0x01020304), wc.ImmData)
			assert.True(t, wc.Solicited)
			require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, timeout).Status)
			require.True(t, bytes.Equal(src[:n], b.read(t, b.iova+8, n)), "payload differs")
		})
		t.Run(fmt.Sprintf("read-%d", n), func(t *testing.T) {
			fill(src[:n], uint64(n)+3)
			b.write(t, b.iova+5, src[:n])
			require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 4, Opcode: hostverbs.WRRDMARead,
				Flags: hostverbs.SendSignaled, SGL: sge(a, 4096+9, n), RemoteAddr: b.iova + 5, RKey: b.mr.RKey()}))
			sw := a.ccq.wait(t, timeout)
			require.Equal(t, hostverbs.WCSuccess, sw.Status, "%+v", sw)
			assert.Equal(t, hostverbs.WCRDMARead, sw.Opcode)
			assert.Equal(t, uint32(n), sw.ByteLen)
			require.True(t, bytes.Equal(src[:n], a.read(t, a.iova+4096+9, n)), "payload differs")
		})
	}
	t.Run("atomics", func(t *testing.T) {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], 40)
		b.write(t, b.iova+64, w[:])
		require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 5, Opcode: hostverbs.WRAtomicFetchAndAdd,
			Flags: hostverbs.SendSignaled, SGL: sge(a, 0, 8), RemoteAddr: b.iova + 64, RKey: b.mr.RKey(), CompareAdd: 2}))
		require.Equal(t, hostverbs.WCSuccess, a.ccq.wait(t, timeout).Status)
		assert.Equal(t, uint64(40), binary.LittleEndian.Uint64(a.read(t, a.iova, 8)), "fetch returns the old value")
		assert.Equal(t, uint64(42), binary.LittleEndian.Uint64(b.read(t, b.iova+64, 8)))
		for _, tc := range []struct{ cmp, swap, old, after uint64 }{{41, 7, 42, 42}, {42, 7, 42, 7}} {
			require.NoError(t, p.qa.PostSend(&hostverbs.SendWR{WRID: 6, Opcode: hostverbs.WRAtomicCmpAndSwp,
				Flags: hostverbs.SendSignaled, SGL: sge(a, 16, 8), RemoteAddr: b.iova + 64, RKey: b.mr.RKey(),
				CompareAdd: tc.cmp, Swap: tc.swap}))
			wc := a.ccq.wait(t, timeout)
			require.Equal(t, hostverbs.WCSuccess, wc.Status)
			assert.Equal(t, hostverbs.WCCompSwap, wc.Opcode)
			assert.Equal(t, tc.old, binary.LittleEndian.Uint64(a.read(t, a.iova+16, 8)))
			assert.Equal(t, tc.after, binary.LittleEndian.Uint64(b.read(t, b.iova+64, 8)))
		}
	})
}

func newLocalPair(t *testing.T, o rcOpts) pair {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	a := newEndpoint(t, f, "a", "10.0.0.1", bufSize+1<<20)
	b := newEndpoint(t, f, "b", "10.0.0.2", bufSize+1<<20)
	qa, qb := connectRC(t, a, b, o)
	return pair{a, b, qa, qb}
}

func TestInProcessAllOps(t *testing.T) {
	p := newLocalPair(t, defaultRC())
	runAllOps(t, p, opSizes, 10*time.Second)
	c := p.a.dev.(*device).f.Counters()
	assert.Zero(t, c["tx_packets"], "in-process traffic never touches a wire")
	assert.NotZero(t, c["local_packets"])
}

// newMemNetPair puts a and b on two fabrics joined by a MemNet.
func newMemNetPair(t *testing.T, o rcOpts, clock Clock, seed uint64) (pair, *wire.MemNet) {
	net := wire.NewMemNet(seed)
	t.Cleanup(net.Close)
	mk := func() *Fabric {
		f, err := New(Config{Wire: net.Attach(), Clock: clock, LinkMTU: 9000})
		require.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	fa, fb := mk(), mk()
	a := newEndpoint(t, fa, "a", "10.0.0.1", bufSize+1<<20)
	b := newEndpoint(t, fb, "b", "10.0.0.2", bufSize+1<<20)
	qa, qb := connectRC(t, a, b, o)
	return pair{a, b, qa, qb}, net
}

func TestMemNetAllOps(t *testing.T) {
	for _, mtu := range []hostverbs.MTU{hostverbs.MTU1024, hostverbs.MTU4096} {
		t.Run(fmt.Sprint(mtu.Bytes()), func(t *testing.T) {
			o := defaultRC()
			o.mtu = mtu
			p, _ := newMemNetPair(t, o, nil, 1)
			runAllOps(t, p, opSizes, 20*time.Second)
			c := p.a.dev.(*device).f.Counters()
			assert.NotZero(t, c["tx_packets"])
			assert.Zero(t, c["drop_bad_icrc"])
			assert.Zero(t, c["local_packets"])
		})
	}
}
