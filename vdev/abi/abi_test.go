package abi

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The offsets and sizes below are written out from the PVRDMA ABI's C headers
// and what the stock driver was seen to use, independently of the constants in the
// package, so a slip in either shows up here (the prototype's SRQ failure
// was a caps-offset slip).

type codec interface{ Encode([]byte) }

// encodeGuarded encodes v into a buffer of size bytes followed by guard
// bytes, and fails if the encoder wrote past size.
func encodeGuarded(t *testing.T, v codec, size int) []byte {
	t.Helper()
	buf := make([]byte, size+32)
	for i := range buf {
		buf[i] = 0xAA
	}
	v.Encode(buf[:size])
	for i := size; i < len(buf); i++ {
		require.Equal(t, byte(0xAA), buf[i], "%T wrote byte %d past its size %d", v, i, size)
	}
	return buf[:size]
}

func le32(b []byte, off int) uint32 { return binary.LittleEndian.Uint32(b[off:]) }
func le64(b []byte, off int) uint64 { return binary.LittleEndian.Uint64(b[off:]) }
func le16(b []byte, off int) uint16 { return binary.LittleEndian.Uint16(b[off:]) }

func TestABISizes(t *testing.T) {
	sizes := map[string][2]int{
		"DSR":             {DSRSize, 280},
		"caps":            {CapsSize, 208},
		"caps offset":     {DSRCapsOffset, 72},
		"ring page info":  {RingPageInfoSize, 16},
		"cmd hdr":         {CmdHdrSize, 16},
		"resp hdr":        {RespHdrSize, 16},
		"req union":       {CmdReqSize, 184},
		"resp union":      {CmdRespSize, 176},
		"port attr":       {PortAttrSize, 48},
		"qp cap":          {QPCapSize, 24},
		"ah attr":         {AHAttrSize, 40},
		"qp attr":         {QPAttrSize, 160},
		"srq attr":        {SRQAttrSize, 16},
		"sge":             {SGESize, 16},
		"rq wqe hdr":      {RQWQEHdrSize, 16},
		"sq wqe hdr":      {SQWQEHdrSize, 80},
		"wr union":        {WRUnionSize, 48},
		"av":              {AVSize, 40},
		"cqe":             {CQESize, 64},
		"eqe":             {EQESize, 8},
		"cqne":            {CQNESize, 4},
		"query_port":      {QueryPortSize, 24},
		"query_port_resp": {QueryPortRespSize, 64},
		"query_pkey":      {QueryPKeySize, 24},
		"query_pkey_resp": {QueryPKeyRespSize, 24},
		"create_uc":       {CreateUCSize, 24},
		"create_uc_resp":  {CreateUCRespSize, 24},
		"destroy_uc":      {DestroyUCSize, 24},
		"create_pd":       {CreatePDSize, 24},
		"create_pd_resp":  {CreatePDRespSize, 24},
		"destroy_pd":      {DestroyPDSize, 24},
		"create_mr":       {CreateMRSize, 56},
		"create_mr_resp":  {CreateMRRespSize, 32},
		"destroy_mr":      {DestroyMRSize, 24},
		"create_cq":       {CreateCQSize, 40},
		"create_cq_resp":  {CreateCQRespSize, 24},
		"resize_cq":       {ResizeCQSize, 24},
		"resize_cq_resp":  {ResizeCQRespSize, 24},
		"destroy_cq":      {DestroyCQSize, 24},
		"create_qp":       {CreateQPSize, 80},
		"create_qp_resp":  {CreateQPRespSize, 40},
		"create_qp_resp2": {CreateQPRespV2Size, 44},
		"modify_qp":       {ModifyQPSize, 184},
		"query_qp":        {QueryQPSize, 24},
		"query_qp_resp":   {QueryQPRespSize, 176},
		"destroy_qp":      {DestroyQPSize, 24},
		"destroy_qp_resp": {DestroyQPRespSize, 24},
		"create_bind":     {CreateBindSize, 48},
		"destroy_bind":    {DestroyBindSize, 40},
		"create_srq":      {CreateSRQSize, 56},
		"create_srq_resp": {CreateSRQRespSize, 24},
		"modify_srq":      {ModifySRQSize, 40},
		"query_srq":       {QuerySRQSize, 24},
		"query_srq_resp":  {QuerySRQRespSize, 32},
		"destroy_srq":     {DestroySRQSize, 24},
	}
	for name, s := range sizes {
		assert.Equal(t, s[1], s[0], name)
	}
	// The request union is the largest request (the driver's BUILD_BUG_ON).
	for _, s := range []int{QueryPortSize, CreateMRSize, CreateCQSize, CreateQPSize, CreateBindSize, DestroyBindSize, CreateSRQSize, ModifySRQSize} {
		assert.LessOrEqual(t, s, CmdReqSize)
	}
	for _, s := range []int{QueryPortRespSize, CreateMRRespSize, CreateQPRespV2Size, QuerySRQRespSize} {
		assert.LessOrEqual(t, s, CmdRespSize)
	}
}

