package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// TestLibvirtHookVerb: `libvirt-hook` as libvirt runs it: refusal with the
// reason on stderr for migrate and restore of a domain libvirt-xml
// printed, nothing at all for other operations, a usage error without
// arguments, and an over-long XML refused only for guarded operations.
func TestLibvirtHookVerb(t *testing.T) {
	dir := t.TempDir()
	code, domain, stderr := cli(t, "libvirt-xml", "--vm", "vm1", "--socket-dir", dir, "--register=false")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, domain, "<qemu:arg value='socket,id=pvrdma-qmp,path="+filepath.Join(dir, "vm1.qmp")+",reconnect-ms=1000'/>")

	var errb bytes.Buffer
	err := runLibvirtHook([]string{"vm1", "migrate", "begin", "-"}, strings.NewReader(domain), &errb)
	require.ErrorIs(t, err, backend.ErrHookRefused)
	require.Contains(t, err.Error(), filepath.Join(dir, "vm1.sock"))
	require.NoError(t, runLibvirtHook([]string{"vm1", "started", "begin", "-"}, strings.NewReader(domain), &errb))
	require.Empty(t, errb.String())

	require.ErrorIs(t, runLibvirtHook(nil, strings.NewReader(""), &errb), errUsage)
	require.Contains(t, errb.String(), "usage: pvrdma-backend libvirt-hook")

	big := strings.Repeat(" ", maxDomainXML+1)
	require.Error(t, runLibvirtHook([]string{"vm1", "restore", "begin", "-"}, strings.NewReader(big), &errb))
	require.NoError(t, runLibvirtHook([]string{"vm1", "start", "begin", "-"}, strings.NewReader(big), &errb))
}

// TestCheckLibvirtHook: doctor's libvirt-hook check on hosts without
// libvirt, with libvirt and no hook, with a hook that is not executable
// or not ours, and with the packaged hook.
func TestCheckLibvirtHook(t *testing.T) {
	h := fakeHost(t)
	require.Equal(t, statusOK, checkLibvirtHook(h).Status, "no libvirt: nothing to check")

	require.NoError(t, os.MkdirAll(filepath.Join(h.etc, "libvirt"), 0o755))
	r := checkLibvirtHook(h)
	require.Equal(t, statusFail, r.Status)
	require.Contains(t, r.Fix, "packaging/libvirt-hook")

	hook, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging/libvirt-hook"))
	require.NoError(t, err)
	p := filepath.Join(h.etc, "libvirt/hooks/qemu.d/pvrdma-backend")
	writeFile(t, p, string(hook))
	r = checkLibvirtHook(h)
	require.Equal(t, statusFail, r.Status, "mode 0644: libvirt skips it")
	require.Contains(t, r.Detail, "not an executable file")

	require.NoError(t, os.Chmod(p, 0o755))
	r = checkLibvirtHook(h)
	require.Equal(t, statusOK, r.Status, r.Detail)

	require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\nexit 0\n"), 0o755))
	require.Equal(t, statusFail, checkLibvirtHook(h).Status, "a hook that is not ours")
}

func repoRoot(t *testing.T) string {
	t.Helper()
	wd, err := os.Getwd()
	require.NoError(t, err)
	return filepath.Join(wd, "../..")
}

// TestCheckVMs: doctor's vms check with no daemon, and with a connected VM
// that has no QMP monitor and no QEMU uid of its own: a warning naming it.
func TestCheckVMs(t *testing.T) {
	dir := t.TempDir()
	r := checkVMs(context.Background(), dir)
	require.Equal(t, statusOK, r.Status, r.Detail)
	require.Contains(t, r.Detail, "no daemon")

	runDaemon(t, backend.Config{SocketDir: dir, VMs: []backend.VMRequest{{Name: "vm1"}, {Name: "vm2"}}})
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, "vm1.sock"), Net: "unix"})
	require.NoError(t, err)
	c := vfiousertest.NewClient(conn)
	defer c.Close()
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		r = checkVMs(context.Background(), dir)
		return strings.Contains(r.Detail, "1 VMs connected")
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, statusWarn, r.Status)
	require.Contains(t, r.Detail, "vm1: no QMP monitor of its QEMU")
	require.Contains(t, r.Detail, "any QEMU of the socket group may connect as it")
	require.NotContains(t, r.Detail, "vm2:", "not connected: not exposed")
}
