package roce

import (
	"encoding/binary"
	"encoding/hex"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	s = strings.Join(strings.Fields(s), "")
	b, err := hex.DecodeString(s)
	require.NoError(t, err)
	return b
}

// Known answers. The CNP was captured from a ConnectX-4 Lx (published in
// scapy's RoCE tests); its ICRC is the hardware's. The UC packet is the
// example of the same tests (ICRC 78 f3 53 f3 on the wire); it has a
// non-zero UDP checksum and TOS, both masked.
func TestICRCKnownAnswers(t *testing.T) {
	frame := unhex(t, `e41d 2dab 2bc2 7cfe 9064 3b32 0800 45c2
		003c 718c 4000 4011 9161 0a00 1101 0a00
		1201 0000 12b7 0028 0000 8100 ffff 4000
		0118 0000 0000 0000 0000 0000 0000 0000
		0000 0000 0000 82fd 002a`)
	d := frame[14:]
	assert.Equal(t, []byte{0x82, 0xfd, 0x00, 0x2a}, d[len(d)-4:])
	assert.Equal(t, binary.LittleEndian.Uint32(d[len(d)-4:]), ICRC(d, IPv4HeaderSize), "ConnectX-4 Lx CNP")

	uc := unhex(t, `4501 0040 0478 4000 4011 0000 c0a8 0007 c0a8 0007
		c000 12b7 002c aca2
		2460 ffff 0000 00d3 00cf 1710
		4630 818b e289 35d9 0e9a 9550 5401 be88 5e50 0000
		78f3 53f3`)
	binary.BigEndian.PutUint16(uc[10:], IPv4Checksum(uc[:20]))
	assert.Equal(t, binary.LittleEndian.Uint32(uc[len(uc)-4:]), ICRC(uc, IPv4HeaderSize), "scapy UC example")
}

func TestOpcodeTableLayout(t *testing.T) {
	for _, tc := range []struct {
		op                                       Opcode
		length, reth, aeth, atom, ack, deth, imm int
	}{
		{RCSendFirst, 12, 0, 0, 0, 0, 0, 0},
		{RCSendLastImm, 16, 0, 0, 0, 0, 0, 12},
		{RCWriteFirst, 28, 12, 0, 0, 0, 0, 0},
		{RCWriteLastImm, 16, 0, 0, 0, 0, 0, 12},
		{RCWriteOnlyImm, 32, 12, 0, 0, 0, 0, 28},
		{RCReadRequest, 28, 12, 0, 0, 0, 0, 0},
		{RCReadResponseFirst, 16, 0, 12, 0, 0, 0, 0},
		{RCReadResponseMiddle, 12, 0, 0, 0, 0, 0, 0},
		{RCAcknowledge, 16, 0, 12, 0, 0, 0, 0},
		{RCAtomicAcknowledge, 24, 0, 12, 0, 16, 0, 0},
		{RCCompareSwap, 40, 0, 0, 12, 0, 0, 0},
		{RCFetchAdd, 40, 0, 0, 12, 0, 0, 0},
		{UDSendOnly, 20, 0, 0, 0, 0, 12, 0},
		{UDSendOnlyImm, 24, 0, 0, 0, 0, 12, 20},
	} {
		i := tc.op.Info()
		require.True(t, i.Valid(), "%v", tc.op)
		assert.Equal(t, tc.length, i.Length, "%v length", tc.op)
		assert.Equal(t, []int{tc.reth, tc.aeth, tc.atom, tc.ack, tc.deth, tc.imm},
			[]int{i.RETHOff, i.AETHOff, i.AtomicETHOff, i.AtomicAckOff, i.DETHOff, i.ImmOff}, "%v offsets", tc.op)
	}
	assert.Equal(t, 16, RCSendOnlyInvalidate.Info().Length)
	assert.Equal(t, 12, RCSendOnlyInvalidate.Info().IETHOff)
	assert.False(t, Opcode(0x24).Info().Valid(), "UC is not implemented")
	assert.False(t, Opcode(0x15).Info().Valid(), "reserved")
	assert.Equal(t, "Opcode(0x80)", Opcode(0x80).String())
	assert.Equal(t, "CNP", CNP.String())
	assert.Equal(t, BTHSize+16, CNP.Info().Length, "CNP: BTH and 16 reserved bytes")
	assert.False(t, CNP.IsRC() || CNP.IsUD())
	assert.True(t, RCSendOnly.Info().Has(MaskSend|MaskStart|MaskEnd|MaskComp))
	assert.True(t, RCWriteLastImm.Info().Has(MaskRecvWQE|MaskComp))
	assert.False(t, RCWriteLast.Info().Any(MaskRecvWQE|MaskComp))
	assert.True(t, UDSendOnly.IsUD())
	assert.True(t, RCFetchAdd.IsRC())
}

