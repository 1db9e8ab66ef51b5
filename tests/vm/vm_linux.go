package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netns"
)

// Defaults of Config.
const (
	DefaultMemMiB      = 512
	DefaultTimeout     = 5 * time.Minute
	DefaultBootTimeout = 2 * time.Minute
)

// DefaultModules are loaded when Config.Modules is nil: the PVRDMA stack.
func DefaultModules() []string { return []string{"ib_core", "ib_uverbs", "vmw_pvrdma"} }

// NIC is a guest network card attached to the Network's bridge (through its own tap), or,
// for a VM started without a Network, to QEMU's restricted user-mode network.
type NIC struct {
	// Model is the QEMU device: "vmxnet3" (default; the PVRDMA pairing NIC) or
	// "virtio-net-pci".
	Model string
	// Addr is the PCI slot.function, e.g. "05.0" (empty: QEMU chooses). A function-0
	// NIC gets multifunction=on so that a device can be added at function 1.
	Addr string
	// MAC, e.g. "52:54:00:77:00:01"; empty: a random one.
	MAC string
	// IP is the guest address with prefix, e.g. "10.77.0.1/24"; empty: none.
	IP string
}

func (n NIC) model() string {
	if n.Model == "" {
		return "vmxnet3"
	}
	return n.Model
}

// Config describes one guest.
type Config struct {
	// Name identifies the VM in logs and is its hostname ([a-z0-9-]).
	Name string
	// MemMiB is the guest RAM (memfd-backed, shared); 0 means DefaultMemMiB.
	MemMiB int
	// MemLock starts QEMU with -overcommit mem-lock=on, the setting qemu-args
	// gives production VMs: QEMU faults in and locks all of guest RAM at start
	// (seconds of CPU per guest on the test machine). Benchmarks set it, so
	// that they measure the configuration users run: without it, perftest's
	// short runs (BenchmarkVMvsRxe) measured slower, though seconds of traffic
	// (BenchmarkGuestPerf) did not. Tests leave it off, since the daemon locks
	// the pages its device touches itself (guestmem.MapFD).
	MemLock bool
	// CPUs is the number of vCPUs (0 means 1: guests run under TCG and
	// boot in parallel on a small host).
	CPUs int
	// NICs are the guest's network cards, in order.
	NICs []NIC
	// ExtraArgs are appended to QEMU's command line, e.g. a vfio-user-pci -device.
	ExtraArgs []string
	// Scenario is a busybox sh script run after setup, with `set -e` (unless NoErrExit)
	// and the helpers of guest/lib.sh (pvt_retry, pvt_rxe, pvt_gid_index). Its exit
	// status is Result.RC; its stdout and stderr are Result.Output.
	Scenario string
	// NoErrExit runs the scenario without `set -e`.
	NoErrExit bool
	// Modules are loaded (modprobe, in order) after the NIC drivers and before the
	// scenario; nil means DefaultModules(), an empty non-nil slice none. They must be in
	// the base image or in one of Layers.
	Modules []string
	// Layers are optional parts of the image the guest loads after the base initramfs
	// (LayerStorage: the kernel's storage consumers and their tools). A layer's helpers
	// are sourced before the scenario with guest/lib.sh. Not with Root.
	Layers []Layer
	// Files are extra guest files (absolute guest path -> content, mode 0755).
	Files map[string][]byte
	// HostFiles are extra guest files copied from the host (guest path -> host path,
	// keeping the permission bits), e.g. a helper binary built by the test.
	HostFiles map[string]string
	// KernelArgs are appended to the kernel command line.
	KernelArgs string
	// KnownWarnings are kernel WARNINGs the test expects from this guest, each with its
	// reason; any other kernel fault on the console fails the guest at once.
	KnownWarnings []KnownWarning
	// Timeout bounds the whole run (0: DefaultTimeout); BootTimeout the time from
	// launching QEMU to /init (0: DefaultBootTimeout).
	Timeout, BootTimeout time.Duration
	// QuietConsole stops copying the kernel console into the test log (it is still kept
	// for error messages).
	QuietConsole bool
	// Launch, if set, starts the guest in place of the harness's own QEMU command line
	// (through libvirt, for example). It gets the boot files and returns a command, not
	// yet started, that runs as long as the guest does; the harness starts it in its own
	// process group, copies its output to the console and kills the group at cleanup.
	// The guest's first serial port is its console; its second must connect to
	// Boot.ResultSocket. Launch needs a nil Network; NICs only tell the guest's init which
	// interfaces to configure.
	Launch func(b Boot) (*exec.Cmd, error)
	// Root, if set, is a host directory the guest boots as its root file system under
	// the root's own init, which must be systemd (a Debian root made by debootstrap with
	// systemd-sysv, for example): the packaged daemon's unit can then run as on a host.
	// /init sets the guest up as for any guest (Modules, NICs), reports SETUP, mounts
	// the directory (shared read-write over virtio-9p with security_model=passthrough:
	// owners and modes are the host's) and switches to its /sbin/init. The scenario runs
	// with the root's /bin/sh (and guest/lib.sh) from a unit /init leaves in
	// /run/systemd/system, ordered after multi-user.target; that unit reports END and
	// powers off (guest/root-run.sh), so Result.Timings.Scenario includes systemd's
	// boot. Before booting, Start copies the guest kernel's modules into
	// Root/lib/modules/<abi> (for the root's modprobe and systemd-modules-load) and
	// writes Files and HostFiles into Root rather than the initramfs. The kernel command
	// line gets net.ifnames=0 (the NICs keep the names /init configured them under),
	// systemd.hostname=Name and a mask of the console's getty. The directory is the
	// guest's to change: give each boot its own copy. Not with Launch.
	Root string
}

