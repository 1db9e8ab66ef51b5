package packaging

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRootKeys: a cached root's directory is keyed on everything its recipe says, so
// that any change builds a new root, and the same recipe always finds the same one.
func TestRootKeys(t *testing.T) {
	pins := []string{"libc6=2.36-9+deb12u13:amd64", "systemd=252.39-1~deb12u1:amd64"}
	base := rootDir("/c", cleanRecipe(), pins)
	require.Equal(t, base, rootDir("/c", cleanRecipe(), pins))
	require.NotEqual(t, base, rootDir("/c", cleanRecipe(), pins[:1]), "another set of pins is another root")
	require.True(t, strings.HasPrefix(base, "/c/pkgroot/bookworm-minbase-"), base)
	for _, change := range []func(*rootRecipe){
		func(r *rootRecipe) { r.Suite = "trixie" },
		func(r *rootRecipe) { r.Variant = "buildd" },
		func(r *rootRecipe) { r.Include = append(r.Include, "dbus") },
		func(r *rootRecipe) { r.Tweaks += "+another" },
	} {
		r := cleanRecipe()
		change(&r)
		require.NotEqual(t, base, rootDir("/c", r, pins), "%+v", r)
	}

	lpins := []string{"kmod=30+20221128-1:amd64"}
	layer := layerDir(base, relayPackages(), lpins)
	require.Equal(t, layer, layerDir(base, relayPackages(), lpins))
	require.True(t, strings.HasPrefix(layer, base+"+"), layer)
	require.NotEqual(t, layer, layerDir(base, append(relayPackages(), "rdma-core"), lpins))
	require.NotEqual(t, layer, layerDir(base, relayPackages(), nil))
	require.NotEqual(t, layer, layerDir(rootDir("/c", rootRecipe{Suite: "trixie"}, pins), relayPackages(), lpins))
	// Package lists are not split or joined: "a b" is not "a", "b".
	require.NotEqual(t, layerDir(base, []string{"a b"}, nil), layerDir(base, []string{"a", "b"}, nil))
}

// TestLayerPins: a layer's pins are what it adds to or changes in the clean root, and
// the list it must end with is the clean root's with those pins in place.
func TestLayerPins(t *testing.T) {
	base := []string{"a=1:amd64", "b=1:all", "c=1:amd64"}
	after := []string{"a=1:amd64", "b=2:all", "c=1:amd64", "d=1:amd64"}
	pins := layerPins(base, after)
	require.Equal(t, []string{"b=2:all", "d=1:amd64"}, pins)
	require.Equal(t, after, wantLayer(base, pins))
	require.NoError(t, pinMismatch("x", after, after))
	err := pinMismatch("x", after, []string{"a=1:amd64", "b=3:all", "c=1:amd64", "d=1:amd64"})
	require.ErrorContains(t, err, "+b=3:all")
	require.ErrorContains(t, err, "-b=2:all")
	require.ErrorContains(t, err, "make testbed-update")
}
