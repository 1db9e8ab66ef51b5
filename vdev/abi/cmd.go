package abi

// Command requests and responses of pvrdma_dev_api.h. Every request starts
// with a CmdHdr and every response with a RespHdr (16 bytes each); the
// offsets below count from the start of the request or response.

// Request sizes.
const (
	QueryPortSize   = 24
	QueryPKeySize   = 24
	CreateUCSize    = 24
	DestroyUCSize   = 24
	CreatePDSize    = 24
	DestroyPDSize   = 24
	CreateMRSize    = 56
	DestroyMRSize   = 24
	CreateCQSize    = 40
	ResizeCQSize    = 24
	DestroyCQSize   = 24
	CreateQPSize    = 80
	ModifyQPSize    = 24 + QPAttrSize // 184
	QueryQPSize     = 24
	DestroyQPSize   = 24
	CreateBindSize  = 48
	DestroyBindSize = 40
	CreateSRQSize   = 56
	ModifySRQSize   = 24 + SRQAttrSize // 40
	QuerySRQSize    = 24
	DestroySRQSize  = 24
)

// Response sizes.
const (
	QueryPortRespSize  = RespHdrSize + PortAttrSize // 64
	QueryPKeyRespSize  = 24
	CreateUCRespSize   = 24
	CreatePDRespSize   = 24
	CreateMRRespSize   = 32
	CreateCQRespSize   = 24
	ResizeCQRespSize   = 24
	CreateQPRespSize   = 40 // version < 20
	CreateQPRespV2Size = 44
	QueryQPRespSize    = RespHdrSize + QPAttrSize // 176
	DestroyQPRespSize  = 24
	CreateSRQRespSize  = 24
	QuerySRQRespSize   = RespHdrSize + SRQAttrSize // 32
)

// HandleReq is the layout shared by the requests that carry one u32 at
// offset 16: DESTROY_UC/PD/MR/CQ/QP/SRQ (a handle), CREATE_PD (a context
// handle) and QUERY_SRQ.
type HandleReq struct{ Handle uint32 }

const reqArg0 = CmdHdrSize // first argument of every request

// Decode reads r from b.
func (r *HandleReq) Decode(b []byte) { _ = b[24-1]; r.Handle = u32(b, reqArg0) }

// Encode writes r to b.
func (r HandleReq) Encode(b []byte) { _ = b[24-1]; put32(b, reqArg0, r.Handle); put32(b, reqArg0+4, 0) }

// QueryPort is struct pvrdma_cmd_query_port.
type QueryPort struct{ PortNum uint8 }

// Decode reads r from b.
func (r *QueryPort) Decode(b []byte) { _ = b[QueryPortSize-1]; r.PortNum = b[reqArg0] }

// Encode writes r to b.
func (r QueryPort) Encode(b []byte) {
	_ = b[QueryPortSize-1]
	clear(b[reqArg0:QueryPortSize])
	b[reqArg0] = r.PortNum
}

// QueryPortResp is struct pvrdma_cmd_query_port_resp.
type QueryPortResp struct{ Attrs PortAttr }

// Decode reads r from b.
func (r *QueryPortResp) Decode(b []byte) { r.Attrs.Decode(b[RespHdrSize:QueryPortRespSize]) }

// Encode writes r to b.
func (r QueryPortResp) Encode(b []byte) { r.Attrs.Encode(b[RespHdrSize:QueryPortRespSize]) }

// QueryPKey is struct pvrdma_cmd_query_pkey.
type QueryPKey struct{ PortNum, Index uint8 }

// Decode reads r from b.
func (r *QueryPKey) Decode(b []byte) {
	_ = b[QueryPKeySize-1]
	r.PortNum, r.Index = b[reqArg0], b[reqArg0+1]
}

// Encode writes r to b.
func (r QueryPKey) Encode(b []byte) {
	_ = b[QueryPKeySize-1]
	clear(b[reqArg0:QueryPKeySize])
	b[reqArg0], b[reqArg0+1] = r.PortNum, r.Index
}

// QueryPKeyResp is struct pvrdma_cmd_query_pkey_resp.
type QueryPKeyResp struct{ PKey uint16 }

// Decode reads r from b.
func (r *QueryPKeyResp) Decode(b []byte) { _ = b[QueryPKeyRespSize-1]; r.PKey = u16(b, RespHdrSize) }

