// Command demo is pvrdma-backend's main job, end to end: it starts the
// daemon (`pvrdma-backend serve`), registers two VMs with `pvrdma-backend
// qemu-args`, boots two stock Linux guests (the test bed's QEMU 11 and
// Debian kernel with vmw_pvrdma) on a private bridge with the device those
// arguments describe, and runs RDMA between them through the daemon:
// ibv_devinfo, ibv_rc_pingpong and ib_write_bw. Finally it shows `pvrdma-backend
// status` and stops the daemon. Everything it creates is removed.
//
//	go build -o bin/pvrdma-backend ./cmd/pvrdma-backend
//	go run ./tests/demo -backend bin/pvrdma-backend [-v]
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// cli implements vm.TB for a command.
type cli struct {
	mu       sync.Mutex
	cleanups []func()
	verbose  bool
}

func (c *cli) Helper()          {}
func (c *cli) Name() string     { return "demo" }
func (c *cli) Cleanup(f func()) { c.mu.Lock(); c.cleanups = append(c.cleanups, f); c.mu.Unlock() }

func (c *cli) Logf(format string, args ...any) {
	if c.verbose {
		fmt.Fprintln(os.Stderr, fmt.Sprintf(format, args...))
	}
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

func main() {
	backendBin := flag.String("backend", "bin/pvrdma-backend", "the pvrdma-backend binary")
	verbose := flag.Bool("v", false, "show the test bed's log (consoles, QEMU command lines)")
	flag.Parse()
	c := &cli{verbose: *verbose}
	err := run(c, *backendBin)
	c.close()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// guest is one demo VM as qemu-args describes it.
type guest struct {
	name, ip, mac string
	device        string   // the vfio-user-pci -device JSON
	monitor       []string // the daemon's QMP monitor: -chardev ... -mon ...
}

func run(c *cli, bin string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	bin, err := filepath.Abs(bin)
	if err != nil {
		return err
	}
	img, err := vm.EnsureImage(ctx, c.Logf)
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	fmt.Printf("test bed: QEMU %s, guest kernel %s\n", img.QEMUVersion, img.KernelABI)

	dir, err := os.MkdirTemp("", "pvrdma-demo-")
	if err != nil {
		return err
	}
	c.Cleanup(func() { os.RemoveAll(dir) })
	sockets := filepath.Join(dir, "run")
	stopDaemon, err := startDaemon(c, bin, sockets, filepath.Join(dir, "daemon.log"))
	if err != nil {
		return err
	}
	defer stopDaemon()

	guests := []*guest{{name: "vm1", ip: "10.77.0.1"}, {name: "vm2", ip: "10.77.0.2"}}
	for _, g := range guests {
		if err := g.qemuArgs(ctx, bin, sockets); err != nil {
			return err
		}
	}

	nw, err := vm.NewNetwork(c, vm.NetworkConfig{})
	if err != nil {
		return fmt.Errorf("network: %w", err)
	}
	mods := append(vm.DefaultModules(), "rdma_ucm")
	var cfgs []vm.Config
	for i, g := range guests {
		peer := ""
		if i == 1 {
			peer = guests[0].ip
		}
		cfgs = append(cfgs, vm.Config{Name: g.name, Modules: mods, QuietConsole: true, Timeout: 6 * time.Minute,
			NICs:      []vm.NIC{{Addr: "05.0", MAC: g.mac, IP: g.ip + "/24"}},
			ExtraArgs: append([]string{"-device", g.device}, g.monitor...),
			Scenario:  scenario(g.ip, peer)})
	}
	fmt.Printf("booting %s and %s on bridge %s in netns %s (TCG: ~10-20 s)...\n", guests[0].name, guests[1].name, nw.Bridge(), nw.Name())
	vms, err := vm.StartAll(ctx, c, img, nw, cfgs...)
	if err != nil {
		return err
	}
	busiest := watchStatus(ctx, bin, sockets)
	res, err := vm.WaitAll(ctx, vms...)
	if err != nil {
		return err
	}
	for _, r := range res {
		fmt.Printf("\n######## %s (boot to /init %v)\n%s\n", r.VM, r.Timings.BootToInit.Round(time.Millisecond),
			strings.TrimRight(r.Output, "\n"))
	}
	fmt.Println("\n######## results (each guest's view)")
	for _, r := range res {
		if pp, err := vm.ParsePingPong(vm.Section(r.Output, "ibv_rc_pingpong")); err == nil {
			fmt.Printf("%s: ibv_rc_pingpong 4 KiB x 1000: %.2f Mbit/s, %.1f usec/iter\n", r.VM, pp.Mbps, pp.UsecPerIter)
		}
		if bw, err := vm.ParsePerftestBW(vm.Section(r.Output, "ib_write_bw")); err == nil && len(bw) == 1 {
			fmt.Printf("%s: ib_write_bw 64 KiB x 1000: %.2f MB/s average\n", r.VM, bw[0].AvgMBps)
		}
	}
	fmt.Printf("\n######## pvrdma-backend status (taken while the guests ran, at their most QPs)\n%s", busiest())
	fmt.Printf("\ndemo finished in %v\n", time.Since(start).Round(time.Millisecond))
	return nil
}

// watchStatus polls `pvrdma-backend status` while the guests run and
// returns a function giving the output taken when the VMs had the most QPs.
func watchStatus(ctx context.Context, bin, sockets string) func() string {
	var (
		mu   sync.Mutex
		best string
		most = -1
	)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			js, err := exec.CommandContext(ctx, bin, "status", "--socket-dir", sockets, "--json").Output()
			if err != nil {
				continue
			}
			var st struct {
				VMs []struct{ Resources map[string]int }
			}
			if json.Unmarshal(js, &st) != nil {
				continue
			}
			qps := 0
			for _, v := range st.VMs {
				qps += v.Resources["qp"]
			}
			text, err := exec.CommandContext(ctx, bin, "status", "--socket-dir", sockets).Output()
			if err != nil {
				continue
			}
			mu.Lock()
			if qps > most {
				most, best = qps, string(text)
			}
			mu.Unlock()
		}
	}()
	return func() string {
		close(stop)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return best
	}
}

