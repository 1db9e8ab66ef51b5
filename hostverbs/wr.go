package hostverbs

// SGE is one scatter/gather element: Length bytes at Addr, an address in
// the IOVA space of the memory region whose lkey is LKey.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// AddressVector addresses a remote port (an IB address handle's
// attributes). RoCE always carries a GRH, so DGID is always meaningful.
type AddressVector struct {
	DGID         GID
	SGIDIndex    uint8
	HopLimit     uint8
	TrafficClass uint8
	FlowLabel    uint32 // 20 bits
	SL           uint8
	StaticRate   uint8
	Port         uint8
	DMAC         [6]byte
	VLANID       uint16
}

// SendWR is a send-queue work request. Fields an opcode does not use are
// ignored. Providers copy what they need: neither wr nor its SGL is retained
// after PostSend returns.
type SendWR struct {
	WRID   uint64
	Opcode WROpcode
	Flags  SendFlags
	SGL    []SGE

	// ImmData is the 4 bytes of immediate data, carried verbatim: the
	// uint32 read little-endian from the poster's buffer is the uint32 the
	// receiver's completion reports (both are network-order values to the
	// application). Also the rkey to invalidate for SEND_WITH_INV.
	ImmData uint32

	// RDMA and atomics.
	RemoteAddr uint64
	RKey       uint32
	CompareAdd uint64 // compare (CMP_SWP) or add (FETCH_ADD) operand
	Swap       uint64

	// UD and GSI.
	AV         AddressVector
	RemoteQPN  uint32
	RemoteQKey uint32
}

// RecvWR is a receive work request. Not retained after PostRecv returns.
type RecvWR struct {
	WRID uint64
	SGL  []SGE
}

// WorkCompletion reports the outcome of one work request.
type WorkCompletion struct {
	WRID      uint64
	Status    WCStatus
	Opcode    WCOpcode
	VendorErr uint32
	ByteLen   uint32
	ImmData   uint32 // verbatim, see SendWR.ImmData; the invalidated rkey with WCFlagWithInvalidate
	// QPN is the local QP the work request belonged to; QPContext is the
	// Context given when it was created.
	QPN       uint32
	QPContext uint64
	SrcQP     uint32
	Flags     WCFlags
	PKeyIndex uint16
	SLID      uint16
	SL        uint8
	DLIDBits  uint8
	Port      uint8
	// NetworkHdrType is set on UD/GSI receive completions (with
	// WCFlagWithNetworkHdrTyp).
	NetworkHdrType NetworkHdrType
	// Solicited is true for a receive completion of a message that had the
	// solicited-event bit set: it satisfies an ARM_SOL request.
	Solicited bool
}

// AsyncEvent is an asynchronous event. Context is the Context of the
// object the event concerns (QP, CQ or SRQ); Port is set for port events.
type AsyncEvent struct {
	Type    EventType
	Context uint64
	QPN     uint32
	Port    uint8
}
