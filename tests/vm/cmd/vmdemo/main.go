// Command vmdemo boots two test-bed guests on a private bridge and shows what they see:
// the PCI devices (vmxnet3 at 00:05.0), the loaded RDMA modules, the verbs devices, and an
// RDMA ping-pong between them over soft-RoCE (rxe). Once the pvrdma device exists it
// becomes the two-VM pvrdma demo.
//
//	go run ./tests/vm/cmd/vmdemo [-v]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// cli implements vm.TB for a command: it prints guest output and runs cleanups on exit.
type cli struct {
	mu       sync.Mutex
	cleanups []func()
	verbose  bool
}

func (c *cli) Helper()          {}
func (c *cli) Name() string     { return "vmdemo" }
func (c *cli) Cleanup(f func()) { c.mu.Lock(); c.cleanups = append(c.cleanups, f); c.mu.Unlock() }

func (c *cli) Logf(format string, args ...any) {
	line := fmt.Sprintf(format, args...)
	if !c.verbose && (strings.Contains(line, " console] ") || strings.Contains(line, ": qemu-system-x86_64 ")) {
		return
	}
	fmt.Fprintln(os.Stderr, line)
}

func (c *cli) close() {
	c.mu.Lock()
	fns := c.cleanups
	c.cleanups = nil
	c.mu.Unlock()
	for i := len(fns) - 1; i >= 0; i-- {
		fns[i]()
	}
}

func scenario(self, peer string) string {
	client, retry := "", ""
	if peer != "" {
		client, retry = " "+peer, "pvt_retry 60 "
	}
	return fmt.Sprintf(`
echo "=== lspci -nn"
lspci -nn
echo "=== RDMA modules"
cut -d' ' -f1 /proc/modules | sort | tr '\n' ' '; echo
echo "=== ibv_devices (vmw_pvrdma has no device to bind until the pvrdma backend is attached)"
ibv_devices
pvt_rxe eth0
g=$(pvt_gid_index rxe0 %[1]s)
echo "=== ibv_devices with soft-RoCE on eth0"
ibv_devices
rdma link show
echo "=== ibv_rc_pingpong -g $g (RoCE v2, IPv4 GID)"
%[3]sibv_rc_pingpong -d rxe0 -g $g -n 1000 -s 4096%[2]s
`, self, client, retry)
}

func main() {
	verbose := flag.Bool("v", false, "also show the kernel consoles and QEMU command lines")
	flag.Parse()
	c := &cli{verbose: *verbose}
	code := run(c)
	c.close()
	os.Exit(code)
}

func run(c *cli) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	img, err := vm.EnsureImage(ctx, c.Logf)
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		return 1
	}
	fmt.Printf("image: kernel %s, QEMU %s (%v)\n", img.KernelABI, img.QEMUVersion, time.Since(start).Round(time.Millisecond))
	nw, err := vm.NewNetwork(c, vm.NetworkConfig{HostAddr: "10.77.0.254/24"})
	if err != nil {
		fmt.Fprintln(os.Stderr, "network:", err)
		return 1
	}
	mods := append(vm.DefaultModules(), "rdma_ucm")
	vms, err := vm.StartAll(ctx, c, img, nw,
		vm.Config{Name: "vm1", Modules: mods, NICs: []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:01", IP: "10.77.0.1/24"}},
			Scenario: scenario("10.77.0.1", "")},
		vm.Config{Name: "vm2", Modules: mods, NICs: []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:02", IP: "10.77.0.2/24"}},
			Scenario: scenario("10.77.0.2", "10.77.0.1")},
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("network namespace %s, bridge %s; guests booting (TCG, ~10 s)...\n", nw.Name(), nw.Bridge())
	res, err := vm.WaitAll(ctx, vms...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for _, r := range res {
		fmt.Printf("\n######## %s (boot to /init %v, total %v)\n%s\n", r.VM,
			r.Timings.BootToInit.Round(time.Millisecond), r.Timings.Total.Round(time.Millisecond), strings.TrimRight(r.Output, "\n"))
	}
	for _, r := range res {
		if pp, err := vm.ParsePingPong(r.Output); err == nil {
			fmt.Printf("%s: rxe ibv_rc_pingpong 4 KiB x 1000: %.2f Mbit/s, %.1f usec/iter\n", r.VM, pp.Mbps, pp.UsecPerIter)
		}
	}
	fmt.Printf("demo finished in %v; everything it created is removed\n", time.Since(start).Round(time.Millisecond))
	return 0
}
