package vfiouser

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
)

// Config parameterises a Server.
type Config struct {
	// NewDevice makes the device served on each connection. Required.
	NewDevice NewDeviceFunc
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// MaxDataXfer is our max_data_xfer_size: the largest REGION_READ or
	// REGION_WRITE the client may send. Default 1 MiB; at most 64 MiB.
	MaxDataXfer uint32
	// MaxMsgFDs is our max_msg_fds: descriptors one message may carry.
	// Default 16 (QEMU's maximum).
	MaxMsgFDs int
	// MaxDMAMaps is our max_dma_maps. Default 4096; at most 65535.
	MaxDMAMaps int
	// DMATimeout bounds a server-to-client DMA_READ/DMA_WRITE round trip.
	// Default 5 s (QEMU's own reply timeout).
	DMATimeout time.Duration
	// PartialHeaderWait bounds how long a connection read one whole
	// message at a time (one a Keeper keeps) waits for the rest of a
	// message header from a client that is still connected; a client
	// that closes its end is noticed at once whatever it sent. Default
	// 5 s.
	PartialHeaderWait time.Duration
	// LockBudget, if set, is charged the bytes of every DMA map with a file
	// descriptor (each is mapped and mlocked) while it lasts: a map it
	// refuses is refused. It spans connections (one per VM).
	LockBudget LockBudget
}

// LockBudget meters the guest memory a server maps and locks.
type LockBudget interface {
	Charge(n uint64) error
	Release(n uint64)
}

func (c *Config) setDefaults() error {
	if c.NewDevice == nil {
		return errors.New("vfiouser: Config.NewDevice is required")
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxDataXfer == 0 {
		c.MaxDataXfer = defaultMaxDataXfer
	}
	if c.MaxDataXfer < 4096 || c.MaxDataXfer > 64<<20 {
		return fmt.Errorf("vfiouser: MaxDataXfer %d outside [4096, 64 MiB]", c.MaxDataXfer)
	}
	if c.MaxMsgFDs == 0 {
		c.MaxMsgFDs = 16
	}
	if c.MaxMsgFDs < 1 || c.MaxMsgFDs > 16 {
		return fmt.Errorf("vfiouser: MaxMsgFDs %d outside [1, 16]", c.MaxMsgFDs)
	}
	if c.MaxDMAMaps == 0 {
		c.MaxDMAMaps = 4096
	}
	if c.MaxDMAMaps < 1 || c.MaxDMAMaps > defaultMaxDMAMaps {
		return fmt.Errorf("vfiouser: MaxDMAMaps %d outside [1, 65535]", c.MaxDMAMaps)
	}
	if c.DMATimeout == 0 {
		c.DMATimeout = 5 * time.Second
	}
	if c.PartialHeaderWait == 0 {
		c.PartialHeaderWait = 5 * time.Second
	}
	if c.PartialHeaderWait < 0 {
		return fmt.Errorf("vfiouser: PartialHeaderWait %v is negative", c.PartialHeaderWait)
	}
	return nil
}

// maxMessage is the largest message we read: a region access of
// MaxDataXfer bytes plus headers (VERSION and SET_IRQS are far smaller).
func (c *Config) maxMessage() uint32 {
	return c.MaxDataXfer + HeaderSize + 64
}

// Server serves vfio-user clients, one device per connection, with the
// lifecycle of net/http.Server: Serve blocks accepting on a listener,
// Shutdown stops accepting and waits for clients to leave, Close ends
// everything at once. One server serves many sockets (one per VM)
// concurrently.
type Server struct {
	cfg Config
	log *slog.Logger

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	closing   bool
	gate      holdGate
	wg        sync.WaitGroup
	seq       atomic.Uint64
}

// NewServer checks cfg and returns a server.
func NewServer(cfg Config) (*Server, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	return &Server{cfg: cfg, log: cfg.Logger, listeners: map[net.Listener]struct{}{}, conns: map[*conn]struct{}{}}, nil
}

// Listen creates a unix socket listener at path. A leftover socket file
// that nobody listens on any more is replaced; a live one is an error.
func Listen(path string) (*net.UnixListener, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err == nil || !errors.Is(err, syscall.EADDRINUSE) {
		return ln, err
	}
	if c, derr := net.Dial("unix", path); derr == nil {
		_ = c.Close()
		return nil, fmt.Errorf("listen %s: a server is already listening: %w", path, err)
	}
	if rerr := os.Remove(path); rerr != nil {
		return nil, fmt.Errorf("listen %s: remove stale socket: %w", path, rerr)
	}
	return net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
}

// ListenAndServe listens on the unix socket path and serves it.
func (s *Server) ListenAndServe(path string) error {
	ln, err := Listen(path)
	if err != nil {
		return err
	}
	return s.Serve(ln)
}

// Serve accepts connections on ln (a unix socket listener) and serves each
// on its own goroutine until ln fails or the server is shut down; it then
// returns ErrServerClosed. Serve closes ln.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		_ = ln.Close()
		return ErrServerClosed
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		_ = ln.Close()
	}()
	var delay time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.isClosing() {
				return ErrServerClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				s.log.Warn("vfio-user accept failed; retrying", "err", err, "delay", delay)
				time.Sleep(delay)
				continue
			}
			return fmt.Errorf("accept: %w", err)
		}
		delay = 0
		uc, ok := nc.(*net.UnixConn)
		if !ok {
			s.log.Error("vfio-user listener returned a non-unix connection", "type", fmt.Sprintf("%T", nc))
			_ = nc.Close()
			continue
		}
		name := ln.Addr().String()
		go func() { _ = s.ServeConn(uc, name) }()
	}
}

