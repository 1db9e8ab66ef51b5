package vm

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseFrame(t *testing.T) {
	const nonce = "0123456789abcdef"
	fr, ok := parseFrame("@@PVT@@ "+nonce+" INIT 3.39", nonce)
	require.True(t, ok)
	require.Equal(t, frame{kind: frameInit, uptime: 3390 * time.Millisecond}, fr)

	fr, ok = parseFrame("@@PVT@@ "+nonce+" END 1 scenario 4.25", nonce)
	require.True(t, ok)
	require.Equal(t, frameEnd, fr.kind)
	require.Equal(t, 1, fr.rc)
	require.Equal(t, "scenario", fr.stage)

	for _, line := range []string{
		"@@PVT@@ ffffffffffffffff END 0 scenario 1.0", // forged: wrong nonce
		"@@PVT@@ " + nonce + " END 0 scenario",        // missing uptime
		"@@PVT@@ " + nonce + " END 256 scenario 1.0",  // rc out of range
		"@@PVT@@ " + nonce + " END -1 scenario 1.0",
		"@@PVT@@ " + nonce + " END x scenario 1.0",
		"@@PVT@@ " + nonce + " BOOM 1.0",
		"@@PVT@@ " + nonce + " INIT nan",
		"@@PVT@@ " + nonce + " INIT -1",
		" @@PVT@@ " + nonce + " INIT 1.0", // not at the start of the line
		"@@PVT@@ " + nonce,
		"",
	} {
		_, ok := parseFrame(line, nonce)
		require.False(t, ok, "%q is output, not a frame", line)
	}
	_, ok = parseFrame("@@PVT@@  INIT 1.0", "")
	require.False(t, ok, "an empty nonce never matches")
}

func TestCapBuffer(t *testing.T) {
	c := capBuffer{max: 10}
	c.Write([]byte("0123456789"))
	require.Equal(t, "0123456789", c.String())
	c.Write([]byte("abc"))
	s := c.String()
	require.True(t, strings.HasPrefix(s, "[... 8 bytes dropped ...]\n"), s)
	require.True(t, strings.HasSuffix(s, "89abc"), s)
}

func TestReadLines(t *testing.T) {
	var got []string
	long := strings.Repeat("x", maxLineBytes+10)
	err := readLines(strings.NewReader("a\r\nb\n\n"+long+"\nlast"), func(l string) { got = append(got, l) })
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b", "", long[:maxLineBytes], long[maxLineBytes:], "last"}, got)
}

func FuzzParseFrame(f *testing.F) {
	f.Add("@@PVT@@ n END 0 scenario 1.5")
	f.Add("@@PVT@@ n INIT 0.1")
	f.Fuzz(func(t *testing.T, line string) {
		fr, ok := parseFrame(line, "n")
		if ok && (fr.rc < 0 || fr.rc > 255 || fr.uptime < 0) {
			t.Fatalf("accepted bad frame %q: %+v", line, fr)
		}
	})
}
