package main

import (
	"fmt"
	"strings"
)

// A Section is one part of the report: one `go test -bench` command and what it
// measures. The report keeps its sections in this order.
type Section struct {
	Name  string // BENCH_SECTIONS uses it; the report's anchor
	Title string
	// Target is the make target that runs the same benchmarks.
	Target string
	// About says what is measured and against which reference, in words (never a figure).
	About string
	// Args are go test's arguments after "go test".
	Args []string
	// BenchtimeFlexible: -benchtime may be overridden (time-based benchmarks); the
	// others run a fixed number of times (1x) because each iteration is a whole scenario.
	BenchtimeFlexible bool
	// Sizing: the section's results give the sizing table (sizing.go)
	// that README's sizing section links to.
	Sizing bool
}

// sections are the report's sections, in the report's order.
var sections = []Section{
	{
		Name: "device", Title: "The device model and vfio-user", Target: "make bench",
		About: "The PVRDMA device model (`vdev`) and the vfio-user server (`vfiouser`) without a guest: " +
			"a vfio-user REGION_WRITE round trip against a bare unix-socket ping-pong in the same run " +
			"(`ratio`), POLL and RECV doorbells and a SEND doorbell to its CQE against a socket round trip " +
			"(`x_socket_rtt`) and a memcpy (`x_memcpy`), the device model over the soft transport against " +
			"calling the transport directly (`x_direct`), the cost of the doorbell-to-CQE histograms " +
			"(`BenchmarkDistributionsAB`: alternating bursts with and without them, `on/off` and `extra_ns/wqe`), " +
			"and a kernel consumer's per-I/O fast registration (`BenchmarkFastRegInvalidate`: a 32-page REG_MR " +
			"plus LOCAL_INV through the device against the provider alone, `x_provider`, and against " +
			"CREATE_MR/DESTROY_MR commands, `x_cmd_reg`).",
		Args:              []string{"-run", "^$", "-bench", ".", "-benchmem", "-benchtime", "2s", "./vfiouser", "./vdev"},
		BenchtimeFlexible: true,
	},
	{
		Name: "wire", Title: "The soft transport over loopback and in process", Target: "make bench",
		About: "The soft RoCE transport between two QPs of one fabric: 1 MiB RDMA WRITEs, 64 KiB SENDs, 1 MiB READs " +
			"and 8-byte ping-pongs over the kernel's UDP path on loopback (`...Loopback`), and WRITEs and SENDs " +
			"delivered in process (`...InProcess`). The references are measured in the same run: a plain UDP " +
			"blast and a UDP GSO+GRO blast of the same segment size (`x_udp_blast`, `x_gso_blast`, and CPU time " +
			"per packet against theirs, `x_..._cpu`), a plain UDP ping-pong and one that hands each datagram to " +
			"another goroutine (`x_udp_pingpong`, `x_udp_handoff`), and memcpy for the in-process path " +
			"(`x_memcpy`). `pkts/tx_msg` and `pkts/rx_msg` are packets per system-call message; `cpu_cores` is " +
			"the process's CPU time over wall time. `BenchmarkRecoverIPv4ID` is the ICRC's IPv4 ID recovery.",
		Args: []string{"-run", "^$", "-bench", "Loopback|InProcess|RecoverIPv4ID", "-benchmem", "-benchtime", "2s",
			"./hostverbs/soft", "./hostverbs/soft/roce"},
		BenchtimeFlexible: true,
	},
	{
		Name: "incast", Title: "Incast through a congested forwarder (DCQCN)", Target: "make bench",
		About: "Four senders into one forwarder port slower than their sum that marks CE above a threshold, " +
			"for each congestion-control configuration (off, the defaults, timers scaled to the link): the " +
			"forwarder queue's median and p99 (also against the marking threshold, `x_mark_threshold`), " +
			"goodput (also against the bottleneck, `x_bottleneck`), Jain's fairness index, drops, " +
			"retransmissions and CNPs.",
		Args: []string{"-run", "^$", "-bench", "Incast", "-benchtime", "1x", "-timeout", "10m", "./hostverbs/soft"},
	},
	{
		Name: "vm", Title: "Stock guests through the daemon against guests running rxe", Target: "make bench-vm",
		About: "Two stock Debian guests (TCG) through one daemon against two guests running the kernel's rxe, " +
			"in the same run (`BenchmarkVMvsRxe`: `ib_write_bw` and `ib_send_bw` 64 KiB, `ibv_rc_pingpong " +
			"-s 4096`, `ib_write_lat` 2 B; the table it prints has both sides and the ratio), and the two " +
			"guests through the daemon alone (`BenchmarkGuestPerf`: time per `ibv_rc_pingpong` iteration and " +
			"`ib_write_bw` bandwidth over seconds of traffic, the figures `scripts/bench-ab` and " +
			"`scripts/bench-guard` compare). The guests lock their RAM as production's `qemu-args` has them " +
			"do (`-overcommit mem-lock=on`). Every figure is dominated by TCG: compare the ratios, not the " +
			"absolute values.",
		Args: []string{"-tags", "vm", "-run", "^$", "-bench", "VMvsRxe|GuestPerf", "-benchtime", "1x", "-timeout", "30m", "./tests/e2e"},
	},
	{
		Name: "storage", Title: "NVMe over Fabrics in stock guests: our device against rxe", Target: "make bench-vm",
		About: "The kernel's NVMe-oF host and target (nvme-rdma, nvmet-rdma on a RAM disk) between two stock " +
			"guests (TCG), through one daemon against the same guests running the kernel's rxe, in the same " +
			"run (`BenchmarkStorageVsRxe`): sequential write and read of 64 MiB in 1 MiB `O_DIRECT` requests " +
			"(`dd`), and 4 KiB random reads and writes at queue depth 1 for 10 s each (`ioping`); the table it " +
			"prints has both sides, the ratios and the average latencies. Every figure is dominated by TCG: " +
			"compare the ratios, not the absolute values.",
		Args: []string{"-tags", "vm", "-run", "^$", "-bench", "StorageVsRxe", "-benchtime", "1x", "-timeout", "30m", "./tests/e2e"},
	},
	{
		Name: "doorbells", Title: "Doorbells trapped and in memory, against rxe", Target: "make bench-vm",
		About: "Three pairs of stock guests (TCG) in one run: kernel rxe in the guests, our device with doorbells " +
			"trapped (each UAR write a VM exit and a vfio-user round trip), and our device with doorbells in " +
			"memory (`doorbells=memory`: the guests' user-space doorbells are stores the daemon polls). Each pair " +
			"runs `ib_write_lat` 2 B, `ib_send_bw` 64 B (message rate), `ibv_rc_pingpong` 64 B busy-polling and " +
			"event-driven (`-e`), UCX's `ucx_perftest` am_lat over rc_verbs, and NVMe-oF 4 KiB random reads and " +
			"writes at queue depth 1 (`BenchmarkDoorbells`). The tables give each figure, each mode against rxe and " +
			"memory against trapped (`x_mem_vs_trap_...`), the doorbells trapped and seen in memory per operation, " +
			"and the daemon's CPU per VM (a daemon process per mode, its CPU time over wall time, halved) while " +
			"both guests hold an idle context and over the workloads. The kernel's consumers ring on UAR page 0, " +
			"trapped in both modes. Every figure is dominated by TCG: compare the ratios, not the absolute values.",
		Args: []string{"-tags", "vm", "-run", "^$", "-bench", "Doorbells", "-benchtime", "1x", "-timeout", "60m", "./tests/e2e"},
	},
	{
		Name: "relay", Title: "The ibverbs relay against a plain libibverbs program", Target: "make bench-vm",
		About: "In one TCG guest with kernel rxe, the relay (`--transport ibverbs`) against a plain C libibverbs " +
			"program on the same rxe device: 64 KiB WRITE throughput and 8-byte SEND post-to-completion, in the " +
			"default (event-driven) mode and with busy polling, and against the plain program with its CQs armed " +
			"at every post or in the relay's thread shape (medians of three rounds; the `RATIO` lines).",
		// -v: the RATIO lines it logs come after the guest's log, and without -v go test
		// keeps only the first ten lines of a benchmark's log.
		Args: []string{"-tags", "vm", "-run", "^$", "-bench", "RelayVsPlain", "-benchtime", "1x", "-v", "-timeout", "30m", "./hostverbs/ibverbs"},
	},
	{
		Name: "scale", Title: "Many VMs on one daemon, and many objects in one VM", Target: "make bench-scale",
		About: "One daemon with N fake-driver VMs (real vfio-user connections, no QEMU; the drivers run in the " +
			"daemon's process), N/2 pairs streaming 16 KiB RDMA WRITEs and a probe pair timing single 8-byte " +
			"WRITEs: aggregate throughput (also against N=8 in the same run, the `SCALE` line), Jain's index, " +
			"the probe's p50 and p99, and what each VM costs the daemon (anonymous memory idle and busy, " +
			"goroutines, threads, descriptors, the page tables mapping its locked RAM). Then one VM creates as many CQs, QPs and MRs as its device " +
			"allows and destroys them: the rate of the last 1024 of each kind against the first 1024, memory " +
			"per object, and the teardown (`OBJECTS` lines). `PVRDMA_SCALE_N=8,32` runs other counts.",
		Args:   []string{"-run", "^$", "-bench", "Scale|Objects", "-benchtime", "1x", "-timeout", "30m", "./tests/hostile"},
		Sizing: true,
	},
	{
		Name: "handover", Title: "The pause of a live upgrade", Target: "make bench-handover",
		About: "Fake-driver VMs streaming RDMA WRITEs through a `serve --keep-state` daemon that is handed over " +
			"to a new process (`pvrdma-backend upgrade`): the guest-visible pause as the daemon reports it and " +
			"its parts (saving, of it holding and draining; the new binary starting, of it the exec and runtime " +
			"start; devices rebuilt), each with the CPU time the daemon spent in it, a probe WRITE's longest " +
			"time across it against its median in the same run, and the RC QPs that kept their connections. " +
			"`PVRDMA_HANDOVER_N=8` runs one count.",
		Args: []string{"-run", "^$", "-bench", "Handover", "-benchtime", "1x", "-timeout", "10m", "./tests/hostile"},
	},
	{
		Name: "hosts", Title: "Many hosts: routed and over a VXLAN overlay", Target: "make bench-hosts",
		About: "Four hosts (network namespaces, a daemon each, two fake-driver VMs each), every VM streaming " +
			"verified 16 KiB WRITEs to every VM of the other hosts at once: in IP mode across a router between " +
			"two subnets, and in L2 mode over a kernel VXLAN overlay. Aggregate throughput and Jain's index " +
			"across hosts and across streams. The daemons and drivers share the machine's cores.",
		Args: []string{"-run", "^$", "-bench", "ManyHosts", "-benchtime", "1x", "-timeout", "10m", "./tests/hostile"},
	},
}

