package vdev

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

func TestValidAccessDropsOptionalHints(t *testing.T) {
	// perftest registers with IBV_ACCESS_RELAXED_ORDERING (1<<20) | LOCAL_WRITE.
	acc, err := validAccess(1<<20 | 1)
	require.NoError(t, err)
	assert.Equal(t, hostverbs.AccessLocalWrite, acc)
	_, err = validAccess(1 << 6) // ON_DEMAND: not optional, not supported
	assert.ErrorIs(t, err, syscall.EINVAL)
	_, err = validAccess(uint32(hostverbs.AccessRemoteWrite)) // remote write needs local write
	assert.ErrorIs(t, err, syscall.EINVAL)
	_, err = validAccess(1 << 30) // above the optional range
	assert.ErrorIs(t, err, syscall.EINVAL)
}
