package soft

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
)

// Device capabilities of the soft provider. They are enforced: creating
// past a maximum fails with ErrNoResources.
const (
	maxQP           = 4096
	maxQPWR         = 16384
	maxSGE          = 32
	maxCQ           = 8192
	maxCQE          = 1 << 20
	maxMR           = 65536
	maxPD           = 4096
	maxRdAtomic     = 128
	maxSRQ          = 1024
	maxSRQWR        = 16384
	gidTableLen     = 16
	maxMRSize       = 1 << 46
	maxMsgSize      = 1 << 31
	firstUserQPN    = 16
	qpnSpace        = 1 << 24
	localCAAckDelay = 15
	gsiQPN          = 1
)

// device is one VM's RDMA device: its GID table, objects and key and QPN
// spaces.
type device struct {
	f    *Fabric
	cfg  hostverbs.DeviceConfig
	mem  *guestmem.Memory
	log  *slog.Logger
	lim  *ratelog.Limiter // what a guest or peer provokes
	attr hostverbs.DeviceAttr
	ctrs counters
	v1   bool // a RoCE v1 device: its GIDs, packets and peers are v1

	closedFlag atomic.Bool

	mu     sync.Mutex // guards everything below and object creation
	closed bool
	gids   [gidTableLen]hostverbs.GIDEntry
	keys   keyTable
	qps    qpMap
	all    map[*qp]struct{}
	cqs    map[*cq]struct{}
	srqs   map[*srq]struct{}
	pds    map[*pd]struct{}
	nextQP uint32
	nMR    int
	// mrBytes is the sum of registered MR lengths (Limits.MaxMRBytes).
	mrBytes uint64

	qkeyViolations atomic.Uint32
	pkeyViolations atomic.Uint32

	// accessCond, with accessMu, wakes invalidations waiting for the
	// copies that hold a registration (mraccess.go).
	accessMu   sync.Mutex
	accessCond *sync.Cond
}

func newDevice(f *Fabric, cfg hostverbs.DeviceConfig) *device {
	lg := cfg.Logger
	if lg == nil {
		lg = slog.Default()
	}
	d := &device{
		f: f, cfg: cfg, mem: cfg.Memory, log: lg.With("device", cfg.Name),
		v1:     cfg.RoCEMode == hostverbs.GIDTypeRoCEv1,
		lim:    ratelog.New(lg.With("device", cfg.Name), 0),
		all:    make(map[*qp]struct{}),
		cqs:    make(map[*cq]struct{}),
		srqs:   make(map[*srq]struct{}),
		pds:    make(map[*pd]struct{}),
		nextQP: firstUserQPN,
	}
	d.accessCond = sync.NewCond(&d.accessMu)
	lim := func(own, cap int) int {
		if own > 0 && own < cap {
			return own
		}
		return cap
	}
	l := cfg.Limits
	d.attr = hostverbs.DeviceAttr{
		NodeGUID:              cfg.NodeGUID,
		SysImageGUID:          cfg.NodeGUID,
		MaxMRSize:             maxMRSize,
		PageSizeCap:           guestmem.PageSize,
		MaxQP:                 lim(l.MaxQP, maxQP),
		MaxQPWR:               maxQPWR,
		MaxSGE:                maxSGE,
		MaxSGERd:              maxSGE,
		MaxCQ:                 lim(l.MaxCQ, maxCQ),
		MaxCQE:                maxCQE,
		MaxMR:                 lim(l.MaxMR, maxMR),
		MaxPD:                 lim(l.MaxPD, maxPD),
		MaxQPRdAtom:           maxRdAtomic,
		MaxQPInitRdAtom:       maxRdAtomic,
		MaxAH:                 maxQP,
		MaxSRQ:                lim(l.MaxSRQ, maxSRQ),
		MaxSRQWR:              maxSRQWR,
		MaxSRQSGE:             maxSGE,
		AtomicCap:             hostverbs.AtomicHCA,
		LocalCAAckDelay:       localCAAckDelay,
		MaxPKeys:              1,
		GIDTableLen:           gidTableLen,
		PhysPortCnt:           1,
		MaxFastRegPageListLen: maxFastRegPages,
		DeviceCapFlags:        hostverbs.DeviceCapMemMgtExtensions,
	}
	d.attr.GIDType = hostverbs.GIDTypeRoCEv2
	if d.v1 {
		d.attr.GIDType = hostverbs.GIDTypeRoCEv1
	}
	d.keys = newKeyTable(d.attr.MaxMR)
	return d
}

