package hostile

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Guests that disappear mid-transfer: two VMs stream SENDs, RDMA WRITEs
// and RDMA READs at each other from their own goroutines (one per VM, as
// a vCPU would), then one of them vanishes. The survivor's QP must end
// with error completions and flushes for everything outstanding, never
// hang, and the daemon must serve on.

const (
	streamBytes = 16 << 10
	streamDepth = qpDepth / 2 // sends in flight per VM
	// rnrRetry 3: an RNR retry count of 7 waits for a receive buffer
	// forever (IBA 9.7.5.2.8), on any HCA; a guest that wants to hear
	// about a peer that stopped posting receives chooses less. With the
	// longest RNR timer (code 0, 655 ms) a peer that is merely slow to
	// repost (a descheduled vCPU) does not exhaust it.
	rnrRetry = 3
	rnrTimer = 0
	// streamTimeout bounds a stream's end after its peer vanished: the
	// transport's retry budget (timeout 14 = 67 ms, 7 retries) is far less.
	streamTimeout = 30 * time.Second
)

var errVanished = errors.New("told to vanish")

// stream drives one endpoint's QP from its own goroutine.
type stream struct {
	p, peer *endpoint
	ops     atomic.Int64         // successful send-side completions
	stop    chan struct{}        // the VM vanishes: stop at once
	act     chan func(*vm) error // do this with the VM's own client, then wait for stop
	acted   chan struct{}        // closed once the action returned
	halt    sync.Once
	running sync.WaitGroup

	// Results, read after run returned.
	sendStatus, recvStatus map[hostverbs.WCStatus]int
	sendOut, recvOut       int
	failedAt               time.Time
}

func newStream(p, peer *endpoint) *stream {
	return &stream{p: p, peer: peer, stop: make(chan struct{}), act: make(chan func(*vm) error, 1), acted: make(chan struct{}),
		sendStatus: map[hostverbs.WCStatus]int{}, recvStatus: map[hostverbs.WCStatus]int{}}
}

// post writes the next work request: SENDs, WRITEs into the peer's MR and
// READs from it, in turn.
func (s *stream) post(n uint64) {
	p, q, mr := s.p, s.p.qp, s.p.mr
	switch n % 3 {
	case 0:
		q.writeSend(sendWQE(n), mr.sge(0, streamBytes))
	case 1:
		q.writeSend(writeWQE(n, s.peer.mr.iova+streamBytes, s.peer.mr.rkey), mr.sge(streamBytes, streamBytes))
	case 2:
		h := writeWQE(n, s.peer.mr.iova+2*streamBytes, s.peer.mr.rkey)
		h.Opcode = uint32(hostverbs.WRRDMARead)
		q.writeSend(h, mr.sge(3*streamBytes, streamBytes))
	}
	_ = p
}

// run streams until the QP fails (then it waits until every outstanding
// send and receive completed, flushed or not) or the VM is told to vanish.
func (s *stream) run() error {
	v, q := s.p.v, s.p.qp
	for i := 0; i < qpDepth; i++ {
		q.writeRecv(uint64(1<<32+i), s.p.mr.sge(0, streamBytes))
	}
	if err := v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPRecv|q.handle); err != nil {
		return err
	}
	s.recvOut = qpDepth
	deadline := time.Now().Add(time.Hour)
	var next uint64
	var lastPoll time.Time
	failed := false
	for {
		select {
		case <-s.stop:
			return errVanished
		case f := <-s.act:
			if err := f(v); err != nil {
				return err
			}
			close(s.acted) // the client is the test goroutine's from now on
			<-s.stop
			return errVanished
		default:
		}
		busy := false
		if !failed && s.sendOut < streamDepth {
			s.post(next)
			next++
			s.sendOut++
			busy = true
			if err := v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle); err != nil {
				return err
			}
		}
		for {
			e, ok, err := s.p.scq.tryPoll()
			if err != nil {
				return err
			}
			if !ok {
				break
			}
			busy = true
			s.sendOut--
			s.sendStatus[hostverbs.WCStatus(e.Status)]++
			if e.Status == uint32(hostverbs.WCSuccess) {
				s.ops.Add(1)
			} else if !failed {
				failed, s.failedAt = true, time.Now()
				deadline = s.failedAt.Add(streamTimeout)
			}
		}
		repost := 0
		for {
			e, ok, err := s.p.rcq.tryPoll()
			if err != nil {
				return err
			}
			if !ok {
				break
			}
			busy = true
			s.recvOut--
			s.recvStatus[hostverbs.WCStatus(e.Status)]++
			if e.Status == uint32(hostverbs.WCSuccess) && !failed {
				q.writeRecv(e.WRID, s.p.mr.sge(0, streamBytes))
				repost++
			}
		}
		if repost > 0 {
			s.recvOut += repost
			if err := v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPRecv|q.handle); err != nil {
				return err
			}
		}
		if failed && s.sendOut == 0 && s.recvOut == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("hung %v after the first error: %d sends and %d receives outstanding (sends %v, receives %v)",
				streamTimeout, s.sendOut, s.recvOut, s.sendStatus, s.recvStatus)
		}
		if !busy {
			if time.Since(lastPoll) > 5*time.Millisecond { // rdma-core's POLL on an empty CQ
				lastPoll = time.Now()
				if err := v.tryDoorbell(s.p.uc, abi.UARCQOffset, abi.UARCQPoll|s.p.scq.handle); err != nil {
					return err
				}
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
}

// start runs s on its own goroutine; the channel yields run's result.
// At cleanup (before the VMs' RAM is unmapped) the stream is stopped and
// waited for.
func (s *stream) start(t *testing.T) <-chan error {
	done := make(chan error, 1)
	s.running.Add(1)
	go func() {
		defer s.running.Done()
		done <- s.run()
	}()
	t.Cleanup(func() {
		s.vanish()
		s.running.Wait()
	})
	return done
}

func (s *stream) vanish() { s.halt.Do(func() { close(s.stop) }) }

func waitDone(t *testing.T, done <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(2 * streamTimeout):
		t.Fatalf("%s did not finish", what)
		return nil
	}
}

