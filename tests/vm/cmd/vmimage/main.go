// Command vmimage builds or loads the VM test bed's image cache and prints its paths and
// how long that took. A warm cache is used without network access.
//
//	go run ./tests/vm/cmd/vmimage [-refresh] [-cache DIR] [-json] [-print-dir]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

func main() {
	refresh := flag.Bool("refresh", false, "fetch the package indices again and rebuild what changed")
	cache := flag.String("cache", "", "cache directory (default: "+vm.DefaultCacheDir()+")")
	asJSON := flag.Bool("json", false, "print the image as JSON")
	printDir := flag.Bool("print-dir", false, "print the cache directory and exit")
	flag.Parse()
	if *printDir {
		if *cache != "" {
			fmt.Println(*cache)
		} else {
			fmt.Println(vm.DefaultCacheDir())
		}
		return
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	start := time.Now()
	img, err := vm.ImageOptions{
		CacheDir: *cache,
		Refresh:  *refresh,
		Logf:     func(format string, args ...any) { log.Info(fmt.Sprintf(format, args...)) },
	}.Ensure(ctx)
	if err != nil {
		log.Error("image", "err", err)
		os.Exit(1)
	}
	elapsed := time.Since(start)
	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(img)
		return
	}
	fmt.Printf("cache:     %s\n", img.CacheDir)
	fmt.Printf("qemu:      %s (%s)\n", img.QEMUDir, img.QEMUVersion)
	fmt.Printf("kernel:    %s (%s, %s)\n", img.Kernel, img.KernelABI, img.KernelVersion)
	fmt.Printf("initramfs: %s\n", img.Initramfs)
	fmt.Printf("modules:   %d\n", len(img.Modules))
	fmt.Printf("packages:  %d\n", len(img.Packages))
	fmt.Printf("time:      %v\n", elapsed.Round(time.Millisecond))
}
