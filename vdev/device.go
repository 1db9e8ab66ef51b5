package vdev

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// IRQ raises the device's interrupts: MSI-X vector v (VectorResponse,
// VectorAsync, VectorCQ), or INTx when the function runs without MSI-X.
// Trigger must be safe to call from any goroutine and must not block.
type IRQ interface {
	Trigger(vector int)
}

// SyncIRQ is an IRQ that can also signal a vector before returning, on
// the goroutine that serves the guest's register accesses. The device
// signals a command's completion that way (when its IRQ offers it), so
// that the interrupt is on its way before the REQUEST write that ran the
// command is answered: the stock driver waits for it with
// wait_for_completion_interruptible_timeout, which returns at once when
// the waiting task has a signal pending unless the completion is already
// done, so an interrupt that reached the guest only after the write had
// retired failed the command (-ETIMEDOUT) for a task being signalled,
// such as LIO's iSER teardown ("completion timeout or interrupted").
type SyncIRQ interface {
	IRQ
	TriggerSync(vector int)
}

// Limits are per-VM resource quotas. A zero field selects the default
// below; the capabilities reported to the guest are the smaller of these
// and the provider's. Exceeding one fails the guest's command with an
// error status (ENOMEM), never host memory exhaustion.
type Limits struct {
	MaxQP, MaxCQ, MaxMR, MaxPD, MaxSRQ, MaxAH int
	// MaxMRBytes caps the bytes of all registered memory regions.
	MaxMRBytes uint64
	// MaxQPWR, MaxCQE and MaxSRQWR cap queue depths; MaxSGE the SGEs per
	// WQE (send, receive and SRQ).
	MaxQPWR, MaxCQE, MaxSRQWR, MaxSGE int
	// MaxBytes caps what the VM's QPs, SRQs, CQs and MRs cost the
	// daemon's memory, in bytes (budget.go: the device model's state, page
	// lists and the provider's queues). The per-object caps alone would
	// let a guest whose page directories all name the same few pages make
	// the daemon allocate gigabytes.
	MaxBytes uint64
	// GIDTableLen is the number of GID table entries offered to the guest.
	GIDTableLen int
}

// DefaultLimits returns the limits used for zero fields of Config.Limits.
func DefaultLimits() Limits {
	return Limits{
		MaxQP: 1024, MaxCQ: 2048, MaxMR: 4096, MaxPD: 1024, MaxSRQ: 512, MaxAH: 4096,
		MaxMRBytes: 4 << 30,
		MaxQPWR:    4096, MaxCQE: 16384, MaxSRQWR: 4096, MaxSGE: 16,
		MaxBytes:    256 << 20,
		GIDTableLen: 16,
	}
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits()
	pick := func(v, def int) int {
		if v <= 0 {
			return def
		}
		return v
	}
	l.MaxQP, l.MaxCQ, l.MaxMR = pick(l.MaxQP, d.MaxQP), pick(l.MaxCQ, d.MaxCQ), pick(l.MaxMR, d.MaxMR)
	l.MaxPD, l.MaxSRQ, l.MaxAH = pick(l.MaxPD, d.MaxPD), pick(l.MaxSRQ, d.MaxSRQ), pick(l.MaxAH, d.MaxAH)
	l.MaxQPWR, l.MaxCQE, l.MaxSRQWR = pick(l.MaxQPWR, d.MaxQPWR), pick(l.MaxCQE, d.MaxCQE), pick(l.MaxSRQWR, d.MaxSRQWR)
	l.MaxSGE, l.GIDTableLen = pick(l.MaxSGE, d.MaxSGE), pick(l.GIDTableLen, d.GIDTableLen)
	if l.MaxBytes == 0 {
		l.MaxBytes = d.MaxBytes
	}
	if l.MaxMRBytes == 0 {
		l.MaxMRBytes = d.MaxMRBytes
	}
	return l
}

