//go:build vm

package vm_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// image returns the cached image, building it if needed (a cold build takes a few
// minutes; a warm one milliseconds).
func image(t *testing.T) *vm.Image {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	start := time.Now()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	t.Logf("image: %s (kernel %s, qemu %s) in %v", img.CacheDir, img.KernelABI, img.QEMUVersion, time.Since(start).Round(time.Millisecond))
	return img
}

// TestBoot boots one guest with a vmxnet3 at 00:05.0 and checks the NIC and that the
// PVRDMA module stack loads.
func TestBoot(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	g, err := vm.Start(ctx, t, img, nil, vm.Config{
		Name: "boot",
		NICs: []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: "52:54:00:77:00:01", IP: "10.0.2.15/24"}},
		Scenario: `
lspci -nn
echo "--- eth0"
cat /sys/class/net/eth0/address /sys/class/net/eth0/operstate
readlink /sys/class/net/eth0/device
ip -br addr show dev eth0
echo "--- modules"
cat /proc/modules | cut -d' ' -f1 | sort
echo "--- ibverbs"
ls /usr/lib/x86_64-linux-gnu/libibverbs/ /etc/libibverbs.d/
ibv_devices
uname -r
`,
	})
	require.NoError(t, err)
	res, err := g.WaitOK(ctx)
	require.NoError(t, err)

	out := res.Output
	require.Regexp(t, regexp.MustCompile(`(?m)^00:05\.0 .*\[15ad:07b0\]`), out, "vmxnet3 at 00:05.0")
	require.Contains(t, out, "52:54:00:77:00:01\nup\n", "eth0 has the configured MAC and is up")
	require.Contains(t, out, "0000:00:05.0", "eth0 is the NIC at 00:05.0")
	require.Contains(t, out, "10.0.2.15/24")
	for _, m := range []string{"vmxnet3", "ib_core", "ib_uverbs", "vmw_pvrdma"} {
		require.Regexp(t, regexp.MustCompile(`(?m)^`+m+`$`), out, "module %s loaded", m)
	}
	require.Contains(t, out, "libvmw_pvrdma-rdmav")
	require.Contains(t, out, img.KernelABI)
	require.NotContains(t, res.Console, "Kernel panic")
	require.Positive(t, res.Timings.BootToInit)
	t.Logf("TIMING boot-to-init=%v guest-uptime-at-init=%v setup=%v scenario=%v total=%v",
		res.Timings.BootToInit.Round(time.Millisecond), res.Timings.GuestUptimeAtInit.Round(time.Millisecond),
		res.Timings.Setup.Round(time.Millisecond), res.Timings.Scenario.Round(time.Millisecond),
		res.Timings.Total.Round(time.Millisecond))
	require.False(t, strings.Contains(out, "@@PVT@@"), "frames are not output")
}

// TestKernelFaultFailsFast: a guest whose console reports a kernel fault fails at once
// with the excerpt, whatever its scenario still waits for, rather than at its deadline
// (an hour here, so that only the fault watch can end the wait). "oops" writes a
// kernel-level BUG report into the kernel log (the console path of a real oops) and then
// waits, as a guest whose peer died would; "panic" crashes the kernel through sysrq.
func TestKernelFaultFailsFast(t *testing.T) {
	img := image(t)
	for _, tc := range []struct {
		name, scenario, want string
	}{
		{"oops", `echo '<1>BUG: kernel NULL pointer dereference, address: 0000000000000000 (pvt fault watch test)' >/dev/kmsg
echo '<4>Call Trace:' >/dev/kmsg
sleep 3600`, "BUG: kernel NULL pointer dereference, address: 0000000000000000 (pvt fault watch test)"},
		{"panic", `echo c >/proc/sysrq-trigger; sleep 3600`, "Kernel panic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			g, err := vm.Start(ctx, t, img, nil, vm.Config{Name: "fault-" + tc.name, Modules: []string{},
				Timeout: time.Hour, Scenario: tc.scenario})
			require.NoError(t, err)
			start := time.Now()
			_, err = g.Wait(ctx)
			var fault *vm.KernelFaultError
			require.ErrorAs(t, err, &fault, "the guest fails with its kernel fault, not at its deadline")
			require.Equal(t, "fault-"+tc.name, fault.VM)
			require.Contains(t, fault.Excerpt, tc.want)
			t.Logf("failed %v after the boot began, with:\n%s", time.Since(start).Round(time.Millisecond), fault.Excerpt)
		})
	}
}