// Encode writes r to b.
func (r QueryPKeyResp) Encode(b []byte) {
	_ = b[QueryPKeyRespSize-1]
	clear(b[RespHdrSize:QueryPKeyRespSize])
	put16(b, RespHdrSize, r.PKey)
}

// CreateUC is struct pvrdma_cmd_create_uc: the page frame number of the
// UAR page the new user context uses (pfn64 from device version 19 on).
type CreateUC struct{ PFN uint64 }

// Decode reads r from b.
func (r *CreateUC) Decode(b []byte) { _ = b[CreateUCSize-1]; r.PFN = u64(b, reqArg0) }

// Encode writes r to b.
func (r CreateUC) Encode(b []byte) { _ = b[CreateUCSize-1]; put64(b, reqArg0, r.PFN) }

// oneU32Resp is the shape of the responses that carry one u32 at offset
// 16: CREATE_UC (ctx_handle), CREATE_PD (pd_handle), RESIZE_CQ (cqe),
// DESTROY_QP (events_reported) and CREATE_SRQ (srqn).
type oneU32Resp struct{ V uint32 }

func (r *oneU32Resp) Decode(b []byte) { _ = b[24-1]; r.V = u32(b, RespHdrSize) }
func (r oneU32Resp) Encode(b []byte) {
	_ = b[24-1]
	put32(b, RespHdrSize, r.V)
	put32(b, RespHdrSize+4, 0)
}

// CreateUCResp is struct pvrdma_cmd_create_uc_resp.
type CreateUCResp struct{ CtxHandle uint32 }

// Decode reads r from b.
func (r *CreateUCResp) Decode(b []byte) { var v oneU32Resp; v.Decode(b); r.CtxHandle = v.V }

// Encode writes r to b.
func (r CreateUCResp) Encode(b []byte) { oneU32Resp{r.CtxHandle}.Encode(b) }

// DestroyUC is struct pvrdma_cmd_destroy_uc.
type DestroyUC struct{ CtxHandle uint32 }

// Decode reads r from b.
func (r *DestroyUC) Decode(b []byte) { var v HandleReq; v.Decode(b); r.CtxHandle = v.Handle }

// Encode writes r to b.
func (r DestroyUC) Encode(b []byte) { HandleReq{r.CtxHandle}.Encode(b) }

// CreatePD is struct pvrdma_cmd_create_pd.
type CreatePD struct{ CtxHandle uint32 }

// Decode reads r from b.
func (r *CreatePD) Decode(b []byte) { var v HandleReq; v.Decode(b); r.CtxHandle = v.Handle }

// Encode writes r to b.
func (r CreatePD) Encode(b []byte) { HandleReq{r.CtxHandle}.Encode(b) }

// CreatePDResp is struct pvrdma_cmd_create_pd_resp.
type CreatePDResp struct{ PDHandle uint32 }

// Decode reads r from b.
func (r *CreatePDResp) Decode(b []byte) { var v oneU32Resp; v.Decode(b); r.PDHandle = v.V }

// Encode writes r to b.
func (r CreatePDResp) Encode(b []byte) { oneU32Resp{r.PDHandle}.Encode(b) }

// DestroyPD is struct pvrdma_cmd_destroy_pd.
type DestroyPD struct{ PDHandle uint32 }

// Decode reads r from b.
func (r *DestroyPD) Decode(b []byte) { var v HandleReq; v.Decode(b); r.PDHandle = v.Handle }

// Encode writes r to b.
func (r DestroyPD) Encode(b []byte) { HandleReq{r.PDHandle}.Encode(b) }

const (
	cmrStart  = 16
	cmrLength = 24
	// CreateMRPDirOffset is where CREATE_MR carries its page directory.
	CreateMRPDirOffset = 32
	cmrPDHandle        = 40
	cmrAccessFlags     = 44
	cmrFlags           = 48
	cmrNChunks         = 52
)

// CreateMR is struct pvrdma_cmd_create_mr.
type CreateMR struct {
	Start, Length, PDirDMA uint64
	PDHandle, AccessFlags  uint32
	Flags, NChunks         uint32
}

// Decode reads r from b.
func (r *CreateMR) Decode(b []byte) {
	_ = b[CreateMRSize-1]
	r.Start, r.Length, r.PDirDMA = u64(b, cmrStart), u64(b, cmrLength), u64(b, CreateMRPDirOffset)
	r.PDHandle, r.AccessFlags = u32(b, cmrPDHandle), u32(b, cmrAccessFlags)
	r.Flags, r.NChunks = u32(b, cmrFlags), u32(b, cmrNChunks)
}

