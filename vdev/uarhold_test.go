package vdev

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// TestMemoryDoorbellsHeldForHandover: a hand-over holds a guest whose
// doorbells are in memory (HoldDoorbells), then saves its RC QPs' transport
// states. The guest's stores go on (plain memory, no connection to hold):
// the poller must not take them, or it would post new work and void the
// saved states (the guest went on: the successor would bring the RC QP
// back in ERR, as TestUpgradeKeepsVMsMemoryDoorbells found it did). They
// stay in memory for the successor; a hand-over abandoned
// (ReleaseDoorbells) takes them here.
func TestMemoryDoorbellsHeldForHandover(t *testing.T) {
	fv := newFakeVerbs()
	mem, raw := guestmem.NewFlat(0, guestRAMSize)
	g := &guest{t: t, mem: mem, raw: raw, verbs: fv, irq: &fakeIRQ{}, next: 1 << 20}
	j := &journalBuf{}
	dev, err := New(Config{Memory: mem, Verbs: fv, IRQ: g.irq, MAC: testMAC, Journal: j.sink,
		Doorbells: DoorbellsMemory, manualDoorbellPoll: true})
	require.NoError(t, err)
	g.dev = dev
	t.Cleanup(func() { _ = dev.Close() })
	g.probe()
	g.bindGID(0, gidA)
	uc := g.createUC(1)
	pd := g.createPD(uc)
	c := g.createCQ(uc, 64)
	mr := g.regMR(pd, 0x7f0000000000, 1<<16, 0xf)
	q := g.createQP(qpSpec{pd: pd, scq: c, rcq: c, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 1, recvSGE: 1, uar: 1})
	q.toRTS(0x99, gidB, 0)
	fq := fakeQPOf(t, fv, q.qpn)
	now := time.Unix(5000, 0)

	dev.HoldDoorbells()
	rep, err := dev.SaveTransports()
	require.NoError(t, err)
	require.Equal(t, 1, rep.Saved)
	q.writeSend(wqe(hostverbs.WRSend, 7, hostverbs.SendSignaled), abi.SGE{Addr: mr.iova, Length: 8, LKey: mr.lkey})
	g.store(1, abi.UARQPOffset, abi.UARQPSend|q.handle)
	g.store(1, abi.UARCQOffset, abi.UARCQPoll|c.handle)
	assert.False(t, g.pass(now), "held: no doorbell taken")
	assert.NotContains(t, recordTypes(j.bytes()), recHandoverAbort, "the saved transport states stand")
	fv.mu.Lock()
	frozen := fq.frozen
	fv.mu.Unlock()
	assert.True(t, frozen, "the provider QP stays frozen")
	sends, _ := fq.take()
	assert.Empty(t, sends, "no new work while held")
	assert.NotZero(t, atomic.LoadUint32(dev.uarm.word(1, abi.UARQPOffset)), "the doorbell waits in memory for the successor")
	assert.Zero(t, dev.Stats().MemoryDoorbells.QP)

	// Abandoned: the device serves on and takes what was stored.
	dev.ResumeTransports()
	dev.ReleaseDoorbells()
	assert.True(t, g.pass(now.Add(time.Millisecond)))
	sends, _ = fq.take()
	assert.Len(t, sends, 1, "the send stored while held is posted")
	assert.EqualValues(t, 1, dev.Stats().MemoryDoorbells.QP)
}