// Boot is what a Config.Launch needs to boot the test bed's guest.
type Boot struct {
	Name string
	// Kernel and Initrd are host paths; Append is the kernel command line.
	Kernel, Initrd, Append string
	// ResultSocket is the host socket (listening) the guest's second serial port
	// (ttyS1) must connect to.
	ResultSocket string
	// MemMiB is the guest RAM.
	MemMiB int
	// Image is the test bed image (its QEMU, for an emulator wrapper).
	Image *Image
}

func (cfg *Config) modules() []string {
	if cfg.Modules == nil {
		return DefaultModules()
	}
	return cfg.Modules
}

// Timings are measured on the host clock, except GuestUptimeAtInit.
type Timings struct {
	// BootToInit is from launching QEMU to the guest's /init starting.
	BootToInit time.Duration
	// Setup is /init's module loading and network configuration.
	Setup time.Duration
	// Scenario is the scenario's run time.
	Scenario time.Duration
	// Total is from launching QEMU to its exit.
	Total time.Duration
	// GuestUptimeAtInit is the guest kernel's uptime when /init started.
	GuestUptimeAtInit time.Duration
}

// Result is what a guest reported.
type Result struct {
	// VM is the guest's name.
	VM string
	// RC is the scenario's exit status (125 if setup failed, see Stage).
	RC int
	// Stage is "scenario", or "setup" if /init failed before the scenario ran.
	Stage string
	// Output is the scenario's (and setup's) stdout and stderr.
	Output string
	// Console is the kernel console (ttyS0) and QEMU's own stderr.
	Console string
	// Timings of the run.
	Timings Timings
}

// GuestError is returned by Result.Err and VM.WaitOK for a non-zero exit status.
type GuestError struct {
	VM     string
	RC     int
	Stage  string
	Output string
}

func (e *GuestError) Error() string {
	return fmt.Sprintf("vm %s: %s exited with status %d; guest output:\n%s", e.VM, e.Stage, e.RC, e.Output)
}

// Err returns a *GuestError (with the guest's output) if the scenario failed.
func (r Result) Err() error {
	if r.RC == 0 {
		return nil
	}
	return &GuestError{VM: r.VM, RC: r.RC, Stage: r.Stage, Output: r.Output}
}