// Encode writes r to b.
func (r CreateMR) Encode(b []byte) {
	_ = b[CreateMRSize-1]
	put64(b, cmrStart, r.Start)
	put64(b, cmrLength, r.Length)
	put64(b, CreateMRPDirOffset, r.PDirDMA)
	put32(b, cmrPDHandle, r.PDHandle)
	put32(b, cmrAccessFlags, r.AccessFlags)
	put32(b, cmrFlags, r.Flags)
	put32(b, cmrNChunks, r.NChunks)
}

// CreateMRResp is struct pvrdma_cmd_create_mr_resp.
type CreateMRResp struct{ MRHandle, LKey, RKey uint32 }

// Decode reads r from b.
func (r *CreateMRResp) Decode(b []byte) {
	_ = b[CreateMRRespSize-1]
	r.MRHandle, r.LKey, r.RKey = u32(b, 16), u32(b, 20), u32(b, 24)
}

// Encode writes r to b.
func (r CreateMRResp) Encode(b []byte) {
	_ = b[CreateMRRespSize-1]
	put32(b, 16, r.MRHandle)
	put32(b, 20, r.LKey)
	put32(b, 24, r.RKey)
	put32(b, 28, 0)
}

// DestroyMR is struct pvrdma_cmd_destroy_mr.
type DestroyMR struct{ MRHandle uint32 }

// Decode reads r from b.
func (r *DestroyMR) Decode(b []byte) { var v HandleReq; v.Decode(b); r.MRHandle = v.Handle }

// Encode writes r to b.
func (r DestroyMR) Encode(b []byte) { HandleReq{r.MRHandle}.Encode(b) }

// CreateCQ is struct pvrdma_cmd_create_cq.
type CreateCQ struct {
	PDirDMA                 uint64
	CtxHandle, CQE, NChunks uint32
}

// Decode reads r from b.
func (r *CreateCQ) Decode(b []byte) {
	_ = b[CreateCQSize-1]
	r.PDirDMA = u64(b, 16)
	r.CtxHandle, r.CQE, r.NChunks = u32(b, 24), u32(b, 28), u32(b, 32)
}

// Encode writes r to b.
func (r CreateCQ) Encode(b []byte) {
	_ = b[CreateCQSize-1]
	put64(b, 16, r.PDirDMA)
	put32(b, 24, r.CtxHandle)
	put32(b, 28, r.CQE)
	put32(b, 32, r.NChunks)
	put32(b, 36, 0)
}

// CreateCQResp is struct pvrdma_cmd_create_cq_resp.
type CreateCQResp struct{ CQHandle, CQE uint32 }

// Decode reads r from b.
func (r *CreateCQResp) Decode(b []byte) {
	_ = b[CreateCQRespSize-1]
	r.CQHandle, r.CQE = u32(b, 16), u32(b, 20)
}

// Encode writes r to b.
func (r CreateCQResp) Encode(b []byte) {
	_ = b[CreateCQRespSize-1]
	put32(b, 16, r.CQHandle)
	put32(b, 20, r.CQE)
}

// ResizeCQ is struct pvrdma_cmd_resize_cq.
type ResizeCQ struct{ CQHandle, CQE uint32 }

// Decode reads r from b.
func (r *ResizeCQ) Decode(b []byte) {
	_ = b[ResizeCQSize-1]
	r.CQHandle, r.CQE = u32(b, 16), u32(b, 20)
}

// Encode writes r to b.
func (r ResizeCQ) Encode(b []byte) {
	_ = b[ResizeCQSize-1]
	put32(b, 16, r.CQHandle)
	put32(b, 20, r.CQE)
}

// ResizeCQResp is struct pvrdma_cmd_resize_cq_resp.
type ResizeCQResp struct{ CQE uint32 }

// Decode reads r from b.
func (r *ResizeCQResp) Decode(b []byte) { var v oneU32Resp; v.Decode(b); r.CQE = v.V }

// Encode writes r to b.
func (r ResizeCQResp) Encode(b []byte) { oneU32Resp{r.CQE}.Encode(b) }

// DestroyCQ is struct pvrdma_cmd_destroy_cq.
type DestroyCQ struct{ CQHandle uint32 }

// Decode reads r from b.
func (r *DestroyCQ) Decode(b []byte) { var v HandleReq; v.Decode(b); r.CQHandle = v.Handle }

// Encode writes r to b.
func (r DestroyCQ) Encode(b []byte) { HandleReq{r.CQHandle}.Encode(b) }

