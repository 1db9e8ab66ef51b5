package roce

import "fmt"

// Opcode is the BTH opcode: the transport service in the top three bits
// (RC 000, UC 001, RD 010, UD 011) and the operation in the low five
// (IBA 9.2.1, table 35).
type Opcode uint8

// RC opcodes.
const (
	RCSendFirst          Opcode = 0x00
	RCSendMiddle         Opcode = 0x01
	RCSendLast           Opcode = 0x02
	RCSendLastImm        Opcode = 0x03
	RCSendOnly           Opcode = 0x04
	RCSendOnlyImm        Opcode = 0x05
	RCWriteFirst         Opcode = 0x06
	RCWriteMiddle        Opcode = 0x07
	RCWriteLast          Opcode = 0x08
	RCWriteLastImm       Opcode = 0x09
	RCWriteOnly          Opcode = 0x0a
	RCWriteOnlyImm       Opcode = 0x0b
	RCReadRequest        Opcode = 0x0c
	RCReadResponseFirst  Opcode = 0x0d
	RCReadResponseMiddle Opcode = 0x0e
	RCReadResponseLast   Opcode = 0x0f
	RCReadResponseOnly   Opcode = 0x10
	RCAcknowledge        Opcode = 0x11
	RCAtomicAcknowledge  Opcode = 0x12
	RCCompareSwap        Opcode = 0x13
	RCFetchAdd           Opcode = 0x14
	RCSendLastInvalidate Opcode = 0x16
	RCSendOnlyInvalidate Opcode = 0x17
	UDSendOnly           Opcode = 0x64
	UDSendOnlyImm        Opcode = 0x65
	// CNP is the RoCE v2 Congestion Notification Packet (IBA Annex
	// A17.9.3): a BTH with this opcode, 16 reserved bytes, the ICRC. It
	// tells the QP in its DestQP that packets it sent arrived marked
	// Congestion Experienced.
	CNP Opcode = 0x81

	opcodeServiceMask Opcode = 0xe0
	opcodeServiceRC   Opcode = 0x00
	opcodeServiceUD   Opcode = 0x60
)

// Mask is a set of properties of an opcode: the code tests these bits
// rather than switching on opcodes (the shape of rxe's rxe_opcode table).
type Mask uint32

// Opcode properties.
const (
	MaskRETH      Mask = 1 << iota // carries a RETH
	MaskAETH                       // carries an AETH
	MaskAtomicETH                  // carries an AtomicETH
	MaskAtomicAck                  // carries an AtomicAckETH
	MaskDETH                       // carries a DETH
	MaskImm                        // carries ImmDt
	MaskIETH                       // carries an IETH
	MaskPayload                    // may carry payload
	MaskReq                        // a request (responder side handles it)
	MaskAck                        // a response (completer side handles it)
	MaskSend                       // part of a SEND
	MaskWrite                      // part of an RDMA WRITE
	MaskRead                       // RDMA READ request or response
	MaskAtomic                     // atomic request or atomic acknowledge
	MaskRecvWQE                    // consumes a receive WQE (SEND, WRITE with immediate)
	MaskComp                       // generates a receive completion
	MaskStart                      // FIRST or ONLY
	MaskMiddle                     // MIDDLE
	MaskEnd                        // LAST or ONLY
	MaskRC                         // RC service
	MaskUD                         // UD service
	MaskCNP                        // congestion notification (16 reserved bytes follow the BTH)
)

// CNPReservedSize is the length of the reserved field after a CNP's BTH.
const CNPReservedSize = 16

// ECN codepoints: the low two bits of the IPv4 TOS / IPv6 traffic class
// (RFC 3168).
const (
	ECNMask = 0x03
	ECNECT0 = 0x02 // ECN-capable transport
	ECNCE   = 0x03 // congestion experienced
)

// OpInfo describes one opcode: its properties, the total transport header
// length (BTH included, payload, pad and ICRC excluded) and the offset of
// each extended header from the start of the BTH (0 when absent).
type OpInfo struct {
	Name          string
	Mask          Mask
	Length        int
	RETHOff       int
	AETHOff       int
	AtomicETHOff  int
	AtomicAckOff  int
	DETHOff       int
	ImmOff        int
	IETHOff       int
	PayloadOffset int
}

// Valid reports whether the opcode is one this codec implements.
func (i *OpInfo) Valid() bool { return i.Length != 0 }

// Has reports whether the opcode has every property in m.
func (i *OpInfo) Has(m Mask) bool { return i.Mask&m == m }

// Any reports whether the opcode has some property in m.
func (i *OpInfo) Any(m Mask) bool { return i.Mask&m != 0 }

// opTable is read-only after init.
var opTable = buildOpTable()

// Info returns the table entry for op; Valid() is false for opcodes we do
// not implement (UC, RD, reserved).
func (op Opcode) Info() *OpInfo { return &opTable[op] }

func (op Opcode) String() string {
	if i := op.Info(); i.Valid() {
		return i.Name
	}
	return fmt.Sprintf("Opcode(%#02x)", uint8(op))
}

// IsRC reports whether op belongs to the RC service.
func (op Opcode) IsRC() bool { return op&opcodeServiceMask == opcodeServiceRC }

