package hostile

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// FuzzDriver plays a fuzzed driver against the whole stack: the daemon,
// vfio-user, the PCI function, the device model and the soft transport,
// with real memfds and eventfds. vdev's own fuzzers (vdev/fuzz_test.go)
// drive the device model alone over fake verbs and flat memory; this one
// adds the protocol, the PCI layer, the provider, resets, DMA unmaps and
// the leak checks.
//
// An input is a program of records [op, n, n payload bytes] applied after
// a good probe that created a GID, a user context, a PD, two CQs, an MR
// and two connected RC QPs:
//
//	0 command: code, pdir choice, request bytes from offset 16
//	1 doorbell: UAR page, doorbell offset, value, "use a live handle"
//	2 BAR1 write: offset, size, bytes (any size and alignment)
//	3 BAR read: BAR, offset, size
//	4 guest scribble: 8 bytes anywhere in the pages handed to the device,
//	  or in a ring-state page, the command slot or the DSR
//	5 WQE: send (QP a) or receive (QP b) WQE bytes, lkeys fixed or not
//	6 reset: vfio-user DEVICE_RESET, CTL RESET, or a new probe
//	7 DMA_UNMAP of all RAM and DMA_MAP again
//
// Whatever the program does: nothing panics, every vfio-user answer is
// well-formed, ERR after a REQUEST is a small positive errno or 0, a
// successful command's response carries its key and code, the connection
// still answers afterwards, the daemon serves a fresh VM, and goroutines,
// descriptors and locked memory return to the baseline.
//
// An input takes some 40 ms (a probe and a dozen objects, the program, a
// fresh VM, the leak checks), so keep minimisation short:
//
//	go test ./tests/hostile -run '^$' -fuzz FuzzDriver -fuzzminimizetime 20x
func FuzzDriver(f *testing.F) {
	// The seeds are in testdata/fuzz/FuzzDriver (see TestSeedCorpus).
	e := newEnvLog(f, vdev.Limits{}, stderrLogger())
	f.Fuzz(func(t *testing.T, prog []byte) {
		// Each input runs on a goroutine of its own: the baseline of all
		// goroutines is the one at its start; the daemon's goroutines,
		// descriptors and locked memory are the daemon's idle ones.
		base := e.base
		base.goroutines = measure(t).goroutines
		ie := &env{t: t, d: e.d, base: base, vms: map[*vm]struct{}{}}
		runProgram(ie, prog)
		ie.closeAll()
		ie.idle()
		fresh := ie.boot(vmPeer)
		fresh.createPD(0)
		fresh.Close()
		ie.idle()
	})
}

// Program records.
const (
	opCommand = iota
	opDoorbell
	opRegWrite
	opBARRead
	opScribble
	opWQE
	opReset
	opRemap
	numOps
)

// fuzzVM is the probed VM a program runs against.
type fuzzVM struct {
	*endpoint
	a, b   *gqp     // a loopback RC pair
	dirs   []uint64 // page directories of 1, 2, 9 and 17 pages
	resets int
}

// pdirOffset is where each creating command carries its page directory.
var pdirOffset = map[uint32]int{abi.CmdCreateMR: 32, abi.CmdCreateCQ: 16, abi.CmdCreateQP: 16, abi.CmdCreateSRQ: 16}

// badCodes are command codes past the table.
var badCodes = []uint32{abi.NumCmds, abi.RespFlag | abi.CmdCreatePD, 0xffffffff}

func runProgram(e *env, prog []byte) {
	t := e.t
	p := e.endpoint(vmEvil, 1)
	fv := &fuzzVM{endpoint: p}
	fv.a, fv.b = p.loopPair()
	for _, n := range []int{1, 2, 9, 17} {
		fv.dirs = append(fv.dirs, p.v.pdir(p.v.pages(n)))
	}
	for len(prog) >= 2 {
		op, n := prog[0]%numOps, int(prog[1])
		prog = prog[2:]
		n = min(n, len(prog))
		var pl [256]byte
		copy(pl[:], prog[:n])
		prog = prog[n:]
		fv.step(t, op, pl[:max(n, 16)])
	}
	require.EqualValues(t, abi.DeviceVersion, p.v.reg(abi.RegVersion), "the connection still answers")
}

