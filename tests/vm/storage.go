package vm

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Storage scenarios: a target guest and an initiator guest (both with LayerStorage) run
// the kernel's RDMA storage consumers in turn (guest/storage.sh): NVMe over Fabrics,
// NFSv4.2 over RDMA, SRP and iSER, each writing data, reading it back with direct I/O and
// checking it on both sides.

// Storage consumers (StorageRun.Kind).
const (
	StorageNVMe = "nvme" // nvmet-rdma target (RAM disk namespace), nvme-rdma host
	StorageNFS  = "nfs"  // nfsd with an RDMA listener on 20049, an NFSv4.2 mount over RDMA
	StorageSRP  = "srp"  // ib_srpt (RAM disk LUN), ib_srp logged in over rdma_cm
	// StorageISER is iSCSI over RDMA: LIO's iSCSI target with an iSER portal (ib_isert,
	// RAM disk LUN), open-iscsi's iscsid and iscsiadm logged in through its iser iface
	// (ib_iser).
	StorageISER = "iser"
)

// StorageConsumers are the consumers every storage test runs (TestStorageConsumers,
// the two hosts' and the crash tests).
var StorageConsumers = []string{StorageNVMe, StorageNFS, StorageSRP}

// storageKinds are the consumers a scenario may run: StorageConsumers and iSER, which
// its own test runs (tests/e2e TestStorageISER).
var storageKinds = append(slices.Clone(StorageConsumers), StorageISER)

// StorageRun is one consumer run of a storage scenario.
type StorageRun struct {
	// Kind is the consumer: StorageNVMe, StorageNFS, StorageSRP or StorageISER.
	Kind string
	// Section is the run's "=== " section; empty means Kind.
	Section string
	// Secs is how long the initiator keeps writing and reading back (pass after pass;
	// at least one): long enough for something to happen to the daemon meanwhile.
	Secs int
	// Opts are more options of the initiator's connection: the nvme connect string's
	// (e.g. "reconnect_delay=2"), the NFS mount's, SRP add_target's.
	Opts string
	// Bench makes the initiator measure the device instead of checking data
	// (guest/storage.sh's pvt_bench: sequential write and read of the run's MiB, then
	// 4 KiB random reads and writes for Secs seconds each); ParseStorageBench reads it.
	Bench bool
}

func (r StorageRun) section() string {
	if r.Section != "" {
		return r.Section
	}
	return r.Kind
}

// storageWordRE is what a value in a generated scenario may hold.
var storageWordRE = regexp.MustCompile(`^[A-Za-z0-9_.:,=/-]*$`)

// StorageScenario is one side's scenario: for each run, "=== <section>", the run
// (pvt_storage_target on the target, pvt_storage_host on the initiator) and "rc=N";
// "=== end" at the end. ibdev is the guest's RDMA device (vmw_pvrdma0, or rxe0, which
// the scenario creates on eth0 first), self and peer the two guests' IPv4 addresses and
// mib the data size of each run. The kernel log of the boot is dropped first so that
// each run's "--- dmesg" holds its own.
func StorageScenario(target bool, ibdev, self, peer string, mib int, runs ...StorageRun) (string, error) {
	for _, w := range []string{ibdev, self, peer} {
		if w == "" || !storageWordRE.MatchString(w) {
			return "", fmt.Errorf("storage scenario: bad word %q", w)
		}
	}
	if mib < 1 || mib > 1024 {
		return "", fmt.Errorf("storage scenario: %d MiB out of range 1..1024", mib)
	}
	var b strings.Builder
	if ibdev == "rxe0" {
		b.WriteString("pvt_rxe eth0\n")
	}
	b.WriteString("dmesg -c >/dev/null\n")
	for _, r := range runs {
		if !contains(storageKinds, r.Kind) || !storageWordRE.MatchString(r.Section) || !storageWordRE.MatchString(r.Opts) || r.Secs < 0 {
			return "", fmt.Errorf("storage scenario: bad run %+v", r)
		}
		call := fmt.Sprintf("pvt_storage_target %s %s %s %s %d %d", r.Kind, ibdev, self, peer, mib, r.Secs)
		if !target {
			call = fmt.Sprintf("pvt_storage_host %s %s %s %s %d %d '%s'", r.Kind, ibdev, self, peer, mib, r.Secs, r.Opts)
			if r.Bench {
				call = "PVT_STORAGE_WORK=pvt_bench " + call
			}
		}
		fmt.Fprintf(&b, "echo '=== %s'\nif %s; then echo rc=0; else echo rc=$?; fi\n", r.section(), call)
	}
	b.WriteString("echo '=== end'\n")
	return b.String(), nil
}