// Config parameterises a device.
type Config struct {
	// Memory is the VM's guest-physical memory. The device requires it to
	// be shared (fd-backed): New calls Memory.RequireShared(true).
	Memory *guestmem.Memory
	// Verbs is the provider device the guest's verbs are relayed to. The
	// caller owns it; route its DeviceConfig.Events to HandleEvent.
	Verbs hostverbs.Device
	// IRQ raises interrupts.
	IRQ IRQ
	// MAC is the paired vmxnet3's MAC address (node GUID, MACL/MACH).
	MAC [6]byte
	// Limits caps the VM's resources.
	Limits Limits
	// Logger is the device's logger; nil means slog.Default().
	Logger *slog.Logger
	// Budget, if set, is the whole daemon's budget for what guests'
	// objects cost; the VM's own (Limits.MaxBytes) charges it too.
	Budget *Budget
	// OnGID, if set, is called when the guest binds (bound true) or
	// unbinds a GID, after the provider accepted it. It runs on the BAR
	// goroutine and must not call back into the device.
	OnGID func(index int, e hostverbs.GIDEntry, bound bool)
	// CheckGID, if set, is asked before the provider whether the guest may
	// bind e at index; an error refuses the CREATE_BIND (the guest sees
	// the errno the error wraps, EPERM if none) and counts in
	// Stats.GIDRefusals. It runs on the BAR goroutine and must not call
	// back into the device.
	CheckGID func(index int, e hostverbs.GIDEntry) error
	// Journal, if set, receives the device's journal: one record for
	// every change of state the guest made (each command that created,
	// modified or destroyed an object or a GID binding, each register
	// write the device keeps, a Reset), in order, under the device lock,
	// after the change and before the guest sees a command's response.
	// Records are self-delimiting and numbered: appended to a file they
	// form a journal that Restore rebuilds the device from, and
	// Checkpoint compacts. The record is the callee's to keep, not to
	// modify; the sink must not block for long nor call into the device.
	Journal func(rec []byte)
	// Doorbells is how UAR doorbells reach the device (DoorbellMode;
	// the zero value traps them).
	Doorbells DoorbellMode
	// UARFile, if positive, is the UAR memory of memory doorbells a
	// previous daemon served the VM with (UARMmap's file, kept in the fd
	// store): the device maps a duplicate of it instead of a new file, so
	// that it watches the memory the guest's mapping names. The caller
	// keeps its descriptor.
	UARFile int
	// manualDoorbellPoll (tests): memory mode without the poller
	// goroutine; the test calls pollUAR.
	manualDoorbellPoll bool
	// Distributions turns on the device's distributions: the latency
	// from a send WQE's doorbell to its CQE and the send queue's depth at
	// each SQ doorbell (Device.Distributions, metrics.go). They cost per
	// send doorbell and per send CQE a clock read and two atomic adds.
	Distributions bool
}

// Errors of the device (wrapped with context; the guest sees errnos).
var (
	// ErrClosed: the device was closed.
	ErrClosed = errors.New("pvrdma device closed")
	// ErrAccess: a BAR access outside a BAR or of a size the register file
	// does not implement.
	ErrAccess = errors.New("invalid BAR access")
	// ErrNoDSR: a command or doorbell arrived before the driver loaded the
	// device shared region (CVE-2022-1050).
	ErrNoDSR = fmt.Errorf("device shared region not loaded: %w", syscall.EFAULT)
	// ErrBadHandle: a handle from the guest names no live object.
	ErrBadHandle = fmt.Errorf("no such handle: %w", hostverbs.ErrInvalid)
	// ErrLimit: a per-VM limit or capability would be exceeded.
	ErrLimit = fmt.Errorf("limit reached: %w", hostverbs.ErrNoResources)
)