// replyErr accepts an error reply from the server and nothing else (a
// broken connection or a malformed answer fails the input).
func replyErr(t testing.TB, err error, what string) {
	t.Helper()
	var re *vfiousertest.ReplyError
	if err != nil && !errors.As(err, &re) {
		t.Fatalf("%s: %v", what, err)
	}
}

func (fv *fuzzVM) step(t testing.TB, op byte, pl []byte) {
	v := fv.v
	switch op {
	case opCommand:
		code := uint32(pl[0]) % (abi.NumCmds + uint32(len(badCodes)))
		if code >= abi.NumCmds {
			code = badCodes[code-abi.NumCmds]
		}
		slot := v.ram[v.cmdSlot : v.cmdSlot+abi.CmdReqSize]
		clear(slot)
		v.key++
		abi.CmdHdr{Response: v.key, Cmd: code}.Encode(slot)
		copy(slot[abi.CmdHdrSize:], pl[2:])
		if off, ok := pdirOffset[code]; ok && pl[1]&0x80 == 0 {
			binary.LittleEndian.PutUint64(slot[off:], fv.dirs[int(pl[1])%len(fv.dirs)])
		}
		v.setReg(abi.RegRequest, 0)
		errReg := v.reg(abi.RegErr)
		if errReg >= 256 {
			t.Fatalf("%s: ERR %#x is not a small positive errno", vdev.CommandName(code), errReg)
		}
		var h abi.RespHdr
		h.Decode(v.ram[v.respSlot:])
		if errReg == 0 && (h.Response != v.key || h.Ack != abi.RespFlag|code || h.Err != 0) {
			t.Fatalf("%s succeeded with response header %+v", vdev.CommandName(code), h)
		}
		v.irq(abi.VectorResponse)
	case opDoorbell:
		page := uint32(pl[0]) % 4
		if pl[0] == 0xff {
			page = vdev.UARPages - 1
		}
		off := uint64(pl[1]%4) * 4
		val := binary.LittleEndian.Uint32(pl[2:])
		if pl[6]&1 != 0 { // aim at a live object
			val = val&^abi.UARHandleMask | []uint32{fv.a.handle, fv.b.handle, fv.scq.handle, fv.rcq.handle}[pl[6]>>1%4]
		}
		replyErr(t, v.tryDoorbell(page, off, val), "doorbell")
	case opRegWrite:
		off := uint64(pl[0]) % 0x30
		size := []int{1, 2, 4, 8}[pl[1]%4]
		replyErr(t, v.c.RegionWrite(bar1, off, pl[2:2+size], false), "register write")
	case opBARRead:
		bar := uint32(pl[0]) % 3
		size := uint64(pl[3]%16) + 1
		barSize := []uint64{vdev.BAR0Size, vdev.BAR1Size, vdev.BAR2Size}[bar]
		off := uint64(binary.LittleEndian.Uint16(pl[1:])) * 37 % (barSize - size + 1)
		_, err := v.c.RegionRead(bar, off, uint32(size))
		replyErr(t, err, "BAR read")
	case opScribble:
		var gpa uint64
		if pl[0]&0x80 != 0 { // a page the device watches
			pages := []uint64{fv.a.pages[0], fv.b.pages[0], fv.scq.pages[0], fv.rcq.pages[0],
				v.async[0], v.cqn[0], v.cmdSlot, v.dsr}
			gpa = pages[pl[0]&7] + uint64(binary.LittleEndian.Uint16(pl[1:]))%4096&^7
		} else {
			gpa = firstPage + uint64(binary.LittleEndian.Uint32(pl[1:]))%(v.next-firstPage)&^7
		}
		copy(v.ram[gpa:gpa+8], pl[5:13])
	case opWQE:
		fix := pl[1]&1 != 0
		if pl[0]&1 == 0 {
			q := fv.a
			tail := load32(v.ram, q.sqState())
			w := v.ram[q.sqWQE(tail) : q.sqWQE(tail)+uint64(q.sstride)]
			copy(w, pl[2:])
			if fix {
				for i := 0; i < int(q.sendSGE); i++ {
					binary.LittleEndian.PutUint32(w[abi.SQWQEHdrSize+i*abi.SGESize+12:], fv.mr.lkey)
				}
			}
			store32(v.ram, q.sqState(), ringInc(tail, q.sendWR))
			replyErr(t, v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPSend|q.handle), "SQ doorbell")
		} else {
			q := fv.b
			tail := load32(v.ram, q.rqState())
			w := v.ram[q.rqWQE(tail) : q.rqWQE(tail)+uint64(q.rstride)]
			copy(w, pl[2:])
			if fix {
				binary.LittleEndian.PutUint32(w[abi.RQWQEHdrSize+12:], fv.mr.lkey)
			}
			store32(v.ram, q.rqState(), ringInc(tail, q.recvWR))
			replyErr(t, v.tryDoorbell(q.uar, abi.UARQPOffset, abi.UARQPRecv|q.handle), "RQ doorbell")
		}
	case opReset:
		if fv.resets++; fv.resets > 16 {
			return // each probe takes guest pages
		}
		switch pl[0] % 3 {
		case 0:
			require.NoError(t, v.c.Reset())
			v.pciSetup()
		case 1:
			v.setReg(abi.RegCtl, abi.CtlReset)
		case 2:
			v.probe()
		}
	case opRemap:
		require.NoError(t, v.c.DMAUnmap(0, ramSize, 0))
		require.NoError(t, v.c.DMAMap(0, ramSize, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, v.ramFD, 0))
	}
}

