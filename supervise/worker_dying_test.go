package supervise

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDying: a live process is not dying; a zombie (exited, not reaped) and a PID that
// names no process are.
func TestDying(t *testing.T) {
	require.False(t, dying(os.Getpid()))
	cmd := exec.Command("true")
	require.NoError(t, cmd.Start())
	pid := cmd.Process.Pid
	require.Eventually(t, func() bool { return dying(pid) }, time.Minute, 5*time.Millisecond, "the exited, unreaped child is a zombie")
	require.NoError(t, cmd.Wait())
	require.True(t, dying(1<<22+12345), "no such process")
}