// StorageResult is what one run reported on both sides.
type StorageResult struct {
	// TargetRC and HostRC are the two sides' exit statuses (-1: none printed).
	TargetRC, HostRC int
	// Written, Read and Target are the digests (MD5) of the initiator's data, of what
	// it read back after its last pass, and of what the target holds.
	Written, Read, Target string
	// Passes is how many write and read-back passes the initiator made.
	Passes int
	// NFSConnects is how many times the NFS client's RDMA transport connected (its
	// connect_count in /proc/self/mountstats, printed before the unmount; more than 1 is
	// a reconnect), 0 when not printed.
	NFSConnects int
	// TargetLog and HostLog are the sections' output; TargetDmesg and HostDmesg the
	// kernel log of the run on each side.
	TargetLog, HostLog     string
	TargetDmesg, HostDmesg string
}

var (
	storageRCRE     = regexp.MustCompile(`(?m)^rc=(\d+)$`)
	storageValueRE  = regexp.MustCompile(`(?m)^(sum_written|sum_read|sum_target|passes)=(\S*)$`)
	errStorageNoRun = errors.New("no such run in the output")
	// The NFS client's RDMA transport counters: the local port, bind_count, then
	// connect_count.
	storageXprtRE = regexp.MustCompile(`(?m)^pvt: xprt:\s+rdma \d+ \d+ (\d+)`)
)

// ParseStorage reads the run whose section is section from the target's and the
// initiator's output.
func ParseStorage(targetOut, hostOut, section string) (StorageResult, error) {
	r := StorageResult{TargetRC: -1, HostRC: -1}
	tl, hl := Section(targetOut, section), Section(hostOut, section)
	if tl == "" && hl == "" {
		return r, fmt.Errorf("storage run %s: %w", section, errStorageNoRun)
	}
	r.TargetLog, r.HostLog = tl, hl
	split := func(s string) (string, string) {
		body, dmesg, _ := strings.Cut(s, "\n--- dmesg\n")
		return body, dmesg
	}
	var tb, hb string
	tb, r.TargetDmesg = split(tl)
	hb, r.HostDmesg = split(hl)
	rc := func(s string) int {
		m := storageRCRE.FindAllStringSubmatch(s, -1)
		if m == nil {
			return -1
		}
		n, _ := strconv.Atoi(m[len(m)-1][1])
		return n
	}
	r.TargetRC, r.HostRC = rc(tl), rc(hl)
	for _, m := range storageValueRE.FindAllStringSubmatch(tb+"\n"+hb, -1) {
		switch m[1] {
		case "sum_written":
			r.Written = m[2]
		case "sum_read":
			r.Read = m[2]
		case "sum_target":
			r.Target = m[2]
		case "passes":
			r.Passes, _ = strconv.Atoi(m[2])
		}
	}
	for _, m := range storageXprtRE.FindAllStringSubmatch(hb, -1) {
		if n, err := strconv.Atoi(m[1]); err == nil && n > r.NFSConnects {
			r.NFSConnects = n
		}
	}
	return r, nil
}

// Err is nil if both sides finished with status 0 and the data the initiator wrote, read
// back and the target holds are the same.
func (r StorageResult) Err() error {
	var errs []error
	if r.TargetRC != 0 {
		errs = append(errs, fmt.Errorf("target exited %d", r.TargetRC))
	}
	if r.HostRC != 0 {
		errs = append(errs, fmt.Errorf("initiator exited %d", r.HostRC))
	}
	if len(r.Written) != 32 {
		errs = append(errs, errors.New("the initiator wrote no data"))
	} else {
		if r.Read != r.Written {
			errs = append(errs, fmt.Errorf("read back %q, wrote %s", r.Read, r.Written))
		}
		if r.Target != r.Written {
			errs = append(errs, fmt.Errorf("the target holds %q, the initiator wrote %s", r.Target, r.Written))
		}
	}
	return errors.Join(errs...)
}

