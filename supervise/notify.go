package supervise

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"

	"golang.org/x/sys/unix"
)

// MaxMessage is the longest notify datagram taken (systemd's
// NOTIFY_BUFFER_MAX, PIPE_BUF); a longer one is dropped.
const MaxMessage = 4096

// MaxMessageFDs is the most descriptors one datagram carries (the
// kernel's SCM_MAX_FD).
const MaxMessageFDs = 253

// MaxFDName is the longest descriptor name (systemd's FDNAME_MAX).
const MaxFDName = 255

// DefaultFDName names descriptors stored without FDNAME=, as systemd does.
const DefaultFDName = "stored"

// Message is what the supervisor reads from one notify datagram
// (sd_notify(3)): newline-separated VARIABLE=VALUE assignments. Where a
// variable is given twice the first counts, as in systemd.
type Message struct {
	Ready     bool // READY=1
	Reloading bool // RELOADING=1
	Stopping  bool // STOPPING=1
	Barrier   bool // BARRIER=1

	Status    string // STATUS=
	HasStatus bool
	Errno     int // ERRNO= (0: absent or not a number)
	MainPID   int // MAINPID= (0: absent or not a PID)

	FDStore       bool // FDSTORE=1
	FDStoreRemove bool // FDSTOREREMOVE=1
	FDName        string
	HasFDName     bool // a valid FDNAME= was given
	BadFDName     bool // an invalid FDNAME= was given (and ignored)
	NoPoll        bool // FDPOLL=0

	// Unknown counts assignments the supervisor does not act on.
	Unknown int
}

// Errors of ParseMessage.
var (
	ErrEmptyMessage = errors.New("empty notify message")
	ErrLongMessage  = fmt.Errorf("notify message longer than %d bytes", MaxMessage)
	ErrNULMessage   = errors.New("notify message with a NUL byte")
)

// ParseMessage parses a notify datagram's text. A message is refused as a
// whole only if it is empty, too long or holds a NUL byte (systemd drops
// those too); lines that are not assignments and values it does not
// understand are ignored.
func ParseMessage(b []byte) (Message, error) {
	var m Message
	switch {
	case len(b) == 0:
		return m, ErrEmptyMessage
	case len(b) > MaxMessage:
		return m, ErrLongMessage
	case bytes.IndexByte(b, 0) >= 0:
		return m, ErrNULMessage
	}
	var seenStatus, seenErrno, seenPID, seenName bool
	for len(b) > 0 {
		var line []byte
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			line, b = b, nil
		}
		key, val, ok := bytes.Cut(line, []byte("="))
		if !ok || len(key) == 0 {
			if len(line) > 0 {
				m.Unknown++
			}
			continue
		}
		switch string(key) {
		case "READY":
			m.Ready = m.Ready || string(val) == "1"
		case "RELOADING":
			m.Reloading = m.Reloading || string(val) == "1"
		case "STOPPING":
			m.Stopping = m.Stopping || string(val) == "1"
		case "BARRIER":
			m.Barrier = m.Barrier || string(val) == "1"
		case "FDSTORE":
			m.FDStore = m.FDStore || string(val) == "1"
		case "FDSTOREREMOVE":
			m.FDStoreRemove = m.FDStoreRemove || string(val) == "1"
		case "FDPOLL":
			m.NoPoll = m.NoPoll || string(val) == "0"
		case "STATUS":
			if !seenStatus {
				seenStatus, m.Status, m.HasStatus = true, string(val), true
			}
		case "ERRNO":
			if !seenErrno {
				seenErrno = true
				if n, err := strconv.Atoi(string(val)); err == nil && n > 0 {
					m.Errno = n
				}
			}
		case "MAINPID":
			if !seenPID {
				seenPID = true
				if n, err := strconv.ParseInt(string(val), 10, 32); err == nil && n > 0 && n <= math.MaxInt32 {
					m.MainPID = int(n)
				}
			}
		case "FDNAME":
			if !seenName {
				seenName = true
				if ValidFDName(string(val)) {
					m.FDName, m.HasFDName = string(val), true
				} else {
					m.BadFDName = true
				}
			}
		default:
			m.Unknown++
		}
	}
	return m, nil
}

// ValidFDName reports whether name may name a stored descriptor: at most
// MaxFDName bytes of printable ASCII other than ':' (the separator of
// LISTEN_FDNAMES), as systemd's fdname_is_valid; empty is valid.
func ValidFDName(name string) bool {
	if len(name) > MaxFDName {
		return false
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < ' ' || c > '~' || c == ':' {
			return false
		}
	}
	return true
}

// controlSpace is the ancillary data buffer a notify datagram needs: the
// most descriptors one message can carry and the sender's credentials.
var controlSpace = unix.CmsgSpace(4*MaxMessageFDs) + unix.CmsgSpace(unix.SizeofUcred)

// ParseControl parses a datagram's ancillary data: the descriptors it
// carries (SCM_RIGHTS, in order) and the sender's credentials
// (SCM_CREDENTIALS; nil if absent). It returns the descriptors found even
// with an error, for the caller to close: they are open in this process.
func ParseControl(oob []byte) (fds []int, cred *unix.Ucred, err error) {
	if len(oob) == 0 {
		return nil, nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, nil, fmt.Errorf("notify message's control data: %w", err)
	}
	for i := range msgs {
		h := msgs[i].Header
		if h.Level != unix.SOL_SOCKET {
			continue
		}
		switch h.Type {
		case unix.SCM_RIGHTS:
			// Read here: x/sys's ParseUnixRights indexes past its slice
			// when the data is not whole descriptors (found by
			// FuzzParseControl); the kernel's never is, but the parser
			// holds for any input.
			d := msgs[i].Data
			for ; len(d) >= 4; d = d[4:] {
				fds = append(fds, int(int32(binary.NativeEndian.Uint32(d))))
			}
			if len(d) != 0 && err == nil {
				err = fmt.Errorf("notify message's descriptors: %d bytes left over", len(d))
			}
		case unix.SCM_CREDENTIALS:
			// Read here too: x/sys's ParseUnixCredentials indexes an
			// empty slice before it checks the length.
			d := msgs[i].Data
			if len(d) < unix.SizeofUcred {
				if err == nil {
					err = fmt.Errorf("notify message's credentials: %d bytes", len(d))
				}
				continue
			}
			if cred == nil {
				cred = &unix.Ucred{Pid: int32(binary.NativeEndian.Uint32(d)), Uid: binary.NativeEndian.Uint32(d[4:]),
					Gid: binary.NativeEndian.Uint32(d[8:])}
			}
		}
	}
	return fds, cred, err
}
