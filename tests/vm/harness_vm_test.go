//go:build vm

package vm

// Tests of the harness itself: failing guests fail the test with their output, timeouts
// and interrupts clean everything up.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func harnessImage(t *testing.T) *Image {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	return img
}

// recorder is a require.TestingT that records a failure instead of failing this test.
type recorder struct {
	failed bool
	msg    string
}

func (r *recorder) Errorf(format string, args ...any) { r.msg += fmt.Sprintf(format, args...) }
func (r *recorder) FailNow()                          { r.failed = true }

// TestHarnessGuestFailure proves that a failing guest command fails the Go test, with the
// guest's output in the failure message: one guest exits non-zero explicitly, the other
// fails a command in the middle (scenarios run with set -e).
func TestHarnessGuestFailure(t *testing.T) {
	t.Parallel()
	img := harnessImage(t)
	ctx := context.Background()
	vms, err := StartAll(ctx, t, img, nil,
		Config{Name: "fail-exit", Modules: []string{}, Scenario: `
echo "stdout-marker-7f3"
echo "stderr-marker-9c1" >&2
echo "@@PVT@@ 0000000000000000 END 0 scenario 1.0"
exit 3`},
		Config{Name: "fail-cmd", Modules: []string{}, Scenario: `
echo before-the-failure
ls /no/such/file
echo after-the-failure`},
	)
	require.NoError(t, err)
	res := make([]Result, len(vms))
	for i, v := range vms {
		res[i], err = v.Wait(ctx)
		require.NoError(t, err, "the guests report a result")
	}
	err = res[0].Err()
	require.Error(t, err)

	require.Equal(t, 3, res[0].RC, "the forged END frame (wrong nonce) is ignored")
	require.Equal(t, "scenario", res[0].Stage)
	var ge *GuestError
	require.True(t, errors.As(res[0].Err(), &ge))
	require.Equal(t, 3, ge.RC)
	for _, want := range []string{"vm fail-exit", "status 3", "stdout-marker-7f3", "stderr-marker-9c1", "@@PVT@@ 0000000000000000 END 0"} {
		require.Contains(t, err.Error(), want)
	}

	require.NotZero(t, res[1].RC)
	require.Contains(t, res[1].Output, "before-the-failure")
	require.Contains(t, res[1].Output, "/no/such/file")
	require.NotContains(t, res[1].Output, "after-the-failure", "set -e stops the scenario")

	// The usual test pattern fails, and the message carries the guest's output.
	rec := &recorder{}
	require.NoError(rec, res[1].Err())
	require.True(t, rec.failed)
	require.Contains(t, rec.msg, "before-the-failure")
	require.Contains(t, rec.msg, "No such file or directory")
}

// TestHarnessTimeout: a guest that never finishes is killed at Config.Timeout, Wait
// reports it with the output so far, and QEMU and the run directory are gone.
func TestHarnessTimeout(t *testing.T) {
	// Parallel: its guest only sleeps until the timeout; the package's
	// other parallel tests run meanwhile.
	t.Parallel()
	img := harnessImage(t)
	ctx := context.Background()
	nw, err := NewNetwork(t, NetworkConfig{})
	require.NoError(t, err)
	v, err := Start(ctx, t, img, nw, Config{Name: "hang", Modules: []string{}, Timeout: 30 * time.Second,
		NICs:     []NIC{{Addr: "05.0", IP: "10.77.0.1/24"}},
		Scenario: "echo hanging-now; sleep 3600"})
	require.NoError(t, err)
	start := time.Now()
	_, err = v.Wait(ctx)
	require.Error(t, err)
	t.Logf("the hung guest's Wait returned in %v (its timeout: 30 s)", time.Since(start).Round(time.Millisecond))
	require.Contains(t, err.Error(), "no result within 30s")
	require.Contains(t, err.Error(), "hanging-now")
	require.ErrorIs(t, unix.Kill(v.PID(), 0), unix.ESRCH, "QEMU is gone")
	require.NoDirExists(t, v.Dir())
	require.NoError(t, nw.Close())
	require.NoFileExists(t, nw.NSPath())
}

