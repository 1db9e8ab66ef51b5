package vm

import (
	"fmt"
	"strings"
	"time"
)

// WaitMarked waits, at most timeout, until every guest's output holds
// mark (a scenario's "=== step" line: a step under way).
func WaitMarked(timeout time.Duration, mark string, vms ...*VM) error {
	deadline := time.Now().Add(timeout)
	for {
		all := true
		for _, v := range vms {
			if !strings.Contains(v.Output(), mark) {
				all = false
				break
			}
		}
		if all {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%q not printed by every guest within %v", mark, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitRising waits, at most timeout, until count grows from one poll to
// the next (e.g. the daemons' send counters: the guests' traffic flows,
// which the tools' own output, buffered until they exit, cannot tell).
func WaitRising(timeout, poll time.Duration, count func() uint64) error {
	deadline := time.Now().Add(timeout)
	last := count()
	for time.Now().Before(deadline) {
		time.Sleep(poll)
		n := count()
		if n > last {
			return nil
		}
		last = n
	}
	return fmt.Errorf("no increase within %v", timeout)
}
