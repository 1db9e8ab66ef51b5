package vdev

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// TestHandoverSoftFastReg: a guest kernel's fast registration survives a
// planned hand-over. Guest a registered pages under its key and gave it to
// its peer (as nvme-rdma gives the key of an I/O's buffer to the target);
// the daemon hands over between the registration and the peer's access;
// the next process rebuilds the device and registers the MR again under
// the same key, so the peer's WRITE lands, its SEND with invalidate frees
// it, and after that the key is refused. A successor that does not know
// fast-reg records gets none, and the key is refused there.
func TestHandoverSoftFastReg(t *testing.T) {
	for _, tc := range []struct {
		name     string
		features []string
		kept     bool
	}{
		{"kept", JournalFeatures(), true},
		{"successor-without-fastreg", []string{featureTransport, featureSRQ}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newSoftFabric(t)
			peer := newSoftKernelSide(t, f, "vm-b", gidB)
			var dev1 atomicDevice
			g, j, sd1 := newHandoverSoftGuest(t, f, "vm-a", &dev1)
			d1 := dev1.Load()
			mem := g.mem
			a := &softSide{g: g, gid: gidA}
			a.pd = g.createPD(0)
			a.scq, a.rcq = g.createCQ(0, 256), g.createCQ(0, 256)
			a.mr = g.regMR(a.pd, 0xffff888000010000, 256<<10, 0xf)
			a.qp = g.createQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeRC, sendWR: 64, recvWR: 64, sendSGE: 2, recvSGE: 2})
			connect(a, peer)
			g.events()

			var fr abi.CreateMRResp
			fr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: a.pd, Flags: abi.MRFlagFRMR, NChunks: 8}))
			pages := g.scatteredPages(2)
			const iova = 0xffff888055550000
			key := fr.LKey&^0xff | (fr.LKey+5)&0xff
			h := wqe(hostverbs.WRRegMR, 1, hostverbs.SendSignaled)
			abi.WRFastReg{IOVAStart: iova, PLPDirDMA: g.pdir(pages), PageShift: 12, PageListLen: 2, Length: 8192,
				AccessFlags: uint32(hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite), RKey: key}.Encode(h.WR[:])
			a.qp.postSend(h)
			require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, a.scq).Status)
			region := &gmr{iova: iova, length: 8192, pages: pages}

			eventuallyTrue(t, d1.SendsDrained)
			rep, err := d1.SaveTransportsFor(tc.features)
			require.NoError(t, err)
			require.Equal(t, 1, rep.Saved)
			require.NoError(t, sd1.Close())
			var dev2 atomicDevice
			sd2 := openHandoverSoft(t, f, "vm-a", mem, &dev2)
			rrep, err := g.restart(sd2, j.bytes(), nil)
			require.NoError(t, err)
			dev2.Store(g.dev)
			assert.Equal(t, 1, rrep.Continued, "%q", rrep.Notes)
			assert.Empty(t, rrep.Notes)

			write := func(wrid uint64, data []byte) abi.CQE {
				t.Helper()
				peer.mr.write(peer.g, 0, data)
				h := wqe(hostverbs.WRRDMAWrite, wrid, hostverbs.SendSignaled)
				abi.WRRDMA{RemoteAddr: iova + 10, RKey: key}.Encode(h.WR[:])
				peer.qp.postSend(h, peer.sge(0, uint32(len(data))))
				return waitCQE(t, peer.scq)
			}
			data := randBytes(6000, 1)
			if !tc.kept {
				assert.Zero(t, rep.SavedFastRegs)
				assert.Zero(t, rrep.RestoredFastRegs)
				assert.EqualValues(t, hostverbs.WCRemAccessErr, write(2, data).Status, "the registration died with the old process")
				return
			}
			assert.Equal(t, 1, rep.SavedFastRegs)
			assert.Equal(t, 1, rrep.RestoredFastRegs)
			require.EqualValues(t, hostverbs.WCSuccess, write(2, data).Status, "the key given before the hand-over works after it")
			assert.True(t, bytes.Equal(data, region.read(g, 10, uint64(len(data)))))
			a.qp.postRecv(30, a.sge(0, 4096))
			h = wqe(hostverbs.WRSendWithInv, 3, hostverbs.SendSignaled)
			h.Ex = key
			peer.qp.postSend(h, peer.sge(0, 16))
			r := waitCQE(t, a.rcq)
			require.EqualValues(t, hostverbs.WCSuccess, r.Status)
			assert.Equal(t, key, r.ImmData)
			require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, peer.scq).Status)
			assert.EqualValues(t, hostverbs.WCRemAccessErr, write(4, data).Status)
		})
	}
}

