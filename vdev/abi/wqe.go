package abi

// Work queue entries, completions and event entries of vmw_pvrdma-abi.h
// and pvrdma_dev_api.h. Enum values (WR and WC opcodes, WC statuses and
// flags, access flags, event types) equal the IB core's and hostverbs'.

// SGESize is sizeof(struct pvrdma_sge).
const SGESize = 16

// SGE is struct pvrdma_sge.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// Decode reads s from b.
func (s *SGE) Decode(b []byte) {
	_ = b[SGESize-1]
	s.Addr, s.Length, s.LKey = u64(b, 0), u32(b, 8), u32(b, 12)
}

// Encode writes s to b.
func (s SGE) Encode(b []byte) {
	_ = b[SGESize-1]
	put64(b, 0, s.Addr)
	put32(b, 8, s.Length)
	put32(b, 12, s.LKey)
}

// RQWQEHdrSize is sizeof(struct pvrdma_rq_wqe_hdr); SGEs follow it.
const RQWQEHdrSize = 16

// RQWQEHdr is struct pvrdma_rq_wqe_hdr.
type RQWQEHdr struct {
	WRID     uint64
	NumSGE   uint32
	TotalLen uint32 // never filled by the drivers: the device sums the SGEs
}

// Decode reads h from b.
func (h *RQWQEHdr) Decode(b []byte) {
	_ = b[RQWQEHdrSize-1]
	h.WRID, h.NumSGE, h.TotalLen = u64(b, 0), u32(b, 8), u32(b, 12)
}

// Encode writes h to b.
func (h RQWQEHdr) Encode(b []byte) {
	_ = b[RQWQEHdrSize-1]
	put64(b, 0, h.WRID)
	put32(b, 8, h.NumSGE)
	put32(b, 12, h.TotalLen)
}

// SQWQEHdrSize is sizeof(struct pvrdma_sq_wqe_hdr); SGEs follow it.
const SQWQEHdrSize = 80

// WRUnionSize is the size of the union wr inside the send WQE header.
const WRUnionSize = 48

const (
	sqWRID     = 0
	sqNumSGE   = 8
	sqTotalLen = 12
	// SQWQEOpcodeOffset is where a send WQE carries its opcode.
	SQWQEOpcodeOffset = 16
	sqSendFlags       = 20
	sqEx              = 24
	sqWR              = 32
)

// SQWQEHdr is struct pvrdma_sq_wqe_hdr. WR holds the raw union wr; decode
// it with the WR* type that matches the opcode and QP type.
type SQWQEHdr struct {
	WRID      uint64
	NumSGE    uint32
	TotalLen  uint32 // never filled by the drivers
	Opcode    uint32
	SendFlags uint32
	// Ex is imm_data (SEND/WRITE_WITH_IMM, verbatim network order) or
	// invalidate_rkey (SEND_WITH_INV, LOCAL_INV).
	Ex uint32
	WR [WRUnionSize]byte
}

// Decode reads h from b.
func (h *SQWQEHdr) Decode(b []byte) {
	_ = b[SQWQEHdrSize-1]
	h.WRID, h.NumSGE, h.TotalLen = u64(b, sqWRID), u32(b, sqNumSGE), u32(b, sqTotalLen)
	h.Opcode, h.SendFlags, h.Ex = u32(b, SQWQEOpcodeOffset), u32(b, sqSendFlags), u32(b, sqEx)
	copy(h.WR[:], b[sqWR:SQWQEHdrSize])
}

// Encode writes h to b.
func (h SQWQEHdr) Encode(b []byte) {
	_ = b[SQWQEHdrSize-1]
	put64(b, sqWRID, h.WRID)
	put32(b, sqNumSGE, h.NumSGE)
	put32(b, sqTotalLen, h.TotalLen)
	put32(b, SQWQEOpcodeOffset, h.Opcode)
	put32(b, sqSendFlags, h.SendFlags)
	put32(b, sqEx, h.Ex)
	put32(b, 28, 0)
	copy(b[sqWR:], h.WR[:])
}

// WRRDMA is the rdma member of the WQE union (RDMA WRITE, WRITE_WITH_IMM,
// READ).
type WRRDMA struct {
	RemoteAddr uint64
	RKey       uint32
}

// Decode reads w from the union bytes b.
func (w *WRRDMA) Decode(b []byte) { _ = b[WRUnionSize-1]; w.RemoteAddr, w.RKey = u64(b, 0), u32(b, 8) }

// Encode writes w to the union bytes b.
func (w WRRDMA) Encode(b []byte) {
	_ = b[WRUnionSize-1]
	clear(b[:WRUnionSize])
	put64(b, 0, w.RemoteAddr)
	put32(b, 8, w.RKey)
}

