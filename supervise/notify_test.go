package supervise

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestParseMessage(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Message
		err  error
	}{
		{in: "READY=1", want: Message{Ready: true}},
		{in: "READY=1\n", want: Message{Ready: true}},
		{in: "READY=0", want: Message{}},
		{in: "RELOADING=1\nSTATUS=handing over", want: Message{Reloading: true, Status: "handing over", HasStatus: true}},
		{in: "STOPPING=1", want: Message{Stopping: true}},
		{in: "FDSTORE=1\nFDNAME=vm1.conn", want: Message{FDStore: true, FDName: "vm1.conn", HasFDName: true}},
		{in: "FDSTOREREMOVE=1\nFDNAME=+fabric.udp4", want: Message{FDStoreRemove: true, FDName: "+fabric.udp4", HasFDName: true}},
		{in: "FDSTORE=1\nFDNAME=a\nFDNAME=b", want: Message{FDStore: true, FDName: "a", HasFDName: true}},
		// An invalid first name is ignored, and so is the next (systemd
		// takes the first FDNAME= only).
		{in: "FDSTORE=1\nFDNAME=a:b\nFDNAME=c", want: Message{FDStore: true, BadFDName: true}},
		{in: "FDSTORE=1\nFDNAME=", want: Message{FDStore: true, HasFDName: true}},
		{in: "FDSTORE=1\nFDPOLL=0", want: Message{FDStore: true, NoPoll: true}},
		{in: "BARRIER=1", want: Message{Barrier: true}},
		{in: "MAINPID=4242", want: Message{MainPID: 4242}},
		{in: "MAINPID=0", want: Message{}},
		{in: "MAINPID=-3\nMAINPID=7", want: Message{}},
		{in: "MAINPID=99999999999", want: Message{}},
		{in: "ERRNO=5", want: Message{Errno: 5}},
		{in: "ERRNO=x", want: Message{}},
		{in: "STATUS=a=b\nSTATUS=c", want: Message{Status: "a=b", HasStatus: true}},
		{in: "WATCHDOG=1\nnonsense\n=x\n\nX_CUSTOM=1", want: Message{Unknown: 4}},
		{in: "", err: ErrEmptyMessage},
		{in: "READY=1\x00", err: ErrNULMessage},
		{in: "STATUS=" + strings.Repeat("x", MaxMessage), err: ErrLongMessage},
	} {
		got, err := ParseMessage([]byte(tc.in))
		if tc.err != nil {
			assert.ErrorIs(t, err, tc.err, "%q", tc.in)
			continue
		}
		require.NoError(t, err, "%q", tc.in)
		assert.Equal(t, tc.want, got, "%q", tc.in)
	}
}

func TestValidFDName(t *testing.T) {
	for name, ok := range map[string]bool{
		"":                       true,
		"stored":                 true,
		"vm1.conn":               true,
		"vm1.m803-1c-2":          true,
		"+fabric.udp4.1":         true,
		"with space":             true,
		strings.Repeat("a", 255): true,
		strings.Repeat("a", 256): false,
		"a:b":                    false,
		"a\nb":                   false,
		"tab\t":                  false,
		"del\x7f":                false,
		"é":                      false,
	} {
		assert.Equal(t, ok, ValidFDName(name), "%q", name)
	}
}