// vanishing ways: the first closes the connection (QEMU killed), the
// others are actions of the victim's own driver or QEMU mid-stream.
var vanishing = []struct {
	name string
	act  func(v *vm) error
}{
	{"connection closed", nil},
	{"memory unmapped", func(v *vm) error { return v.c.DMAUnmap(0, ramSize, 0) }},
	{"device reset", func(v *vm) error { return v.c.Reset() }},
	{"CTL reset", func(v *vm) error { return v.c.Write32(bar1, abi.RegCtl, abi.CtlReset) }},
}

func TestGuestDisappearsMidTransfer(t *testing.T) {
	for _, way := range vanishing {
		t.Run(way.name, func(t *testing.T) {
			e := newEnv(t)
			victim, survivor := e.pairRetry(vmEvil, vmPeer, rnrTimer, rnrRetry)
			vs, ss := newStream(victim, survivor), newStream(survivor, victim)
			vDone, sDone := vs.start(t), ss.start(t)
			require.Eventually(t, func() bool { return vs.ops.Load() >= 30 && ss.ops.Load() >= 30 },
				10*time.Second, time.Millisecond, "both VMs streaming")

			if way.act == nil {
				require.NoError(t, victim.v.c.Close()) // QEMU killed: EOF, nothing else
				vs.vanish()
				if err := waitDone(t, vDone, "victim"); !errors.Is(err, errVanished) {
					require.ErrorIs(t, err, net.ErrClosed)
				}
			} else {
				vs.act <- way.act
				select {
				case <-vs.acted:
				case err := <-vDone:
					t.Fatalf("victim: %v", err)
				case <-time.After(10 * time.Second):
					t.Fatalf("%s did not return", way.name)
				}
			}

			require.NoError(t, waitDone(t, sDone, "survivor"))
			t.Logf("survivor: %d ops, sends %v, receives %v", ss.ops.Load(), ss.sendStatus, ss.recvStatus)
			// One completion carries the error (a send: retry or RNR retry
			// exceeded, a NAK; or a receive the peer's vanished memory
			// could not fill), everything else succeeded or was flushed.
			errs := 0
			for _, m := range []map[hostverbs.WCStatus]int{ss.sendStatus, ss.recvStatus} {
				for st, n := range m {
					if st != hostverbs.WCSuccess && st != hostverbs.WCWRFlushErr {
						errs += n
					}
				}
			}
			require.Equal(t, 1, errs, "one error completion, the rest flushed: sends %v, receives %v",
				ss.sendStatus, ss.recvStatus)
			require.Zero(t, ss.sendOut+ss.recvOut, "every outstanding WQE came back")
			require.Equal(t, hostverbs.QPStateErr, survivor.qp.state())

			if way.act != nil {
				// The victim's device is still there and answers.
				switch way.name {
				case "memory unmapped":
					require.EqualValues(t, abi.DeviceVersion, victim.v.reg(abi.RegVersion))
					victim.v.setReg(abi.RegRequest, 0)
					require.EqualValues(t, eFault, victim.v.reg(abi.RegErr), "the command slot is gone")
				case "device reset":
					victim.v.pciSetup()
					victim.v.probe()
					require.Zero(t, victim.v.createPD(0), "everything before the reset is gone")
				default:
					victim.v.probe()
					require.Zero(t, victim.v.createPD(0), "everything before the reset is gone")
				}
				vs.vanish()
				require.ErrorIs(t, waitDone(t, vDone, "victim"), errVanished)
			}
			victim.Close()

			// The survivor's device serves on: a new pair of its own QPs
			// works.
			a, b := survivor.loopPair2(survivor.scq, survivor.v.createCQ(survivor.uc, 16))
			b.postRecv(1, survivor.mr.sge(0, 64))
			a.postSend(sendWQE(2), survivor.mr.sge(0x100, 64))
			requireCQE(t, survivor.scq.wait(), a, 2, hostverbs.WCSend, hostverbs.WCSuccess)
			e.healthy()
		})
	}
}

// TestDaemonShutdownUnderLoad stops the daemon (SIGTERM's path) while two
// VMs stream at each other: Run returns cleanly, both QEMUs see their
// connection end, and everything the daemon held is released.
func TestDaemonShutdownUnderLoad(t *testing.T) {
	e := newEnv(t)
	a, b := e.pairRetry(vmEvil, vmPeer, rnrTimer, rnrRetry)
	as, bs := newStream(a, b), newStream(b, a)
	aDone, bDone := as.start(t), bs.start(t)
	require.Eventually(t, func() bool { return as.ops.Load() >= 30 && bs.ops.Load() >= 30 },
		10*time.Second, time.Millisecond, "both VMs streaming")
	start := time.Now()
	e.down = true
	require.NoError(t, e.shutdown())
	t.Logf("shutdown with busy VMs in %v", time.Since(start))
	for _, done := range []<-chan error{aDone, bDone} {
		err := waitDone(t, done, "stream")
		require.Error(t, err, "the connection ended under the stream")
		require.NotErrorIs(t, err, errVanished)
	}
	a.Close()
	b.Close()
	// The cleanup checks that goroutines, descriptors and locked memory
	// are back to what they were before the daemon started.
}