// VM is a running guest.
type VM struct {
	cfg     Config
	t       TB
	dir     string
	qmp     string
	nonce   string
	started time.Time
	cmd     *exec.Cmd

	console capBuffer
	output  capBuffer
	faults  *faultWatch
	nw      *Network
	// stoppedFor says why the harness stopped the guest early ("" if it did not): a
	// kernel fault of another guest on its network.
	stoppedFor atomic.Pointer[string]
	initC      chan frame // INIT
	setupC     chan frame // SETUP
	endC       chan frame // END
	exited     chan struct{}
	exitErr    error
	readers    sync.WaitGroup
	listener   *net.UnixListener

	waitOnce sync.Once
	res      Result
	err      error

	stopOnce sync.Once
	unreg    func()
}

// Start launches a guest. With a Network, QEMU runs in its namespace and each NIC gets a
// tap on its bridge; with nil, NICs use QEMU's restricted user-mode network. ctx bounds
// only the launch; use Wait's context and Config.Timeout for the run. t.Cleanup kills
// QEMU (by process group) and removes the run directory.
func Start(ctx context.Context, t TB, img *Image, nw *Network, cfg Config) (*VM, error) {
	t.Helper()
	if img == nil {
		return nil, errors.New("vm.Start: nil image")
	}
	if err := cfg.validate(img); err != nil {
		return nil, err
	}
	if cfg.MemMiB == 0 {
		cfg.MemMiB = DefaultMemMiB
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = DefaultBootTimeout
	}
	cfg.NICs = append([]NIC(nil), cfg.NICs...)
	for i := range cfg.NICs {
		if cfg.NICs[i].MAC == "" {
			cfg.NICs[i].MAC = randomMAC()
		}
	}
	if cfg.Root != "" {
		if err := installRoot(img, &cfg); err != nil {
			return nil, fmt.Errorf("vm %s: %w", cfg.Name, err)
		}
	}
	sweepStale(t.Logf)
	dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-%s-", namePrefix, os.Getpid(), cfg.Name))
	if err != nil {
		return nil, err
	}
	v := &VM{
		cfg: cfg, t: t, dir: dir, qmp: filepath.Join(dir, "qmp.sock"), nonce: randomHex(16),
		console: capBuffer{max: maxConsole}, output: capBuffer{max: maxOutput},
		initC: make(chan frame, 1), setupC: make(chan frame, 1), endC: make(chan frame, 1),
		exited: make(chan struct{}),
	}
	v.faults = newFaultWatch(cfg.KnownWarnings, func(format string, args ...any) {
		t.Logf("vm %s: %s", cfg.Name, fmt.Sprintf(format, args...))
	})
	if v.nw = nw; nw != nil {
		nw.join(v)
	}
	v.unreg = registerCleanup(v.stop)
	t.Cleanup(func() {
		v.stop()
		if v.cmd != nil && v.cmd.Process != nil {
			t.Logf("vm %s: stopped (pid %d)", cfg.Name, v.cmd.Process.Pid)
		}
	})
	if err := v.launch(ctx, img, nw); err != nil {
		v.stop()
		return nil, fmt.Errorf("vm %s: %w", cfg.Name, err)
	}
	return v, nil
}

// Name returns the VM's name.
func (v *VM) Name() string { return v.cfg.Name }

// QMPPath returns the path of the VM's QMP socket (server, no wait).
func (v *VM) QMPPath() string { return v.qmp }

// Dir returns the VM's run directory (initrd, sockets); it is removed at cleanup.
func (v *VM) Dir() string { return v.dir }

// PID returns QEMU's process ID.
func (v *VM) PID() int { return v.cmd.Process.Pid }

// NICs returns the NICs as configured (with the MACs filled in).
func (v *VM) NICs() []NIC { return append([]NIC(nil), v.cfg.NICs...) }

// Console returns the kernel console captured so far.
func (v *VM) Console() string { return v.console.String() }

// Output returns the result channel's output captured so far.
func (v *VM) Output() string { return v.output.String() }

