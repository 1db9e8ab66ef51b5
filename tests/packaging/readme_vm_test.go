//go:build vm

package packaging

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// The packaging tests install and configure the package with what README.md says, taken
// from README itself: a README edit that no longer works fails a test.

func readme(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "README.md"))
	require.NoError(t, err)
	return string(b)
}

// readmeBlock returns the first fenced code block of README.md after the first line
// that mentions what: the test installs what the documentation says, verbatim.
func readmeBlock(t *testing.T, what string) string {
	t.Helper()
	s := readme(t)
	i := strings.Index(s, what)
	require.GreaterOrEqual(t, i, 0, "README.md does not mention %s", what)
	m := regexp.MustCompile("(?s)\n```[a-z]*\n(.*?)\n```\n").FindStringSubmatch(s[i:])
	require.NotNil(t, m, "README.md has no code block after %s", what)
	return m[1] + "\n"
}

// quickStartLine is one command of README's quick start: the line as written (its
// indentation and trailing comment removed) and the numbered step it is in.
type quickStartLine struct {
	text string
	step int
}

// quickStart holds the commands of README's numbered quick start that the package test
// runs as an operator would.
type quickStart struct {
	install, doctor, opts, restart, status quickStartLine
}

var (
	quickStartHeadRE = regexp.MustCompile(`(?m)^## Quick start.*$`)
	nextHeadRE       = regexp.MustCompile(`(?m)^## `)
	numberedStepRE   = regexp.MustCompile(`(?m)^(\d+)\. `)
	fenceRE          = regexp.MustCompile("(?ms)^[ \t]*```[a-z]*\n(.*?)^[ \t]*```[ \t]*$")
	commentRE        = regexp.MustCompile(`\s+#(\s.*)?$`)
)

// readmeQuickStart finds README's "## Quick start" section and, in the code blocks of its
// numbered steps, the first line starting with each command the test runs. The steps must
// come in the order an operator takes them.
func readmeQuickStart(t *testing.T) quickStart {
	t.Helper()
	s := readme(t)
	loc := quickStartHeadRE.FindStringIndex(s)
	require.NotNil(t, loc, "README.md has no \"## Quick start\" section")
	sec := s[loc[1]:]
	if next := nextHeadRE.FindStringIndex(sec); next != nil {
		sec = sec[:next[0]]
	}
	var lines []quickStartLine
	for _, m := range fenceRE.FindAllStringSubmatchIndex(sec, -1) {
		step := 0
		for _, sm := range numberedStepRE.FindAllStringSubmatch(sec[:m[0]], -1) {
			step, _ = strconv.Atoi(sm[1])
		}
		require.NotZero(t, step, "a code block of README's quick start before its first numbered step")
		for _, l := range strings.Split(sec[m[2]:m[3]], "\n") {
			l = strings.TrimSpace(l)
			if c := commentRE.FindStringIndex(l); c != nil && strings.Count(l[:c[0]], `"`)%2 == 0 && strings.Count(l[:c[0]], `'`)%2 == 0 {
				l = strings.TrimSpace(l[:c[0]])
			}
			if l != "" {
				lines = append(lines, quickStartLine{text: l, step: step})
			}
		}
	}
	find := func(prefix string) quickStartLine {
		t.Helper()
		for _, l := range lines {
			if strings.HasPrefix(l.text, prefix) {
				return l
			}
		}
		t.Fatalf("README's quick start has no command starting with %q", prefix)
		return quickStartLine{}
	}
	q := quickStart{
		install: find("apt install ./"),
		doctor:  find("pvrdma-backend doctor"),
		opts:    find("PVRDMA_OPTS="),
		restart: find("systemctl restart pvrdma-backend"),
		status:  find("pvrdma-backend status"),
	}
	order := []quickStartLine{q.install, q.doctor, q.opts, q.restart, q.status}
	for i := 1; i < len(order); i++ {
		require.LessOrEqual(t, order[i-1].step, order[i].step,
			"README's quick start: %q (step %d) comes after %q (step %d)", order[i-1].text, order[i-1].step, order[i].text, order[i].step)
	}
	require.Less(t, q.install.step, q.doctor.step, "install, then doctor")
	return q
}

// debPath is where the package must be for the install line to find it: the line's
// .deb argument (relative to the directory it runs in, /root), its glob filled in.
func (q quickStart) debPath(t *testing.T) string {
	t.Helper()
	for _, f := range strings.Fields(q.install.text) {
		if strings.HasSuffix(f, ".deb") {
			return filepath.Join("/root", strings.ReplaceAll(f, "*", "0.0.0~test_amd64"))
		}
	}
	t.Fatalf("README's install command names no .deb: %q", q.install.text)
	return ""
}