func TestDSRLayout(t *testing.T) {
	d := DSR{
		DriverVersion: 20, GOSInfo: 0x46, CmdSlot: 0x6a37000, RespSlot: 0x6a36000,
		AsyncRing: RingPageInfo{NumPages: 4, PDirDMA: 0x1111000},
		CQRing:    RingPageInfo{NumPages: 5, PDirDMA: 0x2222000},
		UARPFN:    0xfe800,
		Caps: Caps{
			FWVer: 14, NodeGUID: 0x505400fffe123456, SysImageGUID: 0x0102030405060708,
			MaxMRSize: 1 << 27, PageSizeCap: 0x1000, VendorID: 0x15ad, VendorPartID: 0x0820, HWVer: 1,
			MaxQP: 1024, MaxQPWR: 1025, DeviceCapFlags: 7, MaxSGE: 4, MaxSGERd: 5, MaxCQ: 2048, MaxCQE: 2049,
			MaxMR: 1026, MaxPD: 1027, MaxQPRdAtom: 16, MaxResRdAtom: 17, MaxQPInitRdAtom: 18, MaxAH: 64,
			MaxSRQ: 512, MaxSRQWR: 513, MaxSRQSGE: 6, MaxUAR: 512, GIDTblLen: 16, MaxPKeys: 1,
			LocalCAAckDelay: 15, PhysPortCnt: 1, Mode: 0, AtomicOps: 3, BMMEFlags: 7, GIDTypes: 2,
			MaxFastRegPageListLen: 128,
		},
	}
	b := encodeGuarded(t, d, DSRSize)
	assert.EqualValues(t, 20, le32(b, 0))
	assert.EqualValues(t, 0x46, le32(b, 8))
	assert.EqualValues(t, 0x6a37000, le64(b, 16))
	assert.EqualValues(t, 0x6a36000, le64(b, 24))
	assert.EqualValues(t, 4, le32(b, 32))
	assert.EqualValues(t, 0x1111000, le64(b, 40))
	assert.EqualValues(t, 5, le32(b, 48))
	assert.EqualValues(t, 0x2222000, le64(b, 56))
	assert.EqualValues(t, 0xfe800, le64(b, 64))
	// caps at DSR+72
	assert.EqualValues(t, 14, le64(b, 72))
	assert.Equal(t, []byte{0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56}, b[80:88], "node_guid is __be64")
	assert.Equal(t, []byte{1, 2, 3, 4, 5, 6, 7, 8}, b[88:96])
	assert.EqualValues(t, 1<<27, le64(b, 72+24))
	assert.EqualValues(t, 0x1000, le64(b, 72+32))
	assert.EqualValues(t, 0x15ad, le32(b, 72+64))
	assert.EqualValues(t, 0x0820, le32(b, 72+68))
	assert.EqualValues(t, 1, le32(b, 72+72))
	assert.EqualValues(t, 1024, le32(b, 72+76), "max_qp")
	assert.EqualValues(t, 1025, le32(b, 72+80), "max_qp_wr")
	assert.EqualValues(t, 7, le32(b, 72+84), "device_cap_flags")
	assert.EqualValues(t, 4, le32(b, 72+88), "max_sge")
	assert.EqualValues(t, 5, le32(b, 72+92), "max_sge_rd")
	assert.EqualValues(t, 2048, le32(b, 72+96), "max_cq")
	assert.EqualValues(t, 2049, le32(b, 72+100), "max_cqe")
	assert.EqualValues(t, 1026, le32(b, 72+104), "max_mr")
	assert.EqualValues(t, 1027, le32(b, 72+108), "max_pd")
	assert.EqualValues(t, 16, le32(b, 72+112), "max_qp_rd_atom")
	assert.EqualValues(t, 17, le32(b, 72+120), "max_res_rd_atom")
	assert.EqualValues(t, 18, le32(b, 72+124), "max_qp_init_rd_atom")
	assert.EqualValues(t, 64, le32(b, 72+164), "max_ah")
	assert.EqualValues(t, 512, le32(b, 248), "max_srq at DSR+248")
	assert.EqualValues(t, 513, le32(b, 252), "max_srq_wr at DSR+252")
	assert.EqualValues(t, 6, le32(b, 256), "max_srq_sge at DSR+256")
	assert.EqualValues(t, 512, le32(b, 260), "max_uar")
	assert.EqualValues(t, 16, le32(b, 264), "gid_tbl_len")
	assert.EqualValues(t, 1, le16(b, 268), "max_pkeys")
	assert.Equal(t, []byte{15, 1, 0, 3, 7, 2}, b[270:276], "ack delay, ports, mode, atomic_ops, bmme, gid_types")
	assert.EqualValues(t, 128, le32(b, 276), "max_fast_reg_page_list_len")

	var back DSR
	back.Decode(b)
	assert.Equal(t, d, back)
}

