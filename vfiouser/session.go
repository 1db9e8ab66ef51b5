package vfiouser

import (
	"errors"
	"fmt"
	"net"
	"sort"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// A connection outlives the process that serves it when another process
// holds copies of its descriptors (systemd's file descriptor store, or the
// next daemon during a hand-over): the client never sees the socket close.
// What that process needs besides the descriptors is the Session: what was
// negotiated, which guest memory is mapped from which file, and which
// eventfd signals which interrupt vector. A Keeper is told about every
// descriptor the connection takes or lets go of and about every change of
// the session, synchronously, before the client gets its reply, so that a
// crash at any moment leaves a session that matches what the client
// believes (at worst one request the client sent is never answered, which
// QEMU times out).

// SessionVersion is the version of the Session format.
const SessionVersion = 1

// Descriptor names a Keeper sees: the connected socket, the files behind
// DMA maps (FileName) and interrupt eventfds (IRQName).
const ConnName = "conn"

// Session is the state of a connection another process needs to resume it.
type Session struct {
	Version int          `json:"version"`
	Peer    SessionPeer  `json:"peer"`
	DMA     []SessionDMA `json:"dma,omitempty"`
	IRQs    []SessionIRQ `json:"irqs,omitempty"`
}

// SessionPeer are the client's negotiated capabilities.
type SessionPeer struct {
	MaxMsgFDs     uint64 `json:"max_msg_fds"`
	MaxDataXfer   uint64 `json:"max_data_xfer"`
	MaxDMAMaps    uint64 `json:"max_dma_maps"`
	PageSizes     uint64 `json:"pgsizes"`
	WriteMultiple bool   `json:"write_multiple,omitempty"`
}

// SessionDMA is one DMA map. File names the descriptor that backs it
// (empty: a map without one, reached with DMA_READ/DMA_WRITE).
type SessionDMA struct {
	Addr   uint64        `json:"addr"`
	Size   uint64        `json:"size"`
	Offset uint64        `json:"offset,omitempty"`
	Prot   guestmem.Prot `json:"prot"`
	File   string        `json:"file,omitempty"`
}

// SessionIRQ is one interrupt vector with an eventfd.
type SessionIRQ struct {
	Index  IRQIndex `json:"index"`
	Vector uint32   `json:"vector"`
	File   string   `json:"file"`
	Masked bool     `json:"masked,omitempty"`
}

// Keeper keeps copies of a connection's descriptors where they survive the
// serving process, and its Session with them. Its methods run on the
// connection's goroutine, before the reply to the message that caused
// them; they must not call back into the connection.
type Keeper interface {
	// Keep is told the connection holds fd under name (ConnName, a
	// FileName or an IRQName). The connection keeps owning fd; a keeper
	// that needs it beyond the call duplicates it.
	Keep(name string, fd int) error
	// Forget is told the connection let go of name's descriptor.
	Forget(name string)
	// Saved is given the session after each change.
	Saved(s *Session)
}

// FileName names the descriptor of a DMA-mapped file: one name per open
// file (device, inode and access mode), however many ranges are mapped
// from it, since a store keeps one copy of a file however often it is
// given.
func FileName(fd int) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", fmt.Errorf("fstat: %w", err)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return "", fmt.Errorf("fcntl: %w", err)
	}
	return fmt.Sprintf("m%x-%x-%d", st.Dev, st.Ino, fl&unix.O_ACCMODE), nil
}

// IRQName names the eventfd of an interrupt vector.
func IRQName(index IRQIndex, vector uint32) string {
	return "i" + strconv.Itoa(int(index)) + "-" + strconv.FormatUint(uint64(vector), 10)
}

// keepState is the connection's record of what it gave its keeper.
type keepState struct {
	k       Keeper
	files   map[string]int          // DMA file name -> maps using it
	regions map[guestmem.GPA]string // DMA map base -> file name
}

// keeper returns the connection's keeper, or nil.
func (c *conn) keeper() Keeper {
	if c.keep == nil {
		return nil
	}
	return c.keep.k
}

