package vdev

import (
	"encoding/binary"
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// fuzzGuest is a probed guest with a few objects and known-good page
// directories the fuzzers can point commands at.
type fuzzGuest struct {
	*guest
	dirs []uint64 // page directories of 1, 2, 9, 17 and 64 pages
	mr   *gmr
}

func newFuzzGuest(t testing.TB) *fuzzGuest {
	g := newGuestSized(t, newFakeVerbs(), Limits{}, 4<<20)
	g.probe()
	fg := &fuzzGuest{guest: g}
	for _, n := range []int{1, 2, 9, 17, 64} {
		fg.dirs = append(fg.dirs, g.pdir(g.pages(n)))
	}
	g.bindGID(0, gidA)
	g.createUC(1)
	pd := g.createPD(0)
	cq := g.createCQ(0, 64)
	fg.mr = g.regMR(pd, 0x10000, 1<<16, 0xf)
	q := g.createQP(qpSpec{pd: pd, scq: cq, rcq: cq, typ: hostverbs.QPTypeRC, sendWR: 16, recvWR: 16, sendSGE: 2, recvSGE: 2})
	q.toRTS(9, gidB, 0)
	return fg
}

// checkInvariants are what must hold whatever the guest did.
func (fg *fuzzGuest) checkInvariants(t *testing.T) {
	if e := fg.readReg(abi.RegErr); e >= 256 && e != 0xFFFF {
		t.Fatalf("ERR %#x is not a small positive errno", e)
	}
	d := fg.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, tb := range map[string]int{"qp": d.qps.len(), "cq": d.cqs.len(), "pd": d.pds.len(), "mr": d.mrs.len(), "srq": d.srqs.len()} {
		if tb < 0 {
			t.Fatalf("%s table count %d", name, tb)
		}
	}
	d.qps.each(func(h uint32, q *qp) {
		if h >= d.caps.MaxQP || q.handle != h {
			t.Fatalf("QP handle %d (caps %d)", h, d.caps.MaxQP)
		}
	})
	d.cqs.each(func(h uint32, c *cq) {
		if h >= d.caps.MaxCQ {
			t.Fatalf("CQ handle %d (caps %d)", h, d.caps.MaxCQ)
		}
	})
}

// pdirOffset is where each creating command carries its page directory.
var pdirOffset = map[uint32]int{abi.CmdCreateMR: abi.CreateMRPDirOffset, abi.CmdCreateCQ: 16, abi.CmdCreateQP: abi.CreateQPPDirOffset, abi.CmdCreateSRQ: 16}

// FuzzCommand runs one command slot of arbitrary bytes.
func FuzzCommand(f *testing.F) {
	seed := func(code uint32, req encoder) []byte {
		b := make([]byte, abi.CmdReqSize)
		abi.CmdHdr{Cmd: code}.Encode(b)
		if req != nil {
			req.Encode(b)
		}
		return b
	}
	f.Add(seed(abi.CmdQueryPort, abi.QueryPort{PortNum: 1}), uint8(0))
	f.Add(seed(abi.CmdCreateCQ, abi.CreateCQ{CQE: 64, NChunks: 2}), uint8(1))
	f.Add(seed(abi.CmdCreateMR, abi.CreateMR{Start: 0x1000, Length: 0x1000, NChunks: 1, AccessFlags: 1}), uint8(0))
	f.Add(seed(abi.CmdCreateQP, abi.CreateQP{PDHandle: 0, QPType: 2, MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1, TotalChunks: 2, SendChunks: 1}), uint8(1))
	f.Add(seed(abi.CmdModifyQP, abi.ModifyQP{QPHandle: 0, AttrMask: 1, Attrs: abi.QPAttr{State: 6}}), uint8(0))
	f.Add(seed(abi.CmdCreateSRQ, abi.CreateSRQ{Attrs: abi.SRQAttr{MaxWR: 16, MaxSGE: 1}, NChunks: 2}), uint8(1))
	f.Add(seed(abi.CmdCreateBind, abi.CreateBind{Index: 3, NewGID: gidB, GIDType: 2}), uint8(0))
	f.Add(seed(abi.CmdDestroyQP, abi.DestroyQP{}), uint8(0))
	f.Fuzz(func(t *testing.T, slot []byte, dir uint8) {
		fg := newFuzzGuest(t)
		b := make([]byte, abi.CmdReqSize)
		copy(b, slot)
		code := binary.LittleEndian.Uint32(b[8:])
		if off, ok := pdirOffset[code%abi.NumCmds]; ok && dir&0x80 == 0 {
			binary.LittleEndian.PutUint64(b[off:], fg.dirs[int(dir)%len(fg.dirs)])
		}
		copy(fg.raw[fg.cmdGPA:], b)
		if err := fg.writeReg(abi.RegRequest, 0); err != nil {
			t.Fatal(err)
		}
		fg.checkInvariants(t)
		if code < abi.NumCmds && fg.readReg(abi.RegErr) == 0 {
			var h abi.RespHdr
			h.Decode(fg.raw[fg.rspGPA:])
			if h.Ack != abi.RespFlag|code || h.Err != 0 {
				t.Fatalf("success with response %+v", h)
			}
		}
	})
}

// FuzzCommandSequence interleaves commands, doorbells, register writes and
// guest scribbles over the device's rings.
func FuzzCommandSequence(f *testing.F) {
	f.Add([]byte{0, abi.CmdCreatePD, 0, 0, 0, 0, 0, abi.CmdCreateCQ, 1, 64, 0, 0, 0, 1, 0, 0, 0, 1, 4, 0, 0, 0x40})
	f.Add([]byte{0, abi.CmdDestroyQP, 0, 0, 0, 0, 2, 8, 0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0, 0, 0x80})
	f.Add([]byte{3, 0x0c, 2, 0, 0, 0, 0, abi.CmdCreatePD, 0, 0, 0, 0})
	f.Fuzz(runSeq)
}

func runSeq(t *testing.T, prog []byte) {
	fg := newFuzzGuest(t)
	for len(prog) > 0 {
		op := prog[0] % 4
		prog = prog[1:]
		n := min(len(prog), 24)
		arg := make([]byte, 24)
		copy(arg, prog[:n])
		prog = prog[n:]
		switch op {
		case 0: // a command: code, then 16 argument bytes at offset 16, a pdir choice
			b := make([]byte, abi.CmdReqSize)
			code := uint32(arg[0]) % (abi.NumCmds + 2)
			abi.CmdHdr{Cmd: code}.Encode(b)
			copy(b[16:], arg[1:17])
			if off, ok := pdirOffset[code]; ok {
				binary.LittleEndian.PutUint64(b[off:], fg.dirs[int(arg[17])%len(fg.dirs)])
			}
			copy(fg.raw[fg.cmdGPA:], b)
			_ = fg.writeReg(abi.RegRequest, 0)
		case 1: // a doorbell
			page := uint64(arg[0] % 4)
			off := uint64(arg[1]%4) * 4
			_ = fg.dev.WriteBAR(abi.UARBAR, page*abi.UARPageSize+off, arg[2:6])
		case 2: // the guest writes anywhere in the pages it handed the device
			gpa := uint64(1<<20) + uint64(binary.LittleEndian.Uint32(arg[0:]))%(fg.next-(1<<20))
			copy(fg.raw[gpa:min(gpa+8, uint64(len(fg.raw)))], arg[4:12])
		case 3: // a register write (RESET and DSR rewrites included)
			reg := uint64(arg[0]%10) * 4
			_ = fg.dev.WriteBAR(abi.RegsBAR, reg, arg[1:5])
		}
		fg.checkInvariants(t)
	}
}

const guestmemPage = 4096

// FuzzWQE posts one send and one receive WQE of arbitrary bytes.
func FuzzWQE(f *testing.F) {
	var h abi.SQWQEHdr
	h.Opcode = uint32(hostverbs.WRRDMAWrite)
	abi.WRRDMA{RemoteAddr: 0x1000, RKey: 5}.Encode(h.WR[:])
	b := make([]byte, 256)
	h.NumSGE = 1
	h.Encode(b)
	abi.SGE{Addr: 0x10000, Length: 64}.Encode(b[abi.SQWQEHdrSize:])
	f.Add(b, []byte{1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 64, 0, 0, 0}, true)
	f.Add(make([]byte, 256), make([]byte, 64), false)
	f.Fuzz(func(t *testing.T, sq, rq []byte, fixKeys bool) {
		fg := newFuzzGuest(t)
		d := fg.dev
		d.mu.Lock()
		q, _ := d.qps.get(0)
		d.mu.Unlock()
		sstride, rstride := sqStride(q.sendSGE), rqStride(q.recvSGE)
		// QP 0 of newFuzzGuest: contiguous pages, ring states in page 0,
		// 16 SQ WQEs of 256 bytes filling page 1, the RQ from page 2.
		sqHead, rqHead := uint64(q.sq.ring.Head()), uint64(q.rq.ring.Head())
		sqState := sqHead&^0xfff - guestmemPage
		w := make([]byte, sstride)
		copy(w, sq)
		if fixKeys {
			for i := 0; i < 2; i++ {
				binary.LittleEndian.PutUint32(w[abi.SQWQEHdrSize+i*abi.SGESize+12:], fg.mr.lkey)
			}
		}
		copy(fg.raw[sqHead:], w)
		r := make([]byte, rstride)
		copy(r, rq)
		if fixKeys {
			binary.LittleEndian.PutUint32(r[abi.RQWQEHdrSize+12:], fg.mr.lkey)
		}
		copy(fg.raw[rqHead:], r)
		fg.put32(sqState, drvInc(fg.u32(sqState), 16))
		fg.put32(sqState+8, drvInc(fg.u32(sqState+8), 16))
		fg.doorbell(0, abi.UARQPOffset, abi.UARQPSend|abi.UARQPRecv)
		// Each WQE either completed in the device (released) or went to
		// the provider (outstanding): never both, never neither.
		fq := fg.verbs.(*fakeVerbs).qps[0]
		if got := fg.u32(sqState+4) + uint32(fq.outstanding(false)); got != 1 {
			t.Fatalf("send WQE: cons_head %d, %d at the provider", fg.u32(sqState+4), fq.outstanding(false))
		}
		if got := fg.u32(sqState+12) + uint32(fq.outstanding(true)); got != 1 {
			t.Fatalf("receive WQE: cons_head %d, %d at the provider", fg.u32(sqState+12), fq.outstanding(true))
		}
		fg.checkInvariants(t)
	})
}
