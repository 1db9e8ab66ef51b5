package vdev

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// pathIRQ is a SyncIRQ that records which path each vector took: Trigger
// (the backend hands it to the connection's signaller, which may run after
// the register write is answered) or TriggerSync (signalled before the
// write's handler returns). Both count in the guest's fakeIRQ.
type pathIRQ struct {
	f          *fakeIRQ
	mu         sync.Mutex
	async, syn map[int]int
}

func (p *pathIRQ) Trigger(v int) {
	p.mu.Lock()
	p.async[v]++
	p.mu.Unlock()
	p.f.Trigger(v)
}

func (p *pathIRQ) TriggerSync(v int) {
	p.mu.Lock()
	p.syn[v]++
	p.mu.Unlock()
	p.f.Trigger(v)
}

// TestCommandDoneSignalledBeforeWriteReturns: the command-done interrupt
// (vector 0) of every command, successful or not, is signalled on the
// goroutine of the REQUEST write, before the write is answered, when the
// IRQ can (SyncIRQ). The stock driver waits for it with
// wait_for_completion_interruptible_timeout, which gives up at once for a
// task with a signal pending unless the interrupt has already completed
// it: LIO's iSER teardown, signalled, logged "completion timeout or
// interrupted" and "could not modify queuepair, error: -110" when the
// interrupt was left to a goroutine that ran after the write's reply.
func TestCommandDoneSignalledBeforeWriteReturns(t *testing.T) {
	mem, raw := guestmem.NewFlat(0, guestRAMSize)
	g := &guest{t: t, mem: mem, raw: raw, verbs: newFakeVerbs(), irq: &fakeIRQ{}, next: 1 << 20}
	irq := &pathIRQ{f: g.irq, async: map[int]int{}, syn: map[int]int{}}
	d, err := New(Config{Memory: mem, Verbs: g.verbs, IRQ: irq, MAC: testMAC})
	require.NoError(t, err)
	g.dev = d
	t.Cleanup(func() { _ = d.Close() })
	g.probe()
	pd := g.createPD(0)
	errReg, _ := g.cmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd + 100}) // fails: no such PD
	require.NotZero(t, errReg)
	g.mustCmd(abi.CmdDestroyPD, abi.DestroyPD{PDHandle: pd})
	irq.mu.Lock()
	defer irq.mu.Unlock()
	assert.Equal(t, 3, irq.syn[abi.VectorResponse], "each command's completion signalled before REQUEST returns")
	assert.Zero(t, irq.async[abi.VectorResponse], "none left to the asynchronous signaller")
}