// keepConn gives the keeper the connected socket, once the device exists.
func (c *conn) keepConn() {
	if c.host.Keeper == nil {
		return
	}
	c.keep = &keepState{k: c.host.Keeper, files: map[string]int{}, regions: map[guestmem.GPA]string{}}
	fd, ok := c.t.(interface{ sysfd() int })
	if !ok {
		return
	}
	if err := c.keep.k.Keep(ConnName, fd.sysfd()); err != nil {
		c.log.Warn("cannot keep the connection beyond this process: a restart will cut it", "err", err)
	}
}

// keepSaved gives the keeper the session after a change.
func (c *conn) keepSaved() {
	if k := c.keeper(); k != nil && !c.keepOff.Load() {
		s := c.session()
		k.Saved(&s)
	}
}

// keepMapped records a DMA map backed by fd.
func (c *conn) keepMapped(base guestmem.GPA, fd int) {
	if c.keep == nil || c.keepOff.Load() {
		return
	}
	name, err := FileName(fd)
	if err != nil {
		c.log.Warn("cannot name a guest memory file for the store", "err", err)
		return
	}
	c.keep.regions[base] = name
	c.keep.files[name]++
	if c.keep.files[name] == 1 {
		if err := c.keep.k.Keep(name, fd); err != nil {
			c.log.Warn("cannot keep a guest memory file beyond this process: a restart will lose it", "err", err)
		}
	}
}

// keepUnmapped records that the DMA map at base is gone.
func (c *conn) keepUnmapped(base guestmem.GPA) {
	if c.keep == nil {
		return
	}
	name, ok := c.keep.regions[base]
	if !ok {
		return
	}
	delete(c.keep.regions, base)
	if c.keep.files[name]--; c.keep.files[name] <= 0 {
		delete(c.keep.files, name)
		if !c.keepOff.Load() {
			c.keep.k.Forget(name)
		}
	}
}

// keepIRQs gives the keeper the eventfds of vectors [start, start+count)
// of index (assigned true) or forgets them.
func (c *conn) keepIRQs(index IRQIndex, start, count uint32, assigned bool) {
	k := c.keeper()
	if k == nil || c.keepOff.Load() {
		return
	}
	for v := start; v < start+count; v++ {
		name := IRQName(index, v)
		if !assigned {
			k.Forget(name)
			continue
		}
		if e := c.irqs.slot(index, v).efd.Load(); e != nil {
			if err := k.Keep(name, e.fd); err != nil {
				c.log.Warn("cannot keep an interrupt eventfd beyond this process", "err", err, "index", index, "vector", v)
			}
		}
	}
}

// keepGone tells the keeper the connection ended: every descriptor is
// forgotten, unless the daemon let go of it on purpose (StopKeeping).
func (c *conn) keepGone() {
	k := c.keeper()
	if k == nil || c.keepOff.Load() {
		return
	}
	for name := range c.keep.files {
		k.Forget(name)
	}
	n := c.irqs.n.Load()
	for i := 0; i < int(n); i++ {
		for v := range c.irqs.sets[i].slots {
			k.Forget(IRQName(IRQIndex(i), uint32(v)))
		}
	}
	k.Forget(ConnName)
}

// session snapshots the connection's session.
func (c *conn) session() Session {
	s := Session{Version: SessionVersion, Peer: SessionPeer{
		MaxMsgFDs: c.peer.maxMsgFDs, MaxDataXfer: c.peer.maxDataXfer, MaxDMAMaps: c.peer.maxDMAMaps,
		PageSizes: c.peer.pgsizes, WriteMultiple: c.peer.writeMultiple}}
	for _, r := range c.mem.Regions() {
		d := SessionDMA{Addr: uint64(r.Base), Size: r.Size, Prot: r.Prot}
		if r.FD >= 0 {
			d.Offset = uint64(r.Offset)
			if c.keep != nil {
				d.File = c.keep.regions[r.Base]
			}
		}
		s.DMA = append(s.DMA, d)
	}
	n := c.irqs.n.Load()
	for i := 0; i < int(n); i++ {
		for v := range c.irqs.sets[i].slots {
			sl := &c.irqs.sets[i].slots[v]
			if sl.efd.Load() == nil {
				continue
			}
			s.IRQs = append(s.IRQs, SessionIRQ{Index: IRQIndex(i), Vector: uint32(v), File: IRQName(IRQIndex(i), uint32(v)),
				Masked: sl.masked.Load()})
		}
	}
	return s
}