// Stats are the device's counters.
type Stats struct {
	Commands, CommandErrors        uint64
	Doorbells, PollDoorbells       uint64
	BadDoorbells                   uint64
	SendWQEs, RecvWQEs, BadWQEs    uint64
	FlushedWQEs, StalledPosts      uint64
	Completions, StaleCompletions  uint64
	CQOverflows                    uint64
	CQNotifications, NotifyDropped uint64
	AsyncEvents, AsyncDropped      uint64
	Interrupts, MaskedInterrupts   uint64
	BadBARAccesses                 uint64
	// GIDRefusals counts CREATE_BINDs that Config.CheckGID refused.
	GIDRefusals uint64
	// JournalRecords counts the records given to Config.Journal.
	JournalRecords uint64
	// RestoredObjects counts the objects (contexts, PDs, MRs, CQs, QPs,
	// SRQs, GIDs) Restore rebuilt under the guest's handles;
	// RestoreErroredQPs the QPs it moved to ERR (RC and SRQ QPs that were
	// past RESET); RestoreContinuedQPs the RC QPs it restored with their
	// transport state (a planned hand-over); RestoreLostObjects those the
	// provider could not take back (handles kept, errors raised).
	RestoredObjects, RestoreErroredQPs, RestoreContinuedQPs, RestoreLostObjects uint64
	// FastRegs counts REG_MR work requests executed, FastRegRefused those
	// refused (no such fast-reg MR, another PD, a bad page list or key,
	// an MR still valid); LocalInvs and LocalInvRefused the same for
	// LOCAL_INV; FRMRRefused the fast-reg MRs the guest asked for where
	// the provider has no fast registration. Each refusal is logged
	// (rate-limited) with its reason.
	FastRegs, FastRegRefused, LocalInvs, LocalInvRefused, FRMRRefused uint64
	// ErrorCQEs counts the CQEs written with an error status other than
	// a flush, FlushCQEs those of work requests flushed because their QP
	// is in ERR (whoever completed them: the provider or the device). Both
	// are logged, rate-limited, with the QP and the work request (flushes
	// at debug level: every disconnect flushes the receives left posted).
	ErrorCQEs, FlushCQEs uint64
	// TrappedDoorbells counts the UAR doorbells that arrived as region
	// writes, by kind (Doorbells counts them all, with the bad ones);
	// MemoryDoorbells the doorbell words the memory-mode poller found
	// written (DoorbellsMemory: one word may stand for several stores of
	// the guest), MemoryBadDoorbells those of them that named nothing
	// the context owns, DoorbellPasses the poller's passes over the
	// pages. ArmSafetyNets counts the CQ notifications the lost-arm
	// safety net raised (uarmem.go).
	TrappedDoorbells, MemoryDoorbells  DoorbellCounts
	MemoryBadDoorbells, DoorbellPasses uint64
	ArmSafetyNets                      uint64
}

type counters struct {
	commands, commandErrors        atomic.Uint64
	doorbells, pollDoorbells       atomic.Uint64
	badDoorbells                   atomic.Uint64
	sendWQEs, recvWQEs, badWQEs    atomic.Uint64
	flushedWQEs, stalledPosts      atomic.Uint64
	completions, staleCompletions  atomic.Uint64
	cqOverflows                    atomic.Uint64
	cqNotifications, notifyDropped atomic.Uint64
	asyncEvents, asyncDropped      atomic.Uint64
	interrupts, maskedInterrupts   atomic.Uint64
	badBARAccesses                 atomic.Uint64
	gidRefusals                    atomic.Uint64
	journalRecords                 atomic.Uint64
	restored, restoreErrored       atomic.Uint64
	restoreContinued, restoreLost  atomic.Uint64
	fastRegs, fastRegRefused       atomic.Uint64
	localInvs, localInvRefused     atomic.Uint64
	frmrRefused                    atomic.Uint64
	errorCQEs, flushCQEs           atomic.Uint64
	trappedDBs, memDBs             [dbKinds]atomic.Uint64
	memBad, dbPasses               atomic.Uint64
	armSafetyNets                  atomic.Uint64
}

