// Package hostverbs is the verbs provider interface the PVRDMA device model
// drives: a Device per VM with its PDs, MRs over guest memory, CQs, QPs
// (RC, UD, GSI) and SRQs, shaped by InfiniBand verbs semantics. The software
// provider (hostverbs/soft, RoCE v2) implements it; a provider over a real
// HCA through libibverbs is planned.
//
// Errors are values: the sentinels below, wrapped with context, which the
// device converts into PVRDMA statuses with Errno.
//
// Concurrency: every method is safe for concurrent use. Completion handlers
// and event callbacks are called from provider goroutines; they must not
// block and must not call back into the provider.
package hostverbs

import (
	"fmt"
	"log/slog"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
)

// Provider creates devices, one per VM.
type Provider interface {
	// Open creates a device whose memory regions live in cfg.Memory.
	Open(cfg DeviceConfig) (Device, error)
	// Close releases the provider; its devices must be closed first.
	Close() error
}

// DeviceConfig parameterises one device.
type DeviceConfig struct {
	// Name identifies the device (the VM) in logs and metrics.
	Name string
	// Memory is the guest-physical memory that MRs map onto.
	Memory *guestmem.Memory
	// NodeGUID is the device's node GUID (EUI-64 of its NIC's MAC).
	NodeGUID uint64
	// MAC is the MAC address of the VM's paired NIC: the source MAC of
	// frames the device sends, where the provider builds frames.
	MAC [6]byte
	// Events receives asynchronous events. May be nil.
	Events func(AsyncEvent)
	// RoCEMode is the one GID type the device offers (the stock PVRDMA
	// driver accepts a device of one type only): GIDTypeRoCEv1 or
	// GIDTypeRoCEv2. Zero means RoCE v2. A provider that cannot carry
	// the mode fails Open.
	RoCEMode GIDType
	// Limits caps the resources this device may create; zero fields mean
	// the provider's own maximum.
	Limits Limits
	// Logger is the device's logger; nil means slog.Default().
	Logger *slog.Logger
}

// Limits are per-device resource quotas. Exceeding one fails the creating
// call with ErrNoResources.
type Limits struct {
	MaxQP, MaxCQ, MaxMR, MaxPD, MaxSRQ int
	// MaxMRBytes caps the total bytes of all registered MRs.
	MaxMRBytes uint64
}

// Device is one RDMA device (one port) as seen by one VM.
type Device interface {
	// Attr returns the device capabilities. They are the truth: creating
	// more than MaxQP QPs, or a QP deeper than MaxQPWR, fails.
	Attr() DeviceAttr
	// QueryPort returns the attributes of port (1-based).
	QueryPort(port uint8) (PortAttr, error)
	// SetGID installs a GID table entry: the device then receives traffic
	// addressed to that GID.
	SetGID(index int, e GIDEntry) error
	// ClearGID removes a GID table entry.
	ClearGID(index int) error
	// GID returns a GID table entry.
	GID(index int) (GIDEntry, error)
	// AllocPD creates a protection domain.
	AllocPD() (PD, error)
	// CreateCQ creates a completion queue.
	CreateCQ(attr CQAttr) (CQ, error)
	// Close destroys every object of the device and the device itself.
	Close() error
}

// PD is a protection domain.
type PD interface {
	// RegMR registers guest memory described by attr.Pages.
	RegMR(attr MRAttr) (MR, error)
	// CreateQP creates a queue pair. A GSI QP gets QPN 1; at most one per
	// device.
	CreateQP(attr QPInitAttr) (QP, error)
	// CreateSRQ creates a shared receive queue.
	CreateSRQ(attr SRQAttr) (SRQ, error)
	// Dealloc destroys the PD; it fails with ErrBusy while objects use it.
	Dealloc() error
}

// MRAttr describes a memory region.
type MRAttr struct {
	// Pages maps the MR's IOVA range onto guest pages;
	// guestmem.Identity() registers all of guest-physical memory (a DMA MR).
	Pages  guestmem.PageList
	Access Access
	// LKey and RKey, when not zero, are the keys the MR must get: a
	// restarted daemon rebuilding a guest's MRs gives them the keys the
	// guest and its peers already hold. Zero leaves the choice to the
	// provider (RKey zero also when the MR has no remote access). A
	// provider that cannot give exactly these keys fails with an error
	// wrapping ErrNotSupported (it cannot choose keys, or not these) or
	// ErrBusy (a key is in use); it never registers the MR with others.
	LKey, RKey uint32
}

// MR is a registered memory region.
type MR interface {
	LKey() uint32
	// RKey is valid for remote access if the MR allows any.
	RKey() uint32
	// Dereg deregisters the MR; it fails with ErrBusy while in use.
	Dereg() error
}

