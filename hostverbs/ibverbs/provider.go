//go:build linux && cgo

package ibverbs

/*
#include <stdlib.h>
#include "pv.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Provider relays to one port of one host RDMA device. Each VM's Device
// shares the host device context and owns its own PDs, CQs, QPs and MRs.
type Provider struct {
	lib  *lib
	ctx  *C.struct_ibv_context
	port uint8
	name string
	attr C.struct_ibv_device_attr
	log  *slog.Logger
	busy time.Duration // Config.BusyPoll

	mu      sync.Mutex
	devices map[*Device]struct{}
	closed  bool

	// Asynchronous events: the context's event descriptor (a duplicate in
	// Go's poller) and the objects they may name, by host pointer.
	async     *os.File
	asyncStop atomic.Bool // set before async is closed
	asyncDone chan struct{}
	objMu     sync.Mutex
	objs      map[uintptr]asyncTarget

	// MR aliases' mappings: all devices' (guarded by mu) against runLimit.
	runs     int
	runLimit int
}

// Mapping limits of MR aliases: a VM may hold maxRunsPerDevice page runs,
// all VMs together half of the process's vm.max_map_count (the rest is for
// guest RAM, the Go runtime and libraries).
const (
	maxRunsPerDevice = 16384
	defaultMapCount  = 65530
)

// chargeRuns takes n mappings for device d (d.mu held) or fails with
// ErrNoResources.
func (p *Provider) chargeRuns(d *Device, n int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d.runs+n > maxRunsPerDevice {
		return fmt.Errorf("MR of %d page runs: the VM holds %d of %d: %w", n, d.runs, maxRunsPerDevice, hostverbs.ErrNoResources)
	}
	if p.runs+n > p.runLimit {
		return fmt.Errorf("MR of %d page runs: all VMs hold %d of %d: %w", n, p.runs, p.runLimit, hostverbs.ErrNoResources)
	}
	d.runs += n
	p.runs += n
	return nil
}

// releaseRuns returns n mappings of device d (d.mu held).
func (p *Provider) releaseRuns(d *Device, n int) {
	p.mu.Lock()
	d.runs -= n
	p.runs -= n
	p.mu.Unlock()
}

// mapCountLimit is half of vm.max_map_count.
func mapCountLimit() int {
	n := defaultMapCount
	if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && v > 0 {
			n = v
		}
	}
	return n / 2
}

// asyncTarget is what an asynchronous event about a host object is
// reported as: the owning device and the object's context.
type asyncTarget struct {
	d       *Device
	context uint64
	qpn     uint32
}

var _ hostverbs.Provider = (*Provider)(nil)

// New loads libibverbs and opens cfg.Device. Every failure names what to
// install or create.
func New(cfg Config) (*Provider, error) {
	if cfg.Device == "" {
		return nil, fmt.Errorf("ibverbs: no device named: %w", ErrNoDevice)
	}
	if cfg.Port == 0 {
		cfg.Port = 1
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	l, err := loadLib()
	if err != nil {
		return nil, fmt.Errorf("ibverbs: %w", err)
	}
	name := C.CString(cfg.Device)
	defer C.free(unsafe.Pointer(name))
	ctx, err := C.pv_open(l.l, name)
	if ctx == nil {
		names, _ := l.deviceNames()
		l.close()
		if problem := accessProblem("/sys", "/dev", cfg.Device); problem != "" {
			return nil, fmt.Errorf("ibverbs: open %s: %s: %w", cfg.Device, problem, ErrNoAccess)
		}
		have := "none"
		if len(names) > 0 {
			have = strings.Join(names, ", ")
		}
		return nil, fmt.Errorf("ibverbs: open %s: %v: %w (devices: %s; create Soft-RoCE with `rdma link add rxe0 type rxe netdev IFACE` or --create-rxe)",
			cfg.Device, err, ErrNoDevice, have)
	}
	if cfg.BusyPoll < 0 || cfg.BusyPoll > 10*time.Millisecond {
		l.close()
		return nil, fmt.Errorf("ibverbs: busy poll %v: want 0 to 10ms: %w", cfg.BusyPoll, hostverbs.ErrInvalid)
	}
	p := &Provider{lib: l, ctx: ctx, port: cfg.Port, name: cfg.Device, log: log, busy: cfg.BusyPoll, devices: map[*Device]struct{}{},
		objs: map[uintptr]asyncTarget{}, runLimit: mapCountLimit()}
	if rc, err := C.pv_query_device(l.l, ctx, &p.attr); rc != 0 {
		p.closeContext()
		return nil, fmt.Errorf("ibverbs: %s: %w", cfg.Device, errnoErr("ibv_query_device", rc, err))
	}
	if cfg.Port > uint8(p.attr.phys_port_cnt) {
		p.closeContext()
		return nil, fmt.Errorf("ibverbs: %s has %d ports, not %d: %w", cfg.Device, p.attr.phys_port_cnt, cfg.Port, ErrPort)
	}
	pa, err := p.queryPort()
	if err != nil {
		p.closeContext()
		return nil, fmt.Errorf("ibverbs: %s: %w", cfg.Device, err)
	}
	if pa.link_layer != C.IBV_LINK_LAYER_ETHERNET {
		p.closeContext()
		return nil, fmt.Errorf("ibverbs: %s port %d is not Ethernet (RoCE): %w", cfg.Device, cfg.Port, ErrPort)
	}
	if err := p.startAsync(); err != nil {
		p.closeContext()
		return nil, fmt.Errorf("ibverbs: %s: asynchronous events: %w", cfg.Device, err)
	}
	log.Info("ibverbs device opened", "device", cfg.Device, "port", cfg.Port, "state", portStateName(pa.state),
		"max_qp", p.attr.max_qp, "max_mr", p.attr.max_mr)
	return p, nil
}

func (p *Provider) queryPort() (C.struct_ibv_port_attr, error) {
	var pa C.struct_ibv_port_attr
	if rc, err := C.pv_query_port(p.lib.l, p.ctx, C.uint8_t(p.port), &pa); rc != 0 {
		return pa, fmt.Errorf("port %d: %w: %w", p.port, errnoErr("ibv_query_port", rc, err), ErrPort)
	}
	return pa, nil
}

func portStateName(s C.enum_ibv_port_state) string {
	switch s {
	case C.IBV_PORT_DOWN:
		return "DOWN"
	case C.IBV_PORT_INIT:
		return "INIT"
	case C.IBV_PORT_ARMED:
		return "ARMED"
	case C.IBV_PORT_ACTIVE:
		return "ACTIVE"
	case C.IBV_PORT_ACTIVE_DEFER:
		return "ACTIVE_DEFER"
	}
	return "NOP"
}

// Name is the host device's name.
func (p *Provider) Name() string { return p.name }

// Port is the host port used.
func (p *Provider) Port() uint8 { return p.port }

// GIDTable returns the host port's valid GID entries.
func (p *Provider) GIDTable() ([]HostGID, error) {
	pa, err := p.queryPort()
	if err != nil {
		return nil, err
	}
	var out []HostGID
	for i := 0; i < int(pa.gid_tbl_len); i++ {
		var e C.struct_ibv_gid_entry
		rc, _ := C.pv_query_gid(p.lib.l, p.ctx, C.uint32_t(p.port), C.uint32_t(i), &e)
		if rc != 0 {
			continue // an empty slot answers ENODATA
		}
		var g hostverbs.GID
		copy(g[:], C.GoBytes(unsafe.Pointer(&e.gid), 16))
		if g.IsZero() {
			continue
		}
		out = append(out, HostGID{Index: i, GIDEntry: hostverbs.GIDEntry{GID: g, Type: hostverbs.GIDType(e.gid_type)}})
	}
	return out, nil
}

// hasGIDType reports whether the host port's GID table holds a GID of
// type t.
func (p *Provider) hasGIDType(t hostverbs.GIDType) bool {
	tbl, err := p.GIDTable()
	if err != nil {
		return false
	}
	for _, h := range tbl {
		if h.Type == t {
			return true
		}
	}
	return false
}

// hostGIDIndex finds the host GID index holding e.
func (p *Provider) hostGIDIndex(e hostverbs.GIDEntry) (int, error) {
	tbl, err := p.GIDTable()
	if err != nil {
		return 0, err
	}
	for _, h := range tbl {
		if h.GIDEntry == e {
			return h.Index, nil
		}
	}
	return 0, fmt.Errorf("GID %s (%s) is not in %s's GID table (in IP mode the daemon adds it to the netdev): %w",
		e.GID, e.Type, p.name, hostverbs.ErrNotFound)
}

// Open creates the device of one VM.
func (p *Provider) Open(cfg hostverbs.DeviceConfig) (hostverbs.Device, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, hostverbs.ErrClosed
	}
	d, err := newDevice(p, cfg)
	if err != nil {
		return nil, err
	}
	p.devices[d] = struct{}{}
	return d, nil
}

func (p *Provider) forget(d *Device) {
	p.mu.Lock()
	delete(p.devices, d)
	p.mu.Unlock()
}

// Close closes every device and the host device.
func (p *Provider) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	devs := make([]*Device, 0, len(p.devices))
	for d := range p.devices {
		devs = append(devs, d)
	}
	p.mu.Unlock()
	var errs []error
	for _, d := range devs {
		errs = append(errs, d.Close())
	}
	if p.async != nil {
		p.asyncStop.Store(true)
		p.async.Close()
		<-p.asyncDone
	}
	errs = append(errs, p.closeContext())
	return errors.Join(errs...)
}

// startAsync waits for the host context's asynchronous events through Go's
// poller and reports each to the device owning the object it names (QP, CQ,
// SRQ), port events to every device.
func (p *Provider) startAsync() error {
	fd := int(C.pv_async_fd(p.ctx))
	if err := unix.SetNonblock(fd, true); err != nil {
		return err
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	p.async = os.NewFile(uintptr(dup), "ibverbs-async")
	raw, err := p.async.SyscallConn()
	if err != nil {
		p.async.Close()
		p.async = nil
		return err
	}
	p.asyncDone = make(chan struct{})
	go p.asyncEvents(raw)
	return nil
}

// asyncEvents resolves each event's object to its owner while the event
// is not yet acknowledged (the object cannot be destroyed, nor its address
// reused by another VM's object, until then), acknowledges it, and only
// then delivers it: the owner's handler may take locks a destroyer holds
// while ibv_destroy_* waits for the acknowledgement.
func (p *Provider) asyncEvents(raw syscall.RawConn) {
	defer close(p.asyncDone)
	ev := (*C.struct_ibv_async_event)(C.calloc(1, C.size_t(unsafe.Sizeof(C.struct_ibv_async_event{}))))
	defer C.free(unsafe.Pointer(ev))
	serve(raw, &p.asyncStop, p.log, "asynchronous events", func() bool {
		var typ, port C.int
		var obj C.uintptr_t
		if C.pv_get_async_event(p.lib.l, p.ctx, ev, &typ, &obj, &port) <= 0 {
			return false
		}
		var t asyncTarget
		found := false
		if obj != 0 {
			p.objMu.Lock()
			t, found = p.objs[uintptr(obj)]
			p.objMu.Unlock()
		}
		C.pv_ack_async_event(p.lib.l, ev)
		p.dispatch(hostverbs.EventType(typ), obj != 0, t, found, uint8(port))
		return true
	})
}

// dispatch delivers an event: about an object (forObject), to its owner
// if it was still tracked; else a port or device event, to every device.
func (p *Provider) dispatch(typ hostverbs.EventType, forObject bool, t asyncTarget, found bool, port uint8) {
	if forObject {
		if found && t.d.cfg.Events != nil {
			t.d.cfg.Events(hostverbs.AsyncEvent{Type: typ, Context: t.context, QPN: t.qpn})
		}
		return
	}
	if port != 0 && port != p.port {
		return
	}
	p.mu.Lock()
	devs := make([]*Device, 0, len(p.devices))
	for d := range p.devices {
		devs = append(devs, d)
	}
	p.mu.Unlock()
	for _, d := range devs {
		if d.cfg.Events != nil {
			d.cfg.Events(hostverbs.AsyncEvent{Type: typ, Port: 1})
		}
	}
}

// track and untrack keep the objects asynchronous events may name.
func (p *Provider) track(ptr unsafe.Pointer, t asyncTarget) {
	p.objMu.Lock()
	p.objs[uintptr(ptr)] = t
	p.objMu.Unlock()
}

func (p *Provider) untrack(ptr unsafe.Pointer) {
	p.objMu.Lock()
	delete(p.objs, uintptr(ptr))
	p.objMu.Unlock()
}

func (p *Provider) closeContext() error {
	rc, err := C.pv_close_device(p.lib.l, p.ctx)
	p.lib.close()
	return errnoErr("ibv_close_device", rc, err)
}

// PortState returns the host port's state name (ACTIVE, DOWN, ...).
func (p *Provider) PortState() (string, error) {
	pa, err := p.queryPort()
	if err != nil {
		return "", err
	}
	return portStateName(pa.state), nil
}

// Built reports whether this binary has the relay (it needs cgo).
const Built = true
