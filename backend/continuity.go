package backend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// Continuity: what lets a VM's device outlive the daemon's process.
//
// QEMU's vfio-user client never reconnects, so the unit of continuity is
// the connected socket: while some process holds a copy, QEMU sees nothing
// but a pause. Run by systemd, the daemon gives systemd's file descriptor
// store (FDStore) a copy of each VM's connection, of the files guest memory
// is mapped from and of the interrupt eventfds, as they arrive, before
// QEMU gets the reply to the message that brought them. Beside them, in
// the state directory (a tmpfs: /run/pvrdma/state under the unit), it
// keeps per VM its registration, the vfio-user session, the PCI function's
// state and the device's journal. A daemon started again (after a crash,
// systemctl restart or an upgrade) registers the VMs again, takes the
// connections back from LISTEN_FDS and resumes each one: guest memory is
// mapped again from the same files, interrupts fire through the same
// eventfds, the device is rebuilt from its journal.
//
// Layout of the state directory: <dir>/<vm>/vm.json (the VMRequest),
// session.json (vfiouser.Session), pci.state (pcidev), device.journal
// (vdev). Descriptors are stored as "<vm>.<name>", name being a vfiouser
// descriptor name (ConnName, a file or an interrupt: none has a '.').

// stateFiles of a VM.
const (
	stateVM      = "vm.json"
	stateSession = "session.json"
	statePCI     = "pci.state"
	stateJournal = "device.journal"
)

// keeping is the daemon's side of continuity: the state directory and,
// under systemd, the descriptor store.
type keeping struct {
	dir   string
	store *FDStore // nil: connections end with the process
	// state: keep the state even without a store (a live upgrade hands
	// the descriptors over itself).
	state bool
	log   *slog.Logger

	mu        sync.Mutex
	inherited map[string]*os.File // handed back by the service manager, not yet taken
	handed    map[string]handedVM // a predecessor's hand-over state (handoverstate.go)
	recorded  map[string][]byte   // the registrations savedVMs read, by VM
}

func newKeeping(dir string, store *FDStore, state bool, inherited map[string]*os.File, log *slog.Logger) (*keeping, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	return &keeping{dir: dir, store: store, state: state || store != nil, log: log, inherited: inherited}, nil
}

// active reports whether VMs' state is kept for a successor.
func (k *keeping) active() bool { return k.state }

func (k *keeping) vmDir(vm string) string { return filepath.Join(k.dir, vm) }

// writeAtomic replaces a VM's state file: a crash leaves the old or the
// new one, never a mix.
func (k *keeping) writeAtomic(vm, name string, data []byte) error {
	dir := k.vmDir(vm)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	tmp := filepath.Join(dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, name))
}

func (k *keeping) read(vm, name string) ([]byte, error) {
	return os.ReadFile(filepath.Join(k.vmDir(vm), name))
}

// saveVM records a registration, so that a restarted daemon registers the
// VM again (its QEMU may be connected, or may connect later). A record
// that says it already (a restarted daemon registering its VMs again) is
// left as it is.
func (k *keeping) saveVM(req VMRequest) {
	b, err := json.Marshal(req)
	k.mu.Lock()
	old, known := k.recorded[req.Name]
	delete(k.recorded, req.Name)
	k.mu.Unlock()
	if !known {
		old, _ = k.read(req.Name, stateVM)
	}
	if err == nil && bytes.Equal(old, b) {
		return
	}
	if err == nil {
		err = k.writeAtomic(req.Name, stateVM, b)
	}
	if err != nil {
		k.log.Warn("cannot record the VM's registration: a restarted daemon will not know it", "vm", req.Name, "err", err)
	}
}

// forgetVM removes everything kept of an unregistered VM.
func (k *keeping) forgetVM(vm string) {
	_ = os.RemoveAll(k.vmDir(vm))
}

// forgetConn removes the state of a VM's connection once its QEMU left.
func (k *keeping) forgetConn(vm string) {
	for _, n := range []string{stateSession, statePCI, stateJournal, stateCounters} {
		_ = os.Remove(filepath.Join(k.vmDir(vm), n))
	}
}