// StopKeeping detaches the connection from its keeper: when the connection
// is closed by this process (the daemon stops and leaves the connection
// to the store), the keeper keeps every descriptor and the session.
func (h *Host) StopKeeping() {
	if h.conn != nil {
		h.conn.keepOff.Store(true)
	}
}

// Resume serves a connection another process served before, whose
// descriptors it kept: uc is the connected socket, s the session, files
// the kept descriptors by name (Resume owns them all from the call on and
// closes those it does not use). The device factory is called after guest
// memory is mapped again, with Host.Resumed set; then the interrupt
// eventfds are assigned again, and the connection is served like ServeConn.
// A session that does not validate is refused before anything is mapped.
func (s *Server) Resume(uc *net.UnixConn, name string, sess *Session, files map[string]int) error {
	defer func() {
		for _, fd := range files {
			_ = unix.Close(fd)
		}
	}()
	if err := s.checkSession(sess, files); err != nil {
		_ = uc.Close()
		return fmt.Errorf("vfio-user %s: resume: %w", name, err)
	}
	t, err := newUnixTransport(uc)
	if err != nil {
		_ = uc.Close()
		return err
	}
	return s.serveResumed(t, name, peerPID(uc), sess, files)
}

// checkSession validates a session against the server's limits, as the
// messages that built it were validated.
func (s *Server) checkSession(sess *Session, files map[string]int) error {
	if sess == nil {
		return errors.New("no session")
	}
	if sess.Version != SessionVersion {
		return fmt.Errorf("session version %d, this daemon reads %d: %w", sess.Version, SessionVersion, ErrUnsupported)
	}
	p := sess.Peer
	if p.MaxMsgFDs == 0 || p.MaxMsgFDs > 1024 || p.MaxDataXfer == 0 || p.MaxDMAMaps == 0 || p.PageSizes&pageSize4K == 0 {
		return fmt.Errorf("session peer capabilities %+v: %w", p, ErrInvalid)
	}
	if len(sess.DMA) > s.cfg.MaxDMAMaps {
		return fmt.Errorf("session has %d DMA maps (max %d): %w", len(sess.DMA), s.cfg.MaxDMAMaps, ErrInvalid)
	}
	for _, d := range sess.DMA {
		if d.Size == 0 || d.Addr&pageMask != 0 || d.Size&pageMask != 0 || d.Offset&pageMask != 0 ||
			d.Addr+d.Size < d.Addr || d.Offset > 1<<62 || d.Prot == 0 || d.Prot&^(guestmem.ProtRead|guestmem.ProtWrite) != 0 {
			return fmt.Errorf("session DMA map %#x+%#x offset %#x prot %d: %w", d.Addr, d.Size, d.Offset, d.Prot, ErrInvalid)
		}
		if d.File != "" {
			if _, ok := files[d.File]; !ok {
				return fmt.Errorf("session DMA map %#x+%#x: its file %q was not kept: %w", d.Addr, d.Size, d.File, ErrInvalid)
			}
		}
	}
	for _, q := range sess.IRQs {
		if _, ok := files[q.File]; !ok {
			return fmt.Errorf("session interrupt %v vector %d: its eventfd %q was not kept: %w", q.Index, q.Vector, q.File, ErrInvalid)
		}
	}
	return nil
}

// serveResumed builds the resumed connection and serves it to its end.
func (s *Server) serveResumed(t transport, name string, pid int32, sess *Session, files map[string]int) error {
	c, err := s.newConn(t, name, pid, func(c *conn) error { return c.resumeMemory(sess, files) })
	if err != nil {
		_ = t.close()
		return err
	}
	if err := c.resumeIRQs(sess, files); err != nil {
		c.teardown()
		return fmt.Errorf("vfio-user %s: resume: %w", c.name, err)
	}
	c.log.Info("vfio-user connection resumed", "dma_maps", len(sess.DMA), "irqs", len(sess.IRQs))
	return s.run(c)
}