// Device is one PVRDMA function serving one VM.
type Device struct {
	log   *slog.Logger
	lim   *ratelog.Limiter // every log line a guest can provoke goes through it
	mem   *guestmem.Memory
	verbs hostverbs.Device
	irq   IRQ
	onGID func(int, hostverbs.GIDEntry, bool)
	// checkGID vets guest GIDs (Config.CheckGID).
	checkGID func(int, hostverbs.GIDEntry) error
	mac      [6]byte
	limits   Limits
	caps     abi.Caps
	stats    counters
	// dist is what the device measures (Config.Distributions; nil: off).
	dist *distributions
	// uarm is the shared UAR memory of memory doorbells (nil: trapped).
	uarm     *uarMemory
	stopUARM sync.Once

	// Interrupt state, touched from any goroutine.
	icr atomic.Uint32
	imr atomic.Uint32

	// asyncMu guards async, notifyMu guards notify: the device-produced
	// rings of the DSR. Completions and events take them; commands replace
	// them only under mu and the ring's own lock.
	asyncMu  sync.Mutex
	async    *ringbuf.Producer
	eqeBuf   [abi.EQESize]byte
	notifyMu sync.Mutex
	notify   *ringbuf.Producer
	cqneBuf  [abi.CQNESize]byte

	// live maps a QP handle to the QP while it exists, for completion
	// handlers (which must not take mu). See qp.context.
	live []atomic.Pointer[qp]

	// mu serialises BAR accesses, commands, doorbells, Reset and Close.
	// Everything below is guarded by it.
	mu      sync.Mutex
	closed  bool
	dsrLow  uint32
	dsrHigh uint32
	errReg  uint32
	macl    uint32
	mach    uint32
	active  bool
	dsr     *dsrState
	ucs     table[*uctx]
	pds     table[*pd]
	mrs     table[*mr]
	cqs     table[*cq]
	qps     table[*qp]
	srqs    table[*srq]
	keys    map[uint32]*mr // guest lkey -> MR
	frmrs   map[uint32]*mr // FRMR key with the consumer byte cleared -> MR
	mrBytes uint64
	heap    *Budget // what the VM's objects cost the daemon (Limits.MaxBytes)
	gids    []gidSlot
	gsi     *qp
	fault   error // why the last DSR was refused, for the operator
	qpGen   uint32
	stalled int  // QPs with work left in a ring because the provider queue was full
	adopt   bool // rings take the device's indices from guest memory (SetAdoptRings)
	// journal is Config.Journal; seq numbers its records.
	journal func([]byte)
	seq     uint64
	// rp is the restore in progress (nil but inside Restore).
	rp *replayer
	// handover: SaveTransports journaled transport states that are still
	// valid (handover.go).
	handover bool
	// dbHeld: HoldDoorbells stopped the memory doorbell poller's passes
	// (a hand-over holds the guest; the words stay in memory).
	dbHeld bool

	// Scratch space for the BAR goroutine (guarded by mu): command slots
	// and one WQE at a time.
	req  [abi.CmdReqSize]byte
	resp [abi.CmdRespSize]byte
	wqe  [abi.SQWQEHdrSize + abi.SGESize*maxSGELimit]byte
	sgl  [maxSGELimit]hostverbs.SGE
	swr  hostverbs.SendWR
	rwr  hostverbs.RecvWR
}

type gidSlot struct {
	bound bool
	entry hostverbs.GIDEntry
}

// dsrState is what the device keeps of a loaded DSR.
type dsrState struct {
	gpa           guestmem.GPA
	driverVersion uint32
	cmdSlot       guestmem.GPA
	respSlot      guestmem.GPA
	uarPFN        uint64
}

// New creates a device. Memory, Verbs and IRQ are required.
func New(cfg Config) (*Device, error) {
	if cfg.Memory == nil || cfg.Verbs == nil || cfg.IRQ == nil {
		return nil, fmt.Errorf("vdev: Memory, Verbs and IRQ are required: %w", hostverbs.ErrInvalid)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	d := &Device{
		log: log, lim: ratelog.New(log, 0), mem: cfg.Memory, verbs: cfg.Verbs, irq: cfg.IRQ, onGID: cfg.OnGID, checkGID: cfg.CheckGID,
		journal: cfg.Journal, mac: cfg.MAC, limits: cfg.Limits.withDefaults(),
	}
	if cfg.Distributions {
		d.dist = newDistributions()
	}
	d.heap = NewBudget(d.limits.MaxBytes, cfg.Budget)
	// PVRDMA reads rings and buffers in place: guest RAM that QEMU maps
	// without an fd is refused with an error naming the QEMU options.
	d.mem.RequireShared(true)
	d.caps = computeCaps(d.verbs.Attr(), d.limits, d.mac)
	d.live = make([]atomic.Pointer[qp], d.caps.MaxQP)
	d.macl = uint32(d.mac[0]) | uint32(d.mac[1])<<8 | uint32(d.mac[2])<<16 | uint32(d.mac[3])<<24
	d.mach = uint32(d.mac[4]) | uint32(d.mac[5])<<8
	d.resetLocked()
	if cfg.Doorbells == DoorbellsMemory {
		u, err := newUARMemory(cfg.UARFile)
		if err != nil && cfg.UARFile > 0 {
			// The guest's mapping names the kept file: its user-space
			// doorbells go unseen until its driver maps the BAR again.
			d.log.Error("vdev: the kept UAR file does not map; user-space doorbells of this VM go unseen", "err", err)
			u, err = newUARMemory(0)
		}
		if err != nil {
			return nil, fmt.Errorf("vdev: memory doorbells: %w", err)
		}
		d.uarm = u
		if !cfg.manualDoorbellPoll {
			d.startUARPoller()
		}
	}
	return d, nil
}

// Fault returns why the device last refused the guest's device shared
// region (for example guest RAM without an fd, whose message names the
// QEMU options that fix it), or nil once a DSR loaded.
func (d *Device) Fault() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.fault
}

