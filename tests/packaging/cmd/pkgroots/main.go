// Command pkgroots builds, unless they are cached, the bookworm roots the packaging
// tests boot under systemd-nspawn: the clean root (debootstrap) and each package layer
// over it, in the VM image cache's pkgroot/ (`make roots` runs it before the tests).
//
//	go run ./tests/packaging/cmd/pkgroots [-cache DIR]
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
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	start := time.Now()
	dirs, err := packaging.EnsureRoots(ctx, *cache, func(format string, args ...any) {
		log.Info(fmt.Sprintf(format, args...))
	})
	if err != nil {
		log.Error("roots", "err", err)
		os.Exit(1)
	}
	for _, d := range dirs {
		fmt.Printf("root: %s\n", d)
	}
	log.Info(fmt.Sprintf("roots ready in %v", time.Since(start).Round(time.Millisecond)))
}