// optsConfig is what the PVRDMA_OPTS line configures, read with the daemon's own parser.
type optsConfig struct {
	bridge, netdev string
	vms            []backend.VMRequest
}

// parseOpts splits the PVRDMA_OPTS line as systemd splits $PVRDMA_OPTS (on whitespace)
// and reads the fabric and the VMs from it.
func (q quickStart) parseOpts(t *testing.T) optsConfig {
	t.Helper()
	v, ok := strings.CutPrefix(q.opts.text, "PVRDMA_OPTS=")
	require.True(t, ok)
	v = strings.Trim(v, `"`)
	args := strings.Fields(v)
	var c optsConfig
	for i := 0; i < len(args); i++ {
		a := args[i]
		val := ""
		if k, x, ok := strings.Cut(a, "="); ok && strings.HasPrefix(k, "--") {
			a, val = k, x
		} else if i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
			val = args[i+1]
			i++
		}
		switch a {
		case "--fabric-bridge":
			c.bridge = val
		case "--fabric-netdev":
			c.netdev = val
		case "--vm":
			req, err := backend.ParseVMFlag(val)
			require.NoError(t, err, "README's PVRDMA_OPTS: --vm %s", val)
			c.vms = append(c.vms, req)
		}
	}
	return c
}

// fabricNetworkd has systemd-networkd in the root create, at boot, what the PVRDMA_OPTS
// line names (a bridge for --fabric-bridge, a dummy link for --fabric-netdev) and bring it
// up, as a host's network configuration would; it returns the link's name.
func fabricNetworkd(t *testing.T, root string, c optsConfig) string {
	t.Helper()
	name, kind := c.bridge, "bridge"
	if name == "" {
		name, kind = c.netdev, "dummy"
	}
	require.NotEmpty(t, name, "README's PVRDMA_OPTS names no fabric")
	files := map[string]string{
		"etc/systemd/network/10-pvrdma-fabric.netdev":  "[NetDev]\nName=" + name + "\nKind=" + kind + "\n",
		"etc/systemd/network/10-pvrdma-fabric.network": "[Match]\nName=" + name + "\n[Network]\nLinkLocalAddressing=no\nConfigureWithoutCarrier=yes\n",
	}
	for path, text := range files {
		require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(root, path)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, path), []byte(text), 0o644))
	}
	for link, unit := range map[string]string{
		"etc/systemd/system/multi-user.target.wants/systemd-networkd.service": "/lib/systemd/system/systemd-networkd.service",
		"etc/systemd/system/sockets.target.wants/systemd-networkd.socket":     "/lib/systemd/system/systemd-networkd.socket",
	} {
		require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(root, link)), 0o755))
		require.NoError(t, os.Symlink(unit, filepath.Join(root, link)))
	}
	return name
}

// TestReadmeQuickStart reads README's quick start as the package tests do, without a
// container: each command is found in its numbered step, in order, and the PVRDMA_OPTS
// line registers VMs with their RAM and addresses on a fabric.
func TestReadmeQuickStart(t *testing.T) {
	qs := readmeQuickStart(t)
	for _, l := range []quickStartLine{qs.install, qs.doctor, qs.opts, qs.restart, qs.status} {
		require.NotZero(t, l.step)
		require.NotContains(t, l.text, "#", "a trailing comment is not part of the command")
	}
	require.True(t, strings.HasPrefix(qs.debPath(t), "/root/"), qs.debPath(t))
	c := qs.parseOpts(t)
	require.True(t, c.bridge != "" || c.netdev != "", "README's PVRDMA_OPTS names a fabric: %s", qs.opts.text)
	require.NotEmpty(t, c.vms)
	for _, vm := range c.vms {
		require.NotZero(t, vm.MemBytes, "README's VM %s has its RAM size", vm.Name)
		require.NotEmpty(t, vm.GIDAllow, "README's VM %s is assigned its addresses", vm.Name)
	}
	t.Logf("quick start: %+v; fabric %+v", qs, c)
}

// TestReadmeRelayFiles reads the relay's drop-in and modules file from README as
// TestPackagedRelay installs them, without a guest.
func TestReadmeRelayFiles(t *testing.T) {
	dropIn := readmeBlock(t, "pvrdma-backend.service.d/relay.conf")
	require.Equal(t, "[Service]\nPrivateDevices=no\nDevicePolicy=closed\nDeviceAllow=char-infiniband_verbs rw\n", dropIn)
	require.Equal(t, "ib_uverbs\nrdma_rxe\n", readmeBlock(t, "/etc/modules-load.d/pvrdma-relay.conf"))
}
