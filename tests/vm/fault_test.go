package vm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFaultWatch: each kind of fault line triggers the watch once and starts the
// excerpt; ordinary lines and an RCU stall's stack trace do not.
func TestFaultWatch(t *testing.T) {
	for _, line := range []string{
		"[   12.3] BUG: kernel NULL pointer dereference, address: 0000000000000008",
		"[   12.3] Oops: 0000 [#1] PREEMPT SMP NOPTI",
		"[   99.0] Kernel panic - not syncing: Fatal exception",
		"[    5.0] Call Trace:",
		"[  243.1] INFO: task kworker/0:1:42 blocked for more than 120 seconds.",
		"[   30.0] watchdog: BUG: soft lockup - CPU#0 stuck for 22s! [init:1]",
	} {
		f := newFaultWatch(nil, nil)
		require.False(t, f.line("[    1.0] vmw_pvrdma 0000:00:05.1: device version 20"))
		require.True(t, f.line(line), line)
		require.False(t, f.line(" <TASK>"), "only the first fault line reports")
		require.Equal(t, line+"\n <TASK>", f.fault())
		select {
		case <-f.triggered:
		default:
			t.Fatal("not triggered")
		}
	}

	f := newFaultWatch(nil, nil)
	require.False(t, f.line("[   40.0] rcu: INFO: rcu_preempt self-detected stall on CPU"))
	require.False(t, f.line("[   40.0] Call Trace:"), "an RCU stall's trace is the host starving the guest")
	require.True(t, f.line("[   41.0] BUG: unable to handle page fault for address: ffff"), "a BUG still counts")

	// The excerpt stops after faultExcerptLines and is then complete.
	f = newFaultWatch(nil, nil)
	require.True(t, f.line("Oops"))
	for range faultExcerptLines + 10 {
		f.line("trace")
	}
	select {
	case <-f.done:
	default:
		t.Fatal("excerpt not complete")
	}
	require.Len(t, splitLines(f.fault()), faultExcerptLines+1)
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := range len(s) {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

// TestKnownWarning: a WARNING a test declares, and the stack trace after it, do not
// fail the guest; another fault after it does.
func TestKnownWarning(t *testing.T) {
	var logged []string
	f := newFaultWatch(CrashWarnings(), func(format string, args ...any) {
		logged = append(logged, format)
	})
	require.False(t, f.line("[   65.794567] ------------[ cut here ]------------"))
	require.False(t, f.line("[   65.795547] WARNING: CPU: 0 PID: 0 at kernel/softirq.c:400 __local_bh_enable_ip+0x4e/0x70"))
	require.False(t, f.line("[   65.806098] Call Trace:"))
	require.False(t, f.line("[   65.808622]  svc_xprt_enqueue+0xcf/0x1d0 [sunrpc]"))
	require.Len(t, logged, 1, "the known warning is logged")
	require.False(t, f.line("[   83.012672] WARNING: CPU: 0 PID: 289 at drivers/infiniband/core/cq.c:148 ib_cq_completion_direct+0x29/0x30 [ib_core]"))
	require.False(t, f.line("[   83.021423] Call Trace:"))
	require.Len(t, logged, 2)
	require.True(t, f.line("[   70.000000] BUG: kernel NULL pointer dereference, address: 0000000000000010"))

	f = newFaultWatch(CrashWarnings(), nil)
	require.False(t, f.line("[    1.0] WARNING: CPU: 0 PID: 1 at drivers/infiniband/core/cq.c:100 __ib_drain_sq+0x1/0x2"))
	require.True(t, f.line("[    1.0] Call Trace:"), "another warning's trace fails the guest")
}
