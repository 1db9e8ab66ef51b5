package packaging

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// docDir is where the package installs README.md.
const docDir = "/usr/share/doc/pvrdma-backend"

// TestPackageShipsLinkedDocs: every file README.md links to by a relative
// path is in the package (packaging/nfpm.yaml), at the same path relative
// to the installed README, so that the installed README's links resolve.
func TestPackageShipsLinkedDocs(t *testing.T) {
	// A test runs in its package's directory (runtime.Caller names no real path
	// under -trimpath, which make test uses).
	root := "../.."
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	require.NoError(t, err)
	recipe, err := os.ReadFile(filepath.Join(root, "packaging/nfpm.yaml"))
	require.NoError(t, err)
	shipped := map[string]string{} // dst -> src
	for _, m := range regexp.MustCompile(`(?m)^\s*- src: (\S+)\n\s+dst: (\S+)$`).FindAllStringSubmatch(string(recipe), -1) {
		shipped[m[2]] = m[1]
	}
	require.Equal(t, "README.md", shipped[docDir+"/README.md"])
	links := regexp.MustCompile(`\]\(([^)#:\s]+)(?:#[^)]*)?\)`).FindAllStringSubmatch(string(readme), -1)
	require.NotEmpty(t, links)
	for _, l := range links {
		target := filepath.Clean(l[1])
		require.False(t, strings.HasPrefix(target, ".."), "README links outside the repository: %s", l[1])
		src, ok := shipped[filepath.Join(docDir, target)]
		require.True(t, ok, "README links %s, which the package does not install as %s", l[1], filepath.Join(docDir, target))
		require.Equal(t, target, src)
		_, err := os.Stat(filepath.Join(root, src))
		require.NoError(t, err)
	}
}