func (v *VM) launch(ctx context.Context, img *Image, nw *Network) error {
	initrd := filepath.Join(v.dir, "initrd.cpio")
	if err := v.writeInitrd(img, initrd); err != nil {
		return fmt.Errorf("initrd: %w", err)
	}
	// loglevel=5 puts KERN_WARNING and more severe messages on the console (/init sets
	// the same once it runs): the kernel fault watch reads the console, and an oops's
	// trace and a hung task's report are among them.
	kargs := "console=ttyS0 quiet loglevel=5 panic=-1 no_timer_check rdinit=/init"
	if v.cfg.Root != "" {
		// No login prompt on the console: a root without udev would wait 90 s for the
		// serial port's device unit before giving up on it.
		kargs += " net.ifnames=0 systemd.hostname=" + v.cfg.Name + " systemd.mask=serial-getty@ttyS0.service"
	}
	appendLine := strings.TrimSpace(kargs + " " + v.cfg.KernelArgs)
	args := []string{
		"-name", v.cfg.Name,
		"-machine", "q35,memory-backend=ram",
		"-accel", "tcg",
		"-smp", strconv.Itoa(max(v.cfg.CPUs, 1)),
		"-m", strconv.Itoa(v.cfg.MemMiB) + "M",
		"-object", fmt.Sprintf("memory-backend-memfd,id=ram,size=%dM,share=on", v.cfg.MemMiB),
		"-overcommit", "mem-lock=" + onOff(v.cfg.MemLock),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		// qboot reaches the PVH kernel ~1.5 s sooner than SeaBIOS under TCG.
		"-bios", "qboot.rom",
		"-kernel", img.Kernel,
		"-initrd", initrd,
		// no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer
		// check can miss its window and panic ("IO-APIC + timer doesn't work").
		"-append", appendLine,
		"-chardev", "stdio,id=con,signal=off",
		"-serial", "chardev:con",
		"-chardev", "socket,id=res,path=" + filepath.Join(v.dir, "res.sock"),
		"-serial", "chardev:res",
		"-qmp", "unix:" + v.qmp + ",server=on,wait=off",
	}
	for i, n := range v.cfg.NICs {
		if v.cfg.Launch != nil {
			break
		}
		id := "n" + strconv.Itoa(i)
		if nw != nil {
			tap, err := nw.addTap()
			if err != nil {
				return err
			}
			args = append(args, "-netdev", "tap,id="+id+",ifname="+tap+",script=no,downscript=no")
		} else {
			args = append(args, "-netdev", "user,id="+id+",restrict=on")
		}
		dev := n.model() + ",netdev=" + id + ",mac=" + n.MAC + ",romfile="
		if n.Addr != "" {
			dev += ",addr=" + n.Addr
			if strings.HasSuffix(n.Addr, ".0") {
				dev += ",multifunction=on"
			}
		}
		args = append(args, "-device", dev)
	}
	if v.cfg.Root != "" {
		// QEMU's option syntax escapes a comma by doubling it.
		args = append(args,
			"-fsdev", "local,id="+rootTag+",path="+strings.ReplaceAll(v.cfg.Root, ",", ",,")+",security_model=passthrough",
			"-device", "virtio-9p-pci,fsdev="+rootTag+",mount_tag="+rootTag)
	}
	args = append(args, v.cfg.ExtraArgs...)

	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(v.dir, "res.sock"), Net: "unix"})
	if err != nil {
		return err
	}
	v.listener = ln
	v.readers.Add(1)
	go v.readResults()

	if v.cfg.Launch != nil {
		if nw != nil {
			return errors.New("Config.Launch needs a nil Network")
		}
		v.cmd, err = v.cfg.Launch(Boot{Name: v.cfg.Name, Kernel: img.Kernel, Initrd: initrd, Append: appendLine,
			ResultSocket: filepath.Join(v.dir, "res.sock"), MemMiB: v.cfg.MemMiB, Image: img})
		if err != nil {
			return fmt.Errorf("launch: %w", err)
		}
		args = v.cmd.Args
	} else {
		v.cmd = img.QEMUCommand(context.Background(), args...)
	}
	v.cmd.Stdin = nil
	v.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stdout, err := v.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	stderr, err := v.cmd.StderrPipe()
	if err != nil {
		return err
	}
	v.t.Logf("vm %s: %s", v.cfg.Name, strings.Join(append([]string{"qemu-system-x86_64"}, args...), " "))

	// QEMU is started, and waited for, on one locked OS thread: the thread is inside the
	// network namespace (so QEMU is), and PR_SET_PDEATHSIG fires when the thread that
	// started the child ends, so that thread must live as long as QEMU.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread may be in another netns
		if nw != nil {
			if err := netns.Set(nw.ns); err != nil {
				started <- fmt.Errorf("enter netns: %w", err)
				return
			}
		}
		v.started = time.Now()
		if err := v.cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		v.exitErr = v.cmd.Wait()
		close(v.exited)
	}()
	select {
	case err := <-started:
		if err != nil {
			return fmt.Errorf("start qemu: %w", err)
		}
	case <-ctx.Done():
		return ctx.Err()
	}
	v.readers.Add(2)
	go v.copyLines(stdout, "console", v.cfg.QuietConsole)
	go v.copyLines(stderr, "qemu", false)
	return nil
}

