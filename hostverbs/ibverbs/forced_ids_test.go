//go:build linux && cgo

package ibverbs

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// TestForcedIDsRefused: the relay cannot choose a host QPN or host keys,
// so a restore asking for them is refused with ErrNotSupported before the
// host device is touched.
func TestForcedIDsRefused(t *testing.T) {
	var p PD
	_, err := p.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, QPN: 0x11})
	require.ErrorIs(t, err, hostverbs.ErrNotSupported)
	_, err = p.RegMR(hostverbs.MRAttr{LKey: 0x1234})
	require.ErrorIs(t, err, hostverbs.ErrNotSupported)
	_, err = p.RegMR(hostverbs.MRAttr{RKey: 0x1234})
	require.ErrorIs(t, err, hostverbs.ErrNotSupported)
}
