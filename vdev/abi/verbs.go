package abi

// Verbs attribute structures of pvrdma_verbs.h. Their enum fields are 32-bit
// and numerically equal to the IB core's (and hence hostverbs') values.

// PortAttrSize is sizeof(struct pvrdma_port_attr).
const PortAttrSize = 48

const (
	paState         = 0
	paMaxMTU        = 4
	paActiveMTU     = 8
	paGIDTblLen     = 12
	paPortCapFlags  = 16
	paMaxMsgSz      = 20
	paBadPKeyCntr   = 24
	paQKeyViolCntr  = 28
	paPKeyTblLen    = 32
	paLID           = 34
	paSMLID         = 36
	paLMC           = 38
	paMaxVLNum      = 39
	paSMSL          = 40
	paSubnetTimeout = 41
	paInitTypeReply = 42
	paActiveWidth   = 43
	paActiveSpeed   = 44
	paPhysState     = 45
)

// PortAttr is struct pvrdma_port_attr.
type PortAttr struct {
	State, MaxMTU, ActiveMTU    uint32
	GIDTblLen                   uint32
	PortCapFlags                uint32
	MaxMsgSz                    uint32
	BadPKeyCntr, QKeyViolCntr   uint32
	PKeyTblLen, LID, SMLID      uint16
	LMC, MaxVLNum, SMSL         uint8
	SubnetTimeout, InitTypeRepl uint8
	ActiveWidth, ActiveSpeed    uint8
	PhysState                   uint8
}

// Decode reads a from b.
func (a *PortAttr) Decode(b []byte) {
	_ = b[PortAttrSize-1]
	a.State, a.MaxMTU, a.ActiveMTU = u32(b, paState), u32(b, paMaxMTU), u32(b, paActiveMTU)
	a.GIDTblLen, a.PortCapFlags, a.MaxMsgSz = u32(b, paGIDTblLen), u32(b, paPortCapFlags), u32(b, paMaxMsgSz)
	a.BadPKeyCntr, a.QKeyViolCntr = u32(b, paBadPKeyCntr), u32(b, paQKeyViolCntr)
	a.PKeyTblLen, a.LID, a.SMLID = u16(b, paPKeyTblLen), u16(b, paLID), u16(b, paSMLID)
	a.LMC, a.MaxVLNum, a.SMSL = b[paLMC], b[paMaxVLNum], b[paSMSL]
	a.SubnetTimeout, a.InitTypeRepl = b[paSubnetTimeout], b[paInitTypeReply]
	a.ActiveWidth, a.ActiveSpeed, a.PhysState = b[paActiveWidth], b[paActiveSpeed], b[paPhysState]
}

// Encode writes a to b.
func (a PortAttr) Encode(b []byte) {
	_ = b[PortAttrSize-1]
	clear(b[:PortAttrSize])
	put32(b, paState, a.State)
	put32(b, paMaxMTU, a.MaxMTU)
	put32(b, paActiveMTU, a.ActiveMTU)
	put32(b, paGIDTblLen, a.GIDTblLen)
	put32(b, paPortCapFlags, a.PortCapFlags)
	put32(b, paMaxMsgSz, a.MaxMsgSz)
	put32(b, paBadPKeyCntr, a.BadPKeyCntr)
	put32(b, paQKeyViolCntr, a.QKeyViolCntr)
	put16(b, paPKeyTblLen, a.PKeyTblLen)
	put16(b, paLID, a.LID)
	put16(b, paSMLID, a.SMLID)
	b[paLMC], b[paMaxVLNum], b[paSMSL] = a.LMC, a.MaxVLNum, a.SMSL
	b[paSubnetTimeout], b[paInitTypeReply] = a.SubnetTimeout, a.InitTypeRepl
	b[paActiveWidth], b[paActiveSpeed], b[paPhysState] = a.ActiveWidth, a.ActiveSpeed, a.PhysState
}

// QPCapSize is sizeof(struct pvrdma_qp_cap).
const QPCapSize = 24

// QPCap is struct pvrdma_qp_cap.
type QPCap struct {
	MaxSendWR, MaxRecvWR, MaxSendSGE, MaxRecvSGE, MaxInlineData uint32
}

// Decode reads c from b.
func (c *QPCap) Decode(b []byte) {
	_ = b[QPCapSize-1]
	c.MaxSendWR, c.MaxRecvWR = u32(b, 0), u32(b, 4)
	c.MaxSendSGE, c.MaxRecvSGE, c.MaxInlineData = u32(b, 8), u32(b, 12), u32(b, 16)
}

