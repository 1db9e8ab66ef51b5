package vm

import (
	"regexp"
	"strings"
	"sync"
)

// A guest's kernel that oopses, panics or hangs a task rarely takes the guest down: the
// scenario waits for a peer or a device that will never answer, and the test would sit
// until its deadline. The harness reads every console line; the first that reports a
// kernel fault fails the guest at once (Wait returns a *KernelFaultError with the
// excerpt, and QEMU is stopped).

// kernelFaultRE matches the console lines that report a kernel fault: a BUG (a NULL
// dereference, a soft lockup), an oops, a panic, a stack trace (WARN_ON's included), a
// hung task.
var kernelFaultRE = regexp.MustCompile(`BUG: |\bOops\b|Kernel panic|Call Trace:|blocked for more than \d+ seconds`)

// rcuStallRE matches the header of an RCU stall report. Its stack trace is the guest's
// vCPU starved by the host (TCG on a loaded machine), not a fault of the kernel under
// test, so the trace that follows it does not count.
var rcuStallRE = regexp.MustCompile(`rcu: INFO: rcu_\w+ (self-)?detected stall|rcu_\w+ kthread starved`)

// faultExcerptLines is how many console lines after the first fault line go into the
// excerpt (the trace).
const faultExcerptLines = 40

// stallTraceLines is how long after an RCU stall header a stack trace is taken as part
// of that report.
const stallTraceLines = 200

// KernelFaultError is Wait's error for a guest whose console reported a kernel fault.
type KernelFaultError struct {
	// VM is the guest's name.
	VM string
	// Excerpt is the console from the first fault line on (a few dozen lines).
	Excerpt string
}

func (e *KernelFaultError) Error() string {
	return "vm " + e.VM + ": kernel fault on the guest's console:\n" + e.Excerpt
}

// KnownWarning is a kernel WARNING a test expects from a guest's kernel and explains:
// its report (the WARNING line and the stack trace after it) does not fail the guest.
// Keep each one narrow, with the reason.
type KnownWarning struct {
	// Line matches the report's "WARNING: CPU: ... at FILE:LINE FUNC" line.
	Line *regexp.Regexp
	// Reason says why the guest's kernel warns there and why the test accepts it.
	Reason string
}

// knownTraceLines is how long after a known WARNING line a stack trace is taken as its.
const knownTraceLines = 80

// faultWatch scans console lines for a kernel fault.
type faultWatch struct {
	known      []KnownWarning
	logf       func(string, ...any)
	mu         sync.Mutex
	excerpt    []string // from the first fault line on
	sinceRCU   int      // console lines since the last RCU stall header (-1: none yet)
	sinceKnown int      // console lines since the last known WARNING (-1: none)
	triggered  chan struct{}
	done       chan struct{} // closed when the excerpt is complete
	doneOnce   sync.Once
}

func newFaultWatch(known []KnownWarning, logf func(string, ...any)) *faultWatch {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	return &faultWatch{known: known, logf: logf, sinceRCU: -1, sinceKnown: -1,
		triggered: make(chan struct{}), done: make(chan struct{})}
}

// line takes one console line. It reports true once, for the first fault line.
func (f *faultWatch) line(s string) (first bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.excerpt != nil {
		if len(f.excerpt) <= faultExcerptLines {
			f.excerpt = append(f.excerpt, s)
			if len(f.excerpt) > faultExcerptLines {
				f.finish()
			}
		}
		return false
	}
	if rcuStallRE.MatchString(s) {
		f.sinceRCU = 0
		return false
	}
	for _, k := range f.known {
		if k.Line.MatchString(s) {
			f.sinceKnown = 0
			f.logf("known kernel warning (%s): %s", k.Reason, s)
			return false
		}
	}
	if f.sinceRCU >= 0 {
		f.sinceRCU++
		if f.sinceRCU > stallTraceLines {
			f.sinceRCU = -1
		}
	}
	if f.sinceKnown >= 0 {
		f.sinceKnown++
		if f.sinceKnown > knownTraceLines {
			f.sinceKnown = -1
		}
	}
	trace := strings.Contains(s, "Call Trace:")
	if !kernelFaultRE.MatchString(s) || (trace && (f.sinceRCU >= 0 || f.sinceKnown >= 0)) {
		return false
	}
	f.excerpt = []string{s}
	close(f.triggered)
	return true
}

// finish marks the excerpt complete (the console ended, or enough lines came).
func (f *faultWatch) finish() { f.doneOnce.Do(func() { close(f.done) }) }

// fault returns the excerpt, or "" if no fault was seen.
func (f *faultWatch) fault() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.excerpt, "\n")
}

// CrashWarnings are the kernel WARNINGs a guest's storage consumers give when the daemon
// is killed under their I/O and restored, each with its reason; tests that kill the
// daemon under kernel consumers accept these and nothing else.
//
//   - An NFS server's kernel warns when its RDMA transport's QP reports a fatal error
//     through the stock vmw_pvrdma driver: the driver calls QP event handlers from its
//     hard interrupt handler (pvrdma_intr1_handler), and sunrpc's server handler
//     (svc_xprt_enqueue) enables bottom halves there (__local_bh_enable_ip). Over rxe
//     the handler runs in softirq context. The device reports the QP fatal because the
//     crash left the QP in ERR, as an HCA reports a link failure.
//   - ib_core warns once ("got unsolicited completion") when a CQ its consumer polls
//     directly (IB_POLL_DIRECT: SRP's send CQ) is notified. The arm state of the CQs
//     lives in the daemon's memory and is not journaled, so a restore after a crash
//     notifies every CQ that holds unread completions once, lest a waiter miss a
//     notification the crash swallowed.
func CrashWarnings() []KnownWarning {
	return []KnownWarning{
		{
			Line:   regexp.MustCompile(`WARNING: CPU: \d+ PID: \d+ at kernel/softirq\.c:\d+ __local_bh_enable_ip`),
			Reason: "stock vmw_pvrdma delivers a QP fatal event to sunrpc's server in hard IRQ context",
		},
		{
			Line:   regexp.MustCompile(`WARNING: CPU: \d+ PID: \d+ at drivers/infiniband/core/cq\.c:\d+ ib_cq_completion_direct`),
			Reason: "a restore after a crash notifies every CQ with unread completions once, a directly polled one too",
		},
	}
}
