package hostile

import (
	"context"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// TestSupervisorKill9KeepsVMs: a daemon run as a plain process (`serve`,
// no systemd) under its own supervisor; two fake-driver VMs stream RDMA
// WRITEs when its worker is killed with SIGKILL, three times. Each time
// the stream in flight ends with an error, never a hang: its RC QP moved
// to the error state and its WRITEs flushed, or (when the kill came
// between the worker reading a doorbell and answering it) the driver's
// request timed out, as QEMU's does after x-msg-timeout; the VMs' vfio-user
// connections stay open (the supervisor held them), and on the same
// connections, with the PD and MR registered before the first kill, new
// CQs and RC QPs carry a data-checked stream. Between the first and the
// second kill the daemon is upgraded live (the worker execs its binary).
func TestSupervisorKill9KeepsVMs(t *testing.T) {
	dir := serveProcess(t, []string{"sv0", "sv1"}, daemonOpts{args: []string{"--restart-delay", "10ms"}})
	e := externalEnv(t, dir)
	a, b := e.pairGIDs("sv0", "sv1", 1, 2, 12, 7)
	ctx := context.Background()

	for round := 1; round <= 3; round++ {
		st, err := e.ctl.Status(ctx)
		require.NoError(t, err)
		require.NotNil(t, st.Supervisor, "serve runs under its supervisor")
		worker := st.PID
		if round == 2 {
			// A live upgrade under the supervisor: the worker execs its
			// binary in its process, the RC QPs keep their connection,
			// and the store keeps one copy of each descriptor the new
			// image stores again (the kill below needs them all).
			h := upgradeDaemon(t, e.ctl, 1)
			assert.Equal(t, 2, h.Continued, "both RC QPs kept their connection")
			st, err = e.ctl.Status(ctx)
			require.NoError(t, err)
			assert.Equal(t, worker, st.PID, "the upgrade kept the worker's process")
			require.NotNil(t, st.Supervisor)
			assert.Equal(t, 1, st.Supervisor.Restarts)
		}

		var stop atomic.Bool
		var done atomic.Int64
		ended := make(chan error, 1)
		go func() { ended <- streamWrites(a, b, &stop, &done) }()
		require.Eventually(t, func() bool { return done.Load() >= 20*scaleMsg }, time.Minute, time.Millisecond, "round %d: the stream runs", round)
		require.NoError(t, syscall.Kill(worker, syscall.SIGKILL))
		killed := time.Now()
		select {
		case err := <-ended:
			assert.Error(t, err, "round %d: the stream in flight ends with an error", round)
			t.Logf("round %d: the stream in flight ended %v after the kill: %v", round, time.Since(killed).Round(time.Millisecond), err)
		case <-time.After(time.Minute):
			stop.Store(true)
			t.Fatalf("round %d: the stream in flight hangs", round)
		}
		stop.Store(true)

		var back backend.Status
		require.Eventually(t, func() bool {
			back, err = e.ctl.Status(ctx)
			if err != nil || back.PID == worker || len(back.VMs) != 2 {
				return false
			}
			for _, v := range back.VMs {
				if !v.Connected {
					return false
				}
			}
			return true
		}, time.Minute, 5*time.Millisecond, "round %d: the restarted worker did not resume both VMs", round)
		require.NotNil(t, back.Supervisor)
		assert.Equal(t, round, back.Supervisor.Restarts)

		// New CQs and QPs on the kept connections and objects.
		fresh := func(p *endpoint) *endpoint {
			q := *p
			q.scq, q.rcq = p.v.createCQ(p.uc, 64), p.v.createCQ(p.uc, 64)
			q.qp = q.rcQP(q.scq, q.rcq)
			return &q
		}
		a, b = fresh(a), fresh(b)
		connectRC(a, b, 12, 7)
		stop.Store(false)
		done.Store(0)
		s := writeStream{src: a, dst: b, size: scaleMsg, window: scaleWindow, stop: &stop, done: &done, verify: true, seed: uint64(round)}
		go func() {
			for done.Load() < 20*scaleMsg {
				time.Sleep(time.Millisecond)
			}
			stop.Store(true)
		}()
		require.NoError(t, s.run(), "round %d: a data-checked stream after the restart", round)
	}
}