// savedVMs lists the registrations kept, by name.
func (k *keeping) savedVMs() ([]VMRequest, error) {
	ents, err := os.ReadDir(k.dir)
	if err != nil {
		return nil, err
	}
	var reqs []VMRequest
	for _, e := range ents {
		if !e.IsDir() || CheckVMName(e.Name()) != nil {
			continue
		}
		b, err := k.read(e.Name(), stateVM)
		if err != nil {
			continue
		}
		var req VMRequest
		if err := json.Unmarshal(b, &req); err != nil || req.Name != e.Name() {
			k.log.Warn("ignoring a kept registration that does not parse", "vm", e.Name(), "err", err)
			continue
		}
		reqs = append(reqs, req)
		k.mu.Lock()
		if k.recorded == nil {
			k.recorded = map[string][]byte{}
		}
		k.recorded[req.Name] = b
		k.mu.Unlock()
	}
	sort.Slice(reqs, func(i, j int) bool { return reqs[i].Name < reqs[j].Name })
	return reqs, nil
}

// takeInherited removes and returns the inherited descriptors of vm, by
// vfiouser name.
func (k *keeping) takeInherited(vm string) map[string]*os.File {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out map[string]*os.File
	for full, f := range k.inherited {
		i := strings.LastIndexByte(full, '.')
		if i <= 0 || full[:i] != vm {
			continue
		}
		if out == nil {
			out = map[string]*os.File{}
		}
		out[full[i+1:]] = f
		delete(k.inherited, full)
	}
	return out
}

// fabricFDPrefix names the fabric's own descriptors in the store and in a
// hand-over: "+fabric.udp4", "+fabric.udp4.1", ... "+fabric.udp6", ...
// (the UDP wire's port 4791 sockets, IP mode, several per family) or
// "+fabric.packet" (the packet wire's socket on the bridge, L2 mode). No
// VM name starts with '+'.
const fabricFDPrefix = "+fabric."

// takeFabric removes and returns the inherited fabric descriptors. They
// leave the store too, so that a port the next fabric does not take over
// is free to bind again; storeFabric puts back those it took.
func (k *keeping) takeFabric() []*os.File {
	k.mu.Lock()
	var out []*os.File
	var names []string
	for name, f := range k.inherited {
		if strings.HasPrefix(name, fabricFDPrefix) {
			out = append(out, f)
			names = append(names, name)
			delete(k.inherited, name)
		}
	}
	k.mu.Unlock()
	if k.store != nil {
		for _, n := range names {
			if err := k.store.Remove(n); err != nil {
				k.log.Warn("fd store", "name", n, "err", err)
			}
		}
	}
	return out
}

// storeFabric gives the store the fabric's sockets (fabric.sockets), so
// that a daemon restarted after a crash takes them over with what
// arrived meanwhile.
func (k *keeping) storeFabric(socks map[string]int) {
	if k.store == nil {
		return
	}
	for name, fd := range socks {
		if err := k.store.Store(fabricFDPrefix+name, fd); err != nil {
			k.log.Warn("cannot keep the fabric's socket in the fd store: a restart binds it again, and what arrives meanwhile is lost", "socket", name, "err", err)
		}
	}
}

// dropInherited closes the inherited descriptors nobody took (VMs no
// longer registered, leftovers) and removes them from the store.
func (k *keeping) dropInherited() {
	k.mu.Lock()
	left := k.inherited
	k.inherited = nil
	k.mu.Unlock()
	for name, f := range left {
		_ = f.Close()
		if k.store != nil {
			_ = k.store.Remove(name)
		}
		k.log.Info("dropped a kept descriptor no VM claims", "name", name)
	}
}

// connKeeper keeps one VM connection's descriptors in the store and its
// session in the state directory (vfiouser.Keeper).
type connKeeper struct {
	k  *keeping
	vm string
	// leaving is set when the daemon stops and leaves the connection to
	// the store: nothing is forgotten from then on.
	leaving atomic.Bool
	warned  atomic.Bool

	mu  sync.Mutex
	fds map[string]int // the connection's own descriptors, by name (a hand-over passes them)
	// session is the session as last written (a resumed connection's as
	// read): the same session is not written again.
	session []byte
	// stored names the descriptors a resumed connection was handed from
	// the store (or by a predecessor, which stored them): their files are
	// in the store already, so keeping them again sends nothing.
	stored map[string]bool
}

