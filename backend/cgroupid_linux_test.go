package backend

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// cgroup2Mount returns where the unified hierarchy is mounted, from
// /proc/self/mountinfo ("" if it is not).
func cgroup2Mount(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(l, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) >= 5 && len(g) >= 1 && g[0] == "cgroup2" {
			return f[4]
		}
	}
	return ""
}

// testCgroups is a private tree of cgroups in the unified hierarchy,
// removed at the end of the test.
type testCgroups struct {
	t    *testing.T
	base string // the tree's directory
	home string // the test's own cgroup directory (where leftovers go back)
	dirs []string
}

func newTestCgroups(t *testing.T) *testCgroups {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (creates cgroups)")
	}
	mnt := cgroup2Mount(t)
	if mnt == "" {
		t.Skip("no cgroup2 mount")
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	require.NoError(t, err)
	lines, err := parseProcCgroup(self)
	require.NoError(t, err)
	own, ok := "", false
	for _, l := range lines {
		if l.ID == 0 {
			own, ok = l.Path, true
		}
	}
	require.True(t, ok, "no unified line in /proc/self/cgroup")
	var r [6]byte
	_, _ = rand.Read(r[:])
	tc := &testCgroups{t: t, home: filepath.Join(mnt, own), base: filepath.Join(mnt, "pvrdma-test-"+hex.EncodeToString(r[:]))}
	require.NoError(t, os.Mkdir(tc.base, 0o755))
	tc.dirs = append(tc.dirs, tc.base)
	t.Cleanup(tc.remove)
	return tc
}

// mkdir creates a cgroup (and its parents) below the tree.
func (tc *testCgroups) mkdir(rel string) string {
	tc.t.Helper()
	dir := tc.base
	for _, c := range strings.Split(rel, "/") {
		dir = filepath.Join(dir, c)
		if err := os.Mkdir(dir, 0o755); err == nil {
			tc.dirs = append(tc.dirs, dir)
		} else {
			require.ErrorIs(tc.t, err, os.ErrExist)
		}
	}
	return dir
}

// path is a cgroup's path as /proc/PID/cgroup shows it: what a process
// moved into it reads.
func (tc *testCgroups) path(dir string) string {
	tc.t.Helper()
	out, err := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && exec cat /proc/self/cgroup`, "sh", dir).Output()
	require.NoError(tc.t, err)
	for _, l := range strings.Split(string(out), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return p
		}
	}
	tc.t.Fatalf("no unified line: %s", out)
	return ""
}

// remove moves whatever is left in the tree back to the test's own cgroup
// and removes the tree, deepest first.
func (tc *testCgroups) remove() {
	for i := len(tc.dirs) - 1; i >= 0; i-- {
		d := tc.dirs[i]
		if b, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil {
			for _, pid := range strings.Fields(string(b)) {
				_ = os.WriteFile(filepath.Join(tc.home, "cgroup.procs"), []byte(pid), 0)
			}
		}
		var err error
		for try := 0; try < 50; try++ { // a process just reaped may still populate it
			if err = os.Remove(d); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil && !os.IsNotExist(err) {
			tc.t.Errorf("cgroup %s left behind: %v", d, err)
		}
	}
}

// dialFrom connects to the unix socket path from a process in cgroup dir
// (as root: root is not exempt from the cgroup rules) and reports what the
// daemon did within wait, as dialAs does.
func dialFrom(t *testing.T, dir, path string, wait time.Duration) string {
	t.Helper()
	script := `use IO::Socket::UNIX; my $s = IO::Socket::UNIX->new(Peer => $ARGV[0]) or do { print "connect: $!\n"; exit 0 };
vec(my $r = "", fileno($s), 1) = 1; if (select($r, undef, undef, $ARGV[1]) > 0) { my $n = sysread($s, my $x, 1); print $n ? "data\n" : "eof\n" } else { print "open\n" }`
	out, err := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && exec perl -e "$2" "$3" "$4"`, "sh",
		dir, script, path, strconv.FormatFloat(wait.Seconds(), 'f', -1, 64)).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return strings.TrimSpace(string(out))
}

// cgroupPeerEnv makes the test binary a vfio-user client
// (TestCgroupPeerHelper) of the socket it names.
const cgroupPeerEnv = "PVRDMA_TEST_CGROUP_PEER"

