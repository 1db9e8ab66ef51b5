package backend

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/user"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
)

// Who may reach the daemon's sockets (issue 12, least privilege):
//   - the socket directory is mode 0750, owned by the daemon's user and
//     by the socket group (Config.SocketGroup) if one is set, so that only
//     that group's members (the QEMUs) can reach the sockets in it; a
//     directory anyone may write to is refused (another user could plant
//     or replace sockets in it);
//   - each VM socket is 0660 in the socket group (0600 without one) and the
//     control socket 0600: they are created 0600 (the daemon runs under
//     umask 077) and opened up after, so there is no window;
//   - every connection's peer credentials (SO_PEERCRED) are checked against
//     the allowed users and groups: root, the daemon's own user, the socket
//     group and Config.AllowUIDs/AllowGIDs; any other peer is dropped at
//     accept, counted and logged (rate-limited). SO_PEERCRED carries the
//     peer's primary group only, so a peer whose user the host's group
//     database lists as a member of an allowed group (usermod -aG pvrdma
//     libvirt-qemu: libvirt runs QEMU with its own group as the primary
//     one) is admitted too; a process that only holds the group as a
//     supplementary group, its user not listed, is not.

// accessPolicy is the resolved form of the daemon's access settings.
type accessPolicy struct {
	gid       int // the socket group, or -1
	uids      []uint32
	gids      []uint32
	refused   atomic.Uint64
	lim       *ratelog.Limiter
	sockMode  os.FileMode
	ctrlMode  os.FileMode
	dirMode   os.FileMode
	checkPeer bool
	// memberOf reports whether the host's group database lists user uid
	// as a member of group gid (tests replace it).
	memberOf func(uid, gid uint32) bool
}

// ErrInsecureSocketDir: the socket directory can be written by users other
// than the daemon's.
var ErrInsecureSocketDir = errors.New("socket directory is writable by others")

func newAccessPolicy(cfg Config, log *slog.Logger) (*accessPolicy, error) {
	p := &accessPolicy{gid: -1, lim: ratelog.New(log, 0), sockMode: 0o600, ctrlMode: 0o600, dirMode: 0o750,
		checkPeer: true, memberOf: groupMember}
	if cfg.SocketGroup != "" {
		gid, err := lookupGroup(cfg.SocketGroup)
		if err != nil {
			return nil, fmt.Errorf("socket group %q: %w", cfg.SocketGroup, err)
		}
		p.gid = gid
		p.sockMode = 0o660
		p.gids = append(p.gids, uint32(gid))
	}
	p.uids = append([]uint32{0, uint32(os.Geteuid())}, cfg.AllowUIDs...)
	p.gids = append(p.gids, cfg.AllowGIDs...)
	return p, nil
}

func lookupGroup(name string) (int, error) {
	if n, err := strconv.Atoi(name); err == nil && n >= 0 {
		return n, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(g.Gid)
}

// prepareDir creates the socket directory (or checks the one there) and
// gives it the policy's mode and group.
func (p *accessPolicy) prepareDir(dir string) error {
	if err := os.MkdirAll(dir, p.dirMode); err != nil {
		return fmt.Errorf("socket directory: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("socket directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("socket directory %s: not a directory (a symlink?)", dir)
	}
	if fi.Mode().Perm()&0o002 != 0 {
		return fmt.Errorf("%s (mode %v): %w; use a directory of the daemon's own, e.g. /run/pvrdma",
			dir, fi.Mode().Perm(), ErrInsecureSocketDir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != uint32(os.Geteuid()) && st.Uid != 0 {
		return fmt.Errorf("%s is owned by uid %d: %w", dir, st.Uid, ErrInsecureSocketDir)
	}
	if p.gid >= 0 {
		if err := os.Chown(dir, -1, p.gid); err != nil {
			return fmt.Errorf("socket directory group: %w", err)
		}
	}
	if err := os.Chmod(dir, p.dirMode); err != nil {
		return fmt.Errorf("socket directory mode: %w", err)
	}
	return nil
}

// openSocket gives a socket file the policy's group and mode (it was
// created 0600 or stricter under the daemon's umask).
func (p *accessPolicy) openSocket(path string, control bool) error {
	mode := p.sockMode
	if control {
		mode = p.ctrlMode
	}
	// A socket a predecessor handed over is usually set already: a
	// chmod is a write to the file system, a stat is not.
	var st unix.Stat_t
	if unix.Lstat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFSOCK && st.Mode&0o7777 == uint32(mode.Perm()) &&
		(control || p.gid < 0 || st.Gid == uint32(p.gid)) {
		return nil
	}
	if !control && p.gid >= 0 {
		if err := os.Chown(path, -1, p.gid); err != nil {
			return fmt.Errorf("socket %s group: %w", path, err)
		}
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("socket %s mode: %w", path, err)
	}
	return nil
}

// allowed reports whether a peer with these credentials may talk to us:
// an allowed user, an allowed primary group, or a user the group database
// lists in an allowed group.
func (p *accessPolicy) allowed(c *unix.Ucred) bool {
	if slices.Contains(p.uids, c.Uid) || slices.Contains(p.gids, c.Gid) {
		return true
	}
	if p.memberOf != nil {
		for _, g := range p.gids {
			if p.memberOf(c.Uid, g) {
				return true
			}
		}
	}
	return false
}

// groupMember reports whether the host's group database lists user uid in
// group gid (as a member, or as the user's primary group).
func groupMember(uid, gid uint32) bool {
	u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10))
	if err != nil {
		return false
	}
	ids, err := u.GroupIds()
	if err != nil {
		return false
	}
	return slices.Contains(ids, strconv.FormatUint(uint64(gid), 10))
}

// listener wraps ln so that Accept returns only connections from allowed
// peers; the others are closed at once.
func (p *accessPolicy) listener(ln net.Listener, what string) net.Listener {
	if !p.checkPeer {
		return ln
	}
	return &credListener{Listener: ln, p: p, what: what}
}

type credListener struct {
	net.Listener
	p    *accessPolicy
	what string
}

func (l *credListener) Accept() (net.Conn, error) {
	return acceptAllowed(l.Listener, l.p.allowed, func(cred *unix.Ucred, err error) {
		l.p.refused.Add(1)
		if err != nil {
			l.p.lim.Warn("peer-"+l.what, "connection refused: no peer credentials", "socket", l.what, "err", err)
		} else {
			l.p.lim.Warn("peer-"+l.what, "connection refused: peer not allowed", "socket", l.what,
				"uid", cred.Uid, "gid", cred.Gid, "pid", cred.Pid)
		}
	})
}

// acceptAllowed accepts from ln until a peer whose credentials allowed
// admits; the others are closed at once and passed to refused (with the
// error if their credentials could not be read).
func acceptAllowed(ln net.Listener, allowed func(*unix.Ucred) bool, refused func(*unix.Ucred, error)) (net.Conn, error) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return nil, err
		}
		cred, err := peerCred(c)
		if err == nil && allowed(cred) {
			return c, nil
		}
		_ = c.Close()
		refused(cred, err)
	}
}