// WaitStorageIO waits, at most timeout, until the initiator v's run section has started
// its I/O ("pvt-io start"): something done to the daemon now happens during I/O. It
// fails at once if the run ended before.
func WaitStorageIO(timeout time.Duration, v *VM, section string) error {
	deadline := time.Now().Add(timeout)
	for {
		out := v.Output()
		if i := strings.LastIndex(out, "=== "+section+"\n"); i >= 0 {
			sec := out[i:]
			if strings.Contains(sec, "\npvt-io start\n") {
				return nil
			}
			if storageRCRE.MatchString(sec) {
				return fmt.Errorf("vm %s: run %s ended before its I/O:\n%s", v.Name(), section, sec)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("vm %s: run %s started no I/O within %v", v.Name(), section, timeout)
		}
		select {
		case <-v.Exited():
			if why := v.stoppedFor.Load(); why != nil {
				return fmt.Errorf("vm %s: run %s: the guest was stopped before its I/O: %s", v.Name(), section, *why)
			}
			if f := v.faults.fault(); f != "" {
				return fmt.Errorf("vm %s: run %s: %w", v.Name(), section, &KernelFaultError{VM: v.Name(), Excerpt: f})
			}
			return fmt.Errorf("vm %s: run %s: QEMU exited before the I/O started", v.Name(), section)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// StorageBench is what one Bench run measured on the initiator.
type StorageBench struct {
	// SeqWriteMBps and SeqReadMBps are the sequential throughputs in MB/s (10^6).
	SeqWriteMBps, SeqReadMBps float64
	// RandReadIOPS and RandWriteIOPS are 4 KiB random requests per second at queue
	// depth 1.
	RandReadIOPS, RandWriteIOPS float64
	// RandReadUs and RandWriteUs are their average latencies in microseconds.
	RandReadUs, RandWriteUs float64
}

var (
	benchDDRE     = regexp.MustCompile(`(?m)^bench (seq_write|seq_read): (\d+) bytes .* copied, ([0-9.]+) seconds`)
	benchIOPingRE = regexp.MustCompile(`(?m)^bench (rand_read|rand_write): (\d+) (\d+) ([0-9.]+) ([0-9.]+) ([0-9.]+) ([0-9.]+)`)
)

// ParseStorageBench reads a Bench run's figures from its initiator's section output.
func ParseStorageBench(out string) (StorageBench, error) {
	var b StorageBench
	dd := benchDDRE.FindAllStringSubmatch(out, -1)
	io := benchIOPingRE.FindAllStringSubmatch(out, -1)
	if len(dd) != 2 || len(io) != 2 {
		return b, fmt.Errorf("storage bench: %w", ErrNoResult)
	}
	for _, m := range dd {
		bytes, err1 := strconv.ParseFloat(m[2], 64)
		secs, err2 := strconv.ParseFloat(m[3], 64)
		if err := errors.Join(err1, err2); err != nil || secs <= 0 {
			return b, fmt.Errorf("storage bench %s: %q", m[1], m[0])
		}
		if m[1] == "seq_write" {
			b.SeqWriteMBps = bytes / secs / 1e6
		} else {
			b.SeqReadMBps = bytes / secs / 1e6
		}
	}
	for _, m := range io {
		iops, err1 := strconv.ParseFloat(m[4], 64)
		avg, err2 := strconv.ParseFloat(m[7], 64)
		if err := errors.Join(err1, err2); err != nil {
			return b, fmt.Errorf("storage bench %s: %q", m[1], m[0])
		}
		if m[1] == "rand_read" {
			b.RandReadIOPS, b.RandReadUs = iops, avg/1e3
		} else {
			b.RandWriteIOPS, b.RandWriteUs = iops, avg/1e3
		}
	}
	return b, nil
}