// startDaemon runs `pvrdma-backend serve` and waits for its control socket.
func startDaemon(c *cli, bin, sockets, logPath string) (func(), error) {
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "serve", "--socket-dir", sockets, "--log-level", "info")
	cmd.Stdout, cmd.Stderr = logf, logf
	fmt.Printf("$ %s\n", strings.Join(cmd.Args, " "))
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start daemon: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		logf.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(sockets, "control.sock")); err == nil {
			return stop, nil
		}
		select {
		case err := <-done:
			b, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("daemon exited (%v):\n%s", err, b)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return nil, errors.New("daemon did not create its control socket")
		}
	}
}

// qemuArgs registers the VM with the daemon and takes its vmxnet3 MAC and
// vfio-user device from the arguments qemu-args prints.
func (g *guest) qemuArgs(ctx context.Context, bin, sockets string) error {
	// --gid-allow assigns the guest its address: a VM binds only the
	// addresses the operator assigned to it (and its link-local GID).
	cmd := exec.CommandContext(ctx, bin, "qemu-args", "--vm", g.name, "--socket-dir", sockets, "--mem", "512M",
		"--gid-allow", g.ip+"/32", "--shell=false")
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("qemu-args %s: %w", g.name, err)
	}
	fmt.Printf("$ pvrdma-backend qemu-args --vm %s --gid-allow %s/32\n", g.name, g.ip)
	var args []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		args = append(args, sc.Text())
	}
	fmt.Printf("  %s\n", strings.Join(args, " "))
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-chardev" || args[i] == "-mon" {
			g.monitor = append(g.monitor, args[i], args[i+1])
			continue
		}
		if args[i] != "-device" {
			continue
		}
		var dev map[string]any
		if err := json.Unmarshal([]byte(args[i+1]), &dev); err != nil {
			return fmt.Errorf("qemu-args %s: %w", g.name, err)
		}
		switch dev["driver"] {
		case "vmxnet3":
			g.mac, _ = dev["mac"].(string)
		case "vfio-user-pci":
			g.device = args[i+1]
		}
	}
	if g.mac == "" || g.device == "" {
		return fmt.Errorf("qemu-args %s: no vmxnet3 MAC or vfio-user device in %q", g.name, out)
	}
	return nil
}

func scenario(self, peer string) string {
	client, retry := "", ""
	if peer != "" {
		client, retry = " "+peer, "pvt_retry 60 "
	}
	return fmt.Sprintf(`
echo "=== lspci -nn -s 05"
lspci -nn -s 05
g=$(pvt_gid_index vmw_pvrdma0 %[1]s)
echo "=== ibv_devinfo"
ibv_devinfo | head -20
echo "=== ibv_rc_pingpong"
echo "(GID index $g: RoCE v2, IPv4)"
%[3]sibv_rc_pingpong -d vmw_pvrdma0 -g $g -n 1000 -s 4096%[2]s
echo "=== ib_write_bw"
%[3]sib_write_bw -d vmw_pvrdma0 -x $g -F -n 1000 -s 65536%[2]s
`, self, client, retry)
}