func (d *device) Attr() hostverbs.DeviceAttr { return d.attr }

func (d *device) QueryPort(port uint8) (hostverbs.PortAttr, error) {
	if port != 1 {
		return hostverbs.PortAttr{}, fmt.Errorf("query port %d: %w", port, hostverbs.ErrInvalid)
	}
	return hostverbs.PortAttr{
		State:        hostverbs.PortActive,
		MaxMTU:       hostverbs.MTU4096,
		ActiveMTU:    d.f.activeMTU,
		GIDTableLen:  gidTableLen,
		MaxMsgSize:   maxMsgSize,
		BadPKeyCntr:  d.pkeyViolations.Load(),
		QKeyViolCntr: d.qkeyViolations.Load(),
		PKeyTableLen: 1,
		MaxVLNum:     1,
		ActiveWidth:  1,
		ActiveSpeed:  1,
		PhysState:    5, // LinkUp
	}, nil
}

func (d *device) SetGID(index int, e hostverbs.GIDEntry) error {
	if index < 0 || index >= gidTableLen {
		return fmt.Errorf("set gid %d: index out of range: %w", index, hostverbs.ErrInvalid)
	}
	if e.GID.IsZero() {
		return fmt.Errorf("set gid %d: zero gid: %w", index, hostverbs.ErrInvalid)
	}
	if e.Type != d.attr.GIDType {
		return fmt.Errorf("set gid %d: %v gid on a %v device: %w", index, e.Type, d.attr.GIDType, hostverbs.ErrNotSupported)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("set gid %d: %w", index, hostverbs.ErrClosed)
	}
	old := d.gids[index]
	if old == e {
		return nil
	}
	if err := d.f.bindGID(e.GID, d); err != nil {
		return fmt.Errorf("set gid %d: %w", index, err)
	}
	d.gids[index] = e
	if !old.GID.IsZero() && !d.gidInUseLocked(old.GID) {
		d.f.unbindGID(old.GID, d)
	}
	return nil
}

// gidInUseLocked reports whether another table entry still holds g.
func (d *device) gidInUseLocked(g hostverbs.GID) bool {
	for i := range d.gids {
		if d.gids[i].GID == g {
			return true
		}
	}
	return false
}