const (
	// CreateQPPDirOffset is where CREATE_QP carries its page directory.
	CreateQPPDirOffset = 16
	cqpPDHandle        = 24
	// CreateQPSendCQOffset is where CREATE_QP names its send CQ.
	CreateQPSendCQOffset = 28
	cqpRecvCQHandle      = 32
	cqpSRQHandle         = 36
	cqpMaxSendWR         = 40
	cqpMaxRecvWR         = 44
	cqpMaxSendSGE        = 48
	cqpMaxRecvSGE        = 52
	cqpMaxInlineData     = 56
	cqpLKey              = 60
	cqpAccessFlags       = 64
	cqpTotalChunks       = 68
	cqpSendChunks        = 70
	cqpMaxAtomicArg      = 72
	cqpSQSigAll          = 74
	cqpQPType            = 75
	cqpIsSRQ             = 76
)

// CreateQP is struct pvrdma_cmd_create_qp.
type CreateQP struct {
	PDirDMA                                      uint64
	PDHandle, SendCQHandle, RecvCQHandle         uint32
	SRQHandle                                    uint32
	MaxSendWR, MaxRecvWR, MaxSendSGE, MaxRecvSGE uint32
	MaxInlineData, LKey, AccessFlags             uint32
	TotalChunks, SendChunks, MaxAtomicArg        uint16
	SQSigAll, QPType, IsSRQ                      uint8
}

// Decode reads r from b.
func (r *CreateQP) Decode(b []byte) {
	_ = b[CreateQPSize-1]
	r.PDirDMA = u64(b, CreateQPPDirOffset)
	r.PDHandle, r.SendCQHandle, r.RecvCQHandle = u32(b, cqpPDHandle), u32(b, CreateQPSendCQOffset), u32(b, cqpRecvCQHandle)
	r.SRQHandle = u32(b, cqpSRQHandle)
	r.MaxSendWR, r.MaxRecvWR = u32(b, cqpMaxSendWR), u32(b, cqpMaxRecvWR)
	r.MaxSendSGE, r.MaxRecvSGE = u32(b, cqpMaxSendSGE), u32(b, cqpMaxRecvSGE)
	r.MaxInlineData, r.LKey, r.AccessFlags = u32(b, cqpMaxInlineData), u32(b, cqpLKey), u32(b, cqpAccessFlags)
	r.TotalChunks, r.SendChunks, r.MaxAtomicArg = u16(b, cqpTotalChunks), u16(b, cqpSendChunks), u16(b, cqpMaxAtomicArg)
	r.SQSigAll, r.QPType, r.IsSRQ = b[cqpSQSigAll], b[cqpQPType], b[cqpIsSRQ]
}

// Encode writes r to b.
func (r CreateQP) Encode(b []byte) {
	_ = b[CreateQPSize-1]
	clear(b[CmdHdrSize:CreateQPSize])
	put64(b, CreateQPPDirOffset, r.PDirDMA)
	put32(b, cqpPDHandle, r.PDHandle)
	put32(b, CreateQPSendCQOffset, r.SendCQHandle)
	put32(b, cqpRecvCQHandle, r.RecvCQHandle)
	put32(b, cqpSRQHandle, r.SRQHandle)
	put32(b, cqpMaxSendWR, r.MaxSendWR)
	put32(b, cqpMaxRecvWR, r.MaxRecvWR)
	put32(b, cqpMaxSendSGE, r.MaxSendSGE)
	put32(b, cqpMaxRecvSGE, r.MaxRecvSGE)
	put32(b, cqpMaxInlineData, r.MaxInlineData)
	put32(b, cqpLKey, r.LKey)
	put32(b, cqpAccessFlags, r.AccessFlags)
	put16(b, cqpTotalChunks, r.TotalChunks)
	put16(b, cqpSendChunks, r.SendChunks)
	put16(b, cqpMaxAtomicArg, r.MaxAtomicArg)
	b[cqpSQSigAll], b[cqpQPType], b[cqpIsSRQ] = r.SQSigAll, r.QPType, r.IsSRQ
}

// CreateQPResp is struct pvrdma_cmd_create_qp_resp_v2 (device version 20):
// the QP number used on the wire and the handle used in doorbells and
// CQEs, which differ.
type CreateQPResp struct {
	QPN, QPHandle                                uint32
	MaxSendWR, MaxRecvWR, MaxSendSGE, MaxRecvSGE uint32
	MaxInlineData                                uint32
}

