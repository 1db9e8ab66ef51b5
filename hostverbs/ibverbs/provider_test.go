//go:build linux && cgo

package ibverbs

import (
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMissingDevice: on a host without the named device (this one has
// libibverbs but no RDMA devices), New fails with ErrNoDevice and says how
// to create one; without libibverbs it would fail with ErrNoLibrary.
func TestMissingDevice(t *testing.T) {
	if os.Getenv("PVRDMA_IBDEV") != "" {
		t.Skip("an RDMA device is configured")
	}
	_, err := New(Config{Device: "no-such-dev0"})
	require.Error(t, err)
	if errors.Is(err, ErrNoLibrary) {
		require.Contains(t, err.Error(), "apt install libibverbs1")
		return
	}
	require.ErrorIs(t, err, ErrNoDevice)
	require.Contains(t, err.Error(), "rdma link add rxe0 type rxe netdev")
	_, err = New(Config{})
	require.ErrorIs(t, err, ErrNoDevice)
}
