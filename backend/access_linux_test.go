package backend

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The unprivileged peer of these tests: nobody, and a group it is not in.
const (
	nobodyUID = 65534
	testGID   = 4791
)

// dialAs connects to the unix socket path as uid (primary group gid,
// supplementary groups groups) with perl from perl-base, and reports what
// the daemon did within wait: "open" (kept the connection), "eof" (closed
// it) or the connect error. An expected "eof" is waited for up to a
// generous wait (it comes as soon as the daemon refuses the peer); "open"
// is what a daemon that keeps the connection for wait looks like.
func dialAs(t *testing.T, path string, uid, gid int, groups string, wait time.Duration) string {
	t.Helper()
	script := `use IO::Socket::UNIX; my $s = IO::Socket::UNIX->new(Peer => $ARGV[0]) or do { print "connect: $!\n"; exit 0 };
vec(my $r = "", fileno($s), 1) = 1; if (select($r, undef, undef, $ARGV[1]) > 0) { my $n = sysread($s, my $x, 1); print $n ? "data\n" : "eof\n" } else { print "open\n" }`
	args := []string{"--reuid", strconv.Itoa(uid), "--regid", strconv.Itoa(gid)}
	if groups == "" {
		args = append(args, "--clear-groups")
	} else {
		args = append(args, "--groups", groups)
	}
	out, err := exec.Command("setpriv", append(args, "perl", "-e", script, path, strconv.FormatFloat(wait.Seconds(), 'f', -1, 64))...).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return strings.TrimSpace(string(out))
}

func needRootTools(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (setpriv to another user)")
	}
	for _, tool := range []string{"setpriv", "perl"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s", tool)
		}
	}
}

// TestSocketAccess plays a local user who is not QEMU's: the socket
// directory and sockets carry the socket group's permissions, a peer that
// passes the file permissions only through a supplementary group but whose
// credentials are not allowed is dropped at accept (and counted), and an
// allowed uid is served.
func TestSocketAccess(t *testing.T) {
	needRootTools(t)
	top, err := os.MkdirTemp("", "pvrdma-access-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(top) })
	require.NoError(t, os.Chmod(top, 0o755)) // others may traverse it, as /run
	dir := filepath.Join(top, "pvrdma")

	start := func(allow []uint32) (*Daemon, func()) {
		logger, serving := servingLogger(slog.NewTextHandler(io.Discard, nil))
		d, err := New(Config{SocketDir: dir, VMs: []VMRequest{{Name: "vm1"}}, SocketGroup: strconv.Itoa(testGID),
			AllowUIDs: allow, Logger: logger})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- d.Run(ctx) }()
		stop := func() { cancel(); require.NoError(t, <-done) }
		t.Cleanup(func() { cancel() }) // a failed wait leaves Run to the end of the test
		waitServing(t, serving, done)
		return d, stop
	}
	d, stop := start(nil)
	mode := func(p string) (os.FileMode, uint32) {
		fi, err := os.Stat(p)
		require.NoError(t, err)
		return fi.Mode().Perm(), fi.Sys().(*syscall.Stat_t).Gid
	}
	m, g := mode(dir)
	assert.Equal(t, os.FileMode(0o750), m, "socket directory")
	assert.EqualValues(t, testGID, g)
	m, g = mode(d.SocketPath("vm1"))
	assert.Equal(t, os.FileMode(0o660), m, "VM socket")
	assert.EqualValues(t, testGID, g)
	m, _ = mode(filepath.Join(dir, "control.sock"))
	assert.Equal(t, os.FileMode(0o600), m, "control socket")

	// nobody, outside the group, cannot even reach the socket.
	assert.Contains(t, dialAs(t, d.SocketPath("vm1"), nobodyUID, nobodyUID, "", time.Second), "connect:")
	// In the group only as a supplementary group: the files let it through,
	// its credentials (uid nobody, gid nobody) do not.
	assert.Equal(t, "eof", dialAs(t, d.SocketPath("vm1"), nobodyUID, nobodyUID, strconv.Itoa(testGID), hangBound))
	// (The daemon counts the refusal just after closing the connection.)
	assert.Eventually(t, func() bool { return d.Status().Counters["refused_peers"] != 0 }, hangBound, 10*time.Millisecond,
		"refused_peers")
	// With the socket group as its group, it is QEMU's peer: served.
	assert.Equal(t, "open", dialAs(t, d.SocketPath("vm1"), nobodyUID, testGID, strconv.Itoa(testGID), time.Second))
	stop()

	// An allowed uid is served whatever its group.
	d, stop = start([]uint32{nobodyUID})
	assert.Equal(t, "open", dialAs(t, d.SocketPath("vm1"), nobodyUID, nobodyUID, strconv.Itoa(testGID), time.Second))
	stop()
}