// FastRegPD is implemented by the PDs of a provider with fast registration
// (DeviceAttr.DeviceCapFlags has DeviceCapMemMgtExtensions): kernel
// consumers' fast-registration work requests (IB_WR_REG_MR, LOCAL_INV,
// SEND_WITH_INV) act on MRs the provider owns, so that the keys the guest
// gives its peers resolve where they arrive, in the provider's responder.
type FastRegPD interface {
	// AllocFastRegMR creates a fast-registration MR in the free state: a
	// key with no pages, which FastRegMR.Register gives pages, access and
	// a consumer byte. Its LKey is the base key (the index bits the MR
	// keeps for its life; the low byte is the consumer's).
	AllocFastRegMR(attr FastRegAttr) (FastRegMR, error)
}

// FastRegAttr describes a fast-registration MR.
type FastRegAttr struct {
	// MaxPages is the page list capacity (ib_alloc_mr's max_num_sg).
	MaxPages int
	// Key, when not zero, is the key the MR must have (a restarted
	// daemon rebuilding a guest's MRs); as MRAttr.LKey.
	Key uint32
}

// MRState is a fast-registration MR's state (IBA 10.6.1: an allocated
// L_Key is free until a fast registration makes it valid; an
// invalidation, local or remote, makes it free again).
type MRState uint8

// Fast-registration MR states.
const (
	MRFree  MRState = 1
	MRValid MRState = 2
)

func (s MRState) String() string {
	switch s {
	case MRFree:
		return "free"
	case MRValid:
		return "valid"
	}
	return fmt.Sprintf("MRState(%d)", uint8(s))
}

// FastReg is one fast registration (the REG_MR work request): the pages
// mapped from Pages.IOVA, the access rights and the key, whose index bits
// must be the MR's and whose low byte is the consumer's choice
// (ib_update_fast_reg_key).
type FastReg struct {
	Pages  guestmem.PageList
	Access Access
	Key    uint32
}

// FastRegMR is a fast-registration MR. Its LKey and RKey are the current
// key (RKey zero while the registration grants no remote access).
type FastRegMR interface {
	MR
	// Register executes a REG_MR: the MR must be free, r.Key must keep
	// the MR's index bits, r.Pages must fit MaxPages. On success the MR is
	// valid under r.Key until invalidated. Errors wrap ErrInvalid (a key,
	// access or page list the MR cannot take) or ErrBusy (the MR is valid:
	// it must be invalidated first).
	Register(r FastReg) error
	// Invalidate executes a LOCAL_INV with key: it must be the MR's
	// current key; the MR becomes free (invalidating a free MR with its
	// key succeeds, as it does on rxe). Errors wrap ErrInvalid.
	Invalidate(key uint32) error
	// Registration returns the MR's state and, when valid, its
	// registration (what a hand-over saves).
	Registration() (MRState, FastReg)
}

// CompletionHandler receives completions for a CQ. Complete is called once
// per completion, in completion order per QP; it must be safe for concurrent
// calls (QPs sharing a CQ), must not block and must not call into the
// provider.
type CompletionHandler interface {
	Complete(wc *WorkCompletion)
}

// CQAttr describes a completion queue.
type CQAttr struct {
	// Depth is the number of completions the consumer can hold.
	Depth int
	// Context is echoed in events about this CQ.
	Context uint64
	// Handler receives the CQ's completions.
	Handler CompletionHandler
}

// CQ is a completion queue. Completions are pushed to its handler as they
// happen; arming and polling are the consumer's business.
type CQ interface {
	// Resize changes the depth.
	Resize(depth int) error
	// Destroy fails with ErrBusy while QPs use the CQ.
	Destroy() error
}

// QPCap sizes a QP's queues.
type QPCap struct {
	MaxSendWR, MaxRecvWR   uint32
	MaxSendSGE, MaxRecvSGE uint32
	MaxInlineData          uint32
}

// QPInitAttr describes a QP to create.
type QPInitAttr struct {
	Type           QPType
	SendCQ, RecvCQ CQ
	// SRQ, if not nil, supplies receive WRs instead of the QP's own RQ.
	SRQ    SRQ
	Cap    QPCap
	SigAll bool
	// Context is reported in this QP's completions and events.
	Context uint64
	// QPN, when not zero, is the QP number the QP must get (a restarted
	// daemon rebuilding a guest's QPs keeps the numbers its peers know).
	// Zero leaves the choice to the provider. A provider that cannot use
	// exactly this number fails with an error wrapping ErrNotSupported
	// (it cannot choose QPNs, or not this one) or ErrBusy (the number is
	// in use).
	QPN uint32
}

