package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// selectStorageKinds returns the kinds of known that the comma-separated list only
// names, in known's order, or an error naming what is not in known.
func selectStorageKinds(only string, known []string) ([]string, error) {
	named := map[string]bool{}
	for _, k := range strings.Split(only, ",") {
		if k = strings.TrimSpace(k); k == "" {
			continue
		}
		if !slices.Contains(known, k) {
			return nil, fmt.Errorf("no storage consumer %q (known: %s)", k, strings.Join(known, ", "))
		}
		named[k] = true
	}
	var kinds []string
	for _, k := range known {
		if named[k] {
			kinds = append(kinds, k)
		}
	}
	if len(kinds) == 0 {
		return nil, fmt.Errorf("names no storage consumer (known: %s)", strings.Join(known, ", "))
	}
	return kinds, nil
}

// TestSelectStorageKinds: E2E_STORAGE selects consumers in the test bed's order; a
// name that is no consumer, or a list that names none, is an error naming the known
// ones, so that a typo fails the storage tests instead of running nothing.
func TestSelectStorageKinds(t *testing.T) {
	known := []string{"nvme", "nfs", "srp"}
	kinds, err := selectStorageKinds("srp,nvme", known)
	require.NoError(t, err)
	assert.Equal(t, []string{"nvme", "srp"}, kinds)
	kinds, err = selectStorageKinds(" nfs ,", known)
	require.NoError(t, err)
	assert.Equal(t, []string{"nfs"}, kinds)
	for _, only := range []string{"nvme,iscsi", "NVMe", "nvm", ",", " "} {
		_, err := selectStorageKinds(only, known)
		assert.ErrorContains(t, err, "known: nvme, nfs, srp", only)
	}
}