// writeInitrd writes the base initramfs followed by this boot's overlay archive.
func (v *VM) writeInitrd(img *Image, dst string) error {
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	defer out.Close()
	base, err := os.Open(img.Initramfs)
	if err != nil {
		return err
	}
	defer base.Close()
	if _, err := io.Copy(out, base); err != nil { // copy_file_range where possible
		return err
	}
	for _, name := range v.cfg.Layers {
		if err := appendFile(out, img.Layers[name].Archive); err != nil {
			return fmt.Errorf("layer %s: %w", name, err)
		}
	}
	if err := writeOverlay(out, &v.cfg, v.nonce); err != nil {
		return err
	}
	return out.Close()
}

// appendFile copies the host file src to the end of out.
func appendFile(out *os.File, src string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(out, f)
	return err
}

// copyLines copies QEMU's stdout (the guest console) or stderr into the console buffer
// and, unless quiet, the test log.
// The guest console's lines go through the kernel fault watch: the first fault line
// starts the excerpt, and the guest is stopped once it is complete (or after
// faultExcerptWait), which fails Wait with the excerpt.
func (v *VM) copyLines(r io.Reader, what string, quiet bool) {
	defer v.readers.Done()
	if what == "console" {
		defer v.faults.finish()
	}
	_ = readLines(r, func(line string) {
		if what == "qemu" {
			line = "qemu: " + line
		}
		v.console.Write([]byte(line + "\n"))
		if !quiet {
			v.t.Logf("[%s %s] %s", v.cfg.Name, what, line)
		}
		if what == "console" && v.faults.line(line) {
			v.t.Logf("vm %s: kernel fault on the console; stopping the guest", v.cfg.Name)
			if quiet {
				v.t.Logf("[%s console] %s", v.cfg.Name, line)
			}
			if v.nw != nil {
				v.nw.stopOthers(v, fmt.Sprintf("guest %s on the same network reported a kernel fault: %s", v.cfg.Name, line))
			}
			go func() {
				select {
				case <-v.faults.done:
				case <-time.After(faultExcerptWait):
				}
				v.stop()
			}()
		}
	})
}

// faultExcerptWait is how long the harness waits for a fault's trace on the console
// before it stops the guest.
const faultExcerptWait = 5 * time.Second

// readResults accepts QEMU's connection to the result socket and parses it.
func (v *VM) readResults() {
	defer v.readers.Done()
	conn, err := v.listener.Accept()
	v.listener.Close()
	if err != nil {
		return
	}
	defer conn.Close()
	var pendingNL bool // the newline /init writes before END is not output
	_ = readLines(conn, func(line string) {
		if fr, ok := parseFrame(line, v.nonce); ok {
			switch fr.kind {
			case frameInit:
				v.initC <- fr
			case frameSetup:
				v.setupC <- fr
			case frameEnd:
				v.endC <- fr
			}
			return
		}
		if pendingNL {
			v.output.Write([]byte("\n"))
		}
		if line == "" {
			pendingNL = true
			return
		}
		pendingNL = false
		v.output.Write([]byte(line + "\n"))
		v.t.Logf("[%s] %s", v.cfg.Name, line)
	})
}

