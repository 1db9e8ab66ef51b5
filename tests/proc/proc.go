// Package proc starts the processes tests run beside them (daemons,
// supervisors) so that their parent-death signal means what a test means by
// it: "the test process died".
//
// The kernel sends a child its parent-death signal (Pdeathsig) when the
// thread that forked it ends, not the process. The Go runtime ends an OS
// thread when a goroutine locked to it returns without unlocking, as the
// test bed's network namespace code does on purpose, so a daemon started
// from an ordinary goroutine can be killed in the middle of a test because
// some other goroutine's thread went away. Start forks from a goroutine
// locked to its thread that stays until the process has exited.
package proc

import (
	"fmt"
	"os/exec"
	"runtime"
)

// Start starts cmd from a goroutine locked to its OS thread, which waits
// for cmd there (the thread lives as long as the process). The returned
// channel is closed once cmd has exited and cmd.Wait has returned; the
// caller must not call cmd.Wait itself.
func Start(cmd *exec.Cmd) (<-chan struct{}, error) {
	started := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		// Not unlocked: after Wait the thread has served its purpose, and
		// it must not carry anything set on it into other goroutines.
		err := cmd.Start()
		started <- err
		if err == nil {
			_ = cmd.Wait()
		}
		close(done)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	return done, nil
}
