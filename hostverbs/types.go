package hostverbs

import (
	"fmt"
	"net/netip"
)

// The numeric values of the enums and flag sets in this file are those of
// the Linux IB core (include/rdma/ib_verbs.h), which the PVRDMA ABI copies
// one to one, so the device model converts by type conversion alone.

// QPType is a QP transport service type (IBA 9.8.1).
type QPType uint8

// QP types. The soft provider implements RC, UD and GSI.
const (
	QPTypeSMI QPType = 0
	QPTypeGSI QPType = 1
	QPTypeRC  QPType = 2
	QPTypeUC  QPType = 3
	QPTypeUD  QPType = 4
)

func (t QPType) String() string {
	switch t {
	case QPTypeSMI:
		return "SMI"
	case QPTypeGSI:
		return "GSI"
	case QPTypeRC:
		return "RC"
	case QPTypeUC:
		return "UC"
	case QPTypeUD:
		return "UD"
	}
	return fmt.Sprintf("QPType(%d)", uint8(t))
}

// QPState is a QP state (IBA 10.3.1).
type QPState uint8

// QP states.
const (
	QPStateReset QPState = 0
	QPStateInit  QPState = 1
	QPStateRTR   QPState = 2
	QPStateRTS   QPState = 3
	QPStateSQD   QPState = 4
	QPStateSQE   QPState = 5
	QPStateErr   QPState = 6
)

var qpStateNames = [...]string{"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"}

func (s QPState) String() string {
	if int(s) < len(qpStateNames) {
		return qpStateNames[s]
	}
	return fmt.Sprintf("QPState(%d)", uint8(s))
}

// AttrMask selects the QPAttr fields a Modify or Query concerns.
type AttrMask uint32

// QP attribute mask bits (ib_qp_attr_mask).
const (
	AttrState            AttrMask = 1 << 0
	AttrCurState         AttrMask = 1 << 1
	AttrEnSQDAsyncNotify AttrMask = 1 << 2
	AttrAccessFlags      AttrMask = 1 << 3
	AttrPKeyIndex        AttrMask = 1 << 4
	AttrPort             AttrMask = 1 << 5
	AttrQKey             AttrMask = 1 << 6
	AttrAV               AttrMask = 1 << 7
	AttrPathMTU          AttrMask = 1 << 8
	AttrTimeout          AttrMask = 1 << 9
	AttrRetryCnt         AttrMask = 1 << 10
	AttrRNRRetry         AttrMask = 1 << 11
	AttrRQPSN            AttrMask = 1 << 12
	AttrMaxQPRdAtomic    AttrMask = 1 << 13
	AttrAltPath          AttrMask = 1 << 14
	AttrMinRNRTimer      AttrMask = 1 << 15
	AttrSQPSN            AttrMask = 1 << 16
	AttrMaxDestRdAtomic  AttrMask = 1 << 17
	AttrPathMigState     AttrMask = 1 << 18
	AttrCap              AttrMask = 1 << 19
	AttrDestQPN          AttrMask = 1 << 20
	// AttrAll is every defined bit.
	AttrAll AttrMask = 1<<21 - 1
)

// Access is a set of memory and QP access rights.
type Access uint32

// Access flags (ib_access_flags).
const (
	AccessLocalWrite   Access = 1 << 0
	AccessRemoteWrite  Access = 1 << 1
	AccessRemoteRead   Access = 1 << 2
	AccessRemoteAtomic Access = 1 << 3
	AccessMWBind       Access = 1 << 4
	AccessZeroBased    Access = 1 << 5
)

// MTU is an IB path MTU code.
type MTU uint8

// Path MTU codes.
const (
	MTU256  MTU = 1
	MTU512  MTU = 2
	MTU1024 MTU = 3
	MTU2048 MTU = 4
	MTU4096 MTU = 5
)

// Bytes returns the MTU in bytes, or 0 for an invalid code.
func (m MTU) Bytes() int {
	if m < MTU256 || m > MTU4096 {
		return 0
	}
	return 128 << m
}