func TestPSN(t *testing.T) {
	assert.Equal(t, PSN(0), MaxPSN.Add(1))
	assert.Equal(t, MaxPSN, PSN(0).Sub(1))
	assert.Equal(t, int32(1), PSN(0).Diff(MaxPSN))
	assert.Equal(t, int32(-1), MaxPSN.Diff(0))
	assert.True(t, PSN(5).After(MaxPSN.Sub(5)))
	assert.True(t, MaxPSN.Before(3))
	assert.Equal(t, uint32(3), PSN(1).Distance(MaxPSN.Sub(1)))
	assert.True(t, PSN(1).InRange(MaxPSN, 2))
	assert.False(t, PSN(3).InRange(MaxPSN, 2))
	assert.True(t, PSN(7).InRange(7, 7))
	assert.Equal(t, int32(-1<<23), PSN(0).Diff(1<<23), "the far half is earlier")
	assert.False(t, PSN(1<<24).Valid())
}

func TestSourcePorts(t *testing.T) {
	assert.Equal(t, uint16(0xc132), SourcePort(0, 0x11, 0x12), "flow label from the QPN product")
	assert.Equal(t, uint16(0xc000|0x1234^0x2), FlowLabelToSourcePort(0x8000|0x1234))
	assert.Equal(t, uint16(0xc000|0x3c90a&0x3fff^0x3c90a>>14), SourcePort(0x3c90a, 1, 2), "AV flow label wins")
	for qpn := uint32(0); qpn < 1000; qpn++ {
		p := QPSourcePort(qpn)
		assert.GreaterOrEqual(t, p, uint16(SourcePortMin))
	}
}

func TestPKeyMatch(t *testing.T) {
	assert.True(t, PKeyMatch(0xffff, 0xffff))
	assert.True(t, PKeyMatch(0xffff, 0x7fff))
	assert.False(t, PKeyMatch(0x7fff, 0x7fff), "two limited members")
	assert.False(t, PKeyMatch(0xffff, 0xfffe))
	assert.False(t, PKeyMatch(0x8000, 0x8000), "invalid partition")
}

func TestTimers(t *testing.T) {
	assert.Equal(t, 655360*time.Microsecond, RNRTimer(0))
	assert.Equal(t, 640*time.Microsecond, RNRTimer(12))
	assert.Equal(t, 491520*time.Microsecond, RNRTimer(31))
	assert.Equal(t, time.Duration(0), LocalACKTimeout(0))
	assert.Equal(t, 67108864*time.Nanosecond, LocalACKTimeout(14))
}

func gid(s string) [16]byte { return netip.MustParseAddr(s).As16() }

// buildPacket encodes op with n payload bytes between two GIDs.
func buildPacket(t testing.TB, src, dst string, op Opcode, n int) []byte {
	net := NetFields{Src: gid(src), Dst: gid(dst), TClass: 0x68, HopLimit: 64, FlowLabel: 0x12345, ID: 0x4242, SrcPort: 0xc123}
	tf := TransportFields{
		BTH: BTHFields{Opcode: op, SolicitedEvent: true, PKey: DefaultPKey, DestQP: 0x123456, AckReq: true, PSN: 0xabcdef},
		VA:  0x1122334455667788, RKey: 0x99aabbcc, DMALength: 0x100000,
		SwapAdd: 0x0102030405060708, Compare: 0x1112131415161718,
		Syndrome: NAKRemoteAccess, MSN: 0x654321, OrigData: 0x2122232425262728,
		QKey: 0x11111111, SrcQP: 0xfedcba, Imm: 0xdeadbeef, IETHRKey: 0x31323334,
	}
	buf := make([]byte, DatagramSize(IsV4Mapped(&net.Dst), op, n))
	d, off := Build(buf, &net, &tf, n)
	require.Len(t, d, len(buf))
	for i := range n {
		d[off+i] = byte(i*7 + 1)
	}
	SealICRC(d, ipLenOf(d))
	return d
}