// ServeConn serves one connected client socket (for example an inherited
// descriptor) and returns when the client leaves: nil on a clean
// disconnect. name labels the connection in logs.
func (s *Server) ServeConn(uc *net.UnixConn, name string) error {
	t, err := newUnixTransport(uc)
	if err != nil {
		_ = uc.Close()
		return err
	}
	return s.serveTransport(t, name, peerPID(uc))
}

// ServeStream serves one connection whose client side is the scripted
// byte stream segs (bytes, and descriptors sent with the first byte of
// each segment; the server owns them from then on) and returns the
// messages the server wrote, in order. It runs the same pipeline as a
// socket connection: for fuzzing, one-step tests and replaying captured
// traffic. The connection ends at the end of the script.
func (s *Server) ServeStream(segs []Segment) ([][]byte, error) {
	t := newMemTransport(append([]Segment(nil), segs...), oobFDs)
	err := s.serveTransport(t, "stream", 0)
	return t.Written(), err
}

// ServeFD serves an inherited descriptor: a listening unix socket is
// served like Serve, a connected one like ServeConn. The descriptor is
// owned by the server from then on.
func (s *Server) ServeFD(fd int) error {
	f := os.NewFile(uintptr(fd), "vfio-user-fd-"+strconv.Itoa(fd))
	defer f.Close()
	listening, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	if err != nil {
		return fmt.Errorf("fd %d is not a socket: %w", fd, err)
	}
	if listening == 1 {
		ln, err := net.FileListener(f)
		if err != nil {
			return fmt.Errorf("fd %d: %w", fd, err)
		}
		return s.Serve(ln)
	}
	nc, err := net.FileConn(f)
	if err != nil {
		return fmt.Errorf("fd %d: %w", fd, err)
	}
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		_ = nc.Close()
		return fmt.Errorf("fd %d is not a unix stream socket", fd)
	}
	return s.ServeConn(uc, "fd:"+strconv.Itoa(fd))
}

func (s *Server) isClosing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closing
}

// serveTransport runs one connection on t to its end; pid is the
// client's process (0: unknown).
func (s *Server) serveTransport(t transport, name string, pid int32) error {
	c, err := s.newConn(t, name, pid, nil)
	if err != nil {
		_ = t.close()
		return err
	}
	return s.run(c)
}