// TestParseControl sends descriptors and credentials over a real socket
// pair and parses what the kernel delivers.
func TestParseControl(t *testing.T) {
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(sp[0])
	defer unix.Close(sp[1])
	require.NoError(t, unix.SetsockoptInt(sp[1], unix.SOL_SOCKET, unix.SO_PASSCRED, 1))
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	require.NoError(t, unix.Sendmsg(sp[0], []byte("FDSTORE=1\nFDNAME=p"), unix.UnixRights(p[0], p[1]), nil, 0))

	buf, oob := make([]byte, MaxMessage), make([]byte, controlSpace)
	n, oobn, flags, _, err := unix.Recvmsg(sp[1], buf, oob, unix.MSG_CMSG_CLOEXEC)
	require.NoError(t, err)
	assert.Zero(t, flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC))
	fds, cred, err := ParseControl(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, fds, 2)
	for _, fd := range fds {
		defer unix.Close(fd)
		fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		require.NoError(t, err)
		assert.NotZero(t, fl&unix.FD_CLOEXEC, "received descriptors are close-on-exec")
	}
	require.NotNil(t, cred)
	assert.Equal(t, int32(os.Getpid()), cred.Pid)
	assert.Equal(t, uint32(os.Getuid()), cred.Uid)
	m, err := ParseMessage(buf[:n])
	require.NoError(t, err)
	assert.Equal(t, Message{FDStore: true, FDName: "p", HasFDName: true}, m)

	// A message of the most descriptors one can carry fits the buffer.
	many := make([]int, MaxMessageFDs)
	for i := range many {
		many[i] = p[0]
	}
	require.NoError(t, unix.Sendmsg(sp[0], []byte("FDSTORE=1"), unix.UnixRights(many...), nil, 0))
	_, oobn, flags, _, err = unix.Recvmsg(sp[1], buf, oob, unix.MSG_CMSG_CLOEXEC)
	require.NoError(t, err)
	assert.Zero(t, flags&unix.MSG_CTRUNC, "no descriptor lost")
	fds, cred, err = ParseControl(oob[:oobn])
	require.NoError(t, err)
	assert.Len(t, fds, MaxMessageFDs)
	assert.NotNil(t, cred)
	for _, fd := range fds {
		_ = unix.Close(fd)
	}

	// Nothing, and garbage.
	fds, cred, err = ParseControl(nil)
	assert.NoError(t, err)
	assert.Nil(t, fds)
	assert.Nil(t, cred)
	fds, _, err = ParseControl([]byte{1, 2, 3})
	assert.NoError(t, err, "shorter than a header: nothing")
	assert.Nil(t, fds)
	bad := unix.UnixRights(3)
	bad[0] = 0xff // a length past the end
	_, _, err = ParseControl(bad)
	assert.Error(t, err)
}

// FuzzParseMessage: any datagram parses or is refused whole, never
// panics, and a name it accepts is one LISTEN_FDNAMES can carry.
func FuzzParseMessage(f *testing.F) {
	for _, s := range []string{"READY=1", "FDSTORE=1\nFDNAME=vm1.conn", "FDSTOREREMOVE=1\nFDNAME=vm1.i2-0",
		"BARRIER=1", "MAINPID=1\nSTATUS=x", "FDNAME=a:b\nFDSTORE=1\nFDPOLL=0", "ERRNO=22\n\n=\nX"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseMessage(b)
		if err != nil {
			if m != (Message{}) {
				t.Fatalf("a refused message yields %+v", m)
			}
			return
		}
		if m.HasFDName && !ValidFDName(m.FDName) {
			t.Fatalf("name %q accepted", m.FDName)
		}
		if m.HasFDName && m.BadFDName {
			t.Fatal("a name both valid and invalid")
		}
		if m.MainPID < 0 || m.Errno < 0 {
			t.Fatalf("negative MAINPID or ERRNO: %+v", m)
		}
	})
}

// FuzzParseControl: any control data parses or fails without a panic;
// the descriptors it names fit in it. (They are numbers from the input,
// not descriptors of this process: nothing is closed.)
func FuzzParseControl(f *testing.F) {
	f.Add(unix.UnixRights(3, 4))
	f.Add(unix.UnixCredentials(&unix.Ucred{Pid: 1, Uid: 2, Gid: 3}))
	f.Add(append(unix.UnixRights(7), unix.UnixCredentials(&unix.Ucred{Pid: 9})...))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		fds, _, _ := ParseControl(b)
		if 4*len(fds) > len(b) {
			t.Fatalf("%d descriptors from %d bytes", len(fds), len(b))
		}
	})
}
