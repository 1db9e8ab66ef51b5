package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

func cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

// servingSignal is a log handler that discards the daemon's log and closes
// serving when it logs "serving" (its control socket is listening).
type servingSignal struct {
	once    *sync.Once
	serving chan struct{}
}

func (servingSignal) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }
func (h servingSignal) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "serving" {
		h.once.Do(func() { close(h.serving) })
	}
	return nil
}
func (h servingSignal) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h servingSignal) WithGroup(string) slog.Handler      { return h }

// runDaemon runs a daemon on cfg until the test ends and returns once it
// serves. The wait is on the daemon's signal, bounded only against a hang:
// a generous bound, so that a loaded machine does not fail the test.
func runDaemon(t *testing.T, cfg backend.Config) {
	t.Helper()
	sig := servingSignal{once: new(sync.Once), serving: make(chan struct{})}
	cfg.Logger = slog.New(sig)
	d, err := backend.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	const hangBound = 30 * time.Second
	select {
	case <-sig.serving:
	case err := <-done:
		done <- err
		t.Fatalf("daemon stopped before serving: %v", err)
	case <-time.After(hangBound):
		t.Fatalf("daemon not serving after %v", hangBound)
	}
}

func TestUsage(t *testing.T) {
	code, _, stderr := cli(t)
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "qemu-args")
	code, _, stderr = cli(t, "frobnicate")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, `unknown command "frobnicate"`)
	code, _, _ = cli(t, "qemu-args", "--register=false")
	assert.Equal(t, 2, code, "--vm is required")
	code, _, stderr = cli(t, "serve", "--transport", "ibverbs")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "needs --ibdev NAME or --create-rxe NETDEV")
	code, _, stderr = cli(t, "serve", "--transport", "rdma")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "want soft or ibverbs")
	code, _, stderr = cli(t, "serve", "--ibdev", "rxe0")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "need --transport ibverbs")
	code, _, stderr = cli(t, "serve", "--ip-wire", "gso")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "want udp or raw")
	code, _, stderr = cli(t, "serve", "--ip-wire", "raw", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--ip-wire raw needs IP mode")
	code, _, stderr = cli(t, "serve", "--restart-burst", "0")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--restart-burst at least 1")
	// This host has libibverbs but no RDMA device: the error names what
	// to create. (In this process: a supervisor would run this test
	// binary as the daemon.)
	code, _, stderr = cli(t, "serve", "--no-supervisor", "--transport", "ibverbs", "--ibdev", "nosuch0", "--fabric-netdev", "lo", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Regexp(t, `no such RDMA device|cannot load libibverbs`, stderr)
	code, _, stderr = cli(t, "serve", "--no-supervisor", "--transport", "ibverbs", "--ibdev", "nosuch0", "--socket-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "needs --fabric-netdev")
}

func TestQEMUArgsRegistersAndGuardsTheMAC(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "vm1"}, {Name: "vm3", RoCEMode: "v1"}}})

	code, out, stderr := cli(t, "qemu-args", "--vm", "vm2", "--socket-dir", dir, "--mem", "2G", "--slot", "6")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, out, "size=2048M,share=on")
	assert.Contains(t, out, `"addr":"06.1"`)
	assert.Contains(t, out, filepath.Join(dir, "vm2.sock"))
	assert.Contains(t, out, "-chardev socket,id=pvrdma-qmp,path="+filepath.Join(dir, "vm2.qmp")+",reconnect-ms=1000 -mon chardev=pvrdma-qmp,mode=control",
		"qemu-args gives the daemon a QMP monitor of its own")
	_, err := os.Stat(filepath.Join(dir, "vm2.sock"))
	assert.NoError(t, err, "qemu-args registered vm2, so its socket exists before QEMU starts")

	code, _, stderr = cli(t, "qemu-args", "--vm", "vm1", "--socket-dir", dir)
	assert.Equal(t, 0, code, "re-registering with the same MAC is fine: %s", stderr)
	code, _, stderr = cli(t, "qemu-args", "--vm", "vm1", "--socket-dir", dir, "--mac", "52:54:00:00:00:99")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered with MAC "+backend.DefaultMAC("vm1").String())

	code, out, _ = cli(t, "status", "--socket-dir", dir)
	require.Equal(t, 0, code)
	assert.True(t, strings.Contains(out, "vm1") && strings.Contains(out, "vm2"), out)
	assert.Contains(t, out, "RoCE v2 by default, congestion control dcqcn; CNPs sent 0 received 0")
	assert.Regexp(t, `vm3 +false +none +\S+ +v1 `, out)
	code, out, _ = cli(t, "status", "--socket-dir", dir, "--metrics")
	require.Equal(t, 0, code)
	assert.Contains(t, out, `pvrdma_vm_connected{vm="vm2"} 0`)
}

