package e2e

import (
	"crypto/sha256"
	"debug/buildinfo"
	"fmt"
	"io"
	"os"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
)

// binaryIdentity describes the executable at path (a /proc/PID/exe names a
// running process's, even if its file was replaced since): the file it is,
// its SHA-256 and what Go recorded at its build, as space-separated
// key=value pairs: exe, sha256, go, vcs.revision, vcs.modified, tags (the
// last three "-" when the build recorded none).
func binaryIdentity(path string) (string, error) {
	exe, err := os.Readlink(path)
	if err != nil {
		exe = path // not a /proc link
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("hash %s: %w", path, err)
	}
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("build info of %s: %w", path, err)
	}
	set := map[string]string{"vcs.revision": "-", "vcs.modified": "-", "-tags": "-"}
	for _, s := range bi.Settings {
		if _, ok := set[s.Key]; ok && s.Value != "" {
			set[s.Key] = s.Value
		}
	}
	return fmt.Sprintf("exe=%s sha256=%x go=%s vcs.revision=%s vcs.modified=%s tags=%s",
		exe, h.Sum(nil), bi.GoVersion, set["vcs.revision"], set["vcs.modified"], set["-tags"]), nil
}

// TestBinaryIdentity: this test binary, through /proc/self/exe, is named by its file,
// its content's SHA-256 and its Go version, in the form bench-guard parses.
func TestBinaryIdentity(t *testing.T) {
	id, err := binaryIdentity("/proc/self/exe")
	require.NoError(t, err)
	exe, err := os.Executable()
	require.NoError(t, err)
	b, err := os.ReadFile(exe)
	require.NoError(t, err)
	want := fmt.Sprintf("^exe=%s sha256=%x go=go\\S+ vcs\\.revision=\\S+ vcs\\.modified=\\S+ tags=\\S+$", regexp.QuoteMeta(exe), sha256.Sum256(b))
	require.Regexp(t, want, id)
	_, err = binaryIdentity("/nonexistent")
	require.Error(t, err)
}
