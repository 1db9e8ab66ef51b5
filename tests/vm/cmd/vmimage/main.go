// Command vmimage builds or loads the VM test bed's image cache and prints its paths and
// how long that took. A warm cache is used without network access. The packages are the
// test bed lock's (tests/vm/testbed.lock.json, or $PVRDMA_TESTBED_LOCK).
//
//	go run ./tests/vm/cmd/vmimage [-refresh] [-cache DIR] [-json] [-print-dir]
//	go run ./tests/vm/cmd/vmimage -update all|missing [-kernel ABI] -lock-out FILE
//	go run ./tests/vm/cmd/vmimage -lock-diff OLD NEW
//
// -update builds the image from what the mirror serves now (all: every component at its
// newest; missing: only what the lock does not pin for the code's package lists) and
// writes the resulting lock to -lock-out; scripts/testbed-update uses it.
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
	update := flag.String("update", "", "resolve packages from the mirror instead of the lock: all or missing")
	kernel := flag.String("kernel", "", "with -update: the guest kernel ABI to pin (default: the newest complete one)")
	lockOut := flag.String("lock-out", "", "with -update: write the new lock here")
	lockDiff := flag.Bool("lock-diff", false, "print what differs between the two lock files given as arguments")
	flag.Parse()
	if *lockDiff {
		if err := diffLocks(flag.Arg(0), flag.Arg(1)); err != nil {
			fmt.Fprintln(os.Stderr, "vmimage:", err)
			os.Exit(1)
		}
		return
	}
	mode := vm.LockUpdate(*update)
	if mode != vm.UpdateNone && mode != vm.UpdateAll && mode != vm.UpdateMissing {
		fmt.Fprintf(os.Stderr, "vmimage: -update %q: want all or missing\n", *update)
		os.Exit(2)
	}
	if mode != vm.UpdateNone && *lockOut == "" {
		fmt.Fprintln(os.Stderr, "vmimage: -update needs -lock-out FILE")
		os.Exit(2)
	}
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
		CacheDir:  *cache,
		Refresh:   *refresh,
		Update:    mode,
		KernelABI: *kernel,
		Logf:      func(format string, args ...any) { log.Info(fmt.Sprintf(format, args...)) },
	}.Ensure(ctx)
	if err != nil {
		log.Error("image", "err", err)
		os.Exit(1)
	}
	if mode != vm.UpdateNone {
		if err := os.WriteFile(*lockOut, img.Lock.Encode(), 0o644); err != nil {
			log.Error("lock", "err", err)
			os.Exit(1)
		}
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

// diffLocks prints a line per package that differs between two lock files.
func diffLocks(oldPath, newPath string) error {
	var locks [2]*vm.Lock
	for i, p := range []string{oldPath, newPath} {
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if locks[i], err = vm.ParseLock(b); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	}
	d := vm.LockDiff(locks[0], locks[1])
	if len(d) == 0 {
		fmt.Println("no package changed")
	}
	for _, line := range d {
		fmt.Println(line)
	}
	return nil
}