// TestHandoverFastRegInvalidatedWhileBusy: a peer keeps the guest's RC QP
// busy (the guest's SEND waits for a receive the peer does not post), so
// a hand-over's first SaveTransports pass cannot freeze it, then frees the
// guest's registration with a SEND with invalidate through that QP, which
// the guest sees (its receive completes WITH_INVALIDATE) and may reuse the
// pages after. Whether a later pass freezes the QP ("frozen-later") or
// none does and the invalidation comes after the last one ("never-frozen"),
// the successor must not bring the key back.
func TestHandoverFastRegInvalidatedWhileBusy(t *testing.T) {
	for _, frozenLater := range []bool{true, false} {
		name := map[bool]string{true: "frozen-later", false: "never-frozen"}[frozenLater]
		t.Run(name, func(t *testing.T) {
			f := newSoftFabric(t)
			peer := newSoftKernelSide(t, f, "vm-b", gidB)
			var dev1 atomicDevice
			g, j, sd1 := newHandoverSoftGuest(t, f, "vm-a", &dev1)
			d1 := dev1.Load()
			mem := g.mem
			a := &softSide{g: g, gid: gidA}
			a.pd = g.createPD(0)
			a.scq, a.rcq = g.createCQ(0, 256), g.createCQ(0, 256)
			a.mr = g.regMR(a.pd, 0xffff888000010000, 256<<10, 0xf)
			a.qp = g.createQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeRC, sendWR: 64, recvWR: 64, sendSGE: 2, recvSGE: 2})
			connect(a, peer)
			g.events()

			var fr abi.CreateMRResp
			fr.Decode(g.mustCmd(abi.CmdCreateMR, abi.CreateMR{PDHandle: a.pd, Flags: abi.MRFlagFRMR, NChunks: 8}))
			pages := g.scatteredPages(2)
			const iova = 0xffff888055550000
			key := fr.LKey&^0xff | (fr.LKey+5)&0xff
			h := wqe(hostverbs.WRRegMR, 1, hostverbs.SendSignaled)
			abi.WRFastReg{IOVAStart: iova, PLPDirDMA: g.pdir(pages), PageShift: 12, PageListLen: 2, Length: 8192,
				AccessFlags: uint32(hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead), RKey: key}.Encode(h.WR[:])
			a.qp.postSend(h)
			require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, a.scq).Status)
			// The receive the SEND with invalidate will take, and a SEND
			// the peer holds up (RNR: it posts no receive).
			a.qp.postRecv(30, a.sge(0, 4096))
			a.qp.postSend(wqe(hostverbs.WRSend, 2, hostverbs.SendSignaled), a.sge(8192, 64))

			rep, err := d1.SaveTransportsFor(JournalFeatures())
			require.NoError(t, err)
			require.Contains(t, rep.Failed, a.qp.handle, "the busy QP is not frozen: %+v", rep)
			if !frozenLater {
				// The hand-over gives up on it: this was the last pass.
				rep, err = d1.SaveTransportsFor(JournalFeatures())
				require.NoError(t, err)
				require.Contains(t, rep.Failed, a.qp.handle)
				assert.Zero(t, rep.SavedFastRegs, "a QP of the MR's PD can still invalidate it")
			}

			// The peer invalidates the key through the busy QP; the guest
			// is told, and may reuse the pages from now on.
			h = wqe(hostverbs.WRSendWithInv, 3, hostverbs.SendSignaled)
			h.Ex = key
			peer.qp.postSend(h, peer.sge(0, 16))
			require.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, peer.scq).Status)
			r := waitCQEHeld(t, a.rcq)
			require.EqualValues(t, hostverbs.WCSuccess, r.Status)
			require.NotZero(t, r.WCFlags&uint32(hostverbs.WCFlagWithInvalidate))

			if frozenLater {
				// The peer posts its receive: the guest's SEND completes,
				// and the next pass freezes the QP.
				peer.qp.postRecv(40, peer.sge(0, 4096))
				require.EqualValues(t, hostverbs.WCSuccess, waitCQEHeld(t, a.scq).Status)
				eventuallyTrue(t, d1.SendsDrained)
				rep, err = d1.SaveTransportsFor(JournalFeatures())
				require.NoError(t, err)
				require.Empty(t, rep.Failed)
				assert.Zero(t, rep.SavedFastRegs, "the registration is free at the last pass")
			}
			require.NoError(t, sd1.Close())
			var dev2 atomicDevice
			sd2 := openHandoverSoft(t, f, "vm-a", mem, &dev2)
			rrep, err := g.restart(sd2, j.bytes(), nil)
			require.NoError(t, err)
			dev2.Store(g.dev)
			assert.Zero(t, rrep.RestoredFastRegs, "the invalidated key came back: %q", rrep.Notes)
			g.dev.mu.Lock()
			st, _ := g.dev.frmrs[fr.LKey>>8].fr.Registration()
			g.dev.mu.Unlock()
			assert.Equal(t, hostverbs.MRFree, st)
			if frozenLater {
				// The connection was kept: the peer's WRITE through the
				// dead key is a remote access error.
				hw := wqe(hostverbs.WRRDMAWrite, 4, hostverbs.SendSignaled)
				abi.WRRDMA{RemoteAddr: iova, RKey: key}.Encode(hw.WR[:])
				peer.qp.postSend(hw, peer.sge(0, 64))
				assert.EqualValues(t, hostverbs.WCRemAccessErr, waitCQE(t, peer.scq).Status)
			}
		})
	}
}

// waitCQEHeld is waitCQE for a guest held by a hand-over: it reads its CQ
// ring in memory, as the driver polls, and rings no doorbell (its BAR
// writes wait in the socket; one would abandon the hand-over).
func waitCQEHeld(t testing.TB, c *gcq) abi.CQE {
	t.Helper()
	for range 20000 {
		if e, ok := c.poll(); ok {
			return e
		}
		time.Sleep(500 * time.Microsecond)
	}
	t.Fatalf("no CQE on CQ %d", c.handle)
	return abi.CQE{}
}