// Caps returns the capabilities the device reports to the guest.
func (d *Device) Caps() abi.Caps { return d.caps }

// Stats returns a snapshot of the device's counters.
func (d *Device) Stats() Stats {
	s := &d.stats
	return Stats{
		Commands: s.commands.Load(), CommandErrors: s.commandErrors.Load(),
		Doorbells: s.doorbells.Load(), PollDoorbells: s.pollDoorbells.Load(), BadDoorbells: s.badDoorbells.Load(),
		SendWQEs: s.sendWQEs.Load(), RecvWQEs: s.recvWQEs.Load(), BadWQEs: s.badWQEs.Load(),
		FlushedWQEs: s.flushedWQEs.Load(), StalledPosts: s.stalledPosts.Load(),
		Completions: s.completions.Load(), StaleCompletions: s.staleCompletions.Load(),
		CQOverflows:     s.cqOverflows.Load(),
		CQNotifications: s.cqNotifications.Load(), NotifyDropped: s.notifyDropped.Load(),
		AsyncEvents: s.asyncEvents.Load(), AsyncDropped: s.asyncDropped.Load(),
		Interrupts: s.interrupts.Load(), MaskedInterrupts: s.maskedInterrupts.Load(),
		BadBARAccesses: s.badBARAccesses.Load(), GIDRefusals: s.gidRefusals.Load(),
		JournalRecords: s.journalRecords.Load(), RestoredObjects: s.restored.Load(),
		RestoreErroredQPs: s.restoreErrored.Load(), RestoreContinuedQPs: s.restoreContinued.Load(),
		RestoreLostObjects: s.restoreLost.Load(),
		FastRegs:           s.fastRegs.Load(), FastRegRefused: s.fastRegRefused.Load(),
		LocalInvs: s.localInvs.Load(), LocalInvRefused: s.localInvRefused.Load(),
		FRMRRefused: s.frmrRefused.Load(),
		ErrorCQEs:   s.errorCQEs.Load(), FlushCQEs: s.flushCQEs.Load(),
		TrappedDoorbells: loadCounts(&s.trappedDBs), MemoryDoorbells: loadCounts(&s.memDBs),
		MemoryBadDoorbells: s.memBad.Load(), DoorbellPasses: s.dbPasses.Load(),
		ArmSafetyNets: s.armSafetyNets.Load(),
	}
}

// SetAdoptRings sets whether the rings that commands create or reset from
// now on adopt the state already in guest memory instead of resetting the
// indices the device owns to 0, and returns the previous setting. It is
// for a device rebuilt over a running guest (a daemon restarted after a
// crash replays the VM's journal of commands into a new device): with it
// on, CREATE_QP takes each queue's cons_head from guest memory and starts
// posting there (ringbuf.AdoptConsumer), so the WQEs the guest posted that
// never completed are posted again; CREATE_CQ and the DSR's async-event
// and CQ-notification rings take prod_tail (ringbuf.AdoptProducer), so
// CQEs and events the guest has not consumed stay; CREATE_SRQ takes the
// SRQ's cons_head (receives it held in the old provider are lost: the SRQ
// ring is released at post); MODIFY_QP to RESET and RESIZE_CQ reload the
// indices instead of zeroing them. An adopted index the ring's arithmetic
// cannot produce fails the command (EINVAL), never panics. The replay
// turns it on before the first command, off after the last, and then
// calls KickQueues. Work the old provider had completed whose CQE the
// crash lost is executed again: completions are at most once, work at
// least once.
func (d *Device) SetAdoptRings(on bool) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	was := d.adopt
	d.adopt = on
	return was
}

