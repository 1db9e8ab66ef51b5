package supervise

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// DefaultMaxFDs is how many descriptors a Store keeps by default: the
// packaged unit's FileDescriptorStoreMax=.
const DefaultMaxFDs = 4096

// ErrStoreFull: the store holds its maximum; the descriptor was closed.
var ErrStoreFull = errors.New("the descriptor store is full")

// Store keeps named descriptors as systemd's file descriptor store does:
// one copy of each open file description (a file given again, under any
// name, is closed and the first name stays), several descriptors may
// share a name, FDSTOREREMOVE closes every descriptor of a name, and they
// are handed back newest first. A Store is used by one goroutine.
type Store struct {
	max     int
	entries []storeEntry // oldest first
	// same reports whether two of this process's descriptors are the
	// same open file description (nil: sameFile).
	same func(a, b int) (bool, error)
}

type storeEntry struct {
	name     string
	fd       int
	dev, ino uint64
	anon     bool // an anonymous inode (eventfd and the like): shared by unrelated files
	flags    int
}

// NewStore returns an empty store of at most max descriptors (0:
// DefaultMaxFDs).
func NewStore(max int) *Store {
	if max <= 0 {
		max = DefaultMaxFDs
	}
	return &Store{max: max}
}

// Len is the number of descriptors held.
func (s *Store) Len() int { return len(s.entries) }

// Add keeps fd under name and takes it over: it reports whether fd was
// stored; a descriptor of a file description already held, or one the
// store has no room for (ErrStoreFull), is closed. name must be valid
// (ValidFDName).
func (s *Store) Add(name string, fd int) (bool, error) {
	if !ValidFDName(name) {
		_ = unix.Close(fd)
		return false, fmt.Errorf("descriptor name %q is not valid", name)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = unix.Close(fd)
		return false, fmt.Errorf("stored descriptor: %w", err)
	}
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		_ = unix.Close(fd)
		return false, fmt.Errorf("stored descriptor: %w", err)
	}
	e := storeEntry{name: name, fd: fd, dev: st.Dev, ino: st.Ino, anon: st.Mode&unix.S_IFMT == 0, flags: flags}
	same := s.same
	if same == nil {
		same = sameFile
	}
	for i := range s.entries {
		o := &s.entries[i]
		if o.dev != e.dev || o.ino != e.ino {
			continue // different files
		}
		eq, err := same(o.fd, fd)
		if errors.Is(err, errCannotCompare) {
			// Same inode: a socket or a memfd has one of its own, so it
			// is the same file; anonymous inodes (every eventfd shares
			// one) count as the same only under the same name, which
			// is what a restarted worker storing what it got back does.
			eq = o.flags == e.flags && (!e.anon || o.name == name)
		} else if err != nil {
			_ = unix.Close(fd)
			return false, fmt.Errorf("compare stored descriptors: %w", err)
		}
		if eq {
			_ = unix.Close(fd)
			return false, nil
		}
	}
	if len(s.entries) >= s.max {
		_ = unix.Close(fd)
		return false, ErrStoreFull
	}
	s.entries = append(s.entries, e)
	return true, nil
}

// Remove closes every descriptor stored under name and returns how many.
func (s *Store) Remove(name string) int {
	kept := s.entries[:0]
	n := 0
	for _, e := range s.entries {
		if e.name == name {
			_ = unix.Close(e.fd)
			n++
			continue
		}
		kept = append(kept, e)
	}
	clear(s.entries[len(kept):])
	s.entries = kept
	return n
}

// Listen returns the descriptors held in the order a service manager
// hands them back, the newest first, and the environment that names them
// to the process that gets them at descriptors 3, 4, ...: LISTEN_FDS and
// LISTEN_FDNAMES (none if the store is empty). LISTEN_PID, the PID of that
// process, is the caller's to add.
func (s *Store) Listen() (fds []int, env []string) {
	if len(s.entries) == 0 {
		return nil, nil
	}
	fds = make([]int, 0, len(s.entries))
	var names strings.Builder
	for i := len(s.entries) - 1; i >= 0; i-- {
		e := s.entries[i]
		fds = append(fds, e.fd)
		if names.Len() > 0 {
			names.WriteByte(':')
		}
		names.WriteString(e.name)
	}
	return fds, []string{"LISTEN_FDS=" + strconv.Itoa(len(fds)), "LISTEN_FDNAMES=" + names.String()}
}

// Names returns the names held, oldest first (a name once per descriptor).
func (s *Store) Names() []string {
	out := make([]string, len(s.entries))
	for i, e := range s.entries {
		out[i] = e.name
	}
	return out
}

// Close closes every descriptor held.
func (s *Store) Close() {
	for _, e := range s.entries {
		_ = unix.Close(e.fd)
	}
	s.entries = nil
}

// errCannotCompare: the kernel cannot say whether two descriptors are the
// same open file (no kcmp(2): not built in, or refused by a seccomp
// filter).
var errCannotCompare = errors.New("cannot compare open files")

// kcmpFile is kcmp(2)'s KCMP_FILE.
const kcmpFile = 0

// sameFile reports whether descriptors a and b of this process are the
// same open file description, with kcmp(2).
func sameFile(a, b int) (bool, error) {
	if a == b {
		return true, nil
	}
	pid := uintptr(os.Getpid())
	r, _, errno := unix.Syscall6(unix.SYS_KCMP, pid, pid, kcmpFile, uintptr(a), uintptr(b), 0)
	switch {
	case errno == 0:
		return r == 0, nil
	case errno == unix.ENOSYS || errno == unix.EPERM || errno == unix.EACCES:
		return false, errCannotCompare
	default:
		return false, fmt.Errorf("kcmp: %w", errno)
	}
}