// WRAtomic is the atomic member of the WQE union (CMP_AND_SWP,
// FETCH_AND_ADD).
type WRAtomic struct {
	RemoteAddr, CompareAdd, Swap uint64
	RKey                         uint32
}

// Decode reads w from the union bytes b.
func (w *WRAtomic) Decode(b []byte) {
	_ = b[WRUnionSize-1]
	w.RemoteAddr, w.CompareAdd, w.Swap, w.RKey = u64(b, 0), u64(b, 8), u64(b, 16), u32(b, 24)
}

// Encode writes w to the union bytes b.
func (w WRAtomic) Encode(b []byte) {
	_ = b[WRUnionSize-1]
	clear(b[:WRUnionSize])
	put64(b, 0, w.RemoteAddr)
	put64(b, 8, w.CompareAdd)
	put64(b, 16, w.Swap)
	put32(b, 24, w.RKey)
}

// WRFastReg is the fast_reg member of the WQE union (REG_MR).
type WRFastReg struct {
	IOVAStart, PLPDirDMA           uint64
	PageShift, PageListLen, Length uint32
	AccessFlags, RKey              uint32
}

// Decode reads w from the union bytes b.
func (w *WRFastReg) Decode(b []byte) {
	_ = b[WRUnionSize-1]
	w.IOVAStart, w.PLPDirDMA = u64(b, 0), u64(b, 8)
	w.PageShift, w.PageListLen, w.Length = u32(b, 16), u32(b, 20), u32(b, 24)
	w.AccessFlags, w.RKey = u32(b, 28), u32(b, 32)
}

// Encode writes w to the union bytes b.
func (w WRFastReg) Encode(b []byte) {
	_ = b[WRUnionSize-1]
	clear(b[:WRUnionSize])
	put64(b, 0, w.IOVAStart)
	put64(b, 8, w.PLPDirDMA)
	put32(b, 16, w.PageShift)
	put32(b, 20, w.PageListLen)
	put32(b, 24, w.Length)
	put32(b, 28, w.AccessFlags)
	put32(b, 32, w.RKey)
}

// WRUD is the ud member of the WQE union (UD and GSI sends).
type WRUD struct {
	RemoteQPN, RemoteQKey uint32
	AV                    AV
}

// Decode reads w from the union bytes b.
func (w *WRUD) Decode(b []byte) {
	_ = b[WRUnionSize-1]
	w.RemoteQPN, w.RemoteQKey = u32(b, 0), u32(b, 4)
	w.AV.Decode(b[8:])
}

// Encode writes w to the union bytes b.
func (w WRUD) Encode(b []byte) {
	_ = b[WRUnionSize-1]
	put32(b, 0, w.RemoteQPN)
	put32(b, 4, w.RemoteQKey)
	w.AV.Encode(b[8:])
}

// AVSize is sizeof(struct pvrdma_av).
const AVSize = 40

const (
	avPortPD            = 0
	avSLTClassFlowLabel = 4
	avDGID              = 8
	avSrcPathBits       = 24
	avGIDIndex          = 25
	avStatRate          = 26
	avHopLimit          = 27
	avDMAC              = 28
)

// AV is struct pvrdma_av, the address vector of a UD send.
type AV struct {
	// PortPD is pd_handle | port<<24.
	PortPD uint32
	// SLTClassFlowLabel is sl<<28 | traffic_class<<20 | flow_label.
	SLTClassFlowLabel uint32
	DGID              [16]byte
	SrcPathBits       uint8
	GIDIndex          uint8
	StatRate          uint8
	HopLimit          uint8
	DMAC              [6]byte
}

// Port is the port number packed in PortPD.
func (a AV) Port() uint8 { return uint8(a.PortPD >> 24) }

// PD is the PD handle packed in PortPD.
func (a AV) PD() uint32 { return a.PortPD & 0xFFFFFF }

// Decode reads a from b.
func (a *AV) Decode(b []byte) {
	_ = b[AVSize-1]
	a.PortPD, a.SLTClassFlowLabel = u32(b, avPortPD), u32(b, avSLTClassFlowLabel)
	copy(a.DGID[:], b[avDGID:avDGID+16])
	a.SrcPathBits, a.GIDIndex, a.StatRate, a.HopLimit = b[avSrcPathBits], b[avGIDIndex], b[avStatRate], b[avHopLimit]
	copy(a.DMAC[:], b[avDMAC:avDMAC+6])
}

// Encode writes a to b.
func (a AV) Encode(b []byte) {
	_ = b[AVSize-1]
	clear(b[:AVSize])
	put32(b, avPortPD, a.PortPD)
	put32(b, avSLTClassFlowLabel, a.SLTClassFlowLabel)
	copy(b[avDGID:], a.DGID[:])
	b[avSrcPathBits], b[avGIDIndex], b[avStatRate], b[avHopLimit] = a.SrcPathBits, a.GIDIndex, a.StatRate, a.HopLimit
	copy(b[avDMAC:], a.DMAC[:])
}

