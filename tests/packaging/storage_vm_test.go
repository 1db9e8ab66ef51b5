//go:build vm

package packaging

import (
	"context"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// recoveryRE picks the kernel log lines that say what a storage consumer did about its
// connection: errors, reconnects, resets.
var recoveryRE = regexp.MustCompile(`(?i)reconnect|recover|reset|error|fail|abort|timeout|disconnect|connect|QP`)

// TestStorageSurvivesCrash: the packaged daemon, under systemd in a container (its
// descriptors kept in the unit's store), serves two stock guests running the kernel's
// storage consumers, NVMe-oF, NFSv4.2 over RDMA and SRP in turn, each writing and
// reading back 32 MiB with direct I/O for 20 s; during each, the daemon is killed with
// SIGKILL. systemd restarts it and it resumes both devices; their RC QPs come back in
// ERR, as after an HCA's link failure, and each consumer must recover by itself (a
// reconnect: nvme-rdma's error recovery, xprtrdma's, SRP's transport layer): every run
// completes with the data checked on both sides, and each must have reconnected
// (nvme-rdma's and ib_srp's kernel messages, the NFS transport's connect count). The
// test logs what each guest's kernel said.
func TestStorageSurvivesCrash(t *testing.T) {
	img, err := vm.EnsureImage(context.Background(), t.Logf)
	require.NoError(t, err)
	c := bootPackaged(t, nil)
	ctx := context.Background()
	ctl := c.register(t, "sk1=10.78.0.1", "sk2=10.78.0.2")
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	var runs []vm.StorageRun
	for _, k := range vm.StorageConsumers {
		runs = append(runs, vm.StorageRun{Kind: k, Secs: 20})
	}
	const mib = 32
	rdmaCM := []string{"ib_core", "ib_uverbs", "vmw_pvrdma", "configfs", "iw_cm", "ib_cm", "rdma_cm", "rdma_ucm"}
	guest := func(name, ip, peer string, target bool) vm.Config {
		sc, err := vm.StorageScenario(target, "vmw_pvrdma0", ip, peer, mib, runs...)
		require.NoError(t, err)
		cfg := c.guest(name, ip+"/24", sc, rdmaCM)
		cfg.Layers = []vm.Layer{vm.LayerStorage}
		// What the consumers' kernels warn about after the kill: vm.CrashWarnings
		// says why.
		cfg.KnownWarnings = vm.CrashWarnings()
		return cfg
	}
	vms, err := vm.StartAll(ctx, t, img, nw, guest("sk1", "10.78.0.1", "10.78.0.2", true), guest("sk2", "10.78.0.2", "10.78.0.1", false))
	require.NoError(t, err)

	for _, r := range runs {
		require.NoError(t, vm.WaitStorageIO(10*time.Minute, vms[1], r.Kind))
		time.Sleep(3 * time.Second) // into the I/O
		pid := c.daemonPID(t)
		require.NotZero(t, pid, "the daemon runs")
		killed := time.Now()
		require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
		var back time.Duration
		require.Eventually(t, func() bool {
			np := c.daemonPID(t)
			if np == 0 || np == pid {
				return false
			}
			st, err := ctl.Status(ctx)
			if err != nil || len(st.VMs) != 2 {
				return false
			}
			for _, v := range st.VMs {
				if !v.Connected {
					return false
				}
			}
			back = time.Since(killed)
			return true
		}, 30*time.Second, 10*time.Millisecond, "%s: the restarted daemon did not resume both VMs", r.Kind)
		t.Logf("%s: kill -9 during the I/O, both devices resumed after %v", r.Kind, back.Round(time.Millisecond))
	}
	res, err := vm.WaitAll(ctx, vms...)
	require.NoError(t, err)
	for _, r := range res {
		assert.NotRegexp(t, `Assertion|aborted|core dumped|BUG:|Oops`, r.Console, "%s: QEMU and the guest kernel", r.VM)
	}
	for _, r := range runs {
		t.Run(r.Kind, func(t *testing.T) {
			sr, err := vm.ParseStorage(res[0].Output, res[1].Output, r.Kind)
			require.NoError(t, err)
			t.Logf("%s through kill -9: %d passes; initiator's kernel:\n%s\ntarget's kernel:\n%s",
				r.Kind, sr.Passes, grepLines(sr.HostDmesg, recoveryRE), grepLines(sr.TargetDmesg, recoveryRE))
			assert.NoError(t, sr.Err(), "target:\n%s\ninitiator:\n%s", sr.TargetLog, sr.HostLog)
			// The daemon's restart left the QPs in ERR: each consumer must have
			// reconnected, not merely carried on.
			switch r.Kind {
			case vm.StorageNVMe:
				assert.Contains(t, sr.HostDmesg, "Successfully reconnected", "nvme-rdma reconnected")
			case vm.StorageSRP:
				assert.Contains(t, sr.HostDmesg, "reconnect succeeded", "ib_srp reconnected")
			case vm.StorageNFS:
				t.Logf("nfs: the RDMA transport connected %d times", sr.NFSConnects)
				assert.Greater(t, sr.NFSConnects, 1, "xprtrdma reconnected")
			}
		})
	}
}

// grepLines returns the lines of s that re matches.
func grepLines(s string, re *regexp.Regexp) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if re.MatchString(l) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