func TestCommandLayouts(t *testing.T) {
	b := encodeGuarded(t, CmdHdr{Response: 0x1122334455667788, Cmd: CmdModifyQP}, CmdHdrSize)
	assert.EqualValues(t, 0x1122334455667788, le64(b, 0))
	assert.EqualValues(t, 10, le32(b, 8))
	b = encodeGuarded(t, RespHdr{Response: 9, Ack: RespFlag | CmdCreateQP, Err: 22}, RespHdrSize)
	assert.EqualValues(t, 9, le64(b, 0))
	assert.EqualValues(t, 0x80000009, le32(b, 8))
	assert.EqualValues(t, 22, b[12])

	b = encodeGuarded(t, CreateMR{Start: 1, Length: 2, PDirDMA: 3, PDHandle: 4, AccessFlags: 5, Flags: 6, NChunks: 7}, CreateMRSize)
	assert.Equal(t, []uint64{1, 2, 3}, []uint64{le64(b, 16), le64(b, 24), le64(b, 32)})
	assert.Equal(t, []uint32{4, 5, 6, 7}, []uint32{le32(b, 40), le32(b, 44), le32(b, 48), le32(b, 52)})

	b = encodeGuarded(t, CreateCQ{PDirDMA: 0xabc000, CtxHandle: 2, CQE: 512, NChunks: 9}, CreateCQSize)
	assert.Equal(t, []uint32{2, 512, 9}, []uint32{le32(b, 24), le32(b, 28), le32(b, 32)})
	assert.EqualValues(t, 0xabc000, le64(b, 16))

	qp := CreateQP{PDirDMA: 0x1000, PDHandle: 1, SendCQHandle: 2, RecvCQHandle: 3, SRQHandle: 4, MaxSendWR: 5,
		MaxRecvWR: 6, MaxSendSGE: 7, MaxRecvSGE: 8, MaxInlineData: 9, LKey: 10, AccessFlags: 11,
		TotalChunks: 12, SendChunks: 13, MaxAtomicArg: 14, SQSigAll: 15, QPType: 16, IsSRQ: 17}
	b = encodeGuarded(t, qp, CreateQPSize)
	for i, off := range []int{24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64} {
		assert.EqualValues(t, i+1, le32(b, off), "create_qp u32 @%d", off)
	}
	assert.Equal(t, []uint16{12, 13, 14}, []uint16{le16(b, 68), le16(b, 70), le16(b, 72)})
	assert.Equal(t, []byte{15, 16, 17}, b[74:77])
	var qp2 CreateQP
	qp2.Decode(b)
	assert.Equal(t, qp, qp2)

	b = encodeGuarded(t, CreateQPResp{QPN: 0x12, QPHandle: 2, MaxSendWR: 3, MaxRecvWR: 4, MaxSendSGE: 5, MaxRecvSGE: 6, MaxInlineData: 7}, CreateQPRespV2Size)
	for i, off := range []int{16, 20, 24, 28, 32, 36, 40} {
		assert.EqualValues(t, []uint32{0x12, 2, 3, 4, 5, 6, 7}[i], le32(b, off))
	}

	gid := [16]byte{0xfe, 0x80, 15: 0x56}
	b = encodeGuarded(t, CreateBind{MTU: 1024, VLAN: 0xfff, Index: 3, NewGID: gid, GIDType: 2}, CreateBindSize)
	assert.Equal(t, []uint32{1024, 0xfff, 3}, []uint32{le32(b, 16), le32(b, 20), le32(b, 24)})
	assert.Equal(t, gid[:], b[28:44])
	assert.EqualValues(t, 2, b[44])
	b = encodeGuarded(t, DestroyBind{Index: 3, DestGID: gid}, DestroyBindSize)
	assert.EqualValues(t, 3, le32(b, 16))
	assert.Equal(t, gid[:], b[20:36])

	b = encodeGuarded(t, CreateSRQ{PDirDMA: 0x5000, PDHandle: 1, NChunks: 3, Attrs: SRQAttr{MaxWR: 512, MaxSGE: 2, SRQLimit: 7}, SRQType: 0}, CreateSRQSize)
	assert.Equal(t, []uint32{1, 3, 512, 2, 7}, []uint32{le32(b, 24), le32(b, 28), le32(b, 32), le32(b, 36), le32(b, 40)})
	b = encodeGuarded(t, ModifySRQ{SRQHandle: 5, AttrMask: 2, Attrs: SRQAttr{SRQLimit: 9}}, ModifySRQSize)
	assert.Equal(t, []uint32{5, 2, 9}, []uint32{le32(b, 16), le32(b, 20), le32(b, 32)})
	b = encodeGuarded(t, CreateUC{PFN: 0xfe801}, CreateUCSize)
	assert.EqualValues(t, 0xfe801, le64(b, 16))
	b = encodeGuarded(t, CreateMRResp{MRHandle: 1, LKey: 2, RKey: 3}, CreateMRRespSize)
	assert.Equal(t, []uint32{1, 2, 3}, []uint32{le32(b, 16), le32(b, 20), le32(b, 24)})
	b = encodeGuarded(t, QueryPKey{PortNum: 1, Index: 5}, QueryPKeySize)
	assert.Equal(t, []byte{1, 5}, b[16:18])
}