// TestGIDAllowFlags: the GID allow list given to qemu-args reaches the
// daemon (status shows it), a conflicting one is refused like a
// conflicting MAC, and malformed lists fail before anything starts.
func TestGIDAllowFlags(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir})

	code, _, stderr := cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--gid-allow", "10.5.0.0/24, fd05::/64")
	require.Equal(t, 0, code, stderr)
	code, out, _ := cli(t, "status", "--socket-dir", dir, "--json")
	require.Equal(t, 0, code)
	assert.Contains(t, out, `"gid_allow": [
        "10.5.0.0/24",
        "fd05::/64"
      ]`)
	code, _, stderr = cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--gid-allow", "10.6.0.0/24")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered with --gid-allow 10.5.0.0/24,fd05::/64")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--roce-mode", "v1")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered as RoCE v2, not v1")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t3", "--socket-dir", dir, "--roce-mode", "v1")
	require.Equal(t, 0, code, stderr)
	_, out, _ = cli(t, "status", "--socket-dir", dir, "--json")
	assert.Contains(t, out, `"roce_mode": "v1"`)
	code, _, stderr = cli(t, "qemu-args", "--vm", "t5", "--socket-dir", dir, "--doorbells", "memory")
	require.Equal(t, 0, code, stderr)
	_, out, _ = cli(t, "status", "--socket-dir", dir, "--json")
	assert.Regexp(t, `"name": "t5",[^}]*"doorbells": "memory"`, out)
	code, _, stderr = cli(t, "qemu-args", "--vm", "t5", "--socket-dir", dir, "--doorbells", "trapped")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered with doorbells memory, not trapped")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--doorbells", "memory")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "registered with doorbells trapped, not memory")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t6", "--socket-dir", dir, "--doorbells", "mmio")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--doorbells")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t4", "--socket-dir", dir, "--roce-mode", "v3")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "bad RoCE mode")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t2", "--socket-dir", dir, "--gid-allow", "10.5.0.0/33")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "bad GID allow list")

	code, _, stderr = cli(t, "serve", "--socket-dir", t.TempDir(), "--gid-allow", "nonsense")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--gid-allow")
	code, _, stderr = cli(t, "serve", "--socket-dir", t.TempDir(), "--vm", "v1,gid-allow=300.0.0.0/8")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "bad GID allow list")
}

// TestQEMUCgroupFlag: qemu-args --qemu-cgroup registers the VM's cgroup
// (status shows it as the VM's identity), a conflicting one is refused
// like a conflicting MAC, and a path the daemon cannot compare is refused
// before anything starts.
func TestQEMUCgroupFlag(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "plain"}}})

	code, _, stderr := cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir, "--qemu-cgroup", "/machine.slice/t1.scope")
	require.Equal(t, 0, code, stderr)
	code, out, _ := cli(t, "status", "--socket-dir", dir, "--json")
	require.Equal(t, 0, code)
	assert.Contains(t, out, `"qemu_cgroup": "/machine.slice/t1.scope"`)
	assert.Contains(t, out, `"identity": "cgroup /machine.slice/t1.scope"`)
	_, out, _ = cli(t, "status", "--socket-dir", dir)
	assert.Contains(t, out, "t1: identity: cgroup /machine.slice/t1.scope")
	assert.Contains(t, out, "plain: identity: socket group")
	code, _, stderr = cli(t, "qemu-args", "--vm", "t1", "--socket-dir", dir)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, `registered for QEMU cgroup "/machine.slice/t1.scope", not ""`)
	code, _, stderr = cli(t, "qemu-args", "--vm", "t2", "--socket-dir", dir, "--qemu-cgroup", "/machine.slice/../x")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--qemu-cgroup")
	code, _, stderr = cli(t, "serve", "--socket-dir", t.TempDir(), "--vm", "v1,cgroup=/")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "cgroup must be an absolute, clean path")
}

// TestIdentified: doctor counts a VM as identified by its uid, its cgroup
// or the libvirt machine its QEMU was admitted through.
func TestIdentified(t *testing.T) {
	assert.False(t, identified(backend.VMStatus{Identity: backend.IdentitySocketGroup}))
	assert.False(t, identified(backend.VMStatus{}), "a daemon from before identities, no uid")
	assert.True(t, identified(backend.VMStatus{QEMUUID: 1000}))
	assert.True(t, identified(backend.VMStatus{QEMUCgroup: "/x", Identity: "cgroup /x"}))
	assert.True(t, identified(backend.VMStatus{Identity: "libvirt machine qemu-3-vm1"}))
}