// peerCred reads SO_PEERCRED of a unix connection.
func peerCred(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, errors.New("not a unix socket")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var gerr error
	if err := raw.Control(func(fd uintptr) {
		cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, gerr
}

// admit wraps a VM socket's listener (already filtered by the access
// policy) so that only the VM's QEMU is served, as its identity says
// (cgroupid.go): its uid if it has one (and root and the daemon's own
// user), its cgroup if it has one, and by default no QEMU of another
// libvirt domain. The others are closed at accept, counted
// (refused_peers) and logged, rate-limited. vfio marks the vfio-user
// socket, whose admitted peer becomes the VM's connection (newDevice).
func (s *vmSession) admit(ln net.Listener, vfio bool) net.Listener {
	return &identityListener{Listener: ln, s: s, vfio: vfio}
}

type identityListener struct {
	net.Listener
	s    *vmSession
	vfio bool
}

func (l *identityListener) Accept() (net.Conn, error) {
	s := l.s
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cred, machine, err := s.checkPeer(c)
		if err == nil {
			if l.vfio {
				s.mu.Lock()
				s.admitted = admittedPeer{pid: cred.Pid, machine: machine}
				s.mu.Unlock()
			}
			return c, nil
		}
		_ = c.Close()
		s.d.access.refused.Add(1)
		socket := "qmp"
		if l.vfio {
			socket = "vfio-user"
		}
		args := []any{"socket", socket, "err", err}
		if cred != nil {
			args = append(args, "uid", cred.Uid, "pid", cred.Pid)
		}
		if errors.Is(err, errNotThisVM) {
			s.lim.Warn("peer-identity", "connection refused: not this VM's QEMU", args...)
		} else {
			s.lim.Warn("peer-unknown", "connection refused: cannot tell whose QEMU the peer is", args...)
		}
	}
}

// checkPeer applies the VM's identity to a connection's peer; it returns
// the peer's credentials and the libvirt machine through which it is the
// VM's QEMU, if any. Root and the daemon's own user pass the uid rule but
// not the cgroup rules: a root QEMU in another domain's cgroup is still
// another VM's.
func (s *vmSession) checkPeer(c net.Conn) (*unix.Ucred, string, error) {
	cred, err := peerCred(c)
	if err != nil {
		return nil, "", fmt.Errorf("peer credentials: %w", err)
	}
	if u := s.identity.uid; u != 0 && cred.Uid != u && cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return cred, "", fmt.Errorf("uid %d, the VM's QEMU runs as %d: %w", cred.Uid, u, errNotThisVM)
	}
	p, err := readPeerProcess(c, cred)
	if errors.Is(err, errPeerOutside) && s.identity.cgroup == "" {
		// A daemon in a container, its QEMUs outside: the libvirt machine
		// rule cannot be applied, and the VM is identified as without it
		// (by uid, or by the socket group). A VM registered with a cgroup
		// of its own is refused below: that rule cannot be checked.
		s.lim.Warn("peer-outside", "QEMU outside the daemon's pid namespace: its cgroup cannot be checked, "+
			"so the VM's sockets admit it by uid or socket group only", "pid", cred.Pid, "uid", cred.Uid)
		return cred, "", nil
	}
	if err != nil {
		return cred, "", fmt.Errorf("peer cgroups: %w", err)
	}
	machine, err := s.identity.admitCgroups(s.name, p.cgroups, func(m string) string { return s.d.machineTwin(s.name, m) })
	return cred, machine, err
}