func TestQPAttrLayout(t *testing.T) {
	a := QPAttr{State: 1, CurState: 2, PathMTU: 3, PathMigState: 4, QKey: 5, RQPSN: 6, SQPSN: 7, DestQPNum: 8,
		AccessFlags: 9, PKeyIndex: 10, AltPKeyIndex: 11, EnSQDAsyncNotify: 12, SQDraining: 13, MaxRdAtomic: 14,
		MaxDestRdAtomic: 15, MinRNRTimer: 16, PortNum: 17, Timeout: 18, RetryCnt: 19, RNRRetry: 20,
		AltPortNum: 21, AltTimeout: 22,
		Cap: QPCap{MaxSendWR: 23, MaxRecvWR: 24, MaxSendSGE: 25, MaxRecvSGE: 26, MaxInlineData: 27},
		AH: AHAttr{DGID: [16]byte{0: 0xfe, 15: 0x01}, FlowLabel: 28, SGIDIndex: 29, HopLimit: 30, TrafficClass: 31,
			DLID: 32, VLANID: 33, SL: 34, SrcPathBits: 35, StaticRate: 36, Flags: 1, PortNum: 37, DMAC: [6]byte{0x52, 0x54, 0, 0x77, 0, 1}},
		AltAH: AHAttr{FlowLabel: 40, PortNum: 41},
	}
	b := encodeGuarded(t, a, QPAttrSize)
	for i := 0; i < 9; i++ {
		assert.EqualValues(t, i+1, le32(b, 4*i), "u32 #%d", i)
	}
	assert.Equal(t, []uint16{10, 11}, []uint16{le16(b, 36), le16(b, 38)})
	assert.Equal(t, []byte{12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22}, b[40:51])
	assert.Equal(t, []uint32{23, 24, 25, 26, 27}, []uint32{le32(b, 56), le32(b, 60), le32(b, 64), le32(b, 68), le32(b, 72)})
	// ah_attr @80
	assert.EqualValues(t, 0xfe, b[80])
	assert.EqualValues(t, 28, le32(b, 80+16), "flow_label")
	assert.Equal(t, []byte{29, 30, 31}, b[80+20:80+23], "sgid_index hop_limit traffic_class")
	assert.Equal(t, []uint16{32, 33}, []uint16{le16(b, 80+24), le16(b, 80+26)}, "dlid vlan_id")
	assert.Equal(t, []byte{34, 35, 36, 1, 37}, b[80+28:80+33], "sl src_path_bits static_rate ah_flags port_num")
	assert.Equal(t, []byte{0x52, 0x54, 0, 0x77, 0, 1}, b[80+33:80+39], "dmac")
	// alt_ah_attr @120
	assert.EqualValues(t, 40, le32(b, 120+16))
	assert.EqualValues(t, 41, b[120+32])
	var back QPAttr
	back.Decode(b)
	assert.Equal(t, a, back)

	m := ModifyQP{QPHandle: 7, AttrMask: 0x129181, Attrs: a}
	b = encodeGuarded(t, m, ModifyQPSize)
	assert.Equal(t, []uint32{7, 0x129181}, []uint32{le32(b, 16), le32(b, 20)})
	assert.EqualValues(t, 1, le32(b, 24))
	assert.EqualValues(t, 28, le32(b, 24+80+16))
}

