package soft

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// packet is one RoCE packet as the requester, responder and completer see
// it: decoded header fields and a payload, whether it came from the wire
// (fromWire) or is delivered in process. The same state machines handle
// both, so the in-process path has the wire's semantics: PSNs, ACKs, RNR,
// errors. Only its segmentation differs: an in-process message travels as
// one packet whose payload refers to the sender's guest memory, so the
// data crosses from guest to guest with one copy.
type packet struct {
	op   roce.Opcode
	info *roce.OpInfo

	// Network layer.
	src, dst   hostverbs.GID
	v4         bool
	v1         bool // RoCE v1 (GRH in an Ethertype 0x8915 frame), not v2
	ce         bool // arrived marked ECN Congestion Experienced
	tclass     uint8
	hopLimit   uint8
	flowLabel  uint32
	srcPort    uint16
	smac, dmac [6]byte
	ipHdr      []byte // the received IP header (wire only), for UD GRHs

	// BTH.
	se     bool
	ackReq bool
	becn   bool
	pkey   uint16
	dqpn   uint32
	psn    roce.PSN

	// Extended headers: fields are meaningful when info says so.
	va      uint64 // RETH or AtomicETH
	rkey    uint32
	dmaLen  uint32
	swapAdd uint64
	compare uint64
	syn     roce.Syndrome
	msn     uint32
	orig    uint64
	qkey    uint32
	srcQP   uint32
	imm     uint32
	iethKey uint32

	// Payload: n bytes, from data (wire), or from segs at dataOff (being
	// transmitted by the requester or responder, which hold the owning
	// QP's lock), or from the transmit batch's arena (in-process delivery:
	// arenaN segments at arenaOff).
	n        uint32
	data     []byte
	segs     []seg
	dataOff  uint64
	arenaOff int
	arenaN   int
	local    bool
}

// fromWire fills p from a parsed, ICRC-checked datagram.
func (p *packet) fromWire(rp *roce.Packet) {
	*p = packet{
		op:        rp.Op,
		info:      rp.Info,
		src:       hostverbs.GID(rp.SrcGID()),
		dst:       hostverbs.GID(rp.DstGID()),
		v4:        !rp.IPv6,
		v1:        rp.V1,
		tclass:    rp.TClass(),
		hopLimit:  rp.HopLimit(),
		flowLabel: rp.FlowLabel(),
		ipHdr:     rp.IPHeader,
		se:        rp.BTH.SolicitedEvent(),
		ackReq:    rp.BTH.AckReq(),
		becn:      rp.BTH.BECN(),
		pkey:      rp.BTH.PKey(),
		dqpn:      rp.BTH.DestQP(),
		psn:       rp.BTH.PSN(),
		n:         uint32(len(rp.Payload)),
		data:      rp.Payload,
	}
	if !rp.V1 {
		p.srcPort = rp.UDP.SrcPort()
	}
	i := rp.Info
	if i.Has(roce.MaskRETH) {
		r := rp.RETH()
		p.va, p.rkey, p.dmaLen = r.VA(), r.RKey(), r.DMALength()
	}
	if i.Has(roce.MaskAtomicETH) {
		a := rp.AtomicETH()
		p.va, p.rkey, p.swapAdd, p.compare = a.VA(), a.RKey(), a.SwapAdd(), a.Compare()
	}
	if i.Has(roce.MaskAETH) {
		p.syn, p.msn = rp.AETH().Syndrome(), rp.AETH().MSN()
	}
	if i.Has(roce.MaskAtomicAck) {
		p.orig = rp.AtomicAckETH().OrigData()
	}
	if i.Has(roce.MaskDETH) {
		p.qkey, p.srcQP = rp.DETH().QKey(), rp.DETH().SrcQP()
	}
	if i.Has(roce.MaskImm) {
		p.imm = rp.ImmDt().Imm()
	}
	if i.Has(roce.MaskIETH) {
		p.iethKey = rp.IETH().RKey()
	}
}

// transportFields returns the header values to encode p.
func (p *packet) transportFields() roce.TransportFields {
	return roce.TransportFields{
		BTH: roce.BTHFields{
			Opcode: p.op, SolicitedEvent: p.se, PKey: p.pkey, BECN: p.becn,
			DestQP: p.dqpn, AckReq: p.ackReq, PSN: p.psn,
		},
		VA: p.va, RKey: p.rkey, DMALength: p.dmaLen, SwapAdd: p.swapAdd, Compare: p.compare,
		Syndrome: p.syn, MSN: p.msn, OrigData: p.orig, QKey: p.qkey, SrcQP: p.srcQP,
		Imm: p.imm, IETHRKey: p.iethKey,
	}
}

// copyPayloadTo writes the payload to message offset off of dst.
func (p *packet) copyPayloadTo(tx *txBatch, dst []seg, off uint64) error {
	if p.n == 0 {
		return nil
	}
	if p.local {
		src := tx.arena[p.arenaOff : p.arenaOff+p.arenaN]
		return copySegs(dst, off, src, p.dataOff, uint64(p.n))
	}
	return scatter(dst, off, p.data[:p.n])
}
