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

// faultWatch scans console lines for a kernel fault.
type faultWatch struct {
	mu        sync.Mutex
	excerpt   []string // from the first fault line on
	sinceRCU  int      // console lines since the last RCU stall header (-1: none yet)
	triggered chan struct{}
	done      chan struct{} // closed when the excerpt is complete
	doneOnce  sync.Once
}

func newFaultWatch() *faultWatch {
	return &faultWatch{sinceRCU: -1, triggered: make(chan struct{}), done: make(chan struct{})}
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
	if f.sinceRCU >= 0 {
		f.sinceRCU++
		if f.sinceRCU > stallTraceLines {
			f.sinceRCU = -1
		}
	}
	if !kernelFaultRE.MatchString(s) || (f.sinceRCU >= 0 && strings.Contains(s, "Call Trace:")) {
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