func TestPortAttrLayout(t *testing.T) {
	p := PortAttr{State: 4, MaxMTU: 5, ActiveMTU: 3, GIDTblLen: 16, PortCapFlags: 0x10000, MaxMsgSz: 0x80000000,
		BadPKeyCntr: 7, QKeyViolCntr: 8, PKeyTblLen: 1, LID: 9, SMLID: 10, LMC: 11, MaxVLNum: 12, SMSL: 13,
		SubnetTimeout: 14, InitTypeRepl: 15, ActiveWidth: 1, ActiveSpeed: 2, PhysState: 5}
	b := encodeGuarded(t, p, PortAttrSize)
	assert.Equal(t, []uint32{4, 5, 3, 16, 0x10000, 0x80000000, 7, 8},
		[]uint32{le32(b, 0), le32(b, 4), le32(b, 8), le32(b, 12), le32(b, 16), le32(b, 20), le32(b, 24), le32(b, 28)})
	assert.Equal(t, []uint16{1, 9, 10}, []uint16{le16(b, 32), le16(b, 34), le16(b, 36)})
	assert.Equal(t, []byte{11, 12, 13, 14, 15, 1, 2, 5}, b[38:46])
	var back PortAttr
	back.Decode(b)
	assert.Equal(t, p, back)
}

