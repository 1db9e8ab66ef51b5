package packaging

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRootKeys: a cached root's directory is keyed on everything its recipe says, so
// that any change builds a new root, and the same recipe always finds the same one.
func TestRootKeys(t *testing.T) {
	base := rootDir("/c", cleanRecipe())
	require.Equal(t, base, rootDir("/c", cleanRecipe()))
	require.True(t, strings.HasPrefix(base, "/c/pkgroot/bookworm-minbase-"), base)
	for _, change := range []func(*rootRecipe){
		func(r *rootRecipe) { r.Suite = "trixie" },
		func(r *rootRecipe) { r.Variant = "buildd" },
		func(r *rootRecipe) { r.Include = append(r.Include, "dbus") },
		func(r *rootRecipe) { r.Tweaks += "+another" },
	} {
		r := cleanRecipe()
		change(&r)
		require.NotEqual(t, base, rootDir("/c", r), "%+v", r)
	}

	layer := layerDir(base, relayPackages())
	require.Equal(t, layer, layerDir(base, relayPackages()))
	require.True(t, strings.HasPrefix(layer, base+"+"), layer)
	require.NotEqual(t, layer, layerDir(base, append(relayPackages(), "rdma-core")))
	require.NotEqual(t, layer, layerDir(rootDir("/c", rootRecipe{Suite: "trixie"}), relayPackages()))
	// Package lists are not split or joined: "a b" is not "a", "b".
	require.NotEqual(t, layerDir(base, []string{"a b"}), layerDir(base, []string{"a", "b"}))
}
