package vm

import (
	"os"
	"os/signal"
	"slices"
	"sync"
	"syscall"
)

// The launcher's resources (QEMU processes, namespaces, run directories) are removed by
// t.Cleanup, but a test binary that gets SIGINT or SIGTERM dies without running cleanups.
// This process-wide registry, the package's only global state, lets a signal handler
// remove them first; the signal is then re-raised with its default action, so the
// process still ends the way the sender meant. QEMU additionally gets SIGKILL from the
// kernel if our process dies by any other means (PR_SET_PDEATHSIG).
var cleanups = struct {
	sync.Mutex
	next int
	fns  map[int]func()
	once sync.Once
}{fns: map[int]func(){}}

// registerCleanup adds fn to the cleanups run on SIGINT/SIGTERM/SIGHUP and returns a
// function that removes it again.
func registerCleanup(fn func()) (unregister func()) {
	cleanups.once.Do(installSignalHandler)
	cleanups.Lock()
	id := cleanups.next
	cleanups.next++
	cleanups.fns[id] = fn
	cleanups.Unlock()
	return func() {
		cleanups.Lock()
		delete(cleanups.fns, id)
		cleanups.Unlock()
	}
}

func installSignalHandler() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		sig := <-ch
		runCleanups()
		signal.Reset(sig)
		if s, ok := sig.(syscall.Signal); ok {
			_ = syscall.Kill(os.Getpid(), s)
		}
		os.Exit(128 + int(sig.(syscall.Signal)))
	}()
}

// runCleanups runs every registered cleanup, newest first (VMs before their networks).
func runCleanups() {
	cleanups.Lock()
	ids := make([]int, 0, len(cleanups.fns))
	for id := range cleanups.fns {
		ids = append(ids, id)
	}
	fns := cleanups.fns
	cleanups.fns = map[int]func(){}
	cleanups.Unlock()
	slices.Sort(ids)
	slices.Reverse(ids)
	for _, id := range ids {
		fns[id]()
	}
}