// Wait waits for the guest to report its result and QEMU to exit. The error is non-nil
// only if no result came (timeout, ctx, QEMU or kernel failure); a failing scenario is
// Result.RC != 0 (see Result.Err and WaitOK). Wait may be called more than once.
func (v *VM) Wait(ctx context.Context) (Result, error) {
	v.waitOnce.Do(func() { v.res, v.err = v.wait(ctx) })
	return v.res, v.err
}

// WaitOK is Wait that also turns a non-zero exit status into an error carrying the
// guest's output.
func (v *VM) WaitOK(ctx context.Context) (Result, error) {
	res, err := v.Wait(ctx)
	if err != nil {
		return res, err
	}
	return res, res.Err()
}

func (v *VM) wait(ctx context.Context) (Result, error) {
	res := Result{VM: v.cfg.Name}
	deadline := time.NewTimer(time.Until(v.started.Add(v.cfg.Timeout)))
	defer deadline.Stop()
	boot := time.NewTimer(time.Until(v.started.Add(v.cfg.BootTimeout)))
	defer boot.Stop()
	var initAt, setupAt time.Time
	fail := func(format string, args ...any) (Result, error) {
		v.stop()
		res.Output, res.Console = v.output.String(), v.console.String()
		return res, fmt.Errorf("vm %s: %s\n--- guest output ---\n%s\n--- console (tail) ---\n%s",
			v.cfg.Name, fmt.Sprintf(format, args...), lastLines(res.Output, 50), lastLines(res.Console, 50))
	}
	faulted := func() (Result, error) {
		select {
		case <-v.faults.done:
		case <-time.After(faultExcerptWait):
		}
		v.stop()
		res.Output, res.Console = v.output.String(), v.console.String()
		return res, fmt.Errorf("%w\n--- guest output (tail) ---\n%s", &KernelFaultError{VM: v.cfg.Name, Excerpt: v.faults.fault()},
			lastLines(res.Output, 30))
	}
	for {
		select {
		case <-v.faults.triggered:
			return faulted()
		case fr := <-v.initC:
			initAt = time.Now()
			res.Timings.BootToInit = initAt.Sub(v.started)
			res.Timings.GuestUptimeAtInit = fr.uptime
			boot.Stop()
		case <-v.setupC:
			// Durations are computed at END: frames arrive on separate
			// channels, so SETUP may be handled before INIT.
			setupAt = time.Now()
		case fr := <-v.endC:
			if v.faults.fault() != "" {
				return faulted()
			}
			now := time.Now()
			switch {
			case !setupAt.IsZero() && !initAt.IsZero():
				res.Timings.Setup = setupAt.Sub(initAt)
				res.Timings.Scenario = now.Sub(setupAt)
			case !setupAt.IsZero():
				res.Timings.Scenario = now.Sub(setupAt)
			case !initAt.IsZero():
				res.Timings.Setup = now.Sub(initAt)
			}
			res.RC, res.Stage = fr.rc, fr.stage
			// /init powers off right after END; give QEMU a moment to exit by itself.
			select {
			case <-v.exited:
			case <-time.After(10 * time.Second):
				v.t.Logf("vm %s: QEMU did not exit after the guest's poweroff; killing it", v.cfg.Name)
			}
			v.stop()
			res.Timings.Total = time.Since(v.started)
			res.Output = v.output.String()
			res.Console = v.console.String()
			v.t.Logf("vm %s: rc=%d stage=%s boot-to-init=%v setup=%v scenario=%v total=%v",
				v.cfg.Name, res.RC, res.Stage, res.Timings.BootToInit.Round(time.Millisecond),
				res.Timings.Setup.Round(time.Millisecond), res.Timings.Scenario.Round(time.Millisecond),
				res.Timings.Total.Round(time.Millisecond))
			return res, nil
		case <-v.exited:
			// Frames may still be in flight; give the reader a moment.
			select {
			case fr := <-v.endC:
				v.endC <- fr
				continue
			case <-time.After(500 * time.Millisecond):
			}
			if v.faults.fault() != "" {
				return faulted()
			}
			if why := v.stoppedFor.Load(); why != nil {
				return fail("stopped by the harness: %s", *why)
			}
			return fail("QEMU exited (%v) before the guest reported a result", v.exitErr)
		case <-boot.C:
			// Wait may be called long after the guest reached /init (a test
			// that drives the guest first): then both are ready, and select
			// picks either; the frame wins.
			select {
			case fr := <-v.initC:
				v.initC <- fr
				continue
			default:
			}
			return fail("guest did not reach /init within %v", v.cfg.BootTimeout)
		case <-deadline.C:
			return fail("no result within %v", v.cfg.Timeout)
		case <-ctx.Done():
			return fail("wait: %v", ctx.Err())
		}
	}
}

