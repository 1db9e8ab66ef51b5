package vfiouser

import (
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Server-to-client DMA (vfio-user spec, DMA_READ / DMA_WRITE): guest memory
// that the client mapped without a file descriptor is reached through
// messages. The connection implements guestmem.Remote with them.
//
// Any goroutine may issue a request; the reply comes back on the same
// socket as client commands. The caller registers a call, sends, then
// waits either for the serve loop to deliver the reply, or (when the serve
// loop is busy, e.g. because the caller is the serve loop itself inside a
// device callback) takes the read token and reads until its reply arrives,
// queueing client commands for the serve loop. The fast path (REGION_WRITE)
// never touches any of this.

type call struct {
	id    uint16
	cmd   Command
	addr  uint64
	data  []byte // DMA_READ: destination
	count uint64
	done  chan struct{}
	err   error
}

type callTable struct {
	mu      sync.Mutex
	pending map[uint16]*call
	nextID  uint16
	failed  error // set once the connection ended
}

func (t *callTable) add(cl *call) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed != nil {
		return t.failed
	}
	if t.pending == nil {
		t.pending = make(map[uint16]*call)
	}
	for i := 0; i < 1<<16; i++ {
		t.nextID++
		if _, busy := t.pending[t.nextID]; !busy {
			cl.id = t.nextID
			t.pending[cl.id] = cl
			return nil
		}
	}
	return fmt.Errorf("no free message id: %w", syscall.EBUSY)
}

func (t *callTable) remove(cl *call) {
	t.mu.Lock()
	if t.pending[cl.id] == cl {
		delete(t.pending, cl.id)
	}
	t.mu.Unlock()
}

// complete finishes the call with id under the table lock (so the caller
// cannot have left) by running fill, then wakes the caller. It reports
// false if no call waits for id.
func (t *callTable) complete(id uint16, fill func(cl *call)) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	cl, ok := t.pending[id]
	if !ok {
		return false
	}
	delete(t.pending, id)
	fill(cl)
	close(cl.done)
	return true
}

func (t *callTable) failAll(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failed = err
	for id, cl := range t.pending {
		delete(t.pending, id)
		cl.err = err
		close(cl.done)
	}
}

// deliver hands a reply read from the socket to the call waiting for it.
func (c *conn) deliver(m *rawMsg) {
	ok := c.calls.complete(m.hdr.ID, func(cl *call) {
		cl.err = c.checkReply(cl, m)
	})
	if !ok {
		c.stats.dropped.Add(1)
		c.lim.Warn("stray-reply", "unexpected reply from client", "hdr", m.hdr)
	}
	closeFDs(m.fds)
}

// checkReply validates a reply and copies DMA_READ data out of it.
func (c *conn) checkReply(cl *call, m *rawMsg) error {
	h := m.hdr
	if h.Command != cl.cmd {
		return fmt.Errorf("reply for %v to %v request: %w", h.Command, cl.cmd, ErrInvalid)
	}
	if h.Flags&FlagError != 0 {
		return fmt.Errorf("client refused %v %#x+%#x: %w", cl.cmd, cl.addr, cl.count, syscall.Errno(h.Error))
	}
	if cl.cmd == CmdDMAWrite {
		// QEMU answers with a bare header; the spec echoes address and count.
		if len(m.body) >= DMAAccessSize {
			if a := DecodeDMAAccess(m.body); a.Address != cl.addr || a.Count != cl.count {
				return fmt.Errorf("DMA_WRITE reply for %#x+%#x, asked %#x+%#x: %w", a.Address, a.Count, cl.addr, cl.count, ErrInvalid)
			}
		}
		return nil
	}
	if uint64(len(m.body)) != DMAAccessSize+cl.count {
		return fmt.Errorf("DMA_READ reply of %d bytes for %d: %w", len(m.body), cl.count, ErrInvalid)
	}
	if a := DecodeDMAAccess(m.body); a.Address != cl.addr || a.Count != cl.count {
		return fmt.Errorf("DMA_READ reply for %#x+%#x, asked %#x+%#x: %w", a.Address, a.Count, cl.addr, cl.count, ErrInvalid)
	}
	copy(cl.data, m.body[DMAAccessSize:DMAAccessSize+int(cl.count)])
	return nil
}

