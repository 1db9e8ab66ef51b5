// Command pkgroots builds, unless they are cached, the bookworm roots the packaging
// tests boot under systemd-nspawn: the clean root (debootstrap) and each package layer
// over it, in the VM image cache's pkgroot/ (`make roots` runs it before the tests),
// with the packages the test bed lock pins.
//
//	go run ./tests/packaging/cmd/pkgroots [-cache DIR]
//	go run ./tests/packaging/cmd/pkgroots -update all|missing -lock FILE
//
// -update builds the roots from what the mirror serves now (all, or only what the lock
// FILE does not pin) and records their packages in FILE (scripts/testbed-update).
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/tests/packaging"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

func main() {
	cache := flag.String("cache", "", "cache directory (default: "+vm.DefaultCacheDir()+")")
	update := flag.String("update", "", "resolve the roots' packages from the mirror: all or missing")
	lockPath := flag.String("lock", "", "with -update: the lock file to read and rewrite")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	logf := func(format string, args ...any) { log.Info(fmt.Sprintf(format, args...)) }
	start := time.Now()
	var dirs []string
	var err error
	if *update == "" {
		dirs, err = packaging.EnsureRoots(ctx, *cache, logf)
	} else {
		dirs, err = updateRoots(ctx, *cache, vm.LockUpdate(*update), *lockPath, logf)
	}
	if err != nil {
		log.Error("roots", "err", err)
		os.Exit(1)
	}
	for _, d := range dirs {
		fmt.Printf("root: %s\n", d)
	}
	log.Info(fmt.Sprintf("roots ready in %v", time.Since(start).Round(time.Millisecond)))
}

// updateRoots rebuilds the roots from the mirror and records their pins in the lock file.
func updateRoots(ctx context.Context, cache string, mode vm.LockUpdate, path string, logf func(string, ...any)) ([]string, error) {
	if mode != vm.UpdateAll && mode != vm.UpdateMissing {
		return nil, fmt.Errorf("-update %q: want all or missing", mode)
	}
	if path == "" {
		return nil, fmt.Errorf("-update needs -lock FILE")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	lock, err := vm.ParseLock(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	dirs, err := packaging.UpdateRoots(ctx, cache, lock, mode, logf)
	if err != nil {
		return nil, err
	}
	return dirs, os.WriteFile(path, lock.Encode(), 0o644)
}
