// Package vfiousertest is a vfio-user client for tests: it drives a
// vfiouser.Server over a real socketpair with real memfds and eventfds,
// one message at a time, the way QEMU's vfio-user-pci does, and also sends
// raw, malformed messages for hostile-client tests (in the manner of
// libvfio-user's test/py). It answers the server's DMA_READ/DMA_WRITE
// requests from client-side memory, like QEMU does for guest memory that
// it mapped without a file descriptor.
package vfiousertest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

var le = binary.LittleEndian

// ReplyError is an error reply from the server.
type ReplyError struct {
	Command vfiouser.Command
	Errno   syscall.Errno
}

func (e *ReplyError) Error() string { return fmt.Sprintf("%v: server replied %v", e.Command, e.Errno) }

// Unwrap lets errors.Is match the errno.
func (e *ReplyError) Unwrap() error { return e.Errno }

// Msg is a message read from the server.
type Msg struct {
	Hdr  vfiouser.Header
	Body []byte
	FDs  []int
}

// Client is the client end of one connection. Its methods are not safe for
// concurrent use, except Close.
type Client struct {
	conn   *net.UnixConn
	nextID uint16

	mu      sync.Mutex
	remote  map[uint64][]byte // client memory served through DMA_READ/WRITE
	dmaSeen int
	// Timeout bounds each receive (default 10 s).
	Timeout time.Duration
}

// NewClient wraps a connected socket.
func NewClient(c *net.UnixConn) *Client {
	return &Client{conn: c, remote: map[uint64][]byte{}, Timeout: 10 * time.Second}
}

// Socketpair returns two connected unix stream sockets.
func Socketpair() (*net.UnixConn, *net.UnixConn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	conv := func(fd int, name string) (*net.UnixConn, error) {
		f := os.NewFile(uintptr(fd), name)
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			return nil, err
		}
		return c.(*net.UnixConn), nil
	}
	a, err := conv(fds[0], "vfio-user-server")
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	b, err := conv(fds[1], "vfio-user-client")
	if err != nil {
		a.Close()
		return nil, nil, err
	}
	return a, b, nil
}

// Pair serves one connection of srv on a socketpair and returns the client
// end. At cleanup the client closes and Pair waits for the server side to
// finish its teardown.
func Pair(tb testing.TB, srv *vfiouser.Server) *Client {
	tb.Helper()
	s, c, err := Socketpair()
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.ServeConn(s, tb.Name()) }()
	cl := NewClient(c)
	tb.Cleanup(func() {
		cl.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			tb.Errorf("server connection did not end after the client closed")
		}
	})
	return cl
}

// Close closes the client's socket.
func (c *Client) Close() error { return c.conn.Close() }

// Conn returns the client's socket.
func (c *Client) Conn() *net.UnixConn { return c.conn }

// ServeMemory makes [base, base+len(mem)) answer the server's DMA_READ and
// DMA_WRITE requests (memory mapped without a descriptor).
func (c *Client) ServeMemory(base uint64, mem []byte) {
	c.mu.Lock()
	c.remote[base] = mem
	c.mu.Unlock()
}

// DMARequests returns how many DMA requests the client answered.
func (c *Client) DMARequests() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dmaSeen
}

// SendRaw writes b as is, with fds attached.
func (c *Client) SendRaw(b []byte, fds ...int) error {
	if len(fds) == 0 {
		_, err := c.conn.Write(b)
		return err
	}
	n, _, err := c.conn.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	if err == nil && n < len(b) {
		_, err = c.conn.Write(b[n:])
	}
	return err
}

// Build returns a command message with a fresh id.
func (c *Client) Build(cmd vfiouser.Command, flags uint32, payload []byte) []byte {
	c.nextID++
	b := make([]byte, vfiouser.HeaderSize+len(payload))
	vfiouser.Header{ID: c.nextID, Command: cmd, Size: uint32(len(b)), Flags: flags}.Encode(b)
	copy(b[vfiouser.HeaderSize:], payload)
	return b
}

// Send writes a command and returns its id.
func (c *Client) Send(cmd vfiouser.Command, flags uint32, payload []byte, fds ...int) (uint16, error) {
	b := c.Build(cmd, flags, payload)
	return c.nextID, c.SendRaw(b, fds...)
}

// Recv reads the next message that is not a server DMA request (those are
// answered on the way).
func (c *Client) Recv() (Msg, error) {
	for {
		m, err := c.recvOne()
		if err != nil {
			return m, err
		}
		if !m.Hdr.IsReply() && (m.Hdr.Command == vfiouser.CmdDMARead || m.Hdr.Command == vfiouser.CmdDMAWrite) {
			if err := c.answerDMA(m); err != nil {
				return m, err
			}
			continue
		}
		return m, nil
	}
}