// TestAttachFlags: attach offers only the flags it uses (a root port has
// one slot; a running QEMU cannot be given the daemon's monitor) and says
// that its vmxnet3 needs a spare -netdev.
func TestAttachFlags(t *testing.T) {
	code, _, stderr := cli(t, "attach", "-h")
	require.Equal(t, 0, code)
	assert.Contains(t, stderr, "spare -netdev")
	assert.NotContains(t, stderr, "-slot")
	assert.NotContains(t, stderr, "-qmp-monitor")
	for _, f := range []string{"--slot=6", "--qmp-monitor=false"} {
		code, _, stderr = cli(t, "attach", "--qmp", "/nonexistent", "--vm", "vm1", "--bus", "rp1", f)
		assert.Equal(t, 2, code, "attach %s: %s", f, stderr)
		assert.Contains(t, stderr, "flag provided but not defined")
	}
	code, _, stderr = cli(t, "qemu-args", "-h")
	require.Equal(t, 0, code)
	assert.Contains(t, stderr, "-slot")
	assert.Contains(t, stderr, "-qmp-monitor")
}

// TestLibvirtXMLExistingDomain: libvirt-xml --domain adds the device to an
// existing domain's XML and registers the VM under the domain's name with
// its RAM.
func TestLibvirtXMLExistingDomain(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir})
	dom := filepath.Join(t.TempDir(), "web1.xml")
	require.NoError(t, os.WriteFile(dom, []byte("<domain type='kvm'>\n  <name>web1</name>\n  <memory unit='KiB'>2097152</memory>\n"+
		"  <os>\n    <type arch='x86_64' machine='q35'>hvm</type>\n  </os>\n  <devices>\n"+
		"    <disk type='file' device='disk'><source file='/var/lib/libvirt/images/web1.qcow2'/><target dev='vda' bus='virtio'/></disk>\n"+
		"  </devices>\n</domain>\n"), 0o644))
	code, out, stderr := cli(t, "libvirt-xml", "--domain", dom, "--socket-dir", dir, "--nic", "bridge:br0")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, out, "<source file='/var/lib/libvirt/images/web1.qcow2'/>")
	assert.Contains(t, out, `"socket":{"path":"`+filepath.Join(dir, "web1.sock")+`"`)
	assert.Contains(t, out, "<model type='vmxnet3'/>")
	assert.Contains(t, out, "<memballoon model='none'/>")
	st, err := backend.NewControlClient(controlPath(dir)).Status(context.Background())
	require.NoError(t, err)
	require.Len(t, st.VMs, 1)
	assert.Equal(t, "web1", st.VMs[0].Name)
	assert.Equal(t, uint64(2<<30)+backend.LockSlack, st.VMs[0].LockedLimit, "registered with the domain's RAM")

	code, _, stderr = cli(t, "libvirt-xml", "--domain", dom, "--socket-dir", dir, "--mem", "1G")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "has 2048 MiB of RAM, the VM 1024 MiB")
	code, _, stderr = cli(t, "libvirt-xml", "--domain", filepath.Join(dir, "nosuch.xml"), "--socket-dir", dir)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--domain: open ")
}

// TestReadmeQEMUArgsSample: README's qemu-args command prints what README
// shows (the socket directory aside, /run/pvrdma there).
func TestReadmeQEMUArgsSample(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	readme := string(b)
	m := regexp.MustCompile(`(?m)^pvrdma-backend (qemu-args [^#\n]*?)\s+#`).FindStringSubmatch(readme)
	require.NotNil(t, m, "README's qemu-args command")
	sample := regexp.MustCompile("(?s)`qemu-args` prints the arguments.*?\n```text\n(.*?)\n```").FindStringSubmatch(readme)
	require.NotNil(t, sample, "README's qemu-args output")

	dir := t.TempDir()
	runDaemon(t, backend.Config{SocketDir: dir})
	code, out, stderr := cli(t, append(strings.Fields(m[1]), "--socket-dir", dir)...)
	require.Equal(t, 0, code, stderr)
	require.Equal(t, sample[1]+"\n", strings.ReplaceAll(out, dir, "/run/pvrdma"), "README shows what `pvrdma-backend %s` prints", m[1])
}
