package soft

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// fastRegFixture is a connected RC pair whose responder b has a
// fast-registration MR over three scattered pages of its memory, and what
// the checks need to see them.
type fastRegFixture struct {
	p    pair
	fr   hostverbs.FastRegMR
	base uint32
	// iova..iova+len is the registration's range: it starts 0x200 into
	// the first page, which is gpas[0].
	iova uint64
	len  uint64
	gpas []guestmem.GPA
}

const frTimeout = 20 * time.Second

// frPageGPAs are pages of an endpoint's flat memory, out of order: the
// registration's IOVA range maps onto them as the guest's page list says.
var frPageGPAs = []guestmem.GPA{0x3000, 0x1000, 0x7000}

func newFastRegFixture(t *testing.T, mk func(t *testing.T) pair) *fastRegFixture {
	t.Helper()
	p := mk(t)
	fpd, ok := p.b.pd.(hostverbs.FastRegPD)
	require.True(t, ok, "the soft provider's PDs implement FastRegPD")
	require.NotZero(t, p.b.dev.Attr().DeviceCapFlags&hostverbs.DeviceCapMemMgtExtensions)
	fr, err := fpd.AllocFastRegMR(hostverbs.FastRegAttr{MaxPages: 16})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fr.Dereg() })
	st, _ := fr.Registration()
	require.Equal(t, hostverbs.MRFree, st)
	return &fastRegFixture{p: p, fr: fr, base: fr.LKey(), iova: 0xffff8880_12340200, len: 3*4096 - 0x200 - 0x80, gpas: frPageGPAs}
}

func (x *fastRegFixture) variant(v uint8) uint32 { return x.base&^0xff | uint32(v) }

func (x *fastRegFixture) register(t *testing.T, key uint32, acc hostverbs.Access) {
	t.Helper()
	pl, err := guestmem.NewPageList(x.iova, x.len, x.gpas)
	require.NoError(t, err)
	require.NoError(t, x.fr.Register(hostverbs.FastReg{Pages: pl, Access: acc, Key: key}))
}

// gpaBytes reads n bytes of b's registration at IOVA offset off straight
// from guest-physical memory, through the page list.
func (x *fastRegFixture) gpaBytes(t *testing.T, off uint64, n int) []byte {
	t.Helper()
	pl, err := guestmem.NewPageList(x.iova, x.len, x.gpas)
	require.NoError(t, err)
	out := make([]byte, n)
	require.NoError(t, pl.ReadAt(x.p.b.mem, out, x.iova+off))
	return out
}

// write posts an RDMA WRITE of n bytes from a's MR to b's registration at
// offset off with key, and returns a's completion.
func (x *fastRegFixture) write(t *testing.T, key uint32, off uint64, data []byte) hostverbs.WorkCompletion {
	t.Helper()
	a := x.p.a
	a.write(t, a.iova, data)
	require.NoError(t, x.p.qa.PostSend(&hostverbs.SendWR{WRID: 11, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
		SGL: sge(a, 0, len(data)), RemoteAddr: x.iova + off, RKey: key}))
	return a.ccq.wait(t, frTimeout)
}

const frAccessAll = hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic

// runFastReg drives fast registration end to end between two endpoints
// that mk connects: the guest's key (base + consumer byte) resolved by the
// responder for WRITE, READ and atomics; remote invalidation by SEND with
// invalidate; re-registration under the next consumer byte; local
// invalidation; and every access through an invalidated, stale-variant,
// out-of-range or wrong-access key refused with nothing moved.
func runFastReg(t *testing.T, mk func(t *testing.T) pair) {
	t.Run("write-read-atomic-then-send-with-invalidate", func(t *testing.T) {
		x := newFastRegFixture(t, mk)
		a, b := x.p.a, x.p.b
		k1 := x.variant(uint8(x.base) + 1)
		x.register(t, k1, frAccessAll)
		st, reg := x.fr.Registration()
		require.Equal(t, hostverbs.MRValid, st)
		assert.Equal(t, k1, reg.Key)
		assert.Equal(t, k1, x.fr.RKey())

		// WRITE across the three scattered pages.
		data := make([]byte, x.len)
		fill(data, 41)
		wc := x.write(t, k1, 0, data)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		require.True(t, bytes.Equal(data, x.gpaBytes(t, 0, len(data))), "WRITE landed on the registration's pages")

		// READ it back into a at offset 64 KiB.
		require.NoError(t, x.p.qa.PostSend(&hostverbs.SendWR{WRID: 12, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 64<<10, len(data)), RemoteAddr: x.iova, RKey: k1}))
		wc = a.ccq.wait(t, frTimeout)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		require.True(t, bytes.Equal(data, a.read(t, a.iova+64<<10, len(data))))

		// FETCH_ADD on an 8-byte word in the second page.
		off := uint64(4096 - 0x200 + 8)
		old := binary.LittleEndian.Uint64(x.gpaBytes(t, off, 8))
		require.NoError(t, x.p.qa.PostSend(&hostverbs.SendWR{WRID: 13, Opcode: hostverbs.WRAtomicFetchAndAdd, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, 8), RemoteAddr: x.iova + off, RKey: k1, CompareAdd: 5}))
		wc = a.ccq.wait(t, frTimeout)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		assert.Equal(t, old, binary.LittleEndian.Uint64(a.read(t, a.iova, 8)))
		assert.Equal(t, old+5, binary.LittleEndian.Uint64(x.gpaBytes(t, off, 8)))

		// b's own SGE through the fast-reg lkey (a local use): SEND from it.
		require.NoError(t, x.p.qa.PostRecv(&hostverbs.RecvWR{WRID: 20, SGL: sge(a, 128<<10, 4096)}))
		require.NoError(t, x.p.qb.PostSend(&hostverbs.SendWR{WRID: 21, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
			SGL: []hostverbs.SGE{{Addr: x.iova + 100, Length: 300, LKey: k1}}}))
		require.Equal(t, hostverbs.WCSuccess, b.ccq.wait(t, frTimeout).Status)
		wc = a.ccq.wait(t, frTimeout)
		require.Equal(t, hostverbs.WCSuccess, wc.Status)
		require.True(t, bytes.Equal(x.gpaBytes(t, 100, 300), a.read(t, a.iova+128<<10, 300)))

		// SEND with invalidate: b's receive completes with the key, the
		// MR is free.
		require.NoError(t, x.p.qb.PostRecv(&hostverbs.RecvWR{WRID: 30, SGL: sge(b, 0, 4096)}))
		require.NoError(t, x.p.qa.PostSend(&hostverbs.SendWR{WRID: 31, Opcode: hostverbs.WRSendWithInv, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, 64), ImmData: k1}))
		wc = b.ccq.wait(t, frTimeout)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		assert.Equal(t, hostverbs.WCRecv, wc.Opcode)
		assert.Equal(t, hostverbs.WCFlagWithInvalidate, wc.Flags&hostverbs.WCFlagWithInvalidate)
		assert.Equal(t, k1, wc.ImmData, "the invalidated key")
		sw := a.ccq.wait(t, frTimeout)
		require.Equal(t, hostverbs.WCSuccess, sw.Status)
		assert.Equal(t, hostverbs.WCSend, sw.Opcode)
		st, _ = x.fr.Registration()
		assert.Equal(t, hostverbs.MRFree, st)

		// Registered again under the next consumer byte: the new key works.
		k2 := x.variant(uint8(k1) + 1)
		x.register(t, k2, frAccessAll)
		fill(data, 42)
		wc = x.write(t, k2, 0, data)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		require.True(t, bytes.Equal(data, x.gpaBytes(t, 0, len(data))))
		// Registering a valid MR is refused; so is another MR's index.
		pl, _ := guestmem.NewPageList(x.iova, x.len, x.gpas)
		require.ErrorIs(t, x.fr.Register(hostverbs.FastReg{Pages: pl, Access: frAccessAll, Key: k2 + 1}), hostverbs.ErrBusy)
		require.NoError(t, x.fr.Invalidate(k2))
		require.ErrorIs(t, x.fr.Register(hostverbs.FastReg{Pages: pl, Access: frAccessAll, Key: k2 + 0x100}), hostverbs.ErrInvalid)
		require.ErrorIs(t, x.fr.Invalidate(k2+1), hostverbs.ErrInvalid, "a key the MR does not have")
		require.NoError(t, x.fr.Invalidate(k2), "invalidating a free MR with its key succeeds (as on rxe)")
		c := b.dev.(*device).f.Counters()
		assert.Equal(t, uint64(1), c["remote_invalidations"])
	})

	refused := []struct {
		name string
		// prepare leaves the MR in some state and returns the key and the
		// IOVA offset a WRITE of 256 bytes then uses.
		prepare func(t *testing.T, x *fastRegFixture) (uint32, uint64)
	}{
		{"invalidated-locally", func(t *testing.T, x *fastRegFixture) (uint32, uint64) {
			k := x.variant(uint8(x.base) + 7)
			x.register(t, k, frAccessAll)
			require.NoError(t, x.fr.Invalidate(k))
			return k, 0
		}},
		{"never-registered", func(t *testing.T, x *fastRegFixture) (uint32, uint64) {
			return x.base, 0
		}},
		{"stale-variant", func(t *testing.T, x *fastRegFixture) (uint32, uint64) {
			k := x.variant(uint8(x.base) + 1)
			x.register(t, k, frAccessAll)
			return x.variant(uint8(x.base)), 0
		}},
		{"out-of-range", func(t *testing.T, x *fastRegFixture) (uint32, uint64) {
			k := x.variant(uint8(x.base) + 1)
			x.register(t, k, frAccessAll)
			return k, x.len - 100
		}},
		{"no-remote-write", func(t *testing.T, x *fastRegFixture) (uint32, uint64) {
			k := x.variant(uint8(x.base) + 1)
			x.register(t, k, hostverbs.AccessLocalWrite|hostverbs.AccessRemoteRead)
			return k, 0
		}},
	}
	for _, tc := range refused {
		t.Run("refused-"+tc.name, func(t *testing.T) {
			x := newFastRegFixture(t, mk)
			key, off := tc.prepare(t, x)
			before := x.gpaBytes(t, 0, int(x.len))
			data := make([]byte, 256)
			fill(data, 7)
			wc := x.write(t, key, off, data)
			assert.Equal(t, hostverbs.WCRemAccessErr, wc.Status, "%+v", wc)
			assert.Equal(t, before, x.gpaBytes(t, 0, int(x.len)), "nothing moved")
			assert.NotZero(t, x.p.b.dev.(*device).f.Counters()["rkey_rejected"])
		})
	}

	t.Run("send-with-invalidate-refused", func(t *testing.T) {
		x := newFastRegFixture(t, mk)
		b := x.p.b
		k := x.variant(uint8(x.base) + 1)
		x.register(t, k, frAccessAll)
		require.NoError(t, x.p.qb.PostRecv(&hostverbs.RecvWR{WRID: 40, SGL: sge(b, 0, 4096)}))
		// b's ordinary MR is not fast-registered: it cannot be invalidated.
		require.NoError(t, x.p.qa.PostSend(&hostverbs.SendWR{WRID: 41, Opcode: hostverbs.WRSendWithInv, Flags: hostverbs.SendSignaled,
			SGL: sge(x.p.a, 0, 64), ImmData: b.mr.RKey()}))
		wc := b.ccq.wait(t, frTimeout)
		assert.Equal(t, hostverbs.WCRemInvReqErr, wc.Status, "%+v", wc)
		sw := x.p.a.ccq.wait(t, frTimeout)
		assert.Equal(t, hostverbs.WCRemInvReqErr, sw.Status, "%+v", sw)
		st, _ := x.fr.Registration()
		assert.Equal(t, hostverbs.MRValid, st, "the fast-reg MR was not touched")
		assert.Equal(t, uint64(1), b.dev.(*device).f.Counters()["remote_invalidate_refused"])
	})

	t.Run("local-use-after-invalidate", func(t *testing.T) {
		x := newFastRegFixture(t, mk)
		k := x.variant(uint8(x.base) + 1)
		x.register(t, k, frAccessAll)
		require.NoError(t, x.fr.Invalidate(k))
		require.NoError(t, x.p.qa.PostRecv(&hostverbs.RecvWR{WRID: 50, SGL: sge(x.p.a, 0, 4096)}))
		err := x.p.qb.PostSend(&hostverbs.SendWR{WRID: 51, Opcode: hostverbs.WRSend, Flags: hostverbs.SendSignaled,
			SGL: []hostverbs.SGE{{Addr: x.iova, Length: 64, LKey: k}}})
		if err == nil {
			wc := x.p.b.ccq.wait(t, frTimeout)
			assert.Equal(t, hostverbs.WCLocProtErr, wc.Status, "%+v", wc)
		}
	})
}