func (d *device) ClearGID(index int) error {
	if index < 0 || index >= gidTableLen {
		return fmt.Errorf("clear gid %d: index out of range: %w", index, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	old := d.gids[index]
	if old.GID.IsZero() {
		return fmt.Errorf("clear gid %d: %w", index, hostverbs.ErrNotFound)
	}
	d.gids[index] = hostverbs.GIDEntry{}
	if !d.gidInUseLocked(old.GID) {
		d.f.unbindGID(old.GID, d)
	}
	return nil
}

func (d *device) GID(index int) (hostverbs.GIDEntry, error) {
	if index < 0 || index >= gidTableLen {
		return hostverbs.GIDEntry{}, fmt.Errorf("gid %d: index out of range: %w", index, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.gids[index]
	if e.GID.IsZero() {
		return e, fmt.Errorf("gid %d: %w", index, hostverbs.ErrNotFound)
	}
	return e, nil
}

// sgid returns the GID at index for an address vector.
func (d *device) sgid(index uint8) (hostverbs.GID, error) {
	e, err := d.GID(int(index))
	return e.GID, err
}

func (d *device) AllocPD() (hostverbs.PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("alloc pd: %w", hostverbs.ErrClosed)
	}
	if len(d.pds) >= d.attr.MaxPD {
		return nil, fmt.Errorf("alloc pd: %d PDs: %w", len(d.pds), hostverbs.ErrNoResources)
	}
	p := &pd{dev: d}
	d.pds[p] = struct{}{}
	return p, nil
}

func (d *device) CreateCQ(attr hostverbs.CQAttr) (hostverbs.CQ, error) {
	if attr.Handler == nil {
		return nil, fmt.Errorf("create cq: no completion handler: %w", hostverbs.ErrInvalid)
	}
	if attr.Depth < 1 || attr.Depth > maxCQE {
		return nil, fmt.Errorf("create cq: depth %d: %w", attr.Depth, hostverbs.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("create cq: %w", hostverbs.ErrClosed)
	}
	if len(d.cqs) >= d.attr.MaxCQ {
		return nil, fmt.Errorf("create cq: %d CQs: %w", len(d.cqs), hostverbs.ErrNoResources)
	}
	c := &cq{dev: d, handler: attr.Handler, ctx: attr.Context}
	c.depth.Store(int64(attr.Depth))
	d.cqs[c] = struct{}{}
	return c, nil
}

// Close destroys every object of the device, without completions, and
// releases its GIDs.
func (d *device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.closedFlag.Store(true)
	d.lim.Flush()
	qps := make([]*qp, 0, len(d.all))
	for q := range d.all {
		qps = append(qps, q)
	}
	d.mu.Unlock()
	for _, q := range qps {
		q.destroy()
	}
	d.mu.Lock()
	for i := range d.gids {
		if g := d.gids[i].GID; !g.IsZero() {
			d.f.unbindGID(g, d)
		}
		d.gids[i] = hostverbs.GIDEntry{}
	}
	d.qps.clear()
	for i := range d.keys.slots {
		d.keys.slots[i].Store(nil)
	}
	d.srqs, d.cqs, d.pds = nil, nil, nil
	d.mu.Unlock()
	d.f.removeDevice(d)
	return nil
}

// Counters returns the device's statistics.
func (d *device) Counters() map[string]uint64 {
	m := make(map[string]uint64, numCounters)
	d.ctrs.addTo(m)
	return m
}

// event reports an asynchronous event.
func (d *device) event(t hostverbs.EventType, ctx uint64, qpn uint32) {
	d.ctrs.inc(cntAsyncEvents)
	if d.cfg.Events != nil {
		d.cfg.Events(hostverbs.AsyncEvent{Type: t, Context: ctx, QPN: qpn, Port: 1})
	}
}

// lookupQP returns the QP with number qpn, or nil.
func (d *device) lookupQP(qpn uint32) *qp { return d.qps.load(qpn) }

// allocQPNLocked returns an unused QPN: user QPs count up from 16 and wrap,
// so a destroyed QP's number is not reused soon.
func (d *device) allocQPNLocked() uint32 {
	for {
		n := d.nextQP
		d.nextQP++
		if d.nextQP >= qpnSpace {
			d.nextQP = firstUserQPN
		}
		if d.qps.load(n) == nil {
			return n
		}
	}
}

// takeQPNLocked checks that QP number n may be given to a new QP of type
// t, as QPInitAttr.QPN asks: the GSI QP's number is 1, any other QP's is a
// user QPN not in use. Later allocations continue after it, so a restored
// device does not soon hand out the numbers of QPs it rebuilt.
func (d *device) takeQPNLocked(n uint32, t hostverbs.QPType) error {
	if t == hostverbs.QPTypeGSI {
		if n != gsiQPN {
			return fmt.Errorf("QPN %#x for the GSI QP (it is %d): %w", n, gsiQPN, hostverbs.ErrNotSupported)
		}
		return nil
	}
	if n < firstUserQPN || n >= qpnSpace {
		return fmt.Errorf("QPN %#x outside the user QPNs [%#x, %#x): %w", n, firstUserQPN, qpnSpace, hostverbs.ErrNotSupported)
	}
	if d.qps.load(n) != nil {
		return fmt.Errorf("QPN %#x in use: %w", n, hostverbs.ErrBusy)
	}
	if n >= d.nextQP {
		d.nextQP = n + 1
		if d.nextQP >= qpnSpace {
			d.nextQP = firstUserQPN
		}
	}
	return nil
}

func (d *device) publishQPLocked(q *qp) {
	d.qps.store(q.qpn, q)
	d.all[q] = struct{}{}
}

func (d *device) unpublishQPLocked(q *qp) {
	d.qps.deleteIf(q.qpn, q)
	delete(d.all, q)
}