// Valid reports whether m is one of the five defined codes.
func (m MTU) Valid() bool { return m >= MTU256 && m <= MTU4096 }

// WROpcode is a send work request opcode (ib_wr_opcode order).
type WROpcode uint8

// Send work request opcodes.
const (
	WRRDMAWrite          WROpcode = 0
	WRRDMAWriteWithImm   WROpcode = 1
	WRSend               WROpcode = 2
	WRSendWithImm        WROpcode = 3
	WRRDMARead           WROpcode = 4
	WRAtomicCmpAndSwp    WROpcode = 5
	WRAtomicFetchAndAdd  WROpcode = 6
	WRLSO                WROpcode = 7
	WRSendWithInv        WROpcode = 8
	WRRDMAReadWithInv    WROpcode = 9
	WRLocalInv           WROpcode = 10
	WRRegMR              WROpcode = 11
	WRMaskedAtomicCmpSwp WROpcode = 12
	WRMaskedAtomicFAdd   WROpcode = 13
	WRBindMW             WROpcode = 14
)

var wrOpcodeNames = [...]string{"RDMA_WRITE", "RDMA_WRITE_WITH_IMM", "SEND", "SEND_WITH_IMM",
	"RDMA_READ", "ATOMIC_CMP_AND_SWP", "ATOMIC_FETCH_AND_ADD", "LSO", "SEND_WITH_INV",
	"RDMA_READ_WITH_INV", "LOCAL_INV", "REG_MR", "MASKED_ATOMIC_CMP_AND_SWP",
	"MASKED_ATOMIC_FETCH_AND_ADD", "BIND_MW"}

func (o WROpcode) String() string {
	if int(o) < len(wrOpcodeNames) {
		return wrOpcodeNames[o]
	}
	return fmt.Sprintf("WROpcode(%d)", uint8(o))
}

// SendFlags modify a send work request.
type SendFlags uint32

// Send flags (ib_send_flags).
const (
	SendFence     SendFlags = 1 << 0
	SendSignaled  SendFlags = 1 << 1
	SendSolicited SendFlags = 1 << 2
	SendInline    SendFlags = 1 << 3
)

// WCOpcode is a work completion opcode.
type WCOpcode uint8

// Work completion opcodes (ib_wc_opcode).
const (
	WCSend            WCOpcode = 0
	WCRDMAWrite       WCOpcode = 1
	WCRDMARead        WCOpcode = 2
	WCCompSwap        WCOpcode = 3
	WCFetchAdd        WCOpcode = 4
	WCBindMW          WCOpcode = 5
	WCLSO             WCOpcode = 6
	WCLocalInv        WCOpcode = 7
	WCRegMR           WCOpcode = 8
	WCMaskedCompSwap  WCOpcode = 9
	WCMaskedFetchAdd  WCOpcode = 10
	WCRecv            WCOpcode = 0x80
	WCRecvRDMAWithImm WCOpcode = 0x81
)

// WCStatus is a work completion status (ib_wc_status order).
type WCStatus uint8

// Work completion statuses.
const (
	WCSuccess        WCStatus = 0
	WCLocLenErr      WCStatus = 1
	WCLocQPOpErr     WCStatus = 2
	WCLocEECOpErr    WCStatus = 3
	WCLocProtErr     WCStatus = 4
	WCWRFlushErr     WCStatus = 5
	WCMWBindErr      WCStatus = 6
	WCBadRespErr     WCStatus = 7
	WCLocAccessErr   WCStatus = 8
	WCRemInvReqErr   WCStatus = 9
	WCRemAccessErr   WCStatus = 10
	WCRemOpErr       WCStatus = 11
	WCRetryExcErr    WCStatus = 12
	WCRNRRetryExcErr WCStatus = 13
	WCLocRDDViolErr  WCStatus = 14
	WCRemInvRdReqErr WCStatus = 15
	WCRemAbortErr    WCStatus = 16
	WCInvEECNErr     WCStatus = 17
	WCInvEECStateErr WCStatus = 18
	WCFatalErr       WCStatus = 19
	WCRespTimeoutErr WCStatus = 20
	WCGeneralErr     WCStatus = 21
)

