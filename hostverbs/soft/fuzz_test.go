package soft

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// fuzzFixture is a device with an RC QP that has work outstanding (so
// responses reach the completer), a UD QP and the GSI QP, receive WQEs
// posted everywhere, and one MR in the middle of guest memory with canary
// pages on both sides that nothing may touch.
type fuzzFixture struct {
	f    *Fabric
	dev  *device
	mem  []byte
	tx   *txBatch
	peer hostverbs.GID
	self hostverbs.GID
}

const (
	fzMRBase  = 0x2000
	fzMRSize  = 0x10000
	fzMemSize = fzMRBase + fzMRSize + 0x2000
	fzRCQPN   = 16
	fzUDQPN   = 17
	fzRQPSN   = 100
	fzSQPSN   = 200
	fzQKey    = 0x11111111
	fzPeerQPN = 0x100
)

type discardCQ struct{}

func (discardCQ) Complete(*hostverbs.WorkCompletion) {}

func newFuzzFixture(tb testing.TB, v6 bool) *fuzzFixture { return newFuzzFixtureMode(tb, v6, false) }

// newFuzzFixtureMode is newFuzzFixture for a RoCE v1 device if v1.
func newFuzzFixtureMode(tb testing.TB, v6, v1 bool) *fuzzFixture {
	f, err := New(Config{Clock: NewManualClock(time.Unix(0, 0))})
	if err != nil {
		tb.Fatal(err)
	}
	mem, data := guestmem.NewFlat(0, fzMemSize)
	mode := hostverbs.GIDTypeRoCEv2
	if v1 {
		mode = hostverbs.GIDTypeRoCEv1
	}
	d, err := f.Open(hostverbs.DeviceConfig{Name: "fuzz", Memory: mem, RoCEMode: mode, Events: func(hostverbs.AsyncEvent) {}})
	if err != nil {
		tb.Fatal(err)
	}
	fx := &fuzzFixture{f: f, dev: d.(*device), mem: data, tx: newTxBatch(f)}
	self, peer := "10.0.0.1", "10.0.0.2"
	if v6 {
		self, peer = "fd00::1", "fd00::2"
	}
	fx.self = hostverbs.GIDFromAddr(netip.MustParseAddr(self))
	fx.peer = hostverbs.GIDFromAddr(netip.MustParseAddr(peer))
	must := func(err error) {
		if err != nil {
			tb.Fatal(err)
		}
	}
	must(d.SetGID(0, hostverbs.GIDEntry{GID: fx.self, Type: mode}))
	pd, err := d.AllocPD()
	must(err)
	cq, err := d.CreateCQ(hostverbs.CQAttr{Depth: 64, Handler: discardCQ{}})
	must(err)
	pl, err := guestmem.NewPageList(fzMRBase, fzMRSize, pages(fzMRBase, fzMRSize))
	must(err)
	m, err := pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite |
		hostverbs.AccessRemoteWrite | hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic})
	must(err)
	// The seeds name the MR by key 0x101 (index 1, key byte 1): keys are
	// random, so the fixture gives its one MR that key.
	if mm := m.(*mr); mm.key>>8 == 1 {
		mm.key = 0x101
		fx.dev.keys.gen[1] = 1
	} else {
		tb.Fatalf("first MR's key %#x is not at index 1", mm.key)
	}
	s := func(off, n uint32) []hostverbs.SGE {
		return []hostverbs.SGE{{Addr: fzMRBase + uint64(off), Length: n, LKey: m.LKey()}}
	}
	rc, err := pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: cq, RecvCQ: cq,
		Cap: hostverbs.QPCap{MaxSendWR: 16, MaxRecvWR: 16, MaxSendSGE: 2, MaxRecvSGE: 2}})
	must(err)
	must(rc.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, AccessFlags: hostverbs.AccessRemoteWrite |
		hostverbs.AccessRemoteRead | hostverbs.AccessRemoteAtomic},
		hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
	must(rc.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024, DestQPN: fzPeerQPN,
		RQPSN: fzRQPSN, MaxDestRdAtomic: 4, MinRNRTimer: 1, AV: hostverbs.AddressVector{DGID: fx.peer}},
		hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|hostverbs.AttrRQPSN|
			hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
	must(rc.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: 14, RetryCnt: 7, RNRRetry: 7,
		SQPSN: fzSQPSN, MaxRdAtomic: 4}, hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|
		hostverbs.AttrRNRRetry|hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic))
	for i := range 3 {
		must(rc.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: s(0x100*uint32(i), 0x1800)}))
	}
	// Outstanding work whose packets go nowhere (the peer GID is not ours).
	must(rc.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRSend, SGL: s(0x4000, 100)}))
	must(rc.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMAWrite, SGL: s(0x4000, 5000), RemoteAddr: 0x9000, RKey: 77}))
	must(rc.PostSend(&hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRRDMARead, SGL: s(0x6000, 3000), RemoteAddr: 0x9000, RKey: 77}))
	must(rc.PostSend(&hostverbs.SendWR{WRID: 4, Opcode: hostverbs.WRAtomicFetchAndAdd, SGL: s(0x7000, 8), RemoteAddr: 0x9000, RKey: 77}))
	for _, typ := range []hostverbs.QPType{hostverbs.QPTypeUD, hostverbs.QPTypeGSI} {
		q, err := pd.CreateQP(hostverbs.QPInitAttr{Type: typ, SendCQ: cq, RecvCQ: cq,
			Cap: hostverbs.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}})
		must(err)
		mask := hostverbs.AttrState | hostverbs.AttrPKeyIndex | hostverbs.AttrQKey
		qkey := uint32(fzQKey)
		if typ == hostverbs.QPTypeUD {
			mask |= hostverbs.AttrPort
		} else {
			qkey = roce.GSIQKey
		}
		must(q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1, QKey: qkey}, mask))
		must(q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR}, hostverbs.AttrState))
		for i := range 2 {
			must(q.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: s(0x8000+0x800*uint32(i), 0x800)}))
		}
	}
	return fx
}