// Decode reads r from b (the v2 layout).
func (r *CreateQPResp) Decode(b []byte) {
	_ = b[CreateQPRespV2Size-1]
	r.QPN, r.QPHandle = u32(b, 16), u32(b, 20)
	r.MaxSendWR, r.MaxRecvWR, r.MaxSendSGE, r.MaxRecvSGE = u32(b, 24), u32(b, 28), u32(b, 32), u32(b, 36)
	r.MaxInlineData = u32(b, 40)
}

// Encode writes r to b (the v2 layout).
func (r CreateQPResp) Encode(b []byte) {
	_ = b[CreateQPRespV2Size-1]
	put32(b, 16, r.QPN)
	put32(b, 20, r.QPHandle)
	put32(b, 24, r.MaxSendWR)
	put32(b, 28, r.MaxRecvWR)
	put32(b, 32, r.MaxSendSGE)
	put32(b, 36, r.MaxRecvSGE)
	put32(b, 40, r.MaxInlineData)
}

// ModifyQP is struct pvrdma_cmd_modify_qp.
type ModifyQP struct {
	QPHandle, AttrMask uint32
	Attrs              QPAttr
}

// Decode reads r from b.
func (r *ModifyQP) Decode(b []byte) {
	_ = b[ModifyQPSize-1]
	r.QPHandle, r.AttrMask = u32(b, 16), u32(b, 20)
	r.Attrs.Decode(b[24:])
}

// Encode writes r to b.
func (r ModifyQP) Encode(b []byte) {
	_ = b[ModifyQPSize-1]
	put32(b, 16, r.QPHandle)
	put32(b, 20, r.AttrMask)
	r.Attrs.Encode(b[24:])
}

// QueryQP is struct pvrdma_cmd_query_qp.
type QueryQP struct{ QPHandle, AttrMask uint32 }

// Decode reads r from b.
func (r *QueryQP) Decode(b []byte) {
	_ = b[QueryQPSize-1]
	r.QPHandle, r.AttrMask = u32(b, 16), u32(b, 20)
}

// Encode writes r to b.
func (r QueryQP) Encode(b []byte) {
	_ = b[QueryQPSize-1]
	put32(b, 16, r.QPHandle)
	put32(b, 20, r.AttrMask)
}

// QueryQPResp is struct pvrdma_cmd_query_qp_resp.
type QueryQPResp struct{ Attrs QPAttr }

// Decode reads r from b.
func (r *QueryQPResp) Decode(b []byte) { r.Attrs.Decode(b[RespHdrSize:QueryQPRespSize]) }

// Encode writes r to b.
func (r QueryQPResp) Encode(b []byte) { r.Attrs.Encode(b[RespHdrSize:QueryQPRespSize]) }

// DestroyQP is struct pvrdma_cmd_destroy_qp.
type DestroyQP struct{ QPHandle uint32 }

// Decode reads r from b.
func (r *DestroyQP) Decode(b []byte) { var v HandleReq; v.Decode(b); r.QPHandle = v.Handle }

// Encode writes r to b.
func (r DestroyQP) Encode(b []byte) { HandleReq{r.QPHandle}.Encode(b) }

// DestroyQPResp is struct pvrdma_cmd_destroy_qp_resp.
type DestroyQPResp struct{ EventsReported uint32 }

// Decode reads r from b.
func (r *DestroyQPResp) Decode(b []byte) { var v oneU32Resp; v.Decode(b); r.EventsReported = v.V }

// Encode writes r to b.
func (r DestroyQPResp) Encode(b []byte) { oneU32Resp{r.EventsReported}.Encode(b) }

const (
	cbMTU     = 16
	cbVLAN    = 20
	cbIndex   = 24
	cbNewGID  = 28
	cbGIDType = 44
)

// CreateBind is struct pvrdma_cmd_create_bind: install a GID at an index.
type CreateBind struct {
	MTU, VLAN, Index uint32
	NewGID           [16]byte
	GIDType          uint8
}

// Decode reads r from b.
func (r *CreateBind) Decode(b []byte) {
	_ = b[CreateBindSize-1]
	r.MTU, r.VLAN, r.Index = u32(b, cbMTU), u32(b, cbVLAN), u32(b, cbIndex)
	copy(r.NewGID[:], b[cbNewGID:cbNewGID+16])
	r.GIDType = b[cbGIDType]
}