var wcStatusNames = [...]string{"SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR",
	"LOC_PROT_ERR", "WR_FLUSH_ERR", "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR",
	"REM_ACCESS_ERR", "REM_OP_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR",
	"REM_INV_RD_REQ_ERR", "REM_ABORT_ERR", "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR",
	"RESP_TIMEOUT_ERR", "GENERAL_ERR"}

func (s WCStatus) String() string {
	if int(s) < len(wcStatusNames) {
		return wcStatusNames[s]
	}
	return fmt.Sprintf("WCStatus(%d)", uint8(s))
}

// WCFlags describe a work completion.
type WCFlags uint32

// Work completion flags (PVRDMA/ib_wc_flags order).
const (
	WCFlagGRH               WCFlags = 1 << 0
	WCFlagWithImm           WCFlags = 1 << 1
	WCFlagWithInvalidate    WCFlags = 1 << 2
	WCFlagIPCsumOK          WCFlags = 1 << 3
	WCFlagWithSMAC          WCFlags = 1 << 4
	WCFlagWithVLAN          WCFlags = 1 << 5
	WCFlagWithNetworkHdrTyp WCFlags = 1 << 6
)

// NetworkHdrType says how a RoCE packet was carried (for GRH synthesis and
// the WC's network_hdr_type).
type NetworkHdrType uint8

// Network header types.
const (
	NetworkIB   NetworkHdrType = 0 // IB or RoCE v1
	NetworkIPv4 NetworkHdrType = 1 // RoCE v2 over IPv4
	NetworkIPv6 NetworkHdrType = 2 // RoCE v2 over IPv6
)

// EventType is an asynchronous event type (ib_event_type order).
type EventType uint8

// Asynchronous event types.
const (
	EventCQErr           EventType = 0
	EventQPFatal         EventType = 1
	EventQPReqErr        EventType = 2
	EventQPAccessErr     EventType = 3
	EventCommEst         EventType = 4
	EventSQDrained       EventType = 5
	EventPathMig         EventType = 6
	EventPathMigErr      EventType = 7
	EventDeviceFatal     EventType = 8
	EventPortActive      EventType = 9
	EventPortErr         EventType = 10
	EventLIDChange       EventType = 11
	EventPKeyChange      EventType = 12
	EventSMChange        EventType = 13
	EventSRQErr          EventType = 14
	EventSRQLimitReached EventType = 15
	EventQPLastWQEReach  EventType = 16
	EventClientRereg     EventType = 17
	EventGIDChange       EventType = 18
)

// GIDType is how a GID is carried on the wire.
type GIDType uint8

// GID types.
const (
	GIDTypeRoCEv1 GIDType = 1
	GIDTypeRoCEv2 GIDType = 2
)

func (t GIDType) String() string {
	switch t {
	case GIDTypeRoCEv1:
		return "RoCE v1"
	case GIDTypeRoCEv2:
		return "RoCE v2"
	}
	return fmt.Sprintf("GIDType(%d)", uint8(t))
}

// GID is a 128-bit global identifier; for RoCE v2 it is an IPv6 address
// or an IPv4-mapped IPv6 address (::ffff:a.b.c.d).
type GID [16]byte

// GIDFromAddr returns the GID of an IP address (IPv4 as v4-mapped).
func GIDFromAddr(a netip.Addr) GID { return GID(a.As16()) }

// Addr returns the GID as an IP address, unmapping IPv4-mapped GIDs.
func (g GID) Addr() netip.Addr { return netip.AddrFrom16(g).Unmap() }

// IsV4 reports whether g is an IPv4-mapped GID.
func (g GID) IsV4() bool { return netip.AddrFrom16(g).Is4In6() }

// IsZero reports whether g is all zeros (an empty GID table slot).
func (g GID) IsZero() bool { return g == GID{} }

func (g GID) String() string { return netip.AddrFrom16(g).String() }

// GIDEntry is one GID table entry.
type GIDEntry struct {
	GID  GID
	Type GIDType
}