// Encode writes c to b.
func (c QPCap) Encode(b []byte) {
	_ = b[QPCapSize-1]
	put32(b, 0, c.MaxSendWR)
	put32(b, 4, c.MaxRecvWR)
	put32(b, 8, c.MaxSendSGE)
	put32(b, 12, c.MaxRecvSGE)
	put32(b, 16, c.MaxInlineData)
	put32(b, 20, 0)
}

// AHAttrSize is sizeof(struct pvrdma_ah_attr).
const AHAttrSize = 40

const (
	ahDGID         = 0 // grh.dgid
	ahFlowLabel    = 16
	ahSGIDIndex    = 20
	ahHopLimit     = 21
	ahTrafficClass = 22
	ahDLID         = 24
	ahVLANID       = 26
	ahSL           = 28
	ahSrcPathBits  = 29
	ahStaticRate   = 30
	ahFlags        = 31
	ahPortNum      = 32
	ahDMAC         = 33
)

// AHFlagGRH is PVRDMA_AH_GRH.
const AHFlagGRH = 1

// AHAttr is struct pvrdma_ah_attr (with its struct pvrdma_global_route).
type AHAttr struct {
	DGID         [16]byte
	FlowLabel    uint32
	SGIDIndex    uint8
	HopLimit     uint8
	TrafficClass uint8
	DLID         uint16
	VLANID       uint16
	SL           uint8
	SrcPathBits  uint8
	StaticRate   uint8
	Flags        uint8
	PortNum      uint8
	DMAC         [6]byte
}

// Decode reads a from b.
func (a *AHAttr) Decode(b []byte) {
	_ = b[AHAttrSize-1]
	copy(a.DGID[:], b[ahDGID:])
	a.FlowLabel = u32(b, ahFlowLabel)
	a.SGIDIndex, a.HopLimit, a.TrafficClass = b[ahSGIDIndex], b[ahHopLimit], b[ahTrafficClass]
	a.DLID, a.VLANID = u16(b, ahDLID), u16(b, ahVLANID)
	a.SL, a.SrcPathBits, a.StaticRate, a.Flags, a.PortNum = b[ahSL], b[ahSrcPathBits], b[ahStaticRate], b[ahFlags], b[ahPortNum]
	copy(a.DMAC[:], b[ahDMAC:])
}

// Encode writes a to b.
func (a AHAttr) Encode(b []byte) {
	_ = b[AHAttrSize-1]
	clear(b[:AHAttrSize])
	copy(b[ahDGID:], a.DGID[:])
	put32(b, ahFlowLabel, a.FlowLabel)
	b[ahSGIDIndex], b[ahHopLimit], b[ahTrafficClass] = a.SGIDIndex, a.HopLimit, a.TrafficClass
	put16(b, ahDLID, a.DLID)
	put16(b, ahVLANID, a.VLANID)
	b[ahSL], b[ahSrcPathBits], b[ahStaticRate], b[ahFlags], b[ahPortNum] = a.SL, a.SrcPathBits, a.StaticRate, a.Flags, a.PortNum
	copy(b[ahDMAC:], a.DMAC[:])
}

// QPAttrSize is sizeof(struct pvrdma_qp_attr).
const QPAttrSize = 160

const (
	qaState            = 0
	qaCurState         = 4
	qaPathMTU          = 8
	qaPathMigState     = 12
	qaQKey             = 16
	qaRQPSN            = 20
	qaSQPSN            = 24
	qaDestQPNum        = 28
	qaAccessFlags      = 32
	qaPKeyIndex        = 36
	qaAltPKeyIndex     = 38
	qaEnSQDAsyncNotify = 40
	qaSQDraining       = 41
	qaMaxRdAtomic      = 42
	qaMaxDestRdAtomic  = 43
	qaMinRNRTimer      = 44
	qaPortNum          = 45
	qaTimeout          = 46
	qaRetryCnt         = 47
	qaRNRRetry         = 48
	qaAltPortNum       = 49
	qaAltTimeout       = 50
	qaCap              = 56
	qaAHAttr           = 80
	qaAltAHAttr        = 120
)