func TestFastRegInProcess(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	runFastReg(t, func(t *testing.T) pair {
		a := newEndpoint(t, f, "a", "10.0.0.1", 1<<20)
		b := newEndpoint(t, f, "b", "10.0.0.2", 1<<20)
		qa, qb := connectRC(t, a, b, defaultRC())
		return pair{a, b, qa, qb}
	})
}

// Two fabrics (two daemons) joined by a MemNet, MTU 1024 so that the
// registration's WRITE and READ take several packets.
func TestFastRegTwoFabrics(t *testing.T) {
	net := wire.NewMemNet(3)
	t.Cleanup(net.Close)
	mk := func() *Fabric {
		f, err := New(Config{Wire: net.Attach(), LinkMTU: 9000})
		require.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	fa, fb := mk(), mk()
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	runFastReg(t, func(t *testing.T) pair {
		a := newEndpoint(t, fa, "a", "10.0.0.1", 1<<20)
		b := newEndpoint(t, fb, "b", "10.0.0.2", 1<<20)
		qa, qb := connectRC(t, a, b, o)
		return pair{a, b, qa, qb}
	})
}

// TestFastRegStaleKeyNeverNamesRecycledMR: a fast-reg MR registered under
// several consumer bytes, then destroyed, leaves its key index to the next
// MR (the free list hands it back at once here). Over many cycles, the
// next MR on the index, a plain MR or another fast-reg MR, never has a key
// any registration of the previous one had, so a peer's stale key is
// refused: lookups fail, and a WRITE through the last one is a remote
// access error.
func TestFastRegStaleKeyNeverNamesRecycledMR(t *testing.T) {
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	a := newEndpoint(t, f, "a", "10.0.0.1", 1<<20)
	b := newEndpoint(t, f, "b", "10.0.0.2", 1<<20)
	qa, _ := connectRC(t, a, b, defaultRC())
	d := b.dev.(*device)
	fpd := b.pd.(hostverbs.FastRegPD)
	pl, err := guestmem.NewPageList(0x10000, 4096, []guestmem.GPA{0x3000})
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(40, 3))
	var stale []uint32 // every key of the MR that had the index last
	for i := range 1500 {
		// The next MR on the index: a plain MR or a fast-reg MR.
		var key uint32
		var dereg func() error
		var fr hostverbs.FastRegMR
		if i%2 == 0 {
			m, err := b.pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: frAccessAll})
			require.NoError(t, err)
			key, dereg = m.LKey(), m.Dereg
		} else {
			fr, err = fpd.AllocFastRegMR(hostverbs.FastRegAttr{MaxPages: 1})
			require.NoError(t, err)
			key, dereg = fr.LKey(), fr.Dereg
		}
		for _, s := range stale {
			require.Equal(t, s>>8, key>>8, "iteration %d: the index was recycled", i)
			require.NotEqual(t, s, key, "iteration %d: a stale key %#x names the next MR on its index", i, s)
			if fr == nil {
				require.Nil(t, d.keys.lookup(s), "iteration %d: stale key %#x resolves", i, s)
			}
		}
		if fr == nil && i > 0 && i%100 == 0 {
			// A peer's WRITE through the last stale key is refused.
			require.NoError(t, qa.PostSend(&hostverbs.SendWR{WRID: uint64(i), Opcode: hostverbs.WRRDMAWrite,
				Flags: hostverbs.SendSignaled, SGL: sge(a, 0, 64), RemoteAddr: 0x10000, RKey: stale[len(stale)-1]}))
			wc := a.ccq.wait(t, frTimeout)
			require.Equal(t, hostverbs.WCRemAccessErr, wc.Status, "%+v", wc)
			qa, _ = connectRC(t, a, b, defaultRC())
		}
		stale = append(stale[:0], key)
		if fr != nil {
			// The guest registers it under consumer bytes of its choice,
			// invalidating all but the last.
			for r := range 4 {
				k := key&^0xff | uint32(rng.Uint32N(256))
				require.NoError(t, fr.Register(hostverbs.FastReg{Pages: pl, Access: frAccessAll, Key: k}))
				stale = append(stale, k)
				if r < 3 {
					require.NoError(t, fr.Invalidate(k))
				}
			}
		}
		require.NoError(t, dereg())
	}
}
