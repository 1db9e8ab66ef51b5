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
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// pollBatch is how many completions one ibv_poll_cq call takes; a wake-up
// polls each signalled CQ until it is empty, so a busy CQ is served in
// bounded batches.
const pollBatch = 32

// gidTableLen is the GID table the device offers its VM (the PVRDMA
// driver's 16 entries).
const gidTableLen = 16

// Device is one VM's view of the host device: its own PDs, CQs, QPs, SRQs
// and MRs on the shared host context, and its own GID table, whose entries
// are usable once the host's table holds them.
type Device struct {
	p   *Provider
	cfg hostverbs.DeviceConfig
	log *slog.Logger

	channel *C.struct_ibv_comp_channel
	events  *os.File    // a duplicate of the channel's descriptor, in Go's poller
	stop    atomic.Bool // set before events is closed: the loop's wait ends by design
	done    chan struct{}

	mu      sync.Mutex
	closed  bool
	gids    [gidTableLen]hostverbs.GIDEntry
	pds     map[*PD]struct{}
	cqs     map[uintptr]*CQ // by the handle given to the host CQ as its context
	nextCQ  uintptr
	counts  struct{ qp, cq, mr, pd, srq int }
	mrLen   uint64
	dmaKeys uint32
	runs    int // MR alias mappings held (Provider.mu)
}

var _ hostverbs.Device = (*Device)(nil)

func newDevice(p *Provider, cfg hostverbs.DeviceConfig) (*Device, error) {
	if cfg.Memory == nil {
		return nil, fmt.Errorf("ibverbs: open %s: no guest memory: %w", cfg.Name, hostverbs.ErrInvalid)
	}
	switch cfg.RoCEMode {
	case 0:
		cfg.RoCEMode = hostverbs.GIDTypeRoCEv2
	case hostverbs.GIDTypeRoCEv2:
	case hostverbs.GIDTypeRoCEv1:
		// Kernel rxe offers v2 GIDs only; an HCA lists v1 entries too.
		if !p.hasGIDType(hostverbs.GIDTypeRoCEv1) {
			return nil, fmt.Errorf("ibverbs: open %s: %s has no RoCE v1 GIDs (rxe carries RoCE v2 only): %w", cfg.Name, p.name, hostverbs.ErrNotSupported)
		}
	default:
		return nil, fmt.Errorf("ibverbs: open %s: RoCE mode %v: %w", cfg.Name, cfg.RoCEMode, hostverbs.ErrInvalid)
	}
	log := cfg.Logger
	if log == nil {
		log = p.log
	}
	d := &Device{p: p, cfg: cfg, log: log.With("ibdev", p.name), done: make(chan struct{}),
		pds: map[*PD]struct{}{}, cqs: map[uintptr]*CQ{}}
	ch, err := C.pv_create_channel(p.lib.l, p.ctx)
	if ch == nil {
		return nil, fmt.Errorf("ibverbs: %s: ibv_create_comp_channel: %w", cfg.Name, err)
	}
	d.channel = ch
	fd := int(C.pv_channel_fd(ch))
	if err := unix.SetNonblock(fd, true); err != nil {
		C.pv_destroy_channel(p.lib.l, ch)
		return nil, fmt.Errorf("ibverbs: %s: completion channel: %w", cfg.Name, err)
	}
	// The channel is waited on through Go's poller (a duplicate descriptor
	// of the same open file): a goroutine parked there costs no thread, and
	// the goroutine it wakes runs at once instead of after the runtime
	// retakes a processor from a thread blocked in poll(2).
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		C.pv_destroy_channel(p.lib.l, ch)
		return nil, fmt.Errorf("ibverbs: %s: completion channel: %w", cfg.Name, err)
	}
	d.events = os.NewFile(uintptr(dup), "ibverbs-completions")
	raw, err := d.events.SyscallConn()
	if err != nil {
		d.events.Close()
		C.pv_destroy_channel(p.lib.l, ch)
		return nil, fmt.Errorf("ibverbs: %s: completion channel: %w", cfg.Name, err)
	}
	go d.completions(raw)
	return d, nil
}

func (d *Device) limit(n, max int, what string) error {
	if max > 0 && n >= max {
		return fmt.Errorf("%s: limit %d reached: %w", what, max, hostverbs.ErrNoResources)
	}
	return nil
}

