package vfiouser

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
)

// conn serves one client. One goroutine (serve) runs the staged pipeline
// for every command: header -> validate -> body -> state gate -> dispatch
// -> reply (libvfio-user's get_request / handle_request / do_reply). The
// socket's read side is a token (tok): the serve loop holds it while it
// waits for the next message; a goroutine waiting for the reply to a
// server-to-client DMA request takes it when the serve loop is busy,
// delivers replies and queues client commands in the backlog; the serve
// loop handles them in order, at once, even while the waiter keeps the
// token (the client may need those replies before it answers the DMA).
type conn struct {
	name  string
	log   *slog.Logger
	trace bool // debug logging enabled: per-message logs
	cfg   *Config
	t     transport
	rd    *reader

	tok          chan struct{}
	backlogReady chan struct{} // signalled when a waiter queues a command
	backlogM     sync.Mutex
	backlog      []*ownedMsg
	backlogN     atomic.Int32
	backlogBytes atomic.Int64

	wmu sync.Mutex // one message at a time on the socket

	dev  Device
	host *Host
	desc Description
	// keep is what the connection gave its Keeper (nil: none); keepOff
	// is set when the daemon lets go of the connection on purpose and the
	// keeper must keep everything (Host.StopKeeping).
	keep    *keepState
	keepOff atomic.Bool
	// gate is the server's hold (Server.Hold).
	gate  *holdGate
	mem   *guestmem.Memory
	irqs  *IRQs
	calls callTable

	// Negotiated state, owned by the serve goroutine.
	negotiated bool
	peer       peerCaps
	dmaMaps    int
	warnedRAM  bool
	// fdMaps are the file ranges mapped, by file: one range of a file
	// may be mapped once (aliases would lock the same pages many times).
	fdMu   sync.Mutex
	fdMaps map[fileID][]fileSpan

	cur ownedMsg // the command being handled
	out []byte   // reply buffer: header + payload
	// outFDs are descriptors to send with the reply (not owned).
	outFDs []int

	ctx     context.Context
	cancel  context.CancelFunc
	closed  chan struct{}
	closeMu sync.Once

	stats connStats
	// lim rate-limits the log lines the client can provoke (resets,
	// stray replies, maps it cannot use).
	lim *ratelog.Limiter
}

// ownedMsg is a message whose body and descriptors the holder owns.
type ownedMsg struct {
	hdr       Header
	body      []byte
	fds       []int
	truncated bool
}

func (o *ownedMsg) copyFrom(m *rawMsg) {
	o.hdr = m.hdr
	o.body = append(o.body[:0], m.body...)
	o.fds = append(o.fds[:0], m.fds...)
	o.truncated = m.truncated
}

type connStats struct {
	messages atomic.Uint64
	errors   atomic.Uint64
	posted   atomic.Uint64
	dropped  atomic.Uint64 // unexpected replies
}

// maxBacklog and maxBacklogBytes bound the client commands a DMA waiter
// queues while the serve loop is busy.
const (
	maxBacklog      = 1024
	maxBacklogBytes = 4 << 20
)

// next makes the next client command current: from the backlog, else from
// the socket (delivering replies to waiting DMA requests on the way).
func (c *conn) next() error {
	var m rawMsg
	for {
		if c.popBacklog() {
			return nil
		}
		select {
		case <-c.tok:
		case <-c.backlogReady:
			// A DMA waiter holds the token and queued a command: serve it
			// now. The client may be waiting for its reply before it
			// answers the waiter (QEMU's vCPU holds its big lock while it
			// waits for an MMIO reply).
			continue
		}
		if c.backlogN.Load() > 0 {
			c.tok <- struct{}{}
			continue
		}
		err := c.rd.next(&m)
		if err != nil {
			c.tok <- struct{}{}
			return err
		}
		if m.hdr.IsReply() {
			c.deliver(&m)
			c.tok <- struct{}{}
			continue
		}
		c.cur.copyFrom(&m)
		c.tok <- struct{}{}
		return nil
	}
}

func (c *conn) popBacklog() bool {
	if c.backlogN.Load() == 0 {
		return false
	}
	c.backlogM.Lock()
	defer c.backlogM.Unlock()
	if len(c.backlog) == 0 {
		return false
	}
	m := c.backlog[0]
	c.backlog = c.backlog[1:]
	c.backlogN.Add(-1)
	c.backlogBytes.Add(-int64(len(m.body)))
	c.cur.hdr, c.cur.truncated = m.hdr, m.truncated
	c.cur.body = append(c.cur.body[:0], m.body...)
	c.cur.fds = append(c.cur.fds[:0], m.fds...)
	return true
}