func (c *Client) recvOne() (Msg, error) {
	var m Msg
	if err := c.conn.SetReadDeadline(time.Now().Add(c.Timeout)); err != nil {
		return m, err
	}
	hdr := make([]byte, vfiouser.HeaderSize)
	oob := make([]byte, unix.CmsgSpace(16*4))
	n, oobn, _, _, err := c.conn.ReadMsgUnix(hdr, oob)
	if err != nil {
		return m, err
	}
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		if perr != nil {
			return m, perr
		}
		for i := range msgs {
			fds, perr := unix.ParseUnixRights(&msgs[i])
			if perr == nil {
				m.FDs = append(m.FDs, fds...)
			}
		}
	}
	if n < vfiouser.HeaderSize {
		if _, err := io.ReadFull(c.conn, hdr[n:]); err != nil {
			return m, err
		}
	}
	m.Hdr = vfiouser.DecodeHeader(hdr)
	if m.Hdr.Size < vfiouser.HeaderSize || m.Hdr.Size > 64<<20 {
		return m, fmt.Errorf("server sent bad header %v", m.Hdr)
	}
	m.Body = make([]byte, m.Hdr.Size-vfiouser.HeaderSize)
	if _, err := io.ReadFull(c.conn, m.Body); err != nil {
		return m, err
	}
	return m, nil
}

// answerDMA serves a server DMA request from client memory.
func (c *Client) answerDMA(m Msg) error {
	for _, fd := range m.FDs {
		unix.Close(fd)
	}
	c.mu.Lock()
	c.dmaSeen++
	c.mu.Unlock()
	if len(m.Body) < vfiouser.DMAAccessSize {
		return c.replyError(m.Hdr, syscall.EINVAL)
	}
	a := vfiouser.DecodeDMAAccess(m.Body)
	addr, count := a.Address, a.Count
	mem := c.find(addr, count)
	if mem == nil {
		return c.replyError(m.Hdr, syscall.EFAULT)
	}
	if m.Hdr.Command == vfiouser.CmdDMAWrite {
		if uint64(len(m.Body)) != vfiouser.DMAAccessSize+count {
			return c.replyError(m.Hdr, syscall.EINVAL)
		}
		copy(mem, m.Body[vfiouser.DMAAccessSize:])
		// QEMU's answer: a bare header.
		return c.reply(m.Hdr, nil)
	}
	p := make([]byte, vfiouser.DMAAccessSize+int(count))
	a.Encode(p)
	copy(p[vfiouser.DMAAccessSize:], mem)
	return c.reply(m.Hdr, p)
}

func (c *Client) find(addr, count uint64) []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	for base, mem := range c.remote {
		if addr >= base && addr-base <= uint64(len(mem)) && count <= uint64(len(mem))-(addr-base) {
			return mem[addr-base : addr-base+count]
		}
	}
	return nil
}

func (c *Client) reply(req vfiouser.Header, payload []byte) error {
	b := make([]byte, vfiouser.HeaderSize+len(payload))
	vfiouser.Header{ID: req.ID, Command: req.Command, Size: uint32(len(b)), Flags: vfiouser.FlagReply}.Encode(b)
	copy(b[vfiouser.HeaderSize:], payload)
	return c.SendRaw(b)
}

func (c *Client) replyError(req vfiouser.Header, e syscall.Errno) error {
	b := make([]byte, vfiouser.HeaderSize)
	vfiouser.Header{ID: req.ID, Command: req.Command, Size: vfiouser.HeaderSize,
		Flags: vfiouser.FlagReply | vfiouser.FlagError, Error: uint32(e)}.Encode(b)
	return c.SendRaw(b)
}

// Call sends a command and waits for its reply. An error reply is returned
// as a *ReplyError (errors.Is matches the errno); a reply with a wrong id,
// command or type is an error too.
func (c *Client) Call(cmd vfiouser.Command, payload []byte, fds ...int) (Msg, error) {
	id, err := c.Send(cmd, 0, payload, fds...)
	if err != nil {
		return Msg{}, err
	}
	return c.Expect(id, cmd)
}

// Expect reads the reply to the command with id.
func (c *Client) Expect(id uint16, cmd vfiouser.Command) (Msg, error) {
	m, err := c.Recv()
	if err != nil {
		return m, err
	}
	switch {
	case !m.Hdr.IsReply():
		return m, fmt.Errorf("expected a reply to %v, got %v", cmd, m.Hdr)
	case m.Hdr.ID != id || m.Hdr.Command != cmd:
		return m, fmt.Errorf("expected reply id %d %v, got %v", id, cmd, m.Hdr)
	case m.Hdr.Flags&vfiouser.FlagError != 0:
		if len(m.Body) != 0 {
			return m, fmt.Errorf("error reply with %d payload bytes", len(m.Body))
		}
		return m, &ReplyError{Command: cmd, Errno: syscall.Errno(m.Hdr.Error)}
	}
	return m, nil
}

// ExpectSilence checks that the server sends nothing within d (posted
// writes must never be answered).
func (c *Client) ExpectSilence(d time.Duration) error {
	old := c.Timeout
	c.Timeout = d
	defer func() { c.Timeout = old }()
	m, err := c.recvOne()
	if err == nil {
		return fmt.Errorf("unexpected message from server: %v", m.Hdr)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil
	}
	return err
}
