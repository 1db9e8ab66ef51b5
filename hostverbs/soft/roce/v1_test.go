package roce

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// buildV1 builds a sealed RoCE v1 packet with every header field set.
func buildV1(t testing.TB, src, dst string, op Opcode, n int) []byte {
	net := NetFields{Src: gid(src), Dst: gid(dst), TClass: 0x68, HopLimit: 64, FlowLabel: 0x12345}
	tf := TransportFields{
		BTH: BTHFields{Opcode: op, SolicitedEvent: true, PKey: DefaultPKey, DestQP: 0x123456, AckReq: true, PSN: 0xabcdef},
		VA:  0x1122334455667788, RKey: 0x99aabbcc, DMALength: 0x100000,
		SwapAdd: 0x0102030405060708, Compare: 0x1112131415161718,
		Syndrome: NAKRemoteAccess, MSN: 0x654321, OrigData: 0x2122232425262728,
		QKey: 0x11111111, SrcQP: 0xfedcba, Imm: 0xdeadbeef, IETHRKey: 0x31323334,
	}
	buf := make([]byte, PacketSizeV1(op, n))
	d, off := BuildV1(buf, &net, &tf, n)
	require.Len(t, d, len(buf))
	for i := range n {
		d[off+i] = byte(i*7 + 1)
	}
	SealICRCv1(d)
	return d
}

func TestGRHLayout(t *testing.T) {
	d := buildV1(t, "fe80::5054:ff:fe00:1", "::ffff:10.0.0.2", RCSendOnly, 5)
	// IBA 8.3.1: IPVer 4 bits, TClass 8, FlowLabel 20, PayLen 16, NxtHdr 8,
	// HopLmt 8, SGID 128, DGID 128.
	require.Len(t, d, 40+12+5+3+4)
	assert.Equal(t, uint32(6<<28|0x68<<20|0x12345), binary.BigEndian.Uint32(d[0:]))
	assert.Equal(t, uint16(12+8+4), binary.BigEndian.Uint16(d[4:]), "PayLen: BTH to ICRC inclusive")
	assert.Equal(t, byte(0x1b), d[6])
	assert.Equal(t, byte(64), d[7])
	s, g := gid("fe80::5054:ff:fe00:1"), gid("::ffff:10.0.0.2")
	assert.Equal(t, s[:], d[8:24])
	assert.Equal(t, g[:], d[24:40])
	assert.Equal(t, byte(RCSendOnly), d[40])
	assert.Equal(t, 3, BTH(d[40:]).PadCount())
}

func TestBuildParseV1RoundTrip(t *testing.T) {
	for _, op := range allOpcodes() {
		n := 0
		if op.Info().Has(MaskPayload) {
			n = 13
		}
		d := buildV1(t, "fe80::1", "fe80::2", op, n)
		var p Packet
		require.NoError(t, p.ParseV1(d), "%v", op)
		assert.True(t, p.V1)
		assert.Nil(t, p.UDP)
		assert.True(t, p.ICRCValid(), "%v", op)
		assert.Equal(t, op, p.Op)
		assert.Len(t, p.Payload, n)
		assert.Equal(t, gid("fe80::1"), p.SrcGID())
		assert.Equal(t, gid("fe80::2"), p.DstGID())
		assert.Equal(t, uint8(0x68), p.TClass())
		assert.Equal(t, uint8(64), p.HopLimit())
		assert.Equal(t, uint32(0x12345), p.FlowLabel())
		// A v1 packet is not a v2 datagram: its GRH says next header 0x1B.
		assert.ErrorIs(t, (&Packet{}).Parse(d), ErrNotUDP)
	}
}