func ipLenOf(d []byte) int {
	if d[0]>>4 == 4 {
		return IPv4HeaderSize
	}
	return IPv6HeaderSize
}

func allOpcodes() (ops []Opcode) {
	for op := range 256 {
		if Opcode(op).Info().Valid() {
			ops = append(ops, Opcode(op))
		}
	}
	return ops
}

func TestBuildParseRoundTrip(t *testing.T) {
	for _, fam := range [][2]string{{"::ffff:10.0.0.1", "::ffff:10.0.0.2"}, {"fd00::1", "fd00::2"}} {
		for _, op := range allOpcodes() {
			sizes := []int{0}
			if op.Info().Has(MaskPayload) {
				sizes = []int{0, 1, 3, 4, 5, 4096}
			}
			for _, n := range sizes {
				d := buildPacket(t, fam[0], fam[1], op, n)
				var p Packet
				require.NoError(t, p.Parse(d), "%v %d", op, n)
				require.True(t, p.ICRCValid(), "%v %d", op, n)
				assert.Equal(t, op, p.Op)
				assert.Equal(t, fam[0] != "fd00::1", !p.IPv6)
				assert.Equal(t, gid(fam[0]), p.SrcGID())
				assert.Equal(t, gid(fam[1]), p.DstGID())
				assert.Equal(t, uint8(0x68), p.TClass())
				assert.Equal(t, uint8(64), p.HopLimit())
				assert.Equal(t, uint16(0xc123), p.UDP.SrcPort())
				f := p.BTH.Fields()
				assert.Equal(t, BTHFields{Opcode: op, SolicitedEvent: true, PadCount: uint8(PadFor(n)), PKey: 0xffff,
					DestQP: 0x123456, AckReq: true, PSN: 0xabcdef}, f)
				require.Len(t, p.Payload, n)
				for i := range n {
					require.Equal(t, byte(i*7+1), p.Payload[i])
				}
				i := p.Info
				if i.Has(MaskRETH) {
					assert.Equal(t, uint64(0x1122334455667788), p.RETH().VA())
					assert.Equal(t, uint32(0x99aabbcc), p.RETH().RKey())
					assert.Equal(t, uint32(0x100000), p.RETH().DMALength())
				}
				if i.Has(MaskAtomicETH) {
					a := p.AtomicETH()
					assert.Equal(t, []uint64{0x1122334455667788, 0x0102030405060708, 0x1112131415161718},
						[]uint64{a.VA(), a.SwapAdd(), a.Compare()})
					assert.Equal(t, uint32(0x99aabbcc), a.RKey())
				}
				if i.Has(MaskAETH) {
					assert.Equal(t, NAKRemoteAccess, p.AETH().Syndrome())
					assert.Equal(t, uint32(0x654321), p.AETH().MSN())
				}
				if i.Has(MaskAtomicAck) {
					assert.Equal(t, uint64(0x2122232425262728), p.AtomicAckETH().OrigData())
				}
				if i.Has(MaskDETH) {
					assert.Equal(t, uint32(0x11111111), p.DETH().QKey())
					assert.Equal(t, uint32(0xfedcba), p.DETH().SrcQP())
				}
				if i.Has(MaskImm) {
					assert.Equal(t, uint32(0xdeadbeef), p.ImmDt().Imm())
					assert.Equal(t, []byte{0xef, 0xbe, 0xad, 0xde}, []byte(p.ImmDt()[:4]), "imm bytes verbatim")
				}
				if i.Has(MaskIETH) {
					assert.Equal(t, uint32(0x31323334), p.IETH().RKey())
				}
			}
		}
	}
}