// IsUD reports whether op belongs to the UD service.
func (op Opcode) IsUD() bool { return op&opcodeServiceMask == opcodeServiceUD }

func buildOpTable() (t [256]OpInfo) {
	const (
		rc  = MaskRC | MaskReq
		rsp = MaskRC | MaskAck
	)
	def := func(op Opcode, name string, m Mask) {
		i := &t[op]
		i.Name = name
		i.Mask = m
		// Extended headers follow the BTH in the order of IBA 9.2
		// (figure 99): DETH, RETH, AtomicETH, AETH, AtomicAckETH, ImmDt,
		// IETH.
		off := BTHSize
		place := func(bit Mask, size int, dst *int) {
			if m&bit != 0 {
				*dst = off
				off += size
			}
		}
		place(MaskDETH, DETHSize, &i.DETHOff)
		place(MaskRETH, RETHSize, &i.RETHOff)
		place(MaskAtomicETH, AtomicETHSize, &i.AtomicETHOff)
		place(MaskAETH, AETHSize, &i.AETHOff)
		place(MaskAtomicAck, AtomicAckETHSize, &i.AtomicAckOff)
		place(MaskImm, ImmDtSize, &i.ImmOff)
		place(MaskIETH, IETHSize, &i.IETHOff)
		var reserved int
		place(MaskCNP, CNPReservedSize, &reserved)
		i.Length = off
		i.PayloadOffset = off
	}
	send := rc | MaskSend | MaskPayload | MaskRecvWQE
	def(RCSendFirst, "RC_SEND_FIRST", send|MaskStart)
	def(RCSendMiddle, "RC_SEND_MIDDLE", send|MaskMiddle)
	def(RCSendLast, "RC_SEND_LAST", send|MaskEnd|MaskComp)
	def(RCSendLastImm, "RC_SEND_LAST_WITH_IMMEDIATE", send|MaskEnd|MaskComp|MaskImm)
	def(RCSendOnly, "RC_SEND_ONLY", send|MaskStart|MaskEnd|MaskComp)
	def(RCSendOnlyImm, "RC_SEND_ONLY_WITH_IMMEDIATE", send|MaskStart|MaskEnd|MaskComp|MaskImm)
	def(RCSendLastInvalidate, "RC_SEND_LAST_WITH_INVALIDATE", send|MaskEnd|MaskComp|MaskIETH)
	def(RCSendOnlyInvalidate, "RC_SEND_ONLY_WITH_INVALIDATE", send|MaskStart|MaskEnd|MaskComp|MaskIETH)
	write := rc | MaskWrite | MaskPayload
	def(RCWriteFirst, "RC_RDMA_WRITE_FIRST", write|MaskStart|MaskRETH)
	def(RCWriteMiddle, "RC_RDMA_WRITE_MIDDLE", write|MaskMiddle)
	def(RCWriteLast, "RC_RDMA_WRITE_LAST", write|MaskEnd)
	def(RCWriteLastImm, "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE", write|MaskEnd|MaskImm|MaskRecvWQE|MaskComp)
	def(RCWriteOnly, "RC_RDMA_WRITE_ONLY", write|MaskStart|MaskEnd|MaskRETH)
	def(RCWriteOnlyImm, "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", write|MaskStart|MaskEnd|MaskRETH|MaskImm|MaskRecvWQE|MaskComp)
	def(RCReadRequest, "RC_RDMA_READ_REQUEST", rc|MaskRead|MaskRETH|MaskStart|MaskEnd)
	readResp := rsp | MaskRead | MaskPayload
	def(RCReadResponseFirst, "RC_RDMA_READ_RESPONSE_FIRST", readResp|MaskAETH|MaskStart)
	def(RCReadResponseMiddle, "RC_RDMA_READ_RESPONSE_MIDDLE", readResp|MaskMiddle)
	def(RCReadResponseLast, "RC_RDMA_READ_RESPONSE_LAST", readResp|MaskAETH|MaskEnd)
	def(RCReadResponseOnly, "RC_RDMA_READ_RESPONSE_ONLY", readResp|MaskAETH|MaskStart|MaskEnd)
	def(RCAcknowledge, "RC_ACKNOWLEDGE", rsp|MaskAETH|MaskStart|MaskEnd)
	def(RCAtomicAcknowledge, "RC_ATOMIC_ACKNOWLEDGE", rsp|MaskAtomic|MaskAETH|MaskAtomicAck|MaskStart|MaskEnd)
	def(RCCompareSwap, "RC_COMPARE_SWAP", rc|MaskAtomic|MaskAtomicETH|MaskStart|MaskEnd)
	def(RCFetchAdd, "RC_FETCH_ADD", rc|MaskAtomic|MaskAtomicETH|MaskStart|MaskEnd)
	ud := MaskUD | MaskReq | MaskSend | MaskPayload | MaskRecvWQE | MaskComp | MaskStart | MaskEnd | MaskDETH
	def(UDSendOnly, "UD_SEND_ONLY", ud)
	def(UDSendOnlyImm, "UD_SEND_ONLY_WITH_IMMEDIATE", ud|MaskImm)
	def(CNP, "CNP", MaskCNP)
	return t
}