func TestICRCv1Masking(t *testing.T) {
	d := buildV1(t, "fe80::1", "fe80::2", RCWriteOnly, 100)
	// Traffic class and flow label (bytes 0-3 but the version), hop
	// limit, BTH byte 4 (FECN, BECN, reserved): a router may change them.
	for _, i := range []int{1, 2, 3, 7, GRHSize + 4} {
		c := append([]byte(nil), d...)
		c[i] ^= 0x5a
		var p Packet
		require.NoError(t, p.ParseV1(c))
		assert.True(t, p.ICRCValid(), "byte %d is masked", i)
	}
	c := append([]byte(nil), d...)
	c[0] ^= 0x0a // traffic class's high nibble shares byte 0 with the version
	var p Packet
	require.NoError(t, p.ParseV1(c))
	assert.True(t, p.ICRCValid())
	for _, i := range []int{4, 5, 6, 8, 23, 24, 39, GRHSize, GRHSize + 5, GRHSize + 11, len(d) - 5} {
		c := append([]byte(nil), d...)
		c[i] ^= 0x01
		var p Packet
		if p.ParseV1(c) == nil {
			assert.False(t, p.ICRCValid(), "byte %d is covered", i)
		}
	}
	// The same transport over v2 has another ICRC: a v1 ICRC never
	// validates a v2 datagram by accident of layout.
	assert.NotEqual(t, ICRCv1(d), ICRC(buildPacket(t, "fe80::1", "fe80::2", RCWriteOnly, 100), IPv6HeaderSize))
}

func TestParseV1Rejects(t *testing.T) {
	good := buildV1(t, "fe80::1", "fe80::2", RCSendOnly, 10)
	mut := func(f func(d []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for _, tc := range []struct {
		name string
		d    []byte
		want error
	}{
		{"empty", nil, ErrTruncated},
		{"short grh", good[:39], ErrTruncated},
		{"version", mut(func(d []byte) []byte { d[0] = 0x46; return d }), ErrGRH},
		{"udp next header", mut(func(d []byte) []byte { d[6] = 17; return d }), ErrGRH},
		{"trailing", append(append([]byte(nil), good...), 0), ErrGRH},
		{"paylen", mut(func(d []byte) []byte { d[5]--; return d[:len(d)-1] }), ErrPadding},
		{"no bth", mut(func(d []byte) []byte { binary.BigEndian.PutUint16(d[4:], 4); return d[:44] }), ErrTruncated},
		{"opcode", mut(func(d []byte) []byte { d[40] = 0x24; return d }), ErrOpcode},
		{"tver", mut(func(d []byte) []byte { d[41] |= 1; return d }), ErrTVer},
	} {
		var p Packet
		assert.ErrorIs(t, p.ParseV1(tc.d), tc.want, tc.name)
	}
}

// FuzzParseV1: any frame body parses or fails cleanly, and what parses
// has views inside the buffer.
func FuzzParseV1(f *testing.F) {
	for _, op := range allOpcodes() {
		f.Add(buildV1(f, "fe80::1", "fe80::2", op, 5))
	}
	f.Fuzz(func(t *testing.T, d []byte) {
		var p Packet
		if p.ParseV1(d) != nil {
			return
		}
		_ = p.ICRCValid()
		_, _ = p.SrcGID(), p.DstGID()
		_, _, _ = p.TClass(), p.HopLimit(), p.FlowLabel()
		if len(p.Headers) != p.Info.Length || len(p.Payload) > len(d)-GRHSize || !p.V1 || p.UDP != nil {
			t.Fatalf("bad views: headers %d payload %d packet %d", len(p.Headers), len(p.Payload), len(d))
		}
	})
}

// TestWriteSeedCorpusV1 regenerates testdata/fuzz/FuzzParseV1 when
// ROCE_WRITE_CORPUS=1 (the checked-in corpus is its output).
func TestWriteSeedCorpusV1(t *testing.T) {
	if os.Getenv("ROCE_WRITE_CORPUS") != "1" {
		t.Skip("set ROCE_WRITE_CORPUS=1 to regenerate the seed corpus")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzParseV1")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for _, op := range allOpcodes() {
		d := buildV1(t, "::ffff:10.0.0.1", "fe80::2", op, 7)
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", d)
		require.NoError(t, os.WriteFile(filepath.Join(dir, op.String()), []byte(body), 0o644))
	}
}