// A socket directory others may write to (where another user could plant
// or replace sockets) is refused at start.
func TestWorldWritableSocketDirRefused(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o777))
	_, err := New(Config{SocketDir: dir, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.ErrorIs(t, err, ErrInsecureSocketDir)
	sticky := t.TempDir()
	require.NoError(t, os.Chmod(sticky, 0o1777)) // as /tmp
	_, err = New(Config{SocketDir: sticky, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.ErrorIs(t, err, ErrInsecureSocketDir)
}

// TestVMIdentity: a VM registered with its QEMU's uid admits that uid on
// its vfio-user and QMP sockets and drops another QEMU of the same socket
// group (issue 23: any peer of the group could open any VM's socket and
// take its GIDs while it was away); a VM registered without one still
// admits the whole group.
func TestVMIdentity(t *testing.T) {
	needRootTools(t)
	top, err := os.MkdirTemp("", "pvrdma-identity-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(top) })
	require.NoError(t, os.Chmod(top, 0o755))
	dir := filepath.Join(top, "pvrdma")
	const otherQEMU = 4792 // another QEMU's user, in the socket group
	d := serveQuiet(t, Config{SocketDir: dir, SocketGroup: strconv.Itoa(testGID),
		VMs: []VMRequest{{Name: "vm1", QEMUUID: nobodyUID}, {Name: "vm2"}}})

	for _, sock := range []string{d.SocketPath("vm1"), d.QMPSocketPath("vm1")} {
		assert.Equal(t, "open", dialAs(t, sock, nobodyUID, testGID, "", time.Second), "%s: the VM's QEMU", sock)
		assert.Equal(t, "eof", dialAs(t, sock, otherQEMU, testGID, "", hangBound), "%s: another QEMU of the group", sock)
	}
	assert.Equal(t, "open", dialAs(t, d.SocketPath("vm2"), otherQEMU, testGID, "", time.Second), "no identity: the group")
	assert.Eventually(t, func() bool { return d.Status().Counters["refused_peers"] >= 2 }, hangBound, 10*time.Millisecond)
	for _, v := range d.Status().VMs {
		if v.Name == "vm1" {
			assert.EqualValues(t, nobodyUID, v.QEMUUID)
		}
	}
}

// TestAccessPolicyGroupMembers: a peer whose primary group is not the
// socket group is admitted when the group database lists its user in the
// socket group (libvirt's QEMU after usermod -aG pvrdma libvirt-qemu), and
// refused otherwise.
func TestAccessPolicyGroupMembers(t *testing.T) {
	const sockGID, qemuUID, qemuGID, otherUID = 990, 64055, 64055, 1234
	p := &accessPolicy{gid: sockGID, uids: []uint32{0}, gids: []uint32{sockGID},
		memberOf: func(uid, gid uint32) bool { return uid == qemuUID && gid == sockGID }}
	assert.True(t, p.allowed(&unix.Ucred{Uid: otherUID, Gid: sockGID}), "the socket group as primary group")
	assert.True(t, p.allowed(&unix.Ucred{Uid: qemuUID, Gid: qemuGID}), "a listed member of the socket group")
	assert.False(t, p.allowed(&unix.Ucred{Uid: otherUID, Gid: qemuGID}), "neither")
	assert.True(t, p.allowed(&unix.Ucred{Uid: 0, Gid: 0}), "root")
	// The real database: root's primary group is listed as root's; no
	// user is a member of a group that does not exist.
	assert.True(t, groupMember(0, 0))
	assert.False(t, groupMember(0, 4000000000))
	assert.False(t, groupMember(4000000000, 0))
}