func pages(base, size uint64) []guestmem.GPA {
	var p []guestmem.GPA
	for a := base; a < base+size; a += guestmem.PageSize {
		p = append(p, guestmem.GPA(a))
	}
	return p
}

func (fx *fuzzFixture) close() {
	_ = fx.dev.Close()
	_ = fx.f.Close()
}

// datagram wraps transport bytes (BTH onwards, without ICRC) from the peer
// to the device, with a valid ICRC if seal.
func (fx *fuzzFixture) datagram(transport []byte, seal bool) []byte {
	v4 := fx.self.IsV4()
	h := roce.NetHeaderSize(v4)
	d := make([]byte, h+len(transport)+roce.ICRCSize)
	roce.EncodeNet(d, &roce.NetFields{Src: fx.peer, Dst: fx.self, HopLimit: 64, ID: 1, SrcPort: 0xc001},
		len(transport)+roce.ICRCSize)
	copy(d[h:], transport)
	if seal && len(transport) >= roce.BTHSize {
		roce.SealICRC(d, h-roce.UDPHeaderSize)
	}
	return d
}

// datagramV1 is datagram framed as RoCE v1 (a GRH, the content of an
// Ethertype 0x8915 frame).
func (fx *fuzzFixture) datagramV1(transport []byte, seal bool) []byte {
	d := make([]byte, roce.GRHSize+len(transport)+roce.ICRCSize)
	roce.EncodeGRH(d, &roce.NetFields{Src: fx.peer, Dst: fx.self, HopLimit: 64}, len(transport)+roce.ICRCSize)
	copy(d[roce.GRHSize:], transport)
	if seal && len(transport) >= roce.BTHSize {
		roce.SealICRCv1(d)
	}
	return d
}

// setCE marks a datagram Congestion Experienced, as a switch would have
// (the IPv4 header checksum follows; the ICRC does not cover the field).
func setCE(d []byte) {
	if d[0]>>4 == 4 {
		d[1] |= roce.ECNCE
		binary.BigEndian.PutUint16(d[10:], 0)
		binary.BigEndian.PutUint16(d[10:], roce.IPv4Checksum(d[:20]))
		return
	}
	binary.BigEndian.PutUint32(d, binary.BigEndian.Uint32(d)|roce.ECNCE<<20)
}

