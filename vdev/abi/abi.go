package abi

import "encoding/binary"

// Little-endian accessors of the codecs below.

func u16(b []byte, off int) uint16      { return binary.LittleEndian.Uint16(b[off:]) }
func u32(b []byte, off int) uint32      { return binary.LittleEndian.Uint32(b[off:]) }
func u64(b []byte, off int) uint64      { return binary.LittleEndian.Uint64(b[off:]) }
func put16(b []byte, off int, v uint16) { binary.LittleEndian.PutUint16(b[off:], v) }
func put32(b []byte, off int, v uint32) { binary.LittleEndian.PutUint32(b[off:], v) }
func put64(b []byte, off int, v uint64) { binary.LittleEndian.PutUint64(b[off:], v) }

// Device and driver versions (pvrdma_dev_api.h).
const (
	VersionRoCEv1   = 17 // PVRDMA_ROCEV1_VERSION
	VersionRoCEv2   = 18 // PVRDMA_ROCEV2_VERSION
	VersionPPN64    = 19 // PVRDMA_PPN64_VERSION: 64-bit UAR page frame numbers
	VersionQPHandle = 20 // PVRDMA_QPHANDLE_VERSION: CREATE_QP reply carries qpn and handle
	// DeviceVersion is what the VERSION register reports.
	DeviceVersion = VersionQPHandle
)

// BAR1 register offsets (pvrdma_dev_api.h).
const (
	RegVersion = 0x00 // R: device version
	RegDSRLow  = 0x04 // W: device shared region GPA, low half
	RegDSRHigh = 0x08 // W: high half; written last, loads the DSR
	RegCtl     = 0x0c // W: CtlActivate, CtlUnquiesce, CtlReset
	RegRequest = 0x10 // W: run the command in the command slot
	RegErr     = 0x14 // R: error of the last request or control
	RegICR     = 0x18 // R: interrupt cause (read to clear)
	RegIMR     = 0x1c // R/W: interrupt mask
	RegMACL    = 0x20 // R/W: MAC address bytes 0-3
	RegMACH    = 0x24 // R/W: MAC address bytes 4-5
)

// CTL register values (enum pvrdma_device_ctl).
const (
	CtlActivate  = 0
	CtlUnquiesce = 1
	CtlReset     = 2
)

// Interrupt vectors (enum pvrdma_intr_vector); the cause bit in ICR of
// vector v is 1<<v.
const (
	VectorResponse = 0
	VectorAsync    = 1
	VectorCQ       = 2
	// NumVectors is PVRDMA_MAX_INTERRUPTS.
	NumVectors = 3
)

// UAR doorbells (vmw_pvrdma-abi.h): 32-bit writes at these offsets of any
// UAR page; the low 24 bits carry the object handle.
const (
	UARQPOffset  = 0
	UARCQOffset  = 4
	UARSRQOffset = 8

	UARHandleMask = 0x00FFFFFF
	UARQPSend     = 1 << 30
	UARQPRecv     = 1 << 31
	UARCQArmSol   = 1 << 29
	UARCQArm      = 1 << 30
	UARCQPoll     = 1 << 31
	UARSRQRecv    = 1 << 30
)

// Memory region flags of CREATE_MR and CQ arm flags.
const (
	MRFlagDMA  = 1 << 0 // PVRDMA_MR_FLAG_DMA: all of guest-physical memory
	MRFlagFRMR = 1 << 1 // PVRDMA_MR_FLAG_FRMR: fast-register MR
)

// Capability bits.
const (
	AtomicOpCompSwap     = 1 << 0
	AtomicOpFetchAdd     = 1 << 1
	AtomicOpMaskCompSwap = 1 << 2
	AtomicOpMaskFetchAdd = 1 << 3

	BMMEFlagLocalInv  = 1 << 0
	BMMEFlagRemoteInv = 1 << 1
	BMMEFlagFastRegWR = 1 << 2

	GIDTypeFlagRoCEv1 = 1 << 0
	GIDTypeFlagRoCEv2 = 1 << 1

	DeviceModeRoCE = 0
)

// Command codes (the first enum of pvrdma_dev_api.h); the response code of
// command c is RespFlag|c.
const (
	CmdQueryPort   = 0
	CmdQueryPKey   = 1
	CmdCreatePD    = 2
	CmdDestroyPD   = 3
	CmdCreateMR    = 4
	CmdDestroyMR   = 5
	CmdCreateCQ    = 6
	CmdResizeCQ    = 7
	CmdDestroyCQ   = 8
	CmdCreateQP    = 9
	CmdModifyQP    = 10
	CmdQueryQP     = 11
	CmdDestroyQP   = 12
	CmdCreateUC    = 13
	CmdDestroyUC   = 14
	CmdCreateBind  = 15
	CmdDestroyBind = 16
	CmdCreateSRQ   = 17
	CmdModifySRQ   = 18
	CmdQuerySRQ    = 19
	CmdDestroySRQ  = 20
	// NumCmds is PVRDMA_CMD_MAX.
	NumCmds = 21
	// RespFlag is PVRDMA_CMD_FIRST_RESP.
	RespFlag = 1 << 31
)

// CmdHdrSize is sizeof(struct pvrdma_cmd_hdr).
const CmdHdrSize = 16

const (
	cmdHdrResponse = 0
	// CmdHdrCmdOffset is where the command code sits in a request.
	CmdHdrCmdOffset = 8
)

// CmdHdr is struct pvrdma_cmd_hdr, the first 16 bytes of every request.
type CmdHdr struct {
	Response uint64 // opaque key, echoed in the response
	Cmd      uint32
}

// Decode reads h from b.
func (h *CmdHdr) Decode(b []byte) {
	_ = b[CmdHdrSize-1]
	h.Response = u64(b, cmdHdrResponse)
	h.Cmd = u32(b, CmdHdrCmdOffset)
}

// Encode writes h to b (reserved bytes zero).
func (h CmdHdr) Encode(b []byte) {
	_ = b[CmdHdrSize-1]
	put64(b, cmdHdrResponse, h.Response)
	put32(b, CmdHdrCmdOffset, h.Cmd)
	put32(b, 12, 0)
}

// RespHdrSize is sizeof(struct pvrdma_cmd_resp_hdr).
const RespHdrSize = 16

const (
	respHdrResponse = 0
	respHdrAck      = 8
	respHdrErr      = 12
)

// RespHdr is struct pvrdma_cmd_resp_hdr, the first 16 bytes of every
// response.
type RespHdr struct {
	Response uint64 // copied from the request
	Ack      uint32 // RespFlag | command code
	Err      uint8  // errno, 0 on success
}

// Decode reads h from b.
func (h *RespHdr) Decode(b []byte) {
	_ = b[RespHdrSize-1]
	h.Response = u64(b, respHdrResponse)
	h.Ack = u32(b, respHdrAck)
	h.Err = b[respHdrErr]
}

// Encode writes h to b.
func (h RespHdr) Encode(b []byte) {
	_ = b[RespHdrSize-1]
	put64(b, respHdrResponse, h.Response)
	put32(b, respHdrAck, h.Ack)
	b[respHdrErr] = h.Err
	b[13], b[14], b[15] = 0, 0, 0
}

// CmdReqSize is sizeof(union pvrdma_cmd_req): the driver copies this many
// bytes into the command slot (== sizeof(struct pvrdma_cmd_modify_qp), a
// BUILD_BUG_ON in the driver).
const CmdReqSize = ModifyQPSize

// CmdRespSize is sizeof(union pvrdma_cmd_resp): the driver copies this many
// bytes out of the response slot.
const CmdRespSize = QueryQPRespSize