func (c *connKeeper) Keep(name string, fd int) error {
	c.mu.Lock()
	if c.fds == nil {
		c.fds = map[string]int{}
	}
	c.fds[name] = fd
	stored := c.stored[name]
	delete(c.stored, name)
	c.mu.Unlock()
	if c.leaving.Load() || c.k.store == nil || stored {
		return nil
	}
	return c.k.store.Store(c.vm+"."+name, fd)
}

// held returns the connection's descriptors by name.
func (c *connKeeper) held() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.fds))
	for k, v := range c.fds {
		out[k] = v
	}
	return out
}

func (c *connKeeper) Forget(name string) {
	c.mu.Lock()
	delete(c.fds, name)
	c.mu.Unlock()
	if c.leaving.Load() || c.k.store == nil {
		return
	}
	if err := c.k.store.Remove(c.vm + "." + name); err != nil {
		c.k.log.Warn("fd store", "vm", c.vm, "err", err)
	}
}

func (c *connKeeper) Saved(s *vfiouser.Session) {
	if c.leaving.Load() {
		return
	}
	b, err := json.Marshal(s)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil && bytes.Equal(b, c.session) {
		return
	}
	if err == nil {
		err = c.k.writeAtomic(c.vm, stateSession, b)
	}
	if err == nil {
		c.session = b
	} else if !c.warned.Swap(true) {
		c.k.log.Warn("cannot save the VM's vfio-user session: a restart will cut its connection", "vm", c.vm, "err", err)
	}
}

// savePCI records the PCI function's state (config space, MSI-X).
func (c *connKeeper) savePCI(b []byte) {
	if c.leaving.Load() {
		return
	}
	if err := c.k.writeAtomic(c.vm, statePCI, b); err != nil && !c.warned.Swap(true) {
		c.k.log.Warn("cannot save the VM's PCI state: a restart will cut its connection", "vm", c.vm, "err", err)
	}
}

// resumable is what a restarted daemon found of a VM's connection.
type resumable struct {
	conn       *net.UnixConn
	session    vfiouser.Session
	sessionRaw []byte // as read
	files      map[string]int
	pci        []byte
	journal    []byte
	// counters are the VM's counters as the previous process left them.
	counters map[string]uint64
	// stored names the descriptors taken (connKeeper.stored).
	stored map[string]bool
	// rebuilt is called once the device is rebuilt (or cannot be).
	rebuilt func()
	// uarFile is the kept UAR memory of memory doorbells (-1: none),
	// taken out of files by resume.
	uarFile int
}

// loadResumable gathers a VM's kept connection: its descriptors fds (taken
// from the inherited set, at least one) and its state files.
func (k *keeping) loadResumable(vm string, fds map[string]*os.File) (*resumable, error) {
	closeAll := func() {
		for _, f := range fds {
			_ = f.Close()
		}
	}
	cf, ok := fds[vfiouser.ConnName]
	if !ok {
		closeAll()
		return nil, errors.New("its connection was not kept (only its files)")
	}
	var r resumable
	b, err := k.read(vm, stateSession)
	if err == nil {
		err = json.Unmarshal(b, &r.session)
	}
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("session: %w", err)
	}
	r.sessionRaw = b
	if h, ok := k.handedVM(vm); ok && len(h.PCI) > 0 {
		r.pci = h.PCI
	} else if r.pci, err = k.read(vm, statePCI); err != nil && !errors.Is(err, os.ErrNotExist) {
		closeAll()
		return nil, fmt.Errorf("PCI state: %w", err)
	}
	if r.journal, err = k.read(vm, stateJournal); err != nil && !errors.Is(err, os.ErrNotExist) {
		closeAll()
		return nil, fmt.Errorf("device journal: %w", err)
	}
	r.counters = k.takeCounters(vm)
	nc, err := net.FileConn(cf)
	_ = cf.Close()
	delete(fds, vfiouser.ConnName)
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("connection: %w", err)
	}
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		_ = nc.Close()
		closeAll()
		return nil, fmt.Errorf("connection is a %T, not a unix socket", nc)
	}
	r.conn = uc
	r.stored = map[string]bool{vfiouser.ConnName: true}
	for name := range fds {
		r.stored[name] = true
	}
	r.files = map[string]int{}
	for name, f := range fds {
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		_ = f.Close()
		if err != nil {
			continue
		}
		r.files[name] = fd
	}
	return &r, nil
}