// seedTransports are valid requests and responses for the fixture's QPs.
func seedTransports() [][]byte {
	mk := func(tf roce.TransportFields, n int) []byte {
		info := tf.BTH.Opcode.Info()
		tf.BTH.PadCount = uint8(roce.PadFor(n))
		b := make([]byte, info.Length+n+roce.PadFor(n))
		roce.EncodeTransport(b, &tf)
		for i := range n {
			b[info.Length+i] = byte(i)
		}
		return b
	}
	bth := func(op roce.Opcode, qpn uint32, psn roce.PSN) roce.BTHFields {
		return roce.BTHFields{Opcode: op, PKey: 0xffff, DestQP: qpn, PSN: psn, AckReq: true}
	}
	var out [][]byte
	add := func(tf roce.TransportFields, n int) { out = append(out, mk(tf, n)) }
	add(roce.TransportFields{BTH: bth(roce.RCSendOnly, fzRCQPN, fzRQPSN)}, 100)
	add(roce.TransportFields{BTH: bth(roce.RCSendFirst, fzRCQPN, fzRQPSN)}, 1024)
	add(roce.TransportFields{BTH: bth(roce.RCSendOnlyImm, fzRCQPN, fzRQPSN), Imm: 5}, 7)
	add(roce.TransportFields{BTH: bth(roce.RCWriteOnly, fzRCQPN, fzRQPSN), VA: fzMRBase + 0x100, RKey: 0x101, DMALength: 64}, 64)
	add(roce.TransportFields{BTH: bth(roce.RCWriteFirst, fzRCQPN, fzRQPSN), VA: fzMRBase, RKey: 0x101, DMALength: 3000}, 1024)
	add(roce.TransportFields{BTH: bth(roce.RCWriteOnlyImm, fzRCQPN, fzRQPSN), VA: fzMRBase + fzMRSize - 8, RKey: 0x101, DMALength: 8}, 8)
	add(roce.TransportFields{BTH: bth(roce.RCReadRequest, fzRCQPN, fzRQPSN), VA: fzMRBase, RKey: 0x101, DMALength: 5000}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCCompareSwap, fzRCQPN, fzRQPSN), VA: fzMRBase + 8, RKey: 0x101, SwapAdd: 1, Compare: 0}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCFetchAdd, fzRCQPN, fzRQPSN), VA: fzMRBase + 16, RKey: 0x101, SwapAdd: 9}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCAcknowledge, fzRCQPN, fzSQPSN), Syndrome: roce.SyndromeACKUnlimited}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCAcknowledge, fzRCQPN, fzSQPSN+5), Syndrome: roce.SyndromeACKUnlimited}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCAcknowledge, fzRCQPN, fzSQPSN+1), Syndrome: roce.NAKPSNSequenceError}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCAcknowledge, fzRCQPN, fzSQPSN), Syndrome: roce.RNRNAK(3)}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCAcknowledge, fzRCQPN, fzSQPSN), Syndrome: roce.NAKRemoteAccess}, 0)
	add(roce.TransportFields{BTH: bth(roce.RCReadResponseFirst, fzRCQPN, fzSQPSN+6), Syndrome: roce.SyndromeACKUnlimited}, 1024)
	add(roce.TransportFields{BTH: bth(roce.RCReadResponseLast, fzRCQPN, fzSQPSN+8), Syndrome: roce.SyndromeACKUnlimited}, 952)
	add(roce.TransportFields{BTH: bth(roce.RCAtomicAcknowledge, fzRCQPN, fzSQPSN+9), Syndrome: roce.SyndromeACKUnlimited, OrigData: 3}, 0)
	add(roce.TransportFields{BTH: bth(roce.UDSendOnly, fzUDQPN, 0), QKey: fzQKey, SrcQP: 5}, 200)
	add(roce.TransportFields{BTH: bth(roce.UDSendOnlyImm, gsiQPN, 0), QKey: roce.GSIQKey, SrcQP: 1, Imm: 9}, 256)
	add(roce.TransportFields{BTH: roce.BTHFields{Opcode: roce.CNP, PKey: 0xffff, DestQP: fzRCQPN, BECN: true}}, 0)
	return out
}

// Flags of FuzzReceive's first input byte.
const (
	fzSeal     = 1  // recompute the ICRC (so mutations get past it)
	fzV6       = 2  // IPv6 addresses
	fzV1       = 4  // a RoCE v1 device, and the packet framed as v1
	fzCE       = 8  // the packet arrives marked Congestion Experienced (v2)
	fzMismatch = 16 // the device is of the other RoCE version
)

// FuzzReceive drives the receive gate, responder and completer with
// mutated packets. Input byte 0 holds the fz flags; the rest is the
// transport part. Nothing may panic, and no byte outside the MR may
// change.
func FuzzReceive(f *testing.F) {
	for _, tr := range seedTransports() {
		for _, flags := range []byte{fzSeal, fzSeal | fzV6, fzSeal | fzV1, fzSeal | fzCE, fzSeal | fzV1 | fzMismatch} {
			f.Add(append([]byte{flags}, tr...))
		}
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < 1 || len(in) > 5000 {
			return
		}
		flags := in[0]
		v1 := flags&fzV1 != 0
		fx := newFuzzFixtureMode(t, flags&fzV6 != 0, v1 != (flags&fzMismatch != 0))
		defer fx.close()
		var rp roce.Packet
		var p packet
		var d []byte
		var fi *wire.FrameInfo
		if v1 {
			d = fx.datagramV1(in[1:], flags&fzSeal != 0)
			fi = &wire.FrameInfo{RoCEv1: true}
		} else {
			d = fx.datagram(in[1:], flags&fzSeal != 0)
			if flags&fzCE != 0 {
				setCE(d)
			}
		}
		fx.f.receive(fx.tx, d, fi, &rp, &p)
		// A second copy exercises duplicate handling and state after it.
		fx.f.receive(fx.tx, d, fi, &rp, &p)
		fx.tx.flush()
		outside := append(append([]byte(nil), fx.mem[:fzMRBase]...), fx.mem[fzMRBase+fzMRSize:]...)
		if !bytes.Equal(outside, make([]byte, len(outside))) {
			t.Fatalf("memory outside the MR was written")
		}
	})
}

