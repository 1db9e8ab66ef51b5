package roce

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// FuzzParse feeds arbitrary datagrams to Parse: nothing may panic, and a
// datagram Parse accepts must yield views inside it whose fields round-trip
// through EncodeTransport.
func FuzzParse(f *testing.F) {
	for _, op := range allOpcodes() {
		f.Add(buildPacket(f, "::ffff:10.0.0.1", "::ffff:10.0.0.2", op, 5))
	}
	f.Add(buildPacket(f, "fd00::1", "fd00::2", RCReadResponseMiddle, 64))
	f.Fuzz(func(t *testing.T, d []byte) {
		var p Packet
		if p.Parse(d) != nil {
			return
		}
		_ = p.ICRCValid()
		_ = p.SrcGID()
		_ = p.DstGID()
		_, _, _ = p.TClass(), p.HopLimit(), p.FlowLabel()
		if len(p.Headers) != p.Info.Length || len(p.Payload) > len(d) {
			t.Fatalf("bad views: headers %d payload %d datagram %d", len(p.Headers), len(p.Payload), len(d))
		}
		tf := TransportFields{BTH: p.BTH.Fields()}
		i := p.Info
		if i.Has(MaskRETH) {
			r := p.RETH()
			tf.VA, tf.RKey, tf.DMALength = r.VA(), r.RKey(), r.DMALength()
		}
		if i.Has(MaskAtomicETH) {
			a := p.AtomicETH()
			tf.VA, tf.RKey, tf.SwapAdd, tf.Compare = a.VA(), a.RKey(), a.SwapAdd(), a.Compare()
		}
		if i.Has(MaskAETH) {
			tf.Syndrome, tf.MSN = p.AETH().Syndrome(), p.AETH().MSN()
		}
		if i.Has(MaskAtomicAck) {
			tf.OrigData = p.AtomicAckETH().OrigData()
		}
		if i.Has(MaskDETH) {
			tf.QKey, tf.SrcQP = p.DETH().QKey(), p.DETH().SrcQP()
		}
		if i.Has(MaskImm) {
			tf.Imm = p.ImmDt().Imm()
		}
		if i.Has(MaskIETH) {
			tf.IETHRKey = p.IETH().RKey()
		}
		out := make([]byte, i.Length)
		EncodeTransport(out, &tf)
		// Reserved bits are not carried; compare what is defined.
		in := append([]byte(nil), p.Headers...)
		in[bthResv8a] &= bthFECN | bthBECN
		in[bthAckPSN] &= bthAckReq
		if i.Has(MaskDETH) {
			in[i.DETHOff+4] = 0
		}
		if i.Has(MaskCNP) {
			clear(in[BTHSize:])
		}
		if string(in) != string(out) {
			t.Fatalf("re-encoded headers differ:\n%x\n%x", in, out)
		}
	})
}

// TestWriteSeedCorpus regenerates testdata/fuzz/FuzzParse when
// ROCE_WRITE_CORPUS=1 (the checked-in corpus is its output).
func TestWriteSeedCorpus(t *testing.T) {
	if os.Getenv("ROCE_WRITE_CORPUS") != "1" {
		t.Skip("set ROCE_WRITE_CORPUS=1 to regenerate the seed corpus")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzParse")
	for _, op := range allOpcodes() {
		for _, fam := range [][2]string{{"::ffff:10.0.0.1", "::ffff:10.0.0.2"}, {"fd00::1", "fd00::2"}} {
			d := buildPacket(t, fam[0], fam[1], op, 7)
			name := fmt.Sprintf("%s-v%d", op, map[bool]int{true: 6, false: 4}[fam[0] == "fd00::1"])
			body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", d)
			if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}
