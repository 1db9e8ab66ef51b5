package proc

import (
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDeathSignalSurvivesThreadExit: a child started with Pdeathsig
// outlives the end of other locked threads (the reason for Start), and
// done closes when it exits.
func TestDeathSignalSurvivesThreadExit(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	done, err := Start(cmd)
	require.NoError(t, err)
	// End a few locked threads, as network namespace code does.
	for range 8 {
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			runtime.LockOSThread()
		}()
		<-ended
	}
	select {
	case <-done:
		t.Fatal("the child died with another thread")
	case <-time.After(200 * time.Millisecond):
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	<-done
	require.False(t, cmd.ProcessState.Success())
}

func TestStartFails(t *testing.T) {
	_, err := Start(exec.Command("/nonexistent/binary"))
	require.ErrorContains(t, err, "/nonexistent/binary")
}