// QPAttr holds modifiable and queryable QP attributes (ib_qp_attr). Which
// fields matter is given by an AttrMask.
type QPAttr struct {
	State, CurState  QPState
	PathMTU          MTU
	PathMigState     uint8
	QKey             uint32
	RQPSN, SQPSN     uint32
	DestQPN          uint32
	AccessFlags      Access
	PKeyIndex        uint16
	AltPKeyIndex     uint16
	EnSQDAsyncNotify bool
	SQDraining       bool
	MaxRdAtomic      uint8
	MaxDestRdAtomic  uint8
	MinRNRTimer      uint8
	Port             uint8
	Timeout          uint8
	RetryCnt         uint8
	RNRRetry         uint8
	AltPort          uint8
	AltTimeout       uint8
	Cap              QPCap
	AV               AddressVector
	AltAV            AddressVector
}

// QP is a queue pair.
type QP interface {
	// QPN is the QP number used on the wire.
	QPN() uint32
	// Modify applies the attributes selected by mask, validating the
	// transition and mask as IBA 10.3 / 11.2.4.2 require.
	Modify(attr *QPAttr, mask AttrMask) error
	// Query returns the current attributes and init attributes' caps.
	Query() (QPAttr, error)
	// PostSend queues one send work request.
	PostSend(wr *SendWR) error
	// PostRecv queues one receive work request on the QP's own RQ.
	PostRecv(wr *RecvWR) error
	// Destroy destroys the QP; outstanding work is discarded without
	// completions.
	Destroy() error
}

// SRQAttr describes a shared receive queue.
type SRQAttr struct {
	MaxWR, MaxSGE uint32
	// Limit arms the limit event: when fewer than Limit WRs remain, an
	// EventSRQLimitReached fires once and the limit disarms. 0 = disarmed.
	Limit   uint32
	Context uint64
}

// SRQAttrMask selects SRQAttr fields for Modify.
type SRQAttrMask uint32

// SRQ attribute mask bits (ib_srq_attr_mask).
const (
	SRQAttrMaxWR SRQAttrMask = 1 << 0
	SRQAttrLimit SRQAttrMask = 1 << 1
)

// SRQ is a shared receive queue.
type SRQ interface {
	PostRecv(wr *RecvWR) error
	Modify(attr SRQAttr, mask SRQAttrMask) error
	Query() (SRQAttr, error)
	// Destroy fails with ErrBusy while QPs use the SRQ.
	Destroy() error
}

// AtomicCap says which atomicity the device guarantees.
type AtomicCap uint8

// Atomic capabilities.
const (
	AtomicNone AtomicCap = 0
	AtomicHCA  AtomicCap = 1
	AtomicGlob AtomicCap = 2
)

// DeviceCapFlags bits (ib_device_cap_flags) a provider may set in
// DeviceAttr.DeviceCapFlags.
const (
	// DeviceCapMemMgtExtensions: fast registration, local and remote
	// invalidation (the PDs implement FastRegPD; MaxFastRegPageListLen
	// is the largest page list).
	DeviceCapMemMgtExtensions uint64 = 1 << 21
)

// DeviceAttr are a device's capabilities (ib_device_attr).
type DeviceAttr struct {
	FWVersion             uint64
	NodeGUID              uint64
	SysImageGUID          uint64
	MaxMRSize             uint64
	PageSizeCap           uint64
	VendorID              uint32
	VendorPartID          uint32
	HWVersion             uint32
	MaxQP                 int
	MaxQPWR               int
	DeviceCapFlags        uint64
	MaxSGE                int
	MaxSGERd              int
	MaxCQ                 int
	MaxCQE                int
	MaxMR                 int
	MaxPD                 int
	MaxQPRdAtom           int
	MaxQPInitRdAtom       int
	MaxAH                 int
	MaxSRQ                int
	MaxSRQWR              int
	MaxSRQSGE             int
	MaxFastRegPageListLen int
	AtomicCap             AtomicCap
	LocalCAAckDelay       uint8
	MaxPKeys              uint16
	GIDTableLen           int
	PhysPortCnt           uint8
	// GIDType is the one RoCE version the device's GIDs have (the
	// DeviceConfig's RoCEMode); zero means RoCE v2.
	GIDType GIDType
}

// PortState is a port's logical state.
type PortState uint8

// Port states.
const (
	PortNop         PortState = 0
	PortDown        PortState = 1
	PortInit        PortState = 2
	PortArmed       PortState = 3
	PortActive      PortState = 4
	PortActiveDefer PortState = 5
)

// PortAttr are a port's attributes (ib_port_attr).
type PortAttr struct {
	State         PortState
	MaxMTU        MTU
	ActiveMTU     MTU
	GIDTableLen   int
	PortCapFlags  uint32
	MaxMsgSize    uint32
	BadPKeyCntr   uint32
	QKeyViolCntr  uint32
	PKeyTableLen  uint16
	LID           uint16
	SMLID         uint16
	LMC           uint8
	MaxVLNum      uint8
	SMSL          uint8
	SubnetTimeout uint8
	InitTypeReply uint8
	ActiveWidth   uint8
	ActiveSpeed   uint8
	PhysState     uint8
}