// QPAttr is struct pvrdma_qp_attr.
type QPAttr struct {
	State, CurState, PathMTU, PathMigState uint32
	QKey, RQPSN, SQPSN, DestQPNum          uint32
	AccessFlags                            uint32
	PKeyIndex, AltPKeyIndex                uint16
	EnSQDAsyncNotify, SQDraining           uint8
	MaxRdAtomic, MaxDestRdAtomic           uint8
	MinRNRTimer, PortNum, Timeout          uint8
	RetryCnt, RNRRetry                     uint8
	AltPortNum, AltTimeout                 uint8
	Cap                                    QPCap
	AH, AltAH                              AHAttr
}

// Decode reads a from b.
func (a *QPAttr) Decode(b []byte) {
	_ = b[QPAttrSize-1]
	a.State, a.CurState, a.PathMTU, a.PathMigState = u32(b, qaState), u32(b, qaCurState), u32(b, qaPathMTU), u32(b, qaPathMigState)
	a.QKey, a.RQPSN, a.SQPSN, a.DestQPNum = u32(b, qaQKey), u32(b, qaRQPSN), u32(b, qaSQPSN), u32(b, qaDestQPNum)
	a.AccessFlags = u32(b, qaAccessFlags)
	a.PKeyIndex, a.AltPKeyIndex = u16(b, qaPKeyIndex), u16(b, qaAltPKeyIndex)
	a.EnSQDAsyncNotify, a.SQDraining = b[qaEnSQDAsyncNotify], b[qaSQDraining]
	a.MaxRdAtomic, a.MaxDestRdAtomic = b[qaMaxRdAtomic], b[qaMaxDestRdAtomic]
	a.MinRNRTimer, a.PortNum, a.Timeout = b[qaMinRNRTimer], b[qaPortNum], b[qaTimeout]
	a.RetryCnt, a.RNRRetry = b[qaRetryCnt], b[qaRNRRetry]
	a.AltPortNum, a.AltTimeout = b[qaAltPortNum], b[qaAltTimeout]
	a.Cap.Decode(b[qaCap:])
	a.AH.Decode(b[qaAHAttr:])
	a.AltAH.Decode(b[qaAltAHAttr:])
}

// Encode writes a to b.
func (a QPAttr) Encode(b []byte) {
	_ = b[QPAttrSize-1]
	clear(b[:QPAttrSize])
	put32(b, qaState, a.State)
	put32(b, qaCurState, a.CurState)
	put32(b, qaPathMTU, a.PathMTU)
	put32(b, qaPathMigState, a.PathMigState)
	put32(b, qaQKey, a.QKey)
	put32(b, qaRQPSN, a.RQPSN)
	put32(b, qaSQPSN, a.SQPSN)
	put32(b, qaDestQPNum, a.DestQPNum)
	put32(b, qaAccessFlags, a.AccessFlags)
	put16(b, qaPKeyIndex, a.PKeyIndex)
	put16(b, qaAltPKeyIndex, a.AltPKeyIndex)
	b[qaEnSQDAsyncNotify], b[qaSQDraining] = a.EnSQDAsyncNotify, a.SQDraining
	b[qaMaxRdAtomic], b[qaMaxDestRdAtomic] = a.MaxRdAtomic, a.MaxDestRdAtomic
	b[qaMinRNRTimer], b[qaPortNum], b[qaTimeout] = a.MinRNRTimer, a.PortNum, a.Timeout
	b[qaRetryCnt], b[qaRNRRetry] = a.RetryCnt, a.RNRRetry
	b[qaAltPortNum], b[qaAltTimeout] = a.AltPortNum, a.AltTimeout
	a.Cap.Encode(b[qaCap:])
	a.AH.Encode(b[qaAHAttr:])
	a.AltAH.Encode(b[qaAltAHAttr:])
}

// SRQAttrSize is sizeof(struct pvrdma_srq_attr).
const SRQAttrSize = 16

// SRQAttr is struct pvrdma_srq_attr.
type SRQAttr struct {
	MaxWR, MaxSGE, SRQLimit uint32
}

// Decode reads a from b.
func (a *SRQAttr) Decode(b []byte) {
	_ = b[SRQAttrSize-1]
	a.MaxWR, a.MaxSGE, a.SRQLimit = u32(b, 0), u32(b, 4), u32(b, 8)
}

// Encode writes a to b.
func (a SRQAttr) Encode(b []byte) {
	_ = b[SRQAttrSize-1]
	put32(b, 0, a.MaxWR)
	put32(b, 4, a.MaxSGE)
	put32(b, 8, a.SRQLimit)
	put32(b, 12, 0)
}