// KickQueues drains every QP's receive and send queue and every SRQ, as if
// the guest had rung all their doorbells: after a rebuild over adopted
// rings (SetAdoptRings) it posts the work the guest posted before the
// crash, which no doorbell will announce again. It does nothing before
// the guest loaded a DSR. A hand-over in progress ends first
// (ResumeTransports).
func (d *Device) KickQueues() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || d.dsr == nil {
		return
	}
	d.resumeTransportsLocked()
	d.qps.each(func(_ uint32, q *qp) {
		d.postRecvs(q)
		d.postSends(q, false)
	})
	d.srqs.each(func(_ uint32, s *srq) { d.postSRQ(s) })
}

// Reset returns the device to its power-on state: every object is
// destroyed in the provider, GIDs are unbound, the DSR is forgotten and the
// registers reset. It is what CTL RESET, a vfio-user DEVICE_RESET and a
// client disconnect do. The journal records it as a CTL RESET.
func (d *Device) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.resetLocked()
	if !d.closed {
		d.journalReg(abi.RegCtl, abi.CtlReset)
	}
}

// Close resets the device and makes further BAR accesses fail. It does not
// close Verbs or Memory, which the caller owns. The reset is not
// journaled: a daemon that stops in order but keeps the VM's connection
// may Restore the device from its journal as after a crash (one that ends
// the VM's session discards the journal).
func (d *Device) Close() error {
	d.stopUARM.Do(d.stopUARPoller) // it takes mu
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.resetLocked()
	d.closed = true
	if d.uarm != nil {
		d.uarm.close()
	}
	d.lim.Flush()
	return nil
}

// resetLocked drops all state. Objects go in dependency order so the
// provider never sees a busy PD or CQ.
func (d *Device) resetLocked() {
	d.handover = false // the QPs go: nothing to resume
	d.qps.each(func(h uint32, q *qp) { d.destroyQP(q) })
	d.srqs.each(func(h uint32, s *srq) { d.destroySRQ(s) })
	d.cqs.each(func(h uint32, c *cq) { d.destroyCQ(c) })
	d.mrs.each(func(h uint32, m *mr) { d.destroyMR(m) })
	d.pds.each(func(h uint32, p *pd) { d.destroyPD(p) })
	for i := range d.gids {
		if d.gids[i].bound {
			d.unbindGID(i)
		}
	}
	d.asyncMu.Lock()
	d.async = nil
	d.asyncMu.Unlock()
	d.notifyMu.Lock()
	d.notify = nil
	d.notifyMu.Unlock()

	d.ucs = newTable[*uctx](1, d.caps.MaxUAR)
	d.pds = newTable[*pd](0, d.caps.MaxPD)
	d.mrs = newTable[*mr](0, d.caps.MaxMR)
	d.cqs = newTable[*cq](0, d.caps.MaxCQ)
	d.qps = newTable[*qp](0, d.caps.MaxQP)
	d.srqs = newTable[*srq](0, d.caps.MaxSRQ)
	d.keys = map[uint32]*mr{}
	d.frmrs = map[uint32]*mr{}
	d.mrBytes = 0
	d.gids = make([]gidSlot, d.caps.GIDTblLen)
	d.gsi = nil
	d.stalled = 0
	d.dsr = nil
	d.active = false
	d.dsrLow, d.dsrHigh = 0, 0
	d.errReg = 0xFFFF // ERR reads nonzero until the driver activates the device
	d.icr.Store(0)
	d.imr.Store(^uint32(0)) // masked until the driver enables interrupts
}

// raise sets the cause bit of vector v in ICR and triggers the vector
// unless IMR masks it (the driver writes IMR 0 to enable and ~0 to
// disable everything).
func (d *Device) raise(v int) {
	d.icr.Or(1 << v)
	if d.imr.Load()&(1<<v) != 0 {
		d.stats.maskedInterrupts.Add(1)
		return
	}
	d.stats.interrupts.Add(1)
	d.irq.Trigger(v)
}

// raiseSync is raise for the register-access goroutine: the vector is
// signalled before it returns when the IRQ can (SyncIRQ).
func (d *Device) raiseSync(v int) {
	s, ok := d.irq.(SyncIRQ)
	if !ok {
		d.raise(v)
		return
	}
	d.icr.Or(1 << v)
	if d.imr.Load()&(1<<v) != 0 {
		d.stats.maskedInterrupts.Add(1)
		return
	}
	d.stats.interrupts.Add(1)
	s.TriggerSync(v)
}
