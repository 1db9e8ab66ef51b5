package backend

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// The cgroups of a connection's peer come from /proc/PID/cgroup, and the
// PID must be the process that connected:
//
//   - With SO_PEERPIDFD (Linux 6.5), the daemon holds a pidfd of the
//     process that connected, takes its PID from the pidfd's fdinfo (in
//     the pid namespace of the daemon's /proc, and -1 once the process was
//     reaped), reads its files, then reads the fdinfo again: a process
//     that still has the PID afterwards had it during the reads, so they
//     were of that process and no other that reused its PID.
//   - Without it (older kernels), the PID is SO_PEERCRED's. Residual race:
//     a peer that connects and exits, its PID reused by a process of
//     another VM's cgroup before the daemon reads /proc (between connect
//     and accept, a PID wrap-around) would be judged by that process.
//
// Either way the process must not be exiting: the kernel shows an exiting
// task (and a zombie) at the root of every v1 hierarchy, which would hide
// its machine cgroup on a v1 host. A process whose main thread exited
// stays a zombie leader and is refused for the same reason.

// soPeerPIDFD is SO_PEERPIDFD, asm-generic/socket.h's value (every Linux
// architecture Go builds for; x/sys/unix has no name for it yet).
const soPeerPIDFD = 77

// pfExiting is PF_EXITING of /proc/PID/stat's flags (include/linux/sched.h).
const pfExiting = 0x4

// errPeerGone: the peer's process exited before the daemon could read
// its cgroups.
var errPeerGone = errors.New("peer process exited")

// errPeerOutside: the peer's process is not in the pid namespace of the
// daemon's /proc (SO_PEERCRED gives PID 0): the daemon runs in a container
// and the QEMU outside it. Its cgroups cannot be read; a process cannot
// leave the daemon's pid namespace for an outer one, so only a daemon in a
// container meets such peers (see checkPeer).
var errPeerOutside = errors.New("peer process outside the daemon's pid namespace")

// peerProcess is what the daemon read of a peer's process.
type peerProcess struct {
	pid     int
	cgroups []cgroupLine
	// pinned: read through a pidfd (SO_PEERPIDFD), so the PID was not
	// reused.
	pinned bool
}

// readPeerProcess reads the cgroups of the process that connected c
// (cred: its SO_PEERCRED).
func readPeerProcess(c net.Conn, cred *unix.Ucred) (peerProcess, error) {
	pidfd, err := peerPIDFD(c)
	if err != nil {
		return peerProcess{}, err
	}
	if pidfd < 0 {
		if cred.Pid <= 0 {
			return peerProcess{}, fmt.Errorf("peer PID %d: %w", cred.Pid, errPeerOutside)
		}
		return readProcess(int(cred.Pid), -1)
	}
	defer unix.Close(pidfd)
	pid, err := pidfdPID(pidfd)
	if err != nil {
		return peerProcess{}, err
	}
	return readProcess(pid, pidfd)
}

// peerPIDFD returns a pidfd of c's peer, -1 if the kernel has no
// SO_PEERPIDFD.
func peerPIDFD(c net.Conn) (int, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return -1, errors.New("peer pidfd: not a unix socket")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return -1, fmt.Errorf("peer pidfd: %w", err)
	}
	fd, gerr := -1, error(nil)
	if err := raw.Control(func(s uintptr) {
		fd, gerr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, soPeerPIDFD)
	}); err != nil {
		return -1, fmt.Errorf("peer pidfd: %w", err)
	}
	switch {
	case errors.Is(gerr, unix.ENOPROTOOPT):
		return -1, nil
	case gerr != nil:
		return -1, fmt.Errorf("peer pidfd (SO_PEERPIDFD): %w", gerr)
	}
	return fd, nil
}

// readProcess reads process pid's cgroups and checks that it is not
// exiting; with a pidfd (>= 0), that pid is still the pidfd's process
// after the reads.
func readProcess(pid, pidfd int) (peerProcess, error) {
	dir := "/proc/" + strconv.Itoa(pid)
	b, err := readProcFile(dir+"/cgroup", maxProcCgroupBytes)
	if err != nil {
		return peerProcess{}, err
	}
	st, err := readProcFile(dir+"/stat", 4096)
	if err != nil {
		return peerProcess{}, err
	}
	if pidfd >= 0 {
		again, err := pidfdPID(pidfd)
		if err != nil {
			return peerProcess{}, err
		}
		if again != pid {
			return peerProcess{}, fmt.Errorf("PID %d, then %d: %w", pid, again, errPeerGone)
		}
	}
	state, flags, err := parseProcStat(st)
	if err != nil {
		return peerProcess{}, fmt.Errorf("process %d: %w", pid, err)
	}
	if state == 'Z' || state == 'X' || state == 'x' || flags&pfExiting != 0 {
		return peerProcess{}, fmt.Errorf("process %d is exiting (state %c): %w", pid, state, errPeerGone)
	}
	lines, err := parseProcCgroup(b)
	if err != nil {
		return peerProcess{}, fmt.Errorf("process %d: %w", pid, err)
	}
	return peerProcess{pid: pid, cgroups: lines, pinned: pidfd >= 0}, nil
}

// pidfdPID returns the PID of a pidfd's process in the pid namespace of
// the daemon's /proc (its fdinfo's "Pid:" line; -1 once it was reaped, 0
// if it is not in that namespace).
func pidfdPID(pidfd int) (int, error) {
	b, err := readProcFile("/proc/self/fdinfo/"+strconv.Itoa(pidfd), 4096)
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		v, ok := bytes.CutPrefix(sc.Bytes(), []byte("Pid:"))
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(string(bytes.TrimSpace(v)))
		switch {
		case err != nil:
			return 0, fmt.Errorf("pidfd fdinfo Pid %q: %w", v, err)
		case pid == -1:
			return 0, errPeerGone
		case pid <= 0:
			return 0, errPeerOutside
		}
		return pid, nil
	}
	return 0, errors.New("pidfd fdinfo: no Pid line")
}

// readProcFile reads a /proc file of at most max bytes.
func readProcFile(name string, max int) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s: %w (exited, or /proc hides other users' processes: hidepid, ProtectProc=)", name, errPeerGone)
		}
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, int64(max)+1))
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("%s: %w", name, errPeerGone)
		}
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if len(b) > max {
		return nil, fmt.Errorf("%s: more than %d bytes", name, max)
	}
	return b, nil
}

// warnHiddenProc says at start if the daemon's /proc hides other users'
// processes (hidepid=, systemd's ProtectProc=invisible or noaccess): the
// daemon then cannot read a QEMU's cgroups, and refuses every QEMU that
// runs as another user. PID 1 is root's, so it is visible to the daemon
// only if others' processes are.
func warnHiddenProc(log *slog.Logger) {
	if os.Geteuid() == 0 {
		return
	}
	if _, err := os.Stat("/proc/1/cgroup"); err != nil {
		log.Warn("the daemon cannot read other users' processes in /proc (hidepid, ProtectProc=): "+
			"every QEMU that runs as another user will be refused, since its cgroups cannot be checked; "+
			"give the daemon a /proc without hidepid (the packaged unit has ProtectProc=default)", "err", err)
	}
}