// Fields a router may rewrite are masked; everything else is covered.
func TestICRCMasking(t *testing.T) {
	for _, fam := range [][2]string{{"::ffff:10.0.0.1", "::ffff:10.0.0.2"}, {"fd00::1", "fd00::2"}} {
		d := buildPacket(t, fam[0], fam[1], RCWriteOnly, 100)
		ipLen := ipLenOf(d)
		masked := []int{ipLen + 6, ipLen + 7, ipLen + UDPHeaderSize + 4} // UDP checksum, BTH resv8a
		if ipLen == IPv4HeaderSize {
			masked = append(masked, 1, 8, 10, 11) // TOS, TTL, checksum
		} else {
			masked = append(masked, 1, 2, 3, 7) // TC/flow label, hop limit
		}
		for _, i := range masked {
			c := append([]byte(nil), d...)
			c[i] ^= 0x5a
			var p Packet
			require.NoError(t, p.Parse(c))
			assert.True(t, p.ICRCValid(), "byte %d is masked", i)
		}
		covered := []int{ipLen + 0, ipLen + 2, ipLen + UDPHeaderSize, ipLen + UDPHeaderSize + 5, ipLen + UDPHeaderSize + 11, len(d) - 5}
		if ipLen == IPv4HeaderSize {
			covered = append(covered, 4, 5, 12, 19) // ID, addresses
		} else {
			covered = append(covered, 8, 39)
		}
		for _, i := range covered {
			c := append([]byte(nil), d...)
			c[i] ^= 0x01
			var p Packet
			if p.Parse(c) == nil {
				assert.False(t, p.ICRCValid(), "byte %d is covered", i)
			}
		}
	}
}

func TestParseRejects(t *testing.T) {
	good := buildPacket(t, "::ffff:10.0.0.1", "::ffff:10.0.0.2", RCSendOnly, 10)
	mut := func(f func(d []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for _, tc := range []struct {
		name string
		d    []byte
		want error
	}{
		{"empty", nil, ErrTruncated},
		{"version", mut(func(d []byte) []byte { d[0] = 0x55; return d }), ErrIPVersion},
		{"options", mut(func(d []byte) []byte { d[0] = 0x46; return d }), ErrIPHeader},
		{"trailing", append(append([]byte(nil), good...), 0), ErrIPHeader},
		{"fragment", mut(func(d []byte) []byte { d[6] = 0x20; return d }), ErrFragment},
		{"tcp", mut(func(d []byte) []byte { d[9] = 6; return d }), ErrNotUDP},
		{"port", mut(func(d []byte) []byte { d[22] = 0; return d }), ErrUDPPort},
		{"udp length", mut(func(d []byte) []byte { d[25]++; return d }), ErrUDPLength},
		{"opcode", mut(func(d []byte) []byte { d[28] = 0x24; return d }), ErrOpcode},
		{"tver", mut(func(d []byte) []byte { d[29] |= 1; return d }), ErrTVer},
		{"pad", mut(func(d []byte) []byte { d[29] = 3 << 4; d[28] = byte(RCSendOnly); return d[:0] }), ErrTruncated},
		{"ack payload", mut(func(d []byte) []byte { d[28] = byte(RCAcknowledge); d[29] &^= 0x30; return d }), ErrNoPayload},
		{"short ip", good[:10], ErrTruncated},
	} {
		var p Packet
		assert.ErrorIs(t, p.Parse(tc.d), tc.want, tc.name)
	}
	// A datagram whose body is not 4-aligned.
	d := buildPacket(t, "::ffff:10.0.0.1", "::ffff:10.0.0.2", RCAcknowledge, 0)
	d = append(d, 0, 0)
	binary.BigEndian.PutUint16(d[2:], uint16(len(d)))
	binary.BigEndian.PutUint16(d[24:], uint16(len(d)-20))
	var p Packet
	assert.ErrorIs(t, p.Parse(d), ErrPadding)
}
