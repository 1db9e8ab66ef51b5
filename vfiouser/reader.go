package vfiouser

import (
	"errors"
	"fmt"
	"io"
	"time"

	"golang.org/x/sys/unix"
)

// reader splits the byte stream into messages. It reads greedily into one
// buffer (a doorbell's REGION_WRITE then costs one recvmsg), keeps a whole
// message in the buffer until it is complete (so a read that times out
// loses nothing), and attributes received descriptors to messages.
//
// Descriptor attribution: a sender attaches descriptors to the sendmsg that
// carries a message's first byte, and a unix stream socket ends a read
// right after the chunk that carried descriptors. So the descriptors of one
// read belong to the message holding the last byte of that read: the
// message [s, s+size) owns the batch received at stream offset end iff
// s < end <= s+size. Every batch is owned by exactly one message; a
// misbehaving client can only misattribute its own descriptors, which the
// owning message's handler then refuses and closes.
type reader struct {
	t       transport
	buf     []byte
	r, w    int
	pos     uint64 // stream offset of buf[r]
	maxSize uint32
	batches []fdBatch
	scratch []int
	err     error // sticky: EOF, transport failure or an unparseable header
	// exact, if set, consumes the stream one whole message at a time: the
	// header is peeked and the message read with a bound of its own size,
	// so the socket never holds part of a message we took. Another process
	// holding a copy of the socket (a daemon restarted after a crash) then
	// starts at a message boundary. It costs a second syscall per message.
	exact peeker
	// headerWait bounds how long exact waits for the rest of a partial
	// header from a client that is still connected (Config.PartialHeaderWait).
	headerWait time.Duration
}

// peeker is a transport that can look at the next bytes without taking
// them.
type peeker interface {
	peek(p []byte) (int, error)
	// waitHangup waits at most d for the client to close its end (or
	// shut it down for writing) and reports whether it did: the bytes
	// left in the socket are then all there will ever be.
	waitHangup(d time.Duration) bool
}

type fdBatch struct {
	end       uint64
	fds       []int
	truncated bool
}

// rawMsg is a message as read: header, body and descriptors. Body aliases
// the reader's buffer and is valid until the next call to next.
type rawMsg struct {
	hdr       Header
	body      []byte
	fds       []int
	truncated bool
}

// headerError reports a header whose size cannot be trusted: the stream
// cannot be resynchronised, so the connection replies (if it can) and ends.
type headerError struct {
	hdr Header
	err error
}

func (e *headerError) Error() string { return fmt.Sprintf("message header %v: %v", e.hdr, e.err) }
func (e *headerError) Unwrap() error { return e.err }

const readBufSize = 64 << 10

func newReader(t transport, maxSize uint32) *reader {
	return &reader{t: t, buf: make([]byte, readBufSize), maxSize: maxSize, scratch: make([]int, 0, oobFDs)}
}

// next reads the next complete message into m.
func (rd *reader) next(m *rawMsg) error {
	if rd.err != nil {
		return rd.err
	}
	var h Header
	if rd.exact != nil && rd.w == rd.r {
		var err error
		if h, err = rd.peekHeader(); err != nil {
			return err
		}
	} else {
		if err := rd.fill(HeaderSize); err != nil {
			return err
		}
		h = DecodeHeader(rd.buf[rd.r:])
	}
	switch {
	case h.Size < HeaderSize:
		rd.err = &headerError{h, fmt.Errorf("size %d below the header size: %w", h.Size, ErrInvalid)}
		return rd.err
	case h.Size > rd.maxSize:
		rd.err = &headerError{h, fmt.Errorf("size %d above the maximum %d: %w", h.Size, rd.maxSize, ErrTooBig)}
		return rd.err
	}
	if err := rd.fill(int(h.Size)); err != nil {
		return err
	}
	end := rd.pos + uint64(h.Size)
	m.hdr = h
	m.body = rd.buf[rd.r+HeaderSize : rd.r+int(h.Size)]
	m.fds = m.fds[:0]
	m.truncated = false
	k := 0
	for ; k < len(rd.batches) && rd.batches[k].end <= end; k++ {
		m.fds = append(m.fds, rd.batches[k].fds...)
		m.truncated = m.truncated || rd.batches[k].truncated
	}
	if k > 0 {
		rd.batches = rd.batches[:copy(rd.batches, rd.batches[k:])]
	}
	rd.r += int(h.Size)
	rd.pos = end
	return nil
}

// fill reads until at least need bytes are buffered.
func (rd *reader) fill(need int) error {
	for rd.w-rd.r < need {
		if rd.r+need > len(rd.buf) {
			if need > len(rd.buf) {
				nb := make([]byte, need)
				rd.w = copy(nb, rd.buf[rd.r:rd.w])
				rd.buf = nb
			} else {
				rd.w = copy(rd.buf, rd.buf[rd.r:rd.w])
			}
			rd.r = 0
		}
		p := rd.buf[rd.w:]
		if rd.exact != nil {
			p = rd.buf[rd.w : rd.r+need] // never past the message
		}
		n, fds, trunc, err := rd.t.read(p, rd.scratch[:0])
		rd.w += n
		if len(fds) > 0 || trunc {
			rd.batches = append(rd.batches, fdBatch{
				end: rd.pos + uint64(rd.w-rd.r), fds: append([]int(nil), fds...), truncated: trunc})
		}
		if err == nil {
			continue
		}
		if isTimeout(err) {
			return err
		}
		if errors.Is(err, io.EOF) && rd.w > rd.r {
			err = io.ErrUnexpectedEOF // the client went away mid-message
		}
		rd.err = err
		return err
	}
	return nil
}

// peekHeader waits until a whole header is in the socket and decodes it
// without taking it. A client sends a message with one sendmsg, so a
// partial header is rare: it is polled for. Peeking never sees the end of
// the stream while bytes are left in the socket, so a client that went
// away after part of a header is asked about (a hang-up) between polls:
// its connection ends at once, and the VM's next connection is served,
// rather than after headerWait.
func (rd *reader) peekHeader() (Header, error) {
	var hb [HeaderSize]byte
	var start time.Time
	for {
		n, err := rd.exact.peek(hb[:])
		if err != nil {
			if !isTimeout(err) {
				rd.err = err
			}
			return Header{}, err
		}
		if n == HeaderSize {
			return DecodeHeader(hb[:]), nil
		}
		if start.IsZero() {
			start = time.Now()
		}
		if rd.exact.waitHangup(time.Millisecond) {
			// The rest may have come just before the hang-up.
			if n, err = rd.exact.peek(hb[:]); err == nil && n == HeaderSize {
				return DecodeHeader(hb[:]), nil
			}
			rd.err = fmt.Errorf("the client closed the connection after %d bytes of a message header: %w", n, io.ErrUnexpectedEOF)
			return Header{}, rd.err
		}
		if time.Since(start) > rd.headerWait {
			rd.err = fmt.Errorf("a partial message header stayed %d bytes for %v: %w", n, rd.headerWait, io.ErrUnexpectedEOF)
			return Header{}, rd.err
		}
	}
}

// closeFDs closes every descriptor received but not yet attributed (a
// message cut off by a disconnect).
func (rd *reader) closeFDs() {
	for _, b := range rd.batches {
		closeFDs(b.fds)
	}
	rd.batches = nil
}

// closeFDs closes the non-negative descriptors in fds and marks them -1.
func closeFDs(fds []int) {
	for i, fd := range fds {
		if fd >= 0 {
			_ = unix.Close(fd)
			fds[i] = -1
		}
	}
}