// Attr returns the host device's capabilities, capped by the VM's limits.
func (d *Device) Attr() hostverbs.DeviceAttr {
	a := &d.p.attr
	lim := d.cfg.Limits
	capTo := func(host C.int, l int) int {
		if l > 0 && l < int(host) {
			return l
		}
		return int(host)
	}
	return hostverbs.DeviceAttr{
		FWVersion:    0,
		NodeGUID:     d.cfg.NodeGUID,
		SysImageGUID: d.cfg.NodeGUID,
		MaxMRSize:    uint64(a.max_mr_size),
		PageSizeCap:  uint64(a.page_size_cap),
		VendorID:     uint32(a.vendor_id),
		VendorPartID: uint32(a.vendor_part_id),
		HWVersion:    uint32(a.hw_ver),
		MaxQP:        capTo(a.max_qp, lim.MaxQP),
		MaxQPWR:      int(a.max_qp_wr),
		// The host device's fast registration is out of reach: user-space
		// verbs cannot register memory under a key the guest chose, nor
		// execute REG_MR or LOCAL_INV, so the relay offers none
		// (docs/ARCHITECTURE.md, "Fast registration").
		DeviceCapFlags:  uint64(a.device_cap_flags) &^ hostverbs.DeviceCapMemMgtExtensions,
		MaxSGE:          int(a.max_sge),
		MaxSGERd:        int(a.max_sge_rd),
		MaxCQ:           capTo(a.max_cq, lim.MaxCQ),
		MaxCQE:          int(a.max_cqe),
		MaxMR:           capTo(a.max_mr, lim.MaxMR),
		MaxPD:           capTo(a.max_pd, lim.MaxPD),
		MaxQPRdAtom:     int(a.max_qp_rd_atom),
		MaxQPInitRdAtom: int(a.max_qp_init_rd_atom),
		MaxAH:           int(a.max_ah),
		MaxSRQ:          capTo(a.max_srq, lim.MaxSRQ),
		MaxSRQWR:        int(a.max_srq_wr),
		MaxSRQSGE:       int(a.max_srq_sge),
		AtomicCap:       hostverbs.AtomicCap(a.atomic_cap),
		LocalCAAckDelay: uint8(a.local_ca_ack_delay),
		MaxPKeys:        uint16(a.max_pkeys),
		GIDTableLen:     gidTableLen,
		PhysPortCnt:     1,
		GIDType:         d.cfg.RoCEMode,
	}
}

// QueryPort returns the host port's attributes; the VM sees port 1.
func (d *Device) QueryPort(port uint8) (hostverbs.PortAttr, error) {
	if port != 1 {
		return hostverbs.PortAttr{}, fmt.Errorf("port %d: %w", port, hostverbs.ErrInvalid)
	}
	pa, err := d.p.queryPort()
	if err != nil {
		return hostverbs.PortAttr{}, err
	}
	return hostverbs.PortAttr{
		State:         hostverbs.PortState(pa.state),
		MaxMTU:        hostverbs.MTU(pa.max_mtu),
		ActiveMTU:     hostverbs.MTU(pa.active_mtu),
		GIDTableLen:   gidTableLen,
		PortCapFlags:  uint32(pa.port_cap_flags),
		MaxMsgSize:    uint32(pa.max_msg_sz),
		BadPKeyCntr:   uint32(pa.bad_pkey_cntr),
		QKeyViolCntr:  uint32(pa.qkey_viol_cntr),
		PKeyTableLen:  uint16(pa.pkey_tbl_len),
		LID:           uint16(pa.lid),
		SMLID:         uint16(pa.sm_lid),
		LMC:           uint8(pa.lmc),
		MaxVLNum:      uint8(pa.max_vl_num),
		SMSL:          uint8(pa.sm_sl),
		SubnetTimeout: uint8(pa.subnet_timeout),
		InitTypeReply: uint8(pa.init_type_reply),
		ActiveWidth:   uint8(pa.active_width),
		ActiveSpeed:   uint8(pa.active_speed),
		PhysState:     uint8(pa.phys_state),
	}, nil
}

