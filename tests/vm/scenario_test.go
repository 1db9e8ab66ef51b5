package vm

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestWriteOverlay(t *testing.T) {
	host := filepath.Join(t.TempDir(), "helper")
	require.NoError(t, os.WriteFile(host, []byte("#!/bin/sh\n"), 0o750))
	cfg := Config{Name: "g1", Modules: []string{"ib_core", "rdma_rxe"},
		NICs:      []NIC{{Model: "vmxnet3", MAC: "52:54:00:AA:00:01", IP: "10.77.0.1/24"}, {Model: "virtio-net-pci", MAC: "52:54:00:aa:00:02"}},
		Scenario:  "echo hi",
		Files:     map[string][]byte{"/bin/tool": []byte("tool")},
		HostFiles: map[string]string{"/usr/local/bin/helper": host},
	}
	require.NoError(t, cfg.validate(nil))
	files := overlayFiles(t, &cfg)
	require.NotContains(t, files, "bin", "never replace the /bin symlink of the base archive")
	require.Equal(t, initScript, files["init"].Data)
	require.Equal(t, uint32(modeRegular|0o755), files["init"].Mode)
	require.Equal(t, libScript, files[guestLib].Data)
	conf := string(files[guestConfig].Data)
	require.Contains(t, conf, `PVT_NONCE="feedface"`)
	require.Contains(t, conf, `PVT_HOSTNAME="g1"`)
	require.Contains(t, conf, `PVT_PRELOAD="vmxnet3 virtio_pci virtio_net"`)
	require.Contains(t, conf, `PVT_MODULES="ib_core rdma_rxe"`)
	require.Contains(t, conf, `PVT_NICS="52:54:00:aa:00:01=10.77.0.1/24 52:54:00:aa:00:02=-"`)
	script := string(files[guestScenario].Data)
	require.True(t, strings.HasPrefix(script, "set -e\n. /"+guestLib+"\n"), script)
	require.Contains(t, script, "echo hi")
	require.Equal(t, "tool", string(files["usr/bin/tool"].Data), "/bin is merged into /usr/bin")
	require.Equal(t, uint32(modeRegular|0o750), files["usr/local/bin/helper"].Mode)

	cfg.NoErrExit = true
	require.NotContains(t, string(overlayFiles(t, &cfg)[guestScenario].Data), "set -e")
	require.Nil(t, (&Config{}).Modules)
	require.Equal(t, DefaultModules(), (&Config{}).modules(), "nil Modules means the defaults")
	require.Empty(t, (&Config{Modules: []string{}}).modules(), "an empty list means none")
}

// TestWriteOverlayRoot: a guest with its own root gets the 9p modules, the root's tag,
// the runner and its unit, and a scenario that sources the helpers from /run; the test's
// files go into the root, not the archive.
func TestWriteOverlayRoot(t *testing.T) {
	cfg := Config{Name: "r1", Root: "/srv/root", Modules: []string{},
		NICs:     []NIC{{MAC: "52:54:00:aa:00:01", IP: "10.77.0.1/24"}},
		Scenario: "echo hi",
		Files:    map[string][]byte{"/usr/bin/tool": []byte("tool")},
	}
	files := overlayFiles(t, &cfg)
	conf := string(files[guestConfig].Data)
	require.Contains(t, conf, `PVT_ROOT="pvtroot"`)
	require.Contains(t, conf, `PVT_PRELOAD="vmxnet3 virtio_pci 9pnet_virtio 9p"`)
	require.True(t, strings.HasPrefix(string(files[guestScenario].Data), "set -e\n. /run/pvt/lib.sh\n"))
	require.Equal(t, rootRunScript, files[guestRootRun].Data)
	require.Equal(t, rootRunUnit, files[guestRootUnit].Data)
	require.NotContains(t, files, "usr/bin/tool", "Start writes the test's files into the root")

	cfg.Root = ""
	files = overlayFiles(t, &cfg)
	require.Contains(t, string(files[guestConfig].Data), `PVT_ROOT=""`)
	require.NotContains(t, files, guestRootRun)
}

// overlayFiles writes cfg's overlay archive and reads it back, by name.
func overlayFiles(t *testing.T, cfg *Config) map[string]cpioEntry {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, writeOverlay(&b, cfg, "feedface"))
	ents, err := readCPIO(b.Bytes())
	require.NoError(t, err)
	files := map[string]cpioEntry{}
	for _, e := range ents {
		files[e.Name] = e
	}
	return files
}