// roundTrip sends one DMA request and waits for its reply.
func (c *conn) roundTrip(cl *call, req []byte) error {
	cl.done = make(chan struct{})
	if err := c.calls.add(cl); err != nil {
		return err
	}
	Header{ID: cl.id, Command: cl.cmd, Size: uint32(len(req)), Flags: FlagCommand}.Encode(req)
	if err := c.send(req, nil); err != nil {
		c.calls.remove(cl)
		return err
	}
	deadline := time.Now().Add(c.cfg.DMATimeout)
	timer := time.NewTimer(c.cfg.DMATimeout)
	defer timer.Stop()
	tok := c.tok
	for {
		select {
		case <-cl.done:
			return cl.err
		case <-timer.C:
			return c.giveUp(cl)
		case <-c.closed:
			c.calls.remove(cl)
			return ErrDisconnected
		case <-tok:
			err := c.pump(cl, deadline)
			c.tok <- struct{}{}
			select {
			case <-cl.done:
				return cl.err
			default:
			}
			if err == nil { // backlog full: only the serve loop can help now
				tok = nil
				continue
			}
			if isTimeout(err) {
				return c.giveUp(cl)
			}
			c.calls.remove(cl)
			return fmt.Errorf("%v %#x+%#x: %w (%v)", cl.cmd, cl.addr, cl.count, ErrDisconnected, err)
		}
	}
}

func (c *conn) giveUp(cl *call) error {
	c.calls.remove(cl)
	select {
	case <-cl.done: // completed just now
		return cl.err
	default:
	}
	return fmt.Errorf("%v %#x+%#x after %v: %w", cl.cmd, cl.addr, cl.count, c.cfg.DMATimeout, ErrTimeout)
}

// pump reads messages while holding the read token until cl completes,
// the backlog is full (nil error) or a read fails.
func (c *conn) pump(cl *call, deadline time.Time) error {
	if err := c.t.setReadDeadline(deadline); err != nil {
		return err
	}
	defer func() { _ = c.t.setReadDeadline(time.Time{}) }()
	var m rawMsg
	for {
		select {
		case <-cl.done:
			return nil
		default:
		}
		if c.backlogN.Load() >= maxBacklog || c.backlogBytes.Load() >= maxBacklogBytes {
			return nil
		}
		if err := c.rd.next(&m); err != nil {
			return err
		}
		if m.hdr.IsReply() {
			c.deliver(&m)
			continue
		}
		c.pushBacklog(&m)
	}
}

// dmaChunk is the largest transfer one request may carry: the smaller of
// the client's and our max_data_xfer_size.
func (c *conn) dmaChunk() uint64 {
	n := uint64(c.cfg.MaxDataXfer)
	if c.peer.maxDataXfer != 0 && c.peer.maxDataXfer < n {
		n = c.peer.maxDataXfer
	}
	return n
}

// ReadAt implements guestmem.Remote with DMA_READ requests.
func (c *conn) ReadAt(p []byte, gpa guestmem.GPA) error {
	chunk := c.dmaChunk()
	for len(p) > 0 {
		n := min(uint64(len(p)), chunk)
		req := make([]byte, HeaderSize+DMAAccessSize)
		DMAAccess{Address: uint64(gpa), Count: n}.Encode(req[HeaderSize:])
		cl := &call{cmd: CmdDMARead, addr: uint64(gpa), data: p[:n], count: n}
		if err := c.roundTrip(cl, req); err != nil {
			return err
		}
		p = p[n:]
		gpa += guestmem.GPA(n)
	}
	return nil
}

// WriteAt implements guestmem.Remote with DMA_WRITE requests.
func (c *conn) WriteAt(p []byte, gpa guestmem.GPA) error {
	chunk := c.dmaChunk()
	for len(p) > 0 {
		n := min(uint64(len(p)), chunk)
		req := make([]byte, HeaderSize+DMAAccessSize+int(n))
		DMAAccess{Address: uint64(gpa), Count: n}.Encode(req[HeaderSize:])
		copy(req[HeaderSize+DMAAccessSize:], p[:n])
		cl := &call{cmd: CmdDMAWrite, addr: uint64(gpa), count: n}
		if err := c.roundTrip(cl, req); err != nil {
			return err
		}
		p = p[n:]
		gpa += guestmem.GPA(n)
	}
	return nil
}