func TestWQELayouts(t *testing.T) {
	b := encodeGuarded(t, SGE{Addr: 0x7f0000001878, Length: 0x10, LKey: 0x101}, SGESize)
	assert.EqualValues(t, 0x7f0000001878, le64(b, 0))
	assert.Equal(t, []uint32{0x10, 0x101}, []uint32{le32(b, 8), le32(b, 12)})
	b = encodeGuarded(t, RQWQEHdr{WRID: 5, NumSGE: 1}, RQWQEHdrSize)
	assert.EqualValues(t, 5, le64(b, 0))
	assert.EqualValues(t, 1, le32(b, 8))

	h := SQWQEHdr{WRID: 0xdead, NumSGE: 2, TotalLen: 0, Opcode: 3, SendFlags: 2, Ex: 0x04030201}
	WRRDMA{RemoteAddr: 0x1000, RKey: 0x77}.Encode(h.WR[:])
	b = encodeGuarded(t, h, SQWQEHdrSize)
	assert.EqualValues(t, 0xdead, le64(b, 0))
	assert.Equal(t, []uint32{2, 0, 3, 2, 0x04030201}, []uint32{le32(b, 8), le32(b, 12), le32(b, 16), le32(b, 20), le32(b, 24)})
	assert.EqualValues(t, 0x1000, le64(b, 32), "rdma.remote_addr @32")
	assert.EqualValues(t, 0x77, le32(b, 40), "rdma.rkey @40")

	var u [WRUnionSize]byte
	WRAtomic{RemoteAddr: 1, CompareAdd: 2, Swap: 3, RKey: 4}.Encode(u[:])
	assert.Equal(t, []uint64{1, 2, 3}, []uint64{le64(u[:], 0), le64(u[:], 8), le64(u[:], 16)})
	assert.EqualValues(t, 4, le32(u[:], 24), "atomic.rkey @56 of the header")
	WRFastReg{IOVAStart: 1, PLPDirDMA: 2, PageShift: 12, PageListLen: 4, Length: 5, AccessFlags: 6, RKey: 7}.Encode(u[:])
	assert.Equal(t, []uint64{1, 2}, []uint64{le64(u[:], 0), le64(u[:], 8)})
	assert.Equal(t, []uint32{12, 4, 5, 6, 7}, []uint32{le32(u[:], 16), le32(u[:], 20), le32(u[:], 24), le32(u[:], 28), le32(u[:], 32)})

	av := AV{PortPD: 0x01000001, SLTClassFlowLabel: 0x3c90a, DGID: [16]byte{10: 0xff, 11: 0xff, 12: 10, 13: 77, 15: 2},
		SrcPathBits: 0x80, GIDIndex: 1, StatRate: 0, HopLimit: 64, DMAC: [6]byte{0x52, 0x54, 0, 0x77, 0, 2}}
	WRUD{RemoteQPN: 1, RemoteQKey: 0x80010000, AV: av}.Encode(u[:])
	assert.Equal(t, []uint32{1, 0x80010000, 0x01000001, 0x3c90a}, []uint32{le32(u[:], 0), le32(u[:], 4), le32(u[:], 8), le32(u[:], 12)})
	assert.EqualValues(t, 10, u[8+8+12], "dgid @16 of the union, ud.av @40 of the header")
	assert.Equal(t, []byte{0x80, 1, 0, 64}, u[8+24:8+28])
	assert.Equal(t, av.DMAC[:], u[8+28:8+34])
	var ud WRUD
	ud.Decode(u[:])
	assert.Equal(t, av, ud.AV)
	assert.EqualValues(t, 1, ud.AV.Port())
	assert.EqualValues(t, 1, ud.AV.PD())

	c := CQE{WRID: 1, QP: 2, Opcode: 0x80, Status: 5, ByteLen: 296, ImmData: 6, SrcQP: 7, WCFlags: 0x41, VendorErr: 8,
		PKeyIndex: 9, SLID: 10, SL: 11, DLIDPathBits: 12, PortNum: 1, SMAC: [6]byte{1, 2, 3, 4, 5, 6}, NetworkHdrType: 1}
	b = encodeGuarded(t, &c, CQESize)
	assert.Equal(t, []uint64{1, 2}, []uint64{le64(b, 0), le64(b, 8)})
	assert.Equal(t, []uint32{0x80, 5, 296, 6, 7, 0x41, 8}, []uint32{le32(b, 16), le32(b, 20), le32(b, 24), le32(b, 28), le32(b, 32), le32(b, 36), le32(b, 40)})
	assert.Equal(t, []uint16{9, 10}, []uint16{le16(b, 44), le16(b, 46)})
	assert.Equal(t, []byte{11, 12, 1, 1, 2, 3, 4, 5, 6, 1}, b[48:58], "sl dlid_path_bits port_num smac[6] network_hdr_type@57")
	var c2 CQE
	c2.Decode(b)
	assert.Equal(t, c, c2)

	b = encodeGuarded(t, EQE{Type: 9, Info: 1}, EQESize)
	assert.Equal(t, []uint32{9, 1}, []uint32{le32(b, 0), le32(b, 4)})
	b = encodeGuarded(t, CQNE{Info: 3}, CQNESize)
	assert.EqualValues(t, 3, le32(b, 0))
}