// Kill stops the guest at once (SIGKILL to QEMU's process group) and waits for QEMU and
// the output readers to finish.
func (v *VM) Kill() { v.stop() }

// Exited is closed when the guest's QEMU has exited (by itself or stopped).
func (v *VM) Exited() <-chan struct{} { return v.exited }

// stopFor stops the guest because of something outside it (another guest's fault).
func (v *VM) stopFor(why string) {
	v.stoppedFor.CompareAndSwap(nil, &why)
	v.t.Logf("vm %s: stopping: %s", v.cfg.Name, why)
	go v.stop()
}

// stop kills QEMU's process group, waits for it and the readers, and removes the run
// directory. It is idempotent and is the VM's cleanup.
func (v *VM) stop() {
	v.stopOnce.Do(func() {
		if v.listener != nil {
			v.listener.Close()
		}
		if v.cmd != nil && v.cmd.Process != nil {
			_ = syscall.Kill(-v.cmd.Process.Pid, syscall.SIGKILL)
			select {
			case <-v.exited:
			case <-time.After(30 * time.Second):
				v.t.Logf("vm %s: QEMU pid %d did not exit after SIGKILL", v.cfg.Name, v.cmd.Process.Pid)
			}
		}
		done := make(chan struct{})
		go func() { v.readers.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
		os.RemoveAll(v.dir)
		if v.unreg != nil {
			v.unreg()
		}
	})
}

// StartAll starts several guests (they boot in parallel).
func StartAll(ctx context.Context, t TB, img *Image, nw *Network, cfgs ...Config) ([]*VM, error) {
	t.Helper()
	vms := make([]*VM, 0, len(cfgs))
	for _, c := range cfgs {
		v, err := Start(ctx, t, img, nw, c)
		if err != nil {
			for _, o := range vms {
				o.Kill()
			}
			return nil, err
		}
		vms = append(vms, v)
	}
	return vms, nil
}

// WaitAll waits for all guests concurrently. The error joins every guest's Wait error and
// non-zero exit status (with their output). Once one guest has failed, the others get
// FailGrace to finish (their peer is usually gone) before they are killed.
func WaitAll(ctx context.Context, vms ...*VM) ([]Result, error) {
	res := make([]Result, len(vms))
	errs := make([]error, len(vms))
	failed := make(chan struct{})
	var failOnce sync.Once
	var wg sync.WaitGroup
	for i, v := range vms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i], errs[i] = v.WaitOK(ctx)
			if errs[i] != nil {
				failOnce.Do(func() { close(failed) })
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-failed:
		select {
		case <-done:
		case <-time.After(FailGrace):
			for _, v := range vms {
				v.Kill()
			}
			<-done
		}
	}
	return res, errors.Join(errs...)
}

// FailGrace is how long WaitAll lets the other guests run after one has failed.
const FailGrace = 10 * time.Second

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// randomMAC returns a random address in QEMU's 52:54:00 range.
func randomMAC() string {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return fmt.Sprintf("52:54:00:%02x:%02x:%02x", b[0], b[1], b[2])
}

// onOff spells a QEMU boolean option.
func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}
