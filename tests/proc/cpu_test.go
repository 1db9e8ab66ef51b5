package proc

import (
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseStat(t *testing.T) {
	// A name with spaces and parentheses; utime 250, stime 50 ticks.
	line := "4242 (a (weird) name) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 100 1000 10\n"
	pid, ppid, cpu, err := parseStat(line)
	require.NoError(t, err)
	assert.Equal(t, 4242, pid)
	assert.Equal(t, 17, ppid)
	assert.Equal(t, 3*time.Second, cpu)
	for _, bad := range []string{"", "12 noparen S 1", "12 (x) S", "x (y) S 1 2 3 4 5 6 7 8 9 10 11 12 13"} {
		_, _, _, err := parseStat(bad)
		assert.Error(t, err, "%q", bad)
	}
}

// TestTreeCPUCountsDescendants: a shell whose child spins is charged the
// child's CPU time.
func TestTreeCPUCountsDescendants(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sh -c 'while :; do :; done' & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	_, err := TreeCPU(os.Getpid())
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		c, err := TreeCPU(cmd.Process.Pid)
		return err == nil && c >= 3*clockTick
	}, time.Minute, 10*time.Millisecond, "the spinning grandchild's time is counted")
	_, err = TreeCPU(1 << 30)
	assert.Error(t, err)
}