func (c *conn) pushBacklog(m *rawMsg) {
	o := &ownedMsg{}
	o.copyFrom(m)
	c.backlogM.Lock()
	c.backlog = append(c.backlog, o)
	c.backlogN.Add(1)
	c.backlogBytes.Add(int64(len(o.body)))
	c.backlogM.Unlock()
	select {
	case c.backlogReady <- struct{}{}:
	default:
	}
}

// serve runs the connection until the client goes away or the server
// closes it. It returns nil on a clean EOF.
func (c *conn) serve() error {
	woken := false
	for {
		if g := c.gate; g != nil && !c.park(g, woken) {
			return ErrDisconnected
		}
		err := c.next()
		if woken = err != nil && isTimeout(err) && c.gate != nil; woken {
			continue // woken by Hold: park, or finish the message under way
		}
		if err != nil {
			var he *headerError
			switch {
			case errors.As(err, &he):
				c.stats.errors.Add(1)
				if he.hdr.Type() == FlagCommand && !he.hdr.NoReply() {
					_ = c.sendError(he.hdr, Errno(he.err))
				}
				return err
			case errors.Is(err, io.EOF):
				return nil
			}
			return err
		}
		if err := c.handle(); err != nil {
			return err
		}
	}
}

// handle runs the current command through validate -> gate -> dispatch ->
// reply. It returns an error only when the connection must end.
func (c *conn) handle() (fatal error) {
	m := &c.cur
	c.stats.messages.Add(1)
	if m.hdr.Type() != FlagCommand {
		// Neither a command nor a reply (those went to waiting requests):
		// there is nobody to answer.
		c.stats.errors.Add(1)
		closeFDs(m.fds)
		c.log.Debug("dropped message of unknown type", "hdr", m.hdr)
		return nil
	}
	if m.hdr.NoReply() {
		c.stats.posted.Add(1)
	}
	n, err := c.dispatch(m)
	closeFDs(m.fds) // whatever the handler did not take, before the client hears back
	if err != nil {
		c.stats.errors.Add(1)
		if m.hdr.NoReply() || c.trace {
			c.log.Debug("vfio-user command failed", "cmd", m.hdr.Command, "id", m.hdr.ID, "posted", m.hdr.NoReply(), "err", err)
		}
		var fe fatalError
		if errors.As(err, &fe) {
			if !m.hdr.NoReply() {
				_ = c.sendError(m.hdr, Errno(err))
			}
			return err
		}
		if m.hdr.NoReply() {
			return nil
		}
		return c.sendError(m.hdr, Errno(err))
	}
	if m.hdr.NoReply() {
		return nil
	}
	return c.sendReply(m.hdr, n)
}

// fatalError marks a failure after which the connection ends (an
// unsupported protocol version).
type fatalError struct{ err error }

func (e fatalError) Error() string { return e.err.Error() }
func (e fatalError) Unwrap() error { return e.err }

// cmdInfo drives validation and dispatch of one command (STYLE item 3: a
// table keyed by command code).
type cmdInfo struct {
	handler func(c *conn, m *ownedMsg) (int, error)
	minBody int  // payload bytes required
	exact   bool // payload must be exactly minBody
	maxFDs  int  // descriptors allowed (-1: up to the negotiated maximum)
	early   bool // allowed before VERSION
}

var commands = [...]cmdInfo{
	CmdVersion:             {handler: (*conn).handleVersion, minBody: 4, early: true},
	CmdDMAMap:              {handler: (*conn).handleDMAMap, minBody: DMAMapSize, exact: true, maxFDs: 1},
	CmdDMAUnmap:            {handler: (*conn).handleDMAUnmap, minBody: DMAUnmapSize, exact: true},
	CmdDeviceGetInfo:       {handler: (*conn).handleGetInfo, minBody: DeviceInfoSize, exact: true},
	CmdDeviceGetRegionInfo: {handler: (*conn).handleGetRegionInfo, minBody: RegionInfoSize, exact: true},
	CmdDeviceGetIRQInfo:    {handler: (*conn).handleGetIRQInfo, minBody: IRQInfoSize, exact: true},
	CmdDeviceSetIRQs:       {handler: (*conn).handleSetIRQs, minBody: IRQSetSize, maxFDs: -1},
	CmdRegionRead:          {handler: (*conn).handleRegionRead, minBody: RegionAccessSize, exact: true},
	CmdRegionWrite:         {handler: (*conn).handleRegionWrite, minBody: RegionAccessSize},
	CmdDeviceReset:         {handler: (*conn).handleReset, exact: true},
	CmdRegionWriteMulti:    {handler: (*conn).handleWriteMulti, minBody: MultiHeaderSize},
	CmdGetRegionIOFDs:      {handler: unsupported},
	CmdDeviceFeature:       {handler: (*conn).handleFeature},
	CmdMigDataRead:         {handler: unsupported},
	CmdMigDataWrite:        {handler: unsupported},
	CmdDMARead:             {handler: wrongDirection},
	CmdDMAWrite:            {handler: wrongDirection},
}