// TestWriteReceiveCorpus regenerates testdata/fuzz/FuzzReceive when
// SOFT_WRITE_CORPUS=1.
func TestWriteReceiveCorpus(t *testing.T) {
	if os.Getenv("SOFT_WRITE_CORPUS") != "1" {
		t.Skip("set SOFT_WRITE_CORPUS=1 to regenerate the seed corpus")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzReceive")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i, tr := range seedTransports() {
		for _, flag := range []byte{fzSeal, fzSeal | fzV6, fzSeal | fzV1, fzSeal | fzCE, fzSeal | fzV1 | fzMismatch} {
			op := roce.BTH(tr).Opcode()
			body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", append([]byte{flag}, tr...))
			name := fmt.Sprintf("%02d-%s-%d", i, op, flag)
			if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// The seeds themselves must be accepted as the valid packets they are.
func TestFuzzSeedsAreValid(t *testing.T) {
	for _, tr := range seedTransports() {
		fx := newFuzzFixture(t, false)
		before := fx.f.Counters()
		var rp roce.Packet
		var p packet
		fx.f.receiveDatagram(fx.tx, fx.datagram(tr, true), &rp, &p)
		fx.tx.flush()
		c := fx.f.Counters()
		for _, k := range []string{"drop_bad_icrc", "drop_truncated", "drop_unknown_qpn", "drop_wrong_transport",
			"drop_bad_padding", "drop_bad_qkey", "drop_bad_address", "drop_qp_state"} {
			if c[k] != before[k] {
				t.Errorf("seed %v dropped: %s", roce.BTH(tr).Opcode(), k)
			}
		}
		fx.close()
	}
}

// TestFuzzSeedsV1AndCE: framed as RoCE v1 for a v1 device the seeds are
// accepted as well; for a v2 device they are version mismatches; marked
// CE, an RC request makes the QP send a CNP to its peer.
func TestFuzzSeedsV1AndCE(t *testing.T) {
	drops := []string{"drop_bad_icrc", "drop_truncated", "drop_unknown_qpn", "drop_wrong_transport",
		"drop_bad_padding", "drop_bad_qkey", "drop_bad_address", "drop_qp_state", "drop_roce_version_mismatch", "drop_ip_header"}
	for _, tr := range seedTransports() {
		op := roce.BTH(tr).Opcode()
		fx := newFuzzFixtureMode(t, false, true)
		var rp roce.Packet
		var p packet
		fx.f.receive(fx.tx, fx.datagramV1(tr, true), &wire.FrameInfo{RoCEv1: true}, &rp, &p)
		fx.tx.flush()
		c := fx.f.Counters()
		for _, k := range drops {
			assert.Zero(t, c[k], "v1 seed %v: %s", op, k)
		}
		fx.close()

		fx = newFuzzFixtureMode(t, false, false)
		fx.f.receive(fx.tx, fx.datagramV1(tr, true), &wire.FrameInfo{RoCEv1: true}, &rp, &p)
		fx.tx.flush()
		if op != roce.CNP {
			assert.Equal(t, uint64(1), fx.f.Counters()["drop_roce_version_mismatch"], "v1 seed %v at a v2 device", op)
		}
		fx.close()

		fx = newFuzzFixture(t, false)
		d := fx.datagram(tr, true)
		setCE(d)
		fx.f.receive(fx.tx, d, nil, &rp, &p)
		fx.tx.flush()
		c = fx.f.Counters()
		assert.Equal(t, uint64(1), c["rx_ecn_ce_marked"], "seed %v", op)
		if op.Info().Has(roce.MaskReq) && op.IsRC() {
			assert.Equal(t, uint64(1), c["tx_cnp"], "CE-marked %v: a CNP", op)
		}
		fx.close()
	}
}