// TestHarnessBootTimeout: a kernel that never reaches /init (here: no initrd to find it)
// is reported as a boot timeout.
func TestHarnessBootFailure(t *testing.T) {
	img := harnessImage(t)
	v, err := Start(context.Background(), t, img, nil, Config{Name: "noinit", Modules: []string{},
		KernelArgs: "rdinit=/no-such-init init=/no-such-init", BootTimeout: 60 * time.Second, Scenario: "true"})
	require.NoError(t, err)
	_, err = v.Wait(context.Background())
	require.Error(t, err)
	// panic=-1 and -no-reboot make QEMU exit on the resulting panic; either way there is no
	// result and the console explains why.
	require.Contains(t, err.Error(), "Kernel panic")
}

// TestHarnessInterrupt runs a VM test in a child process and interrupts it: SIGINT must
// remove QEMU, the namespace and the run directory; SIGKILL (no cleanup possible) must
// still kill QEMU (PR_SET_PDEATHSIG), and the next run sweeps the namespace and directory.
func TestHarnessInterrupt(t *testing.T) {
	if os.Getenv("PVT_HELPER_CHILD") == "1" {
		t.Skip("helper child")
	}
	harnessImage(t) // make sure the child finds a warm cache
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperInterruptedChild$", "-test.v", "-test.timeout=5m")
			cmd.Env = append(os.Environ(), "PVT_HELPER_CHILD=1")
			out, err := cmd.StdoutPipe()
			require.NoError(t, err)
			cmd.Stderr = cmd.Stdout
			require.NoError(t, cmd.Start())
			defer cmd.Process.Kill()
			var pid int
			var ns, dir string
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				line := sc.Text()
				if i := strings.Index(line, "READY "); i >= 0 {
					f := strings.Fields(line[i:])
					require.Len(t, f, 4, line)
					pid, _ = strconv.Atoi(f[1])
					ns, dir = f[2], f[3]
					break
				}
			}
			require.NotZero(t, pid, "child did not start its VM")
			require.NoError(t, unix.Kill(pid, 0), "QEMU runs")
			require.FileExists(t, "/run/netns/"+ns)
			require.DirExists(t, dir)
			require.NoError(t, cmd.Process.Signal(sig))
			go func() { _, _ = bufio.NewReader(out).WriteTo(devNull{}) }()
			_ = cmd.Wait()
			// QEMU dies with its parent either way.
			require.Eventually(t, func() bool { return errors.Is(unix.Kill(pid, 0), unix.ESRCH) }, 10*time.Second, 50*time.Millisecond, "QEMU pid %d survived", pid)
			if sig == syscall.SIGINT {
				require.NoFileExists(t, "/run/netns/"+ns, "SIGINT cleanup removes the namespace")
				require.NoDirExists(t, dir)
				return
			}
			// SIGKILL leaves the namespace behind (no cleanup can run); a
			// test process running beside this one (make test runs two VM
			// packages at a time) may sweep it first, with the same sweep.
			if _, err := os.Stat("/run/netns/" + ns); err != nil {
				t.Logf("namespace %s already swept by a test process beside this one: %v", ns, err)
			}
			sweep(t.Logf)
			require.NoFileExists(t, "/run/netns/"+ns, "the next run sweeps it")
			require.NoDirExists(t, dir)
		})
	}
}

type devNull struct{}

func (devNull) Write(p []byte) (int, error) { return len(p), nil }

// TestHelperInterruptedChild is the child of TestHarnessInterrupt.
func TestHelperInterruptedChild(t *testing.T) {
	if os.Getenv("PVT_HELPER_CHILD") != "1" {
		t.Skip("only run as TestHarnessInterrupt's child")
	}
	img := harnessImage(t)
	nw, err := NewNetwork(t, NetworkConfig{})
	require.NoError(t, err)
	v, err := Start(context.Background(), t, img, nw, Config{Name: "victim", Modules: []string{},
		NICs: []NIC{{Addr: "05.0"}}, Scenario: "sleep 3600"})
	require.NoError(t, err)
	fmt.Printf("READY %d %s %s\n", v.PID(), nw.Name(), v.Dir())
	_, _ = v.Wait(context.Background())
}
