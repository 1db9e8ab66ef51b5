package vdev

import (
	"encoding/binary"
	"errors"
	"hash/crc32"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// The journal: the device's state as the guest made it, as a stream of
// records a restarted daemon replays (Restore). A record is
//
//	offset size
//	 0     4    magic "PVRJ"
//	 4     1    format version (JournalVersion)
//	 5     1    type
//	 6     2    flags (recFlagSnapshot)
//	 8     8    sequence number
//	16     4    payload length
//	20     4    CRC-32C of bytes 0-19 and the payload
//	24     n    payload
//
// all little-endian. Types:
//
//   - command: a command's request bytes (its size in the command table),
//     then the response payload the device produced (handles, QPN, keys;
//     the 16-byte header zero). Replay runs the request again, forcing the
//     recorded handles, QPN and keys.
//   - register: a u32 register offset and the u32 value written (DSRLOW,
//     DSRHIGH, CTL, IMR, MACL, MACH).
//   - checkpoint: a u32 count; that many records follow with the snapshot
//     flag and the checkpoint's sequence number: a compact stream equal in
//     effect to every record up to that number (Checkpoint).
//   - transport: a u8 payload version (1), 3 bytes 0, a u32 QP handle and
//     the provider's transport state of that RC QP (SaveTransports, for a
//     hand-over to another process; handover.go). Valid only while every
//     record after it is a transport or SRQ receive record; a checkpoint
//     taken during a hand-over holds them last. Payload up to 8 KiB.
//   - hand-over abort: no payload; the transport and SRQ receive records
//     before it are void (ResumeTransports, or the guest's next BAR
//     write).
//   - SRQ receives: the receives an SRQ's provider held, for a hand-over
//     (SaveTransports; format in handover_srq.go), one record or more per
//     SRQ. Valid, as transport records, only while every record after it
//     is a transport or SRQ receive record. Payload up to 64 KiB.
//
// Records the device emits are numbered 1, 2, ... (a restored device
// continues the journal's numbering). Restore accepts a stream that either
// starts with record 1 or with a checkpoint, skips records numbered at or
// below the last one applied (a daemon rotating its file may write some
// twice) and refuses gaps.

// JournalVersion is the format version of the journal records this
// package writes and reads.
const JournalVersion = 1

const (
	recMagic      = 0x4a525650 // "PVRJ"
	recHdrSize    = 24
	maxRecPayload = 1024

	recCommand       = 1
	recRegister      = 2
	recCheckpoint    = 3
	recTransport     = 4
	recHandoverAbort = 5
	recSRQRecvs      = 6
	recFastReg       = 7

	recFlagSnapshot = 1
)

// castagnoli is the CRC-32C table (read-only).
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// recHeader is a decoded record header.
type recHeader struct {
	version, typ uint8
	flags        uint16
	seq          uint64
	length       uint32
	crc          uint32
}

func decodeRecHeader(b []byte) (recHeader, bool) {
	_ = b[recHdrSize-1]
	h := recHeader{version: b[4], typ: b[5], flags: binary.LittleEndian.Uint16(b[6:]),
		seq: binary.LittleEndian.Uint64(b[8:]), length: binary.LittleEndian.Uint32(b[16:]),
		crc: binary.LittleEndian.Uint32(b[20:])}
	return h, binary.LittleEndian.Uint32(b) == recMagic
}

// recordCRC is the checksum of a record's first 20 bytes and its payload.
func recordCRC(hdr, payload []byte) uint32 {
	return crc32.Update(crc32.Checksum(hdr[:20], castagnoli), castagnoli, payload)
}

// sealRecord fills the header of rec (recHdrSize bytes, then the payload).
func sealRecord(rec []byte, typ uint8, flags uint16, seq uint64) {
	binary.LittleEndian.PutUint32(rec, recMagic)
	rec[4], rec[5] = JournalVersion, typ
	binary.LittleEndian.PutUint16(rec[6:], flags)
	binary.LittleEndian.PutUint64(rec[8:], seq)
	binary.LittleEndian.PutUint32(rec[16:], uint32(len(rec)-recHdrSize))
	binary.LittleEndian.PutUint32(rec[20:], recordCRC(rec[:recHdrSize], rec[recHdrSize:]))
}

// appendRecord appends a sealed record of payload to dst.
func appendRecord(dst []byte, typ uint8, flags uint16, seq uint64, payload ...[]byte) []byte {
	start := len(dst)
	dst = append(dst, make([]byte, recHdrSize)...)
	for _, p := range payload {
		dst = append(dst, p...)
	}
	sealRecord(dst[start:], typ, flags, seq)
	return dst
}

// journaledCmd reports whether command code changes the device's state
// (the queries do not).
func journaledCmd(code uint32) bool {
	switch code {
	case abi.CmdQueryPort, abi.CmdQueryPKey, abi.CmdQueryQP, abi.CmdQuerySRQ:
		return false
	}
	return code < abi.NumCmds
}

// emit numbers, seals and hands a record to the journal sink. Nothing is
// emitted while Restore replays the journal.
func (d *Device) emit(rec []byte, typ uint8) {
	if d.rp != nil {
		return
	}
	d.seq++
	sealRecord(rec, typ, 0, d.seq)
	if d.journal != nil {
		d.journal(rec)
		d.stats.journalRecords.Add(1)
	}
}

// journalCommand records a command that ran (mu held), after it changed
// the device and before the dispatcher writes its response: a crash may
// leave an object the guest does not know of, never the reverse. A
// failed command is recorded only if it still changed the device (a
// destroy whose object left the table although the provider failed).
func (d *Device) journalCommand(code uint32, req, resp []byte, err error) {
	if !journaledCmd(code) || (err != nil && (errors.Is(err, ErrBadHandle) || !d.goneAnyway(code, req))) {
		return
	}
	rec := make([]byte, recHdrSize+len(req)+len(resp))
	payload := rec[recHdrSize:]
	copy(payload, req)
	copy(payload[len(req):], resp)
	if err == nil {
		d.keep(code, payload, len(req))
	}
	d.emit(rec, recCommand)
}

// goneAnyway reports whether a failed DESTROY removed its object anyway.
func (d *Device) goneAnyway(code uint32, req []byte) bool {
	var r abi.HandleReq
	r.Decode(req)
	h := r.Handle
	switch code {
	case abi.CmdDestroyPD:
		_, ok := d.pds.get(h)
		return !ok
	case abi.CmdDestroyCQ:
		_, ok := d.cqs.get(h)
		return !ok
	case abi.CmdDestroyQP:
		_, ok := d.qps.get(h)
		return !ok
	case abi.CmdDestroySRQ:
		_, ok := d.srqs.get(h)
		return !ok
	}
	return false
}

// journalReg records a register write the device keeps (mu held).
func (d *Device) journalReg(reg uint64, v uint32) {
	rec := make([]byte, recHdrSize+8)
	binary.LittleEndian.PutUint32(rec[recHdrSize:], uint32(reg))
	binary.LittleEndian.PutUint32(rec[recHdrSize+4:], v)
	d.emit(rec, recRegister)
}

// journalUnbind records that GID index i lost its binding to gid although
// the command failed (CREATE_BIND could not put the old GID back).
func (d *Device) journalUnbind(i uint32, gid hostverbs.GID) {
	req := make([]byte, abi.DestroyBindSize)
	abi.CmdHdr{Cmd: abi.CmdDestroyBind}.Encode(req)
	abi.DestroyBind{Index: i, DestGID: gid}.Encode(req)
	d.journalCommand(abi.CmdDestroyBind, req, make([]byte, abi.RespHdrSize), nil)
}

// keep attaches the payload of a successful command to the object it
// created or changed, for Checkpoint: the objects' create records, a CQ's
// last resize, an SRQ's last modify and a QP's modifies (compacted). The
// payload is never modified afterwards (it may be the sink's too).
func (d *Device) keep(code uint32, payload []byte, reqSize int) {
	req, resp := payload[:reqSize], payload[reqSize:]
	switch code {
	case abi.CmdCreateMR:
		var r abi.CreateMRResp
		r.Decode(resp)
		if m, ok := d.mrs.get(r.MRHandle); ok {
			m.rec = payload
		}
	case abi.CmdCreateCQ:
		var r abi.CreateCQResp
		r.Decode(resp)
		if cq, ok := d.cqs.get(r.CQHandle); ok {
			cq.rec = payload
		}
	case abi.CmdResizeCQ:
		var r abi.ResizeCQ
		r.Decode(req)
		if cq, ok := d.cqs.get(r.CQHandle); ok {
			cq.resizeRec = payload
		}
	case abi.CmdCreateQP:
		var r abi.CreateQPResp
		r.Decode(resp)
		if q, ok := d.qps.get(r.QPHandle); ok {
			q.rec = payload
		}
	case abi.CmdModifyQP:
		var r abi.ModifyQP
		r.Decode(req)
		if q, ok := d.qps.get(r.QPHandle); ok {
			q.keepModify(&r, payload)
		}
	case abi.CmdCreateSRQ:
		var r abi.CreateSRQResp
		r.Decode(resp)
		if s, ok := d.srqs.get(r.SRQN); ok {
			s.rec = payload
		}
	case abi.CmdModifySRQ:
		var r abi.ModifySRQ
		r.Decode(req)
		if s, ok := d.srqs.get(r.SRQHandle); ok {
			s.modRec = payload
		}
	}
}

// abiEncoder is an ABI struct that encodes itself.
type abiEncoder interface{ Encode([]byte) }

// qpMod is one kept MODIFY_QP: the state it leads to and its payload.
type qpMod struct {
	next hostverbs.QPState
	rec  []byte
}

// maxQPMods bounds a QP's kept modifies (one per state on the way to the
// current one is the rule; the bound holds whatever a guest does).
const maxQPMods = 8

// keepModify adds a successful MODIFY_QP to the QP's path from RESET to
// its state, so that Checkpoint costs O(1) per QP: RESET empties the path,
// ERR replaces it (any state may go to ERR), and a modify to a state
// already on the path (RTS->RTS, or RTS->SQD->RTS) is merged into that
// state's entry, whose attributes it updates, and ends the path there.
func (q *qp) keepModify(r *abi.ModifyQP, payload []byte) {
	mask := hostverbs.AttrMask(r.AttrMask)
	next := hostverbs.QPStateReset
	if n := len(q.mods); n > 0 {
		next = q.mods[n-1].next
	}
	if mask&hostverbs.AttrState != 0 {
		next = hostverbs.QPState(r.Attrs.State)
	}
	switch next {
	case hostverbs.QPStateReset:
		q.mods = nil
		return
	case hostverbs.QPStateErr:
		q.mods = []qpMod{{next, payload}}
		return
	}
	for i := range q.mods {
		if q.mods[i].next != next {
			continue
		}
		from := hostverbs.QPStateReset
		if i > 0 {
			from = q.mods[i-1].next
		}
		if merged, ok := mergeModify(q.typ, from, q.mods[i].rec, payload); ok || len(q.mods) >= maxQPMods {
			q.mods = append(q.mods[:i], qpMod{next, merged})
			return
		}
		break
	}
	if len(q.mods) >= maxQPMods {
		q.mods = q.mods[:maxQPMods-1]
	}
	q.mods = append(q.mods, qpMod{next, payload})
}

// mergeModify returns the MODIFY_QP payload dst (a transition from state
// from) with the attributes src sets copied over (src's state and current
// state excepted), and whether the merged mask is still valid for dst's
// transition.
func mergeModify(t hostverbs.QPType, from hostverbs.QPState, dst, src []byte) ([]byte, bool) {
	var a, b abi.ModifyQP
	a.Decode(dst)
	b.Decode(src)
	m := hostverbs.AttrMask(b.AttrMask) &^ (hostverbs.AttrState | hostverbs.AttrCurState)
	x, y := &a.Attrs, &b.Attrs
	for bit := hostverbs.AttrMask(1); bit <= hostverbs.AttrAll; bit <<= 1 {
		if m&bit == 0 {
			continue
		}
		switch bit {
		case hostverbs.AttrEnSQDAsyncNotify:
			x.EnSQDAsyncNotify = y.EnSQDAsyncNotify
		case hostverbs.AttrAccessFlags:
			x.AccessFlags = y.AccessFlags
		case hostverbs.AttrPKeyIndex:
			x.PKeyIndex = y.PKeyIndex
		case hostverbs.AttrPort:
			x.PortNum = y.PortNum
		case hostverbs.AttrQKey:
			x.QKey = y.QKey
		case hostverbs.AttrAV:
			x.AH = y.AH
		case hostverbs.AttrPathMTU:
			x.PathMTU = y.PathMTU
		case hostverbs.AttrTimeout:
			x.Timeout = y.Timeout
		case hostverbs.AttrRetryCnt:
			x.RetryCnt = y.RetryCnt
		case hostverbs.AttrRNRRetry:
			x.RNRRetry = y.RNRRetry
		case hostverbs.AttrRQPSN:
			x.RQPSN = y.RQPSN
		case hostverbs.AttrMaxQPRdAtomic:
			x.MaxRdAtomic = y.MaxRdAtomic
		case hostverbs.AttrAltPath:
			x.AltAH, x.AltPortNum, x.AltTimeout, x.AltPKeyIndex = y.AltAH, y.AltPortNum, y.AltTimeout, y.AltPKeyIndex
		case hostverbs.AttrMinRNRTimer:
			x.MinRNRTimer = y.MinRNRTimer
		case hostverbs.AttrSQPSN:
			x.SQPSN = y.SQPSN
		case hostverbs.AttrMaxDestRdAtomic:
			x.MaxDestRdAtomic = y.MaxDestRdAtomic
		case hostverbs.AttrPathMigState:
			x.PathMigState = y.PathMigState
		case hostverbs.AttrCap:
			x.Cap = y.Cap
		case hostverbs.AttrDestQPN:
			x.DestQPNum = y.DestQPNum
		}
	}
	a.AttrMask = (a.AttrMask | uint32(m)) &^ uint32(hostverbs.AttrCurState)
	out := append([]byte(nil), dst...)
	a.Encode(out)
	next := from
	if a.AttrMask&uint32(hostverbs.AttrState) != 0 {
		next = hostverbs.QPState(a.Attrs.State)
	}
	return out, hostverbs.CheckQPModify(t, from, hostverbs.AttrMask(a.AttrMask), next) == nil
}

// Checkpoint returns a compact journal equal in effect to every record
// the device has journaled so far: a checkpoint record, then the
// registers, the bound GIDs and the live objects' create records in
// dependency order (contexts, PDs, CQs with their last resize, MRs, SRQs
// with their last modify, QPs with the modifies that lead to their
// state), then during a hand-over the SRQ receive and transport records
// SaveTransports wrote. It costs O(live objects). Written to a new file,
// it replaces the journal; records the sink receives from the moment
// Checkpoint is called are appended after it (Restore skips those the
// checkpoint already holds, by their numbers).
func (d *Device) Checkpoint() []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.seq
	out := make([]byte, recHdrSize+4, 4096)
	n := uint32(0)
	put := func(typ uint8, payload ...[]byte) {
		out = appendRecord(out, typ, recFlagSnapshot, s, payload...)
		n++
	}
	reg := func(r uint64, v uint32) {
		var b [8]byte
		binary.LittleEndian.PutUint32(b[:], uint32(r))
		binary.LittleEndian.PutUint32(b[4:], v)
		put(recRegister, b[:])
	}
	if d.dsr != nil {
		reg(abi.RegDSRLow, d.dsrLow)
		reg(abi.RegDSRHigh, d.dsrHigh)
	}
	reg(abi.RegIMR, d.imr.Load())
	reg(abi.RegMACL, d.macl)
	reg(abi.RegMACH, d.mach)
	if d.active {
		reg(abi.RegCtl, abi.CtlActivate)
	}
	cmd := func(code uint32, req, resp abiEncoder) {
		c := &commands[code]
		b := make([]byte, c.reqSize+c.respSize)
		abi.CmdHdr{Cmd: code}.Encode(b)
		req.Encode(b[:c.reqSize])
		if resp != nil {
			resp.Encode(b[c.reqSize:])
		}
		put(recCommand, b)
	}
	for i, g := range d.gids {
		if g.bound {
			cmd(abi.CmdCreateBind, abi.CreateBind{Index: uint32(i), NewGID: g.entry.GID, GIDType: uint8(g.entry.Type)}, nil)
		}
	}
	if d.dsr != nil {
		d.ucs.each(func(h uint32, _ *uctx) {
			cmd(abi.CmdCreateUC, abi.CreateUC{PFN: d.dsr.uarPFN + uint64(h)}, abi.CreateUCResp{CtxHandle: h})
		})
	}
	d.pds.each(func(h uint32, p *pd) {
		cmd(abi.CmdCreatePD, abi.CreatePD{CtxHandle: p.uar}, abi.CreatePDResp{PDHandle: h})
	})
	d.cqs.each(func(_ uint32, c *cq) {
		put(recCommand, c.rec)
		if c.resizeRec != nil {
			put(recCommand, c.resizeRec)
		}
	})
	d.mrs.each(func(_ uint32, m *mr) { put(recCommand, m.rec) })
	d.srqs.each(func(_ uint32, s *srq) {
		put(recCommand, s.rec)
		if s.modRec != nil {
			put(recCommand, s.modRec)
		}
	})
	d.qps.each(func(h uint32, q *qp) {
		put(recCommand, q.rec)
		for _, m := range q.mods {
			put(recCommand, m.rec)
		}
		if q.State() == hostverbs.QPStateErr && (len(q.mods) == 0 || q.mods[len(q.mods)-1].next != hostverbs.QPStateErr) {
			// In ERR by a completion error, a fatal event or Restore.
			cmd(abi.CmdModifyQP, abi.ModifyQP{QPHandle: h, AttrMask: uint32(hostverbs.AttrState),
				Attrs: abi.QPAttr{State: uint32(hostverbs.QPStateErr)}}, nil)
		}
	})
	if d.handover {
		// A hand-over in progress: its SRQ receive and transport records
		// come last, where Restore takes them.
		d.srqs.each(func(_ uint32, s *srq) {
			for _, p := range s.saved {
				put(recSRQRecvs, p)
			}
		})
		d.qps.each(func(_ uint32, q *qp) {
			if q.transport != nil {
				put(recTransport, q.transport)
			}
		})
		d.mrs.each(func(_ uint32, m *mr) {
			if m.saved != nil {
				put(recFastReg, m.saved)
			}
		})
	}
	var cnt [4]byte
	binary.LittleEndian.PutUint32(cnt[:], n)
	copy(out[recHdrSize:], cnt[:])
	sealRecord(out[:recHdrSize+4], recCheckpoint, 0, s)
	return out
}