func unsupported(c *conn, m *ownedMsg) (int, error) {
	return 0, fmt.Errorf("%v: %w", m.hdr.Command, ErrUnsupported)
}

func wrongDirection(c *conn, m *ownedMsg) (int, error) {
	return 0, fmt.Errorf("%v is a server-to-client command: %w", m.hdr.Command, ErrInvalid)
}

// dispatch validates the message against its command's table entry and
// runs the handler, which leaves its reply payload in c.out[HeaderSize:]
// and returns its length.
func (c *conn) dispatch(m *ownedMsg) (int, error) {
	h := m.hdr
	if h.Flags&^knownFlags != 0 || h.Flags&FlagError != 0 {
		return 0, fmt.Errorf("flags %#x on a command: %w", h.Flags, ErrInvalid)
	}
	var info cmdInfo
	if int(h.Command) < len(commands) {
		info = commands[h.Command]
	}
	if info.handler == nil {
		return 0, fmt.Errorf("command %d: %w", uint16(h.Command), syscall.ENOSYS)
	}
	if len(m.body) < info.minBody || (info.exact && len(m.body) != info.minBody) {
		return 0, fmt.Errorf("%v: payload of %d bytes (want %d): %w", h.Command, len(m.body), info.minBody, ErrInvalid)
	}
	maxFDs := info.maxFDs
	if maxFDs < 0 {
		maxFDs = c.cfg.MaxMsgFDs
	}
	if m.truncated || len(m.fds) > maxFDs {
		return 0, fmt.Errorf("%v: %d file descriptors (max %d, truncated %v): %w", h.Command, len(m.fds), maxFDs, m.truncated, ErrInvalid)
	}
	if !c.negotiated && !info.early {
		return 0, fmt.Errorf("%v before VERSION: %w", h.Command, ErrInvalid)
	}
	if c.negotiated && h.Command == CmdVersion {
		return 0, fmt.Errorf("VERSION after negotiation: %w", ErrInvalid)
	}
	return info.handler(c, m)
}

// payload returns c.out's payload area sized n, growing the buffer.
func (c *conn) payload(n int) []byte {
	if cap(c.out) < HeaderSize+n {
		c.out = make([]byte, HeaderSize+n)
	}
	c.out = c.out[:HeaderSize+n]
	return c.out[HeaderSize:]
}

func (c *conn) sendReply(req Header, n int) error {
	c.out = c.out[:HeaderSize+n]
	Header{ID: req.ID, Command: req.Command, Size: uint32(HeaderSize + n), Flags: FlagReply}.Encode(c.out)
	fds := c.outFDs
	c.outFDs = nil
	return c.send(c.out, fds)
}

func (c *conn) sendError(req Header, errno syscall.Errno) error {
	if errno == 0 {
		errno = syscall.EIO
	}
	var b [HeaderSize]byte
	Header{ID: req.ID, Command: req.Command, Size: HeaderSize, Flags: FlagReply | FlagError, Error: uint32(errno)}.Encode(b[:])
	c.outFDs = nil
	return c.send(b[:], nil)
}

func (c *conn) send(p []byte, fds []int) error {
	c.wmu.Lock()
	err := c.t.write(p, fds)
	c.wmu.Unlock()
	if err != nil {
		return fmt.Errorf("write to client: %w", err)
	}
	return nil
}

// close ends the connection: the serve loop's read fails, waiters return
// ErrDisconnected. Safe to call more than once, from any goroutine.
func (c *conn) close() {
	c.closeMu.Do(func() {
		close(c.closed)
		c.cancel()
		_ = c.t.close()
	})
}

// teardown runs after serve returns: fail outstanding requests, reset and
// close the device, close every eventfd, unmap all guest memory (waiting
// for accesses in flight), close descriptors that never reached a handler.
func (c *conn) teardown() {
	c.close()
	c.keepGone()
	c.calls.failAll(ErrDisconnected)
	if c.dev != nil {
		if err := c.dev.Reset(ResetDisconnect); err != nil {
			c.log.Warn("device reset on disconnect failed", "err", err)
		}
		if err := c.dev.Close(); err != nil {
			c.log.Warn("device close failed", "err", err)
		}
	}
	if c.irqs != nil {
		c.irqs.closeAll()
	}
	if err := c.mem.RemoveAll(); err != nil {
		c.log.Warn("unmapping guest memory failed", "err", err)
	}
	// The token is free once serve has returned and waiters have given up.
	<-c.tok
	c.rd.closeFDs()
	c.backlogM.Lock()
	for _, m := range c.backlog {
		closeFDs(m.fds)
	}
	c.backlog = nil
	c.backlogM.Unlock()
	c.tok <- struct{}{}
	c.lim.Flush()
}