// Encode writes r to b.
func (r CreateBind) Encode(b []byte) {
	_ = b[CreateBindSize-1]
	clear(b[CmdHdrSize:CreateBindSize])
	put32(b, cbMTU, r.MTU)
	put32(b, cbVLAN, r.VLAN)
	put32(b, cbIndex, r.Index)
	copy(b[cbNewGID:], r.NewGID[:])
	b[cbGIDType] = r.GIDType
}

// DestroyBind is struct pvrdma_cmd_destroy_bind.
type DestroyBind struct {
	Index   uint32
	DestGID [16]byte
}

// Decode reads r from b.
func (r *DestroyBind) Decode(b []byte) {
	_ = b[DestroyBindSize-1]
	r.Index = u32(b, 16)
	copy(r.DestGID[:], b[20:36])
}

// Encode writes r to b.
func (r DestroyBind) Encode(b []byte) {
	_ = b[DestroyBindSize-1]
	clear(b[CmdHdrSize:DestroyBindSize])
	put32(b, 16, r.Index)
	copy(b[20:], r.DestGID[:])
}

// CreateSRQ is struct pvrdma_cmd_create_srq.
type CreateSRQ struct {
	PDirDMA           uint64
	PDHandle, NChunks uint32
	Attrs             SRQAttr
	SRQType           uint8
}

// Decode reads r from b.
func (r *CreateSRQ) Decode(b []byte) {
	_ = b[CreateSRQSize-1]
	r.PDirDMA = u64(b, 16)
	r.PDHandle, r.NChunks = u32(b, 24), u32(b, 28)
	r.Attrs.Decode(b[32:])
	r.SRQType = b[48]
}

// Encode writes r to b.
func (r CreateSRQ) Encode(b []byte) {
	_ = b[CreateSRQSize-1]
	clear(b[CmdHdrSize:CreateSRQSize])
	put64(b, 16, r.PDirDMA)
	put32(b, 24, r.PDHandle)
	put32(b, 28, r.NChunks)
	r.Attrs.Encode(b[32:])
	b[48] = r.SRQType
}

// CreateSRQResp is struct pvrdma_cmd_create_srq_resp.
type CreateSRQResp struct{ SRQN uint32 }

// Decode reads r from b.
func (r *CreateSRQResp) Decode(b []byte) { var v oneU32Resp; v.Decode(b); r.SRQN = v.V }

// Encode writes r to b.
func (r CreateSRQResp) Encode(b []byte) { oneU32Resp{r.SRQN}.Encode(b) }

// ModifySRQ is struct pvrdma_cmd_modify_srq.
type ModifySRQ struct {
	SRQHandle, AttrMask uint32
	Attrs               SRQAttr
}

// Decode reads r from b.
func (r *ModifySRQ) Decode(b []byte) {
	_ = b[ModifySRQSize-1]
	r.SRQHandle, r.AttrMask = u32(b, 16), u32(b, 20)
	r.Attrs.Decode(b[24:])
}

// Encode writes r to b.
func (r ModifySRQ) Encode(b []byte) {
	_ = b[ModifySRQSize-1]
	put32(b, 16, r.SRQHandle)
	put32(b, 20, r.AttrMask)
	r.Attrs.Encode(b[24:])
}

// QuerySRQ is struct pvrdma_cmd_query_srq.
type QuerySRQ struct{ SRQHandle uint32 }

// Decode reads r from b.
func (r *QuerySRQ) Decode(b []byte) { var v HandleReq; v.Decode(b); r.SRQHandle = v.Handle }

// Encode writes r to b.
func (r QuerySRQ) Encode(b []byte) { HandleReq{r.SRQHandle}.Encode(b) }

// QuerySRQResp is struct pvrdma_cmd_query_srq_resp.
type QuerySRQResp struct{ Attrs SRQAttr }

// Decode reads r from b.
func (r *QuerySRQResp) Decode(b []byte) { r.Attrs.Decode(b[RespHdrSize:QuerySRQRespSize]) }

// Encode writes r to b.
func (r QuerySRQResp) Encode(b []byte) { r.Attrs.Encode(b[RespHdrSize:QuerySRQRespSize]) }

// DestroySRQ is struct pvrdma_cmd_destroy_srq.
type DestroySRQ struct{ SRQHandle uint32 }

// Decode reads r from b.
func (r *DestroySRQ) Decode(b []byte) { var v HandleReq; v.Decode(b); r.SRQHandle = v.Handle }

// Encode writes r to b.
func (r DestroySRQ) Encode(b []byte) { HandleReq{r.SRQHandle}.Encode(b) }