// prog builds programs for the seed corpus.
type prog struct{ bytes.Buffer }

func (p *prog) rec(op byte, payload ...byte) *prog {
	p.WriteByte(op)
	p.WriteByte(byte(len(payload)))
	p.Write(payload)
	return p
}

// cmd records a command; dir picks a page directory (0x80: none).
func (p *prog) cmd(code uint32, dir byte, req encoder) *prog {
	b := make([]byte, abi.CmdReqSize)
	if req != nil {
		req.Encode(b)
	}
	body := bytes.TrimRight(b[abi.CmdHdrSize:], "\x00")
	return p.rec(opCommand, append([]byte{byte(code), dir}, body...)...)
}

func (p *prog) bell(page, reg byte, val uint32, live byte) *prog {
	return p.rec(opDoorbell, page, reg, byte(val), byte(val>>8), byte(val>>16), byte(val>>24), live)
}

func (p *prog) wqe(recv, fix bool, w []byte) *prog {
	var b0, b1 byte
	if recv {
		b0 = 1
	}
	if fix {
		b1 = 1
	}
	return p.rec(opWQE, append([]byte{b0, b1}, w...)...)
}

func sqWQEBytes(h abi.SQWQEHdr, sges ...abi.SGE) []byte {
	h.NumSGE = uint32(len(sges))
	b := make([]byte, abi.SQWQEHdrSize+len(sges)*abi.SGESize)
	h.Encode(b)
	for i, s := range sges {
		s.Encode(b[abi.SQWQEHdrSize+i*abi.SGESize:])
	}
	return b
}