// stateAddrs lists, in the state directory, the guests' GID addresses the
// daemon put on the fabric netdev (IP mode): a restarted daemon adopts
// them instead of taking them for the host's own.
const stateAddrs = "addrs.json"

// saveAddrs records the GID addresses the fabric holds for guests.
func (d *Daemon) saveAddrs() {
	am := d.fabric.addrs
	if am == nil || !d.keep.active() {
		return
	}
	var list []string
	for _, a := range am.Owned() {
		list = append(list, a.String())
	}
	sort.Strings(list)
	b, _ := json.Marshal(list)
	tmp := filepath.Join(d.keep.dir, "."+stateAddrs+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err == nil {
		_ = os.Rename(tmp, filepath.Join(d.keep.dir, stateAddrs))
	}
}

// adoptAddrs takes back the GID addresses a previous daemon left.
func (d *Daemon) adoptAddrs() {
	am := d.fabric.addrs
	if am == nil || !d.keep.active() {
		return
	}
	b, err := os.ReadFile(filepath.Join(d.keep.dir, stateAddrs))
	if err != nil {
		return
	}
	var list []string
	if json.Unmarshal(b, &list) != nil {
		return
	}
	var addrs []netip.Addr
	for _, s := range list {
		if a, err := netip.ParseAddr(s); err == nil {
			addrs = append(addrs, a)
		}
	}
	n, err := am.Adopt(addrs)
	if err != nil {
		d.log.Warn("cannot adopt the GID addresses a previous daemon left", "err", err)
		return
	}
	if n > 0 {
		d.log.Info("adopted guests' GID addresses a previous daemon left on the fabric netdev", "count", n)
	}
}

// stateReservations lists, in the state directory, the GIDs reserved to
// each VM (gidOwners): a restarted daemon keeps them reserved, so a VM
// whose QEMU is away cannot lose its addresses to another VM meanwhile.
const stateReservations = "reservations.json"

// saveReservations records the GID reservations (when state is kept).
func (d *Daemon) saveReservations() {
	if !d.keep.active() {
		return
	}
	snap := d.owners.snapshot()
	out := make(map[string][]string, len(snap))
	for vm, as := range snap {
		for _, a := range as {
			out[vm] = append(out[vm], a.String())
		}
	}
	b, _ := json.Marshal(out)
	d.resMu.Lock()
	defer d.resMu.Unlock()
	tmp := filepath.Join(d.keep.dir, "."+stateReservations+".tmp")
	err := os.WriteFile(tmp, b, 0o600)
	if err == nil {
		err = os.Rename(tmp, filepath.Join(d.keep.dir, stateReservations))
	}
	if err != nil {
		d.log.Warn("cannot record the GID reservations: a restarted daemon starts without them", "err", err)
	}
}

// adoptReservations takes back the reservations a previous daemon left.
// Those of VMs that are not registered again are dropped after the
// restore (dropOrphanReservations).
func (d *Daemon) adoptReservations() {
	if !d.keep.active() {
		return
	}
	b, err := os.ReadFile(filepath.Join(d.keep.dir, stateReservations))
	if err != nil {
		return
	}
	var in map[string][]string
	if err := json.Unmarshal(b, &in); err != nil {
		d.log.Warn("ignoring GID reservations that do not parse", "err", err)
		return
	}
	res := make(map[string][]netip.Addr, len(in))
	for vm, list := range in {
		for _, s := range list {
			if a, err := netip.ParseAddr(s); err == nil {
				res[vm] = append(res[vm], a)
			}
		}
	}
	if n := d.owners.adopt(res); n > 0 {
		d.log.Info("took back the GID reservations a previous daemon left", "gids", n)
	}
}

// dropOrphanReservations frees the reservations of VMs no longer
// registered (their registration was not kept).
func (d *Daemon) dropOrphanReservations() {
	changed := false
	for vm := range d.owners.snapshot() {
		d.mu.Lock()
		_, ok := d.vms[vm]
		d.mu.Unlock()
		if !ok && d.owners.release(vm) {
			changed = true
		}
	}
	if changed {
		d.saveReservations()
	}
}

// stateCounters holds a VM's counters for its successor: written at a
// hand-over, and every Config.CounterCheckpoint while the VM is
// connected, so a crash loses at most that much of them.
const stateCounters = "counters.json"

// checkpointCounters saves the connected VMs' counters every
// Config.CounterCheckpoint until ctx ends (nothing if no state is kept).
func (d *Daemon) checkpointCounters(ctx context.Context) {
	if !d.keep.active() {
		return
	}
	every := d.cfg.CounterCheckpoint
	if every <= 0 {
		every = 2 * time.Second
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.mu.Lock()
		vms := make([]*vmSession, 0, len(d.vms))
		for _, s := range d.vms {
			vms = append(vms, s)
		}
		d.mu.Unlock()
		for _, s := range vms {
			s.mu.Lock()
			c := s.conn
			s.mu.Unlock()
			if c == nil || c.keeper == nil || c.keeper.leaving.Load() {
				continue
			}
			if st := s.status(); st.Connected {
				d.keep.saveCounters(s.name, st.Counters)
			}
		}
	}
}

// saveCounters records a VM's counters for the successor of a hand-over.
func (k *keeping) saveCounters(vm string, c map[string]uint64) {
	if b, err := json.Marshal(c); err == nil {
		_ = k.writeAtomic(vm, stateCounters, b)
	}
}

// takeCounters reads and removes the counters a predecessor left (in its
// hand-over state, or in the VM's file).
func (k *keeping) takeCounters(vm string) map[string]uint64 {
	if h, ok := k.handedVM(vm); ok {
		return h.Counters
	}
	path := filepath.Join(k.vmDir(vm), stateCounters)
	b, err := os.ReadFile(path)
	_ = os.Remove(path)
	if err != nil {
		return nil
	}
	var c map[string]uint64
	if json.Unmarshal(b, &c) != nil {
		return nil
	}
	return c
}

// CheckState reads the state a daemon keeps in dir (<socket-dir>/state)
// as a successor would and says whether it can take it: each VM's
// registration, session, PCI state and device journal, and the journal
// features need (e.g. "transport") must be among those it understands.
// It returns a line per VM.
func CheckState(dir string, need []string) ([]string, error) {
	have := map[string]bool{}
	for _, f := range vdev.JournalFeatures() {
		have[f] = true
	}
	for _, f := range need {
		if f != "" && !have[f] {
			return nil, fmt.Errorf("this binary cannot restore %q journal records", f)
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	var lines []string
	for _, e := range ents {
		if !e.IsDir() || CheckVMName(e.Name()) != nil {
			continue
		}
		vm := filepath.Join(dir, e.Name())
		var req VMRequest
		b, err := os.ReadFile(filepath.Join(vm, stateVM))
		if err == nil {
			err = json.Unmarshal(b, &req)
		}
		if err != nil {
			return lines, fmt.Errorf("VM %s: registration: %w", e.Name(), err)
		}
		line := e.Name() + ": registered"
		if b, err := os.ReadFile(filepath.Join(vm, stateSession)); err == nil {
			var s vfiouser.Session
			if err := json.Unmarshal(b, &s); err != nil {
				return lines, fmt.Errorf("VM %s: session: %w", e.Name(), err)
			}
			if err := s.Check(); err != nil {
				return lines, fmt.Errorf("VM %s: %w", e.Name(), err)
			}
			line += fmt.Sprintf(", session with %d DMA maps and %d interrupts", len(s.DMA), len(s.IRQs))
		}
		if b, err := os.ReadFile(filepath.Join(vm, statePCI)); err == nil {
			if err := pcidev.CheckState(b); err != nil {
				return lines, fmt.Errorf("VM %s: %w", e.Name(), err)
			}
			line += ", PCI state"
		}
		if b, err := os.ReadFile(filepath.Join(vm, stateJournal)); err == nil {
			rep, err := vdev.CheckJournal(b)
			if err != nil {
				return lines, fmt.Errorf("VM %s: %w", e.Name(), err)
			}
			line += fmt.Sprintf(", journal of %d records", rep.Records)
		}
		lines = append(lines, line)
	}
	return lines, nil
}