// resumeMemory negotiates from the session and maps its DMA ranges again
// from the kept files, before the device exists.
func (c *conn) resumeMemory(sess *Session, files map[string]int) error {
	c.peer = peerCaps{maxMsgFDs: sess.Peer.MaxMsgFDs, maxDataXfer: sess.Peer.MaxDataXfer, maxDMAMaps: sess.Peer.MaxDMAMaps,
		pgsizes: sess.Peer.PageSizes, writeMultiple: sess.Peer.WriteMultiple}
	c.negotiated = true
	dmas := append([]SessionDMA(nil), sess.DMA...)
	sort.Slice(dmas, func(i, j int) bool { return dmas[i].Addr < dmas[j].Addr })
	for _, d := range dmas {
		fd := -1
		if d.File != "" {
			var err error
			if fd, err = unix.FcntlInt(uintptr(files[d.File]), unix.F_DUPFD_CLOEXEC, 0); err != nil {
				return fmt.Errorf("DMA map %#x+%#x: dup %s: %w", d.Addr, d.Size, d.File, err)
			}
			if got, err := FileName(fd); err != nil || got != d.File {
				_ = unix.Close(fd)
				return fmt.Errorf("DMA map %#x+%#x: descriptor %q is another file (%s): %w", d.Addr, d.Size, d.File, got, ErrInvalid)
			}
		}
		if err := c.mapRegion(d.Addr, d.Size, d.Offset, d.Prot, fd); err != nil {
			return fmt.Errorf("resume: %w", err)
		}
	}
	return nil
}

// resumeIRQs assigns the session's eventfds again, once the device has
// described its interrupts, and tells the device.
func (c *conn) resumeIRQs(sess *Session, files map[string]int) error {
	for _, q := range sess.IRQs {
		if q.Index >= IRQIndex(c.irqs.n.Load()) || q.Vector >= c.irqs.Count(q.Index) {
			return fmt.Errorf("interrupt %v vector %d: the device has no such vector: %w", q.Index, q.Vector, ErrInvalid)
		}
		fd, err := unix.FcntlInt(uintptr(files[q.File]), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("interrupt %v vector %d: dup: %w", q.Index, q.Vector, err)
		}
		if err := checkEventFD(fd); err != nil {
			_ = unix.Close(fd)
			return fmt.Errorf("interrupt %v vector %d: %w", q.Index, q.Vector, err)
		}
		c.irqs.assign(q.Index, q.Vector, []int{fd})
		if q.Masked {
			_ = c.irqs.setMasked(q.Index, q.Vector, 1, nil, true)
		}
	}
	if n, ok := c.dev.(DMANotifier); ok {
		for _, r := range c.mem.Regions() {
			r.Data, r.Release = nil, nil
			n.DMAMapped(r)
		}
	}
	for _, q := range sess.IRQs {
		c.notifyIRQ(q.Index, q.Vector, 1, IRQAssigned)
	}
	if c.keep != nil {
		for _, r := range c.mem.Regions() {
			if r.FD >= 0 {
				c.keepMapped(r.Base, r.FD)
			}
		}
		for _, q := range sess.IRQs {
			c.keepIRQs(q.Index, q.Vector, 1, true)
		}
		c.keepSaved()
	}
	return nil
}

// FileNames lists the descriptor names a session refers to.
func (s *Session) FileNames() []string {
	var names []string
	seen := map[string]bool{}
	for _, d := range s.DMA {
		if d.File != "" && !seen[d.File] {
			seen[d.File] = true
			names = append(names, d.File)
		}
	}
	for _, q := range s.IRQs {
		if !seen[q.File] {
			seen[q.File] = true
			names = append(names, q.File)
		}
	}
	sort.Strings(names)
	return names
}

// Check reports whether this daemon reads the session's format.
func (s *Session) Check() error {
	if s.Version != SessionVersion {
		return fmt.Errorf("session version %d, this daemon reads %d: %w", s.Version, SessionVersion, ErrUnsupported)
	}
	return nil
}