// seedPrograms are the seed corpus: the well-behaved path and one program
// per hostile class, in the encoding above.
func seedPrograms() []struct{ name, prog string } {
	var out []struct{ name, prog string }
	add := func(name string, p *prog) { out = append(out, struct{ name, prog string }{name, p.String()}) }
	sge := abi.SGE{Addr: mrIOVA, Length: 64}
	live := func(i byte) byte { return 1 | i<<1 } // a, b, scq, rcq

	p := &prog{}
	p.wqe(true, true, func() []byte {
		b := make([]byte, 32)
		abi.RQWQEHdr{WRID: 1, NumSGE: 1}.Encode(b)
		sge.Encode(b[16:])
		return b
	}())
	p.wqe(false, true, sqWQEBytes(sendWQE(2), sge))
	p.bell(1, 1, abi.UARCQPoll, live(2))
	p.cmd(abi.CmdQueryQP, 0x80, abi.QueryQP{QPHandle: 1, AttrMask: 1})
	add("good_send", p)

	p = &prog{}
	p.cmd(abi.CmdCreatePD, 0x80, abi.CreatePD{CtxHandle: 1})
	p.cmd(abi.CmdCreateCQ, 1, abi.CreateCQ{CtxHandle: 1, CQE: 16, NChunks: 2})
	p.cmd(abi.CmdCreateQP, 2, abi.CreateQP{PDHandle: 1, SendCQHandle: 2, RecvCQHandle: 2, MaxSendWR: 4, MaxRecvWR: 4,
		MaxSendSGE: 1, MaxRecvSGE: 1, QPType: uint8(hostverbs.QPTypeRC), TotalChunks: 3, SendChunks: 1})
	p.cmd(abi.CmdModifyQP, 0x80, abi.ModifyQP{QPHandle: 2, AttrMask: 1, Attrs: abi.QPAttr{State: 6}})
	p.cmd(abi.CmdDestroyQP, 0x80, abi.DestroyQP{QPHandle: 2})
	add("create_destroy", p)

	p = &prog{}
	h := sqWQEBytes(sendWQE(3), sge)
	binary.LittleEndian.PutUint32(h[8:], 0xffffffff)
	p.wqe(false, true, h)
	add("cve_2018_20124_num_sge", p)

	p = &prog{}
	p.cmd(abi.CmdCreateCQ, 3, abi.CreateCQ{CQE: 16, NChunks: 0xffffffff})
	p.cmd(abi.CmdCreateQP, 3, abi.CreateQP{PDHandle: 0, TotalChunks: 0xffff, SendChunks: 0xfffe, MaxSendWR: 4,
		MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1, QPType: uint8(hostverbs.QPTypeRC)})
	add("cve_2018_20125_nchunks", p)

	p = &prog{}
	p.cmd(abi.CmdCreateMR, 2, abi.CreateMR{Start: 0x1000, Length: 3 * 4096, NChunks: 2, PDHandle: 0, AccessFlags: 1})
	add("cve_2021_3582_mr", p)

	p = &prog{}
	p.rec(opScribble, 0x80, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x21, 0, 0, 0) // QP a: SQ prod_tail, RQ 33 ahead
	p.bell(1, 0, abi.UARQPSend|abi.UARQPRecv, live(0))
	p.rec(opScribble, 0x83, 8, 0, 0, 0, 0, 0, 0, 0, 0x78, 0x56, 0x34, 0x12) // receive CQ: cons_head
	p.wqe(true, true, make([]byte, 32))
	add("cve_2018_20216_indices", p)

	p = &prog{}
	p.rec(opReset, 1)
	p.cmd(abi.CmdCreatePD, 0x80, nil)
	p.bell(0, 1, abi.UARCQArm, live(2))
	p.rec(opReset, 0)
	p.cmd(abi.CmdQueryPort, 0x80, abi.QueryPort{PortNum: 1})
	p.rec(opReset, 2)
	p.cmd(abi.CmdCreatePD, 0x80, nil)
	add("cve_2022_1050_after_resets", p)

	p = &prog{}
	p.rec(opRegWrite, byte(abi.RegDSRHigh), 2, 0, 0, 0, 0)
	p.rec(opRegWrite, byte(abi.RegDSRLow), 2, 0x10, 0, 0, 0)
	p.rec(opRegWrite, byte(abi.RegDSRHigh), 2, 0, 0, 0, 0)
	p.rec(opRegWrite, byte(abi.RegIMR+1), 1, 0xff, 0xff)
	p.rec(opRegWrite, byte(abi.RegRequest), 0, 0)
	p.rec(opBARRead, 2, 0xff, 0xff, 7)
	p.rec(opBARRead, 1, 3, 0, 15)
	add("dsr_rewrite_odd_bar", p)

	p = &prog{}
	p.wqe(false, true, sqWQEBytes(writeWQE(4, mrIOVA+0x1000, 0), sge))
	p.rec(opRemap)
	p.wqe(false, true, sqWQEBytes(sendWQE(5), sge))
	p.bell(1, 2, abi.UARSRQRecv|7, 0)
	p.bell(0xff, 1, abi.UARCQArmSol, live(3))
	add("remap_unknown_doorbells", p)
	return out
}

// TestSeedCorpus keeps testdata/fuzz/FuzzDriver in step with
// seedPrograms (HOSTILE_UPDATE_SEEDS=1 rewrites it), so that the corpus
// the fuzzer starts from is the one documented here.
func TestSeedCorpus(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzDriver")
	update := os.Getenv("HOSTILE_UPDATE_SEEDS") != ""
	if update {
		require.NoError(t, os.MkdirAll(dir, 0o755))
	}
	for _, s := range seedPrograms() {
		want := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", s.prog)
		path := filepath.Join(dir, s.name)
		if update {
			require.NoError(t, os.WriteFile(path, []byte(want), 0o644))
			continue
		}
		got, err := os.ReadFile(path)
		require.NoError(t, err, "run with HOSTILE_UPDATE_SEEDS=1")
		require.Equal(t, want, string(got), "%s is stale: run with HOSTILE_UPDATE_SEEDS=1", path)
	}
}