// CQESize is sizeof(struct pvrdma_cqe).
const CQESize = 64

const (
	cqeWRID           = 0
	cqeQP             = 8
	cqeOpcode         = 16
	cqeStatus         = 20
	cqeByteLen        = 24
	cqeImmData        = 28
	cqeSrcQP          = 32
	cqeWCFlags        = 36
	cqeVendorErr      = 40
	cqePKeyIndex      = 44
	cqeSLID           = 46
	cqeSL             = 48
	cqeDLIDPathBits   = 49
	cqePortNum        = 50
	cqeSMAC           = 51
	cqeNetworkHdrType = 57
)

// CQE is struct pvrdma_cqe.
type CQE struct {
	WRID uint64
	// QP is the QP handle (not the QPN): both drivers look the QP up by
	// qp & 0xFFFF in a table indexed by handle.
	QP             uint64
	Opcode         uint32
	Status         uint32
	ByteLen        uint32
	ImmData        uint32
	SrcQP          uint32
	WCFlags        uint32
	VendorErr      uint32
	PKeyIndex      uint16
	SLID           uint16
	SL             uint8
	DLIDPathBits   uint8
	PortNum        uint8
	SMAC           [6]byte
	NetworkHdrType uint8
}

// Decode reads c from b.
func (c *CQE) Decode(b []byte) {
	_ = b[CQESize-1]
	c.WRID, c.QP = u64(b, cqeWRID), u64(b, cqeQP)
	c.Opcode, c.Status, c.ByteLen, c.ImmData = u32(b, cqeOpcode), u32(b, cqeStatus), u32(b, cqeByteLen), u32(b, cqeImmData)
	c.SrcQP, c.WCFlags, c.VendorErr = u32(b, cqeSrcQP), u32(b, cqeWCFlags), u32(b, cqeVendorErr)
	c.PKeyIndex, c.SLID = u16(b, cqePKeyIndex), u16(b, cqeSLID)
	c.SL, c.DLIDPathBits, c.PortNum = b[cqeSL], b[cqeDLIDPathBits], b[cqePortNum]
	copy(c.SMAC[:], b[cqeSMAC:cqeSMAC+6])
	c.NetworkHdrType = b[cqeNetworkHdrType]
}

// Encode writes c to b.
func (c *CQE) Encode(b []byte) {
	_ = b[CQESize-1]
	put64(b, cqeWRID, c.WRID)
	put64(b, cqeQP, c.QP)
	put32(b, cqeOpcode, c.Opcode)
	put32(b, cqeStatus, c.Status)
	put32(b, cqeByteLen, c.ByteLen)
	put32(b, cqeImmData, c.ImmData)
	put32(b, cqeSrcQP, c.SrcQP)
	put32(b, cqeWCFlags, c.WCFlags)
	put32(b, cqeVendorErr, c.VendorErr)
	put16(b, cqePKeyIndex, c.PKeyIndex)
	put16(b, cqeSLID, c.SLID)
	b[cqeSL], b[cqeDLIDPathBits], b[cqePortNum] = c.SL, c.DLIDPathBits, c.PortNum
	copy(b[cqeSMAC:], c.SMAC[:])
	b[cqeNetworkHdrType] = c.NetworkHdrType
	clear(b[cqeNetworkHdrType+1 : CQESize])
}

// EQESize is sizeof(struct pvrdma_eqe), an async event ring entry.
const EQESize = 8

// EQE is struct pvrdma_eqe.
type EQE struct {
	Type uint32 // enum pvrdma_eqe_type == hostverbs.EventType
	Info uint32 // QP, CQ or SRQ handle, or port number
}

// Decode reads e from b.
func (e *EQE) Decode(b []byte) { _ = b[EQESize-1]; e.Type, e.Info = u32(b, 0), u32(b, 4) }

// Encode writes e to b.
func (e EQE) Encode(b []byte) { _ = b[EQESize-1]; put32(b, 0, e.Type); put32(b, 4, e.Info) }

// CQNESize is sizeof(struct pvrdma_cqne), a CQ-notification ring entry.
const CQNESize = 4

// CQNE is struct pvrdma_cqne.
type CQNE struct{ Info uint32 } // CQ handle

// Decode reads c from b.
func (c *CQNE) Decode(b []byte) { c.Info = u32(b[:CQNESize], 0) }

// Encode writes c to b.
func (c CQNE) Encode(b []byte) { put32(b[:CQNESize], 0, c.Info) }