// run serves a built connection to its end.
func (s *Server) run(c *conn) error {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		c.teardown()
		return ErrServerClosed
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		s.wg.Done()
	}()

	c.log.Info("vfio-user client connected")
	err := c.serve()
	c.teardown()
	c.log.Info("vfio-user client disconnected", "err", err, "messages", c.stats.messages.Load(),
		"errors", c.stats.errors.Load(), "posted", c.stats.posted.Load())
	return err
}

// newConn builds a connection and its device. before, if set, runs before
// the device is made (a resumed connection maps guest memory there).
func (s *Server) newConn(t transport, name string, pid int32, before func(*conn) error) (*conn, error) {
	id := s.seq.Add(1)
	name = fmt.Sprintf("%s#%d", name, id)
	log := s.log.With("vfio_user", name)
	ctx, cancel := context.WithCancel(context.Background())
	c := &conn{
		name:         name,
		log:          log,
		trace:        log.Enabled(ctx, slog.LevelDebug),
		cfg:          &s.cfg,
		t:            t,
		rd:           newReader(t, s.cfg.maxMessage()),
		tok:          make(chan struct{}, 1),
		backlogReady: make(chan struct{}, 1),
		out:          make([]byte, HeaderSize, 4096),
		ctx:          ctx,
		cancel:       cancel,
		closed:       make(chan struct{}),
		gate:         &s.gate,
	}
	c.tok <- struct{}{}
	c.lim = ratelog.New(log, 0)
	c.mem = guestmem.New(guestmem.WithRemote(c))
	c.irqs = &IRQs{}
	c.host = &Host{Name: name, Memory: c.mem, IRQs: c.irqs, Logger: log, PeerPID: pid, Resumed: before != nil, conn: c}
	if before != nil {
		if err := before(c); err != nil {
			_ = c.mem.RemoveAll()
			cancel()
			return nil, fmt.Errorf("vfio-user %s: %w", name, err)
		}
	}
	dev, err := s.cfg.NewDevice(ctx, c.host)
	if err != nil {
		_ = c.mem.RemoveAll()
		cancel()
		return nil, fmt.Errorf("vfio-user %s: create device: %w", name, err)
	}
	desc := dev.Describe()
	if err := desc.validate(); err != nil {
		_ = dev.Close()
		_ = c.mem.RemoveAll()
		cancel()
		return nil, fmt.Errorf("vfio-user %s: device description: %w", name, err)
	}
	c.dev, c.desc = dev, desc
	c.irqs.configure(desc.IRQs)
	c.mem.RequireShared(desc.RequireSharedMemory)
	if c.host.Keeper != nil {
		// A kept connection is read one whole message at a time, so
		// whoever holds it next starts at a message boundary.
		if p, ok := t.(peeker); ok {
			c.rd.exact, c.rd.headerWait = p, s.cfg.PartialHeaderWait
		}
		c.keepConn()
	}
	return c, nil
}

// Shutdown stops accepting and waits until every client has disconnected
// or ctx is done; then it closes what is left and returns ctx's error.
func (s *Server) Shutdown(ctx context.Context) error {
	s.stopListening()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		_ = s.Close()
		return ctx.Err()
	}
}

// Close stops accepting, disconnects every client and waits until their
// devices are closed and their memory unmapped.
func (s *Server) Close() error {
	s.stopListening()
	s.mu.Lock()
	for c := range s.conns {
		c.close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *Server) stopListening() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closing = true
	for ln := range s.listeners {
		_ = ln.Close()
	}
}

// Stats is a snapshot of the server's state.
type Stats struct {
	Connections int
	// LockedBytes is guest memory mlocked across all connections.
	LockedBytes uint64
	// Messages, Errors and Posted count client commands handled, refused,
	// and sent without a reply wanted.
	Messages, Errors, Posted uint64
}

// Stats returns counters across the live connections.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Connections: len(s.conns)}
	for c := range s.conns {
		st.LockedBytes += c.mem.LockedBytes()
		st.Messages += c.stats.messages.Load()
		st.Errors += c.stats.errors.Load()
		st.Posted += c.stats.posted.Load()
	}
	return st
}