// TestCgroupPeerHelper is not a test: run by TestVMCgroupIdentity in a
// cgroup, it connects to $PVRDMA_TEST_CGROUP_PEER as QEMU does, says
// whether the daemon took it, and holds the connection until its stdin
// closes.
func TestCgroupPeerHelper(t *testing.T) {
	sock := os.Getenv(cgroupPeerEnv)
	if sock == "" {
		t.Skip("helper process of TestVMCgroupIdentity")
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	c := vfiousertest.NewClient(conn)
	defer c.Close()
	if _, err := c.Negotiate(vfiousertest.QEMUCaps); err != nil {
		fmt.Println("error:", err)
		return
	}
	fmt.Println("negotiated")
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// qemuFrom starts the test binary as a vfio-user client of sock in cgroup
// dir; it returns its first line and a function that ends it.
func qemuFrom(t *testing.T, dir, sock string) (string, func()) {
	t.Helper()
	cmd := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && exec "$2" -test.run '^TestCgroupPeerHelper$'`, "sh", dir, os.Args[0])
	cmd.Env = append(os.Environ(), cgroupPeerEnv+"="+sock)
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	stop := func() { _ = in.Close(); _ = cmd.Wait() }
	t.Cleanup(stop)
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	return strings.TrimSpace(line), stop
}

// TestVMCgroupIdentity: under libvirt every QEMU has the same uid and gid,
// so a VM registered without a uid admitted any QEMU of the socket group
// (issue 23). Now a process in a libvirt machine's cgroup (machined's
// machine-qemu\x2d<id>\x2d<name>.scope, with sub-groups, or libvirt's own
// qemu-<id>-<name>.libvirt-qemu) is admitted on the vfio-user and QMP
// sockets of the VM that machine names only, as root too; a process in
// no machine cgroup is admitted as before; and a VM registered with a
// cgroup admits only processes in it or below. The cgroups are real (a
// private tree in the unified hierarchy), the clients real processes.
func TestVMCgroupIdentity(t *testing.T) {
	if _, err := exec.LookPath("perl"); err != nil {
		t.Skip("needs perl")
	}
	tc := newTestCgroups(t)
	vma := tc.mkdir(`machine.slice/machine-qemu\x2d7\x2dvma.scope/libvirt/emulator`)
	vmb := tc.mkdir(`machine.slice/machine-qemu\x2d8\x2dvmb.scope`)
	vmc := tc.mkdir(`machine/qemu-9-vmc.libvirt-qemu/emulator`)
	plain := tc.mkdir("user.slice/session-1.scope")
	own := tc.mkdir("custom.scope")
	ownPayload := tc.mkdir("custom.scope/payload")
	explicit := tc.path(own)
	require.NoError(t, CheckCgroupPath(explicit))

	d := serveQuiet(t, Config{SocketDir: filepath.Join(t.TempDir(), "pvrdma"),
		VMs: []VMRequest{{Name: "vma"}, {Name: "vmb"}, {Name: "vmc"}, {Name: "vmd", QEMUCgroup: explicit}}})
	refused := func() uint64 { return d.Status().Counters["refused_peers"] }

	// Another domain's QEMU on vma's sockets: closed at accept, counted.
	for i, sock := range []string{d.SocketPath("vma"), d.QMPSocketPath("vma")} {
		assert.Equal(t, "eof", dialFrom(t, vmb, sock, hangBound), "%s: vmb's QEMU", sock)
		assert.Eventually(t, func() bool { return refused() >= uint64(i+1) }, hangBound, 10*time.Millisecond, "refused_peers")
	}
	assert.Equal(t, "eof", dialFrom(t, vmc, d.SocketPath("vma"), hangBound), "vmc's QEMU (libvirt's own layout)")
	// The VMs' own QEMUs.
	for _, sock := range []string{d.SocketPath("vma"), d.QMPSocketPath("vma")} {
		assert.Equal(t, "open", dialFrom(t, vma, sock, time.Second), "%s: vma's QEMU", sock)
	}
	assert.Equal(t, "open", dialFrom(t, vmb, d.SocketPath("vmb"), time.Second), "vmb's QEMU")
	assert.Equal(t, "open", dialFrom(t, vmc, d.SocketPath("vmc"), time.Second), "vmc's QEMU")
	// No machine cgroup: the group rule, as before.
	assert.Equal(t, "open", dialFrom(t, plain, d.SocketPath("vma"), time.Second), "a QEMU in no machine cgroup")
	// The explicit rule: in the cgroup or below it only.
	assert.Equal(t, "open", dialFrom(t, ownPayload, d.SocketPath("vmd"), time.Second), "vmd's QEMU, below its cgroup")
	before := refused()
	assert.Equal(t, "eof", dialFrom(t, plain, d.SocketPath("vmd"), hangBound), "outside vmd's cgroup")
	assert.Equal(t, "eof", dialFrom(t, vma, d.QMPSocketPath("vmd"), hangBound), "vma's QEMU on vmd's QMP socket")
	assert.Eventually(t, func() bool { return refused() >= before+2 }, hangBound, 10*time.Millisecond, "refused_peers")

	// status: the identity each VM's sockets enforce.
	line, stop := qemuFrom(t, vma, d.SocketPath("vma"))
	require.Equal(t, "negotiated", line)
	line, stopPlain := qemuFrom(t, plain, d.SocketPath("vmb"))
	require.Equal(t, "negotiated", line)
	ids := map[string]VMStatus{}
	require.Eventually(t, func() bool {
		for _, v := range d.Status().VMs {
			ids[v.Name] = v
		}
		return ids["vma"].Connected && ids["vmb"].Connected
	}, hangBound, 10*time.Millisecond)
	assert.Equal(t, "libvirt machine qemu-7-vma", ids["vma"].Identity)
	assert.Equal(t, IdentitySocketGroup, ids["vmb"].Identity, "vmb's QEMU is in no machine cgroup")
	assert.Equal(t, IdentitySocketGroup, ids["vmc"].Identity, "not connected")
	assert.Equal(t, "cgroup "+explicit, ids["vmd"].Identity)
	assert.Equal(t, explicit, ids["vmd"].QEMUCgroup)
	stop()
	stopPlain()
}

// TestReadPeerProcess: the daemon reads the cgroups of the process that
// connected, through its pidfd where the kernel gives one; an exiting or
// reaped process is refused (an exiting task shows "/" on every v1
// hierarchy, which would hide its machine cgroup).
func TestReadPeerProcess(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer ln.Close()
	cl, err := net.Dial("unix", sock)
	require.NoError(t, err)
	defer cl.Close()
	c, err := ln.Accept()
	require.NoError(t, err)
	defer c.Close()
	cred, err := peerCred(c)
	require.NoError(t, err)
	p, err := readPeerProcess(c, cred)
	require.NoError(t, err)
	assert.Equal(t, os.Getpid(), p.pid)
	assert.NotEmpty(t, p.cgroups)
	var u unix.Utsname
	require.NoError(t, unix.Uname(&u))
	t.Logf("kernel %s: pidfd %v", unix.ByteSliceToString(u.Release[:]), p.pinned)

	// Without a pidfd (kernels before 6.5): the PID alone.
	p, err = readProcess(os.Getpid(), -1)
	require.NoError(t, err)
	assert.False(t, p.pinned)

	// A zombie: refused with and without its pidfd; once reaped, its
	// pidfd says so.
	cmd := exec.Command("true")
	require.NoError(t, cmd.Start())
	pid := cmd.Process.Pid
	pidfd, err := unix.PidfdOpen(pid, 0)
	require.NoError(t, err)
	defer unix.Close(pidfd)
	require.Eventually(t, func() bool {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		st, _, perr := parseProcStat(b)
		return err == nil && perr == nil && st == 'Z'
	}, hangBound, 5*time.Millisecond)
	_, err = readProcess(pid, -1)
	assert.ErrorIs(t, err, errPeerGone)
	_, err = readProcess(pid, pidfd)
	assert.ErrorIs(t, err, errPeerGone)
	require.NoError(t, cmd.Wait())
	_, err = pidfdPID(pidfd)
	assert.ErrorIs(t, err, errPeerGone)
	_, err = readProcess(pid, pidfd)
	assert.Error(t, err)
}