// SetGID records a GID the VM bound. It is used (in AVs) only while the
// host's GID table holds the same GID and type.
func (d *Device) SetGID(index int, e hostverbs.GIDEntry) error {
	if index < 0 || index >= gidTableLen || e.GID.IsZero() {
		return fmt.Errorf("GID index %d: %w", index, hostverbs.ErrInvalid)
	}
	if e.Type != d.cfg.RoCEMode {
		return fmt.Errorf("GID index %d: %v GID on a %v device: %w", index, e.Type, d.cfg.RoCEMode, hostverbs.ErrNotSupported)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gids[index] = e
	return nil
}

// ClearGID removes a GID table entry.
func (d *Device) ClearGID(index int) error {
	if index < 0 || index >= gidTableLen {
		return fmt.Errorf("GID index %d: %w", index, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gids[index] = hostverbs.GIDEntry{}
	return nil
}

// GID returns a GID table entry.
func (d *Device) GID(index int) (hostverbs.GIDEntry, error) {
	if index < 0 || index >= gidTableLen {
		return hostverbs.GIDEntry{}, fmt.Errorf("GID index %d: %w", index, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gids[index].GID.IsZero() {
		return hostverbs.GIDEntry{}, fmt.Errorf("GID index %d: %w", index, hostverbs.ErrNotFound)
	}
	return d.gids[index], nil
}

// hostSGID maps the VM's source GID index to the host's.
func (d *Device) hostSGID(index uint8) (int, error) {
	e, err := d.GID(int(index))
	if err != nil {
		return 0, fmt.Errorf("source GID: %w", err)
	}
	return d.p.hostGIDIndex(e)
}

// AllocPD creates a protection domain.
func (d *Device) AllocPD() (hostverbs.PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, hostverbs.ErrClosed
	}
	if err := d.limit(d.counts.pd, d.cfg.Limits.MaxPD, "alloc pd"); err != nil {
		return nil, err
	}
	pd, err := C.pv_alloc_pd(d.p.lib.l, d.p.ctx)
	if pd == nil {
		return nil, fmt.Errorf("alloc pd: %w", hostErr(err))
	}
	p := &PD{d: d, pd: pd, ahs: map[ahKey]*C.struct_ibv_ah{}, mrs: map[*MR]struct{}{}, qps: map[*QP]struct{}{}, srqs: map[*SRQ]struct{}{}}
	d.pds[p] = struct{}{}
	d.counts.pd++
	return p, nil
}

// hostErr maps an errno from a host verbs call to our sentinel errors
// where one fits.
func hostErr(err error) error {
	var e unix.Errno
	if !errors.As(err, &e) {
		if err == nil {
			return errors.New("failed")
		}
		return err
	}
	switch e {
	case unix.EINVAL:
		return fmt.Errorf("%w: %w", e, hostverbs.ErrInvalid)
	case unix.ENOMEM, unix.ENOSPC:
		return fmt.Errorf("%w: %w", e, hostverbs.ErrNoResources)
	case unix.EBUSY:
		return fmt.Errorf("%w: %w", e, hostverbs.ErrBusy)
	case unix.EOPNOTSUPP:
		return fmt.Errorf("%w: %w", e, hostverbs.ErrNotSupported)
	}
	return e
}

// Close destroys every object of the device, in dependency order, and the
// completion channel.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	pds := make([]*PD, 0, len(d.pds))
	for p := range d.pds {
		pds = append(pds, p)
	}
	d.mu.Unlock()
	var errs []error
	for _, p := range pds {
		errs = append(errs, p.destroyAll())
	}
	d.mu.Lock()
	cqs := make([]*CQ, 0, len(d.cqs))
	for _, c := range d.cqs {
		cqs = append(cqs, c)
	}
	d.mu.Unlock()
	for _, c := range cqs {
		errs = append(errs, c.destroy(true))
	}
	d.stop.Store(true)
	d.events.Close() // ends the completion loop's wait
	<-d.done
	if rc, err := C.pv_destroy_channel(d.p.lib.l, d.channel); rc != 0 {
		errs = append(errs, errnoErr("ibv_destroy_comp_channel", rc, err))
	}
	d.p.forget(d)
	return errors.Join(errs...)
}

// completions takes the completion channel's events as they come (edge
// triggered: each wake-up drains the channel) and delivers the completions
// of each signalled CQ to its handler, until the channel's duplicate is
// closed.
func (d *Device) completions(raw syscall.RawConn) {
	defer close(d.done)
	var hot []*CQ // CQs an event named since the goroutine last waited
	for {
		err := raw.Read(func(uintptr) bool {
			got := false
			for {
				var h C.uintptr_t
				if C.pv_get_cq_event(d.p.lib.l, d.channel, &h) <= 0 {
					return got
				}
				got = true
				d.mu.Lock()
				cq := d.cqs[uintptr(h)]
				d.mu.Unlock()
				if cq == nil {
					continue
				}
				if d.p.busy == 0 {
					cq.drain()
				} else if cq.poll() >= 0 && !slices.Contains(hot, cq) {
					hot = append(hot, cq)
				}
			}
		})
		if err != nil {
			if !d.stop.Load() && !errors.Is(err, os.ErrClosed) {
				d.log.Error("completion channel", "err", err)
			}
			return
		}
		d.busyPoll(hot)
		hot = hot[:0]
	}
}

// busyPoll polls the CQs an event just named, unarmed, until none has
// had a completion for the provider's BusyPoll, then arms each (taking
// what came before the arming): see Config.BusyPoll.
func (d *Device) busyPoll(hot []*CQ) {
	if len(hot) == 0 {
		return
	}
	deadline := time.Now().Add(d.p.busy)
	for time.Now().Before(deadline) {
		for _, cq := range hot {
			if cq.poll() > 0 || cq.touched.Swap(false) {
				deadline = time.Now().Add(d.p.busy)
			}
		}
		runtime.Gosched()
	}
	for _, cq := range hot {
		cq.drain()
	}
}

// serve calls take, whenever the descriptor behind raw is readable, until
// take finds nothing more (the poller is edge triggered), and returns when
// raw's file is closed (quietly if stop was set first: a Close that ends a
// wait in progress fails it with "use of closed file", not os.ErrClosed).
func serve(raw syscall.RawConn, stop *atomic.Bool, log *slog.Logger, what string, take func() bool) {
	for {
		err := raw.Read(func(uintptr) bool {
			got := false
			for take() {
				got = true
			}
			return got
		})
		if err != nil {
			if !stop.Load() && !errors.Is(err, os.ErrClosed) {
				log.Error(what, "err", err)
			}
			return
		}
	}
}

// guestMemory is the VM's memory.
func (d *Device) guestMemory() *guestmem.Memory { return d.cfg.Memory }