// sectionByName returns the named section.
func sectionByName(name string) (Section, bool) {
	for _, s := range sections {
		if s.Name == name {
			return s, true
		}
	}
	return Section{}, false
}

// selectSections parses BENCH_SECTIONS: "all", or names separated by commas or spaces.
func selectSections(list string) ([]Section, error) {
	list = strings.TrimSpace(list)
	if list == "" || list == "all" {
		return sections, nil
	}
	want := map[string]bool{}
	for _, n := range strings.FieldsFunc(list, func(r rune) bool { return r == ',' || r == ' ' }) {
		if _, ok := sectionByName(n); !ok {
			return nil, fmt.Errorf("no section %q (sections: %s)", n, sectionNames())
		}
		want[n] = true
	}
	var out []Section
	for _, s := range sections {
		if want[s.Name] {
			out = append(out, s)
		}
	}
	return out, nil
}

func sectionNames() string {
	names := make([]string, len(sections))
	for i, s := range sections {
		names[i] = s.Name
	}
	return strings.Join(names, ", ")
}

// withBenchtime returns the section's arguments with -benchtime replaced by d (if the
// section allows it and d is set).
func (s Section) withBenchtime(d string) []string {
	args := append([]string(nil), s.Args...)
	if d == "" || !s.BenchtimeFlexible {
		return args
	}
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-benchtime" {
			args[i+1] = d
		}
	}
	return args
}
