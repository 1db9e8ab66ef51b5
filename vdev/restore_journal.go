package vdev

import (
	"encoding/binary"
	"fmt"
)

// Reading a journal: its records framed and checked (numbers, checkpoint,
// snapshot flags) before Restore applies any, and what this daemon's
// Restore understands (CheckJournal, JournalFeatures).

// jrec is one framed journal record.
type jrec struct {
	typ     uint8
	flags   uint16
	seq     uint64
	payload []byte
	off     int
}

// parseJournal frames and checks the records of a journal and returns
// those to apply, in order, and the number of the last one.
func parseJournal(b []byte, rep *RestoreReport) ([]jrec, uint64, error) {
	framed, err := frameRecords(b, rep)
	if err != nil {
		return nil, 0, err
	}
	return orderRecords(framed, rep)
}

// frameRecords splits a journal into its records, checking each one's
// header and checksum. A record the crash cut short at the end is
// ignored (rep.Torn); rep.ValidBytes is where it starts.
func frameRecords(b []byte, rep *RestoreReport) ([]jrec, error) {
	var framed []jrec
	off := 0
	for off < len(b) {
		rest := b[off:]
		if len(rest) < recHdrSize {
			rep.Torn = true
			break
		}
		h, magic := decodeRecHeader(rest)
		if !magic && allZero(rest) {
			rep.Torn = true // a tail the file system extended but never wrote
			break
		}
		switch {
		case !magic:
			return nil, fmt.Errorf("byte %d: no record: %w", off, ErrJournal)
		case h.version != JournalVersion:
			return nil, fmt.Errorf("byte %d: record format version %d (this is %d): %w", off, h.version, JournalVersion, ErrJournal)
		case h.length > recPayloadLimit(h.typ):
			return nil, fmt.Errorf("byte %d: record of %d bytes (at most %d): %w", off, h.length, recPayloadLimit(h.typ), ErrJournal)
		}
		end := recHdrSize + int(h.length)
		if end > len(rest) {
			rep.Torn = true
			break
		}
		if recordCRC(rest[:recHdrSize], rest[recHdrSize:end]) != h.crc {
			if end == len(rest) {
				rep.Torn = true // the last record, partly written
				break
			}
			return nil, fmt.Errorf("byte %d: record checksum mismatch: %w", off, ErrJournal)
		}
		framed = append(framed, jrec{typ: h.typ, flags: h.flags, seq: h.seq, payload: rest[recHdrSize:end], off: off})
		off += end
	}
	rep.ValidBytes = off
	if rep.Torn {
		rep.Notes = append(rep.Notes, fmt.Sprintf("the last record (%d bytes at byte %d) was cut short by the crash and ignored", len(b)-off, off))
	}
	return framed, nil
}

// orderRecords checks the framed records' order: a checkpoint only first,
// followed by exactly its snapshot records, then records numbered one
// after another (those a checkpoint holds already skipped as duplicates).
// It returns the records to apply and the number of the last one.
func orderRecords(framed []jrec, rep *RestoreReport) ([]jrec, uint64, error) {
	var out []jrec
	var last uint64
	snapLeft := 0
	for i, r := range framed {
		switch {
		case r.typ == recCheckpoint:
			if i != 0 || r.flags != 0 || len(r.payload) != 4 {
				return nil, 0, fmt.Errorf("byte %d: misplaced or malformed checkpoint record: %w", r.off, ErrJournal)
			}
			snapLeft = int(binary.LittleEndian.Uint32(r.payload))
			last = r.seq
			continue
		case r.typ != recCommand && r.typ != recRegister && !handoverRecord(r.typ) && r.typ != recHandoverAbort:
			return nil, 0, fmt.Errorf("byte %d: record type %d: %w", r.off, r.typ, ErrJournal)
		case r.flags == recFlagSnapshot:
			if snapLeft == 0 || r.seq != last || r.typ == recHandoverAbort {
				return nil, 0, fmt.Errorf("byte %d: snapshot record outside its checkpoint: %w", r.off, ErrJournal)
			}
			snapLeft--
			out = append(out, r)
			continue
		case r.flags != 0:
			return nil, 0, fmt.Errorf("byte %d: record flags %#x: %w", r.off, r.flags, ErrJournal)
		case snapLeft > 0:
			return nil, 0, fmt.Errorf("byte %d: checkpoint ends %d records early: %w", r.off, snapLeft, ErrJournal)
		}
		switch {
		case r.seq == 0:
			return nil, 0, fmt.Errorf("byte %d: record number 0: %w", r.off, ErrJournal)
		case r.seq <= last:
			rep.Duplicates++ // a checkpoint holds it
		case r.seq != last+1:
			return nil, 0, fmt.Errorf("byte %d: record %d follows record %d: %d missing: %w", r.off, r.seq, last, r.seq-last-1, ErrJournal)
		default:
			last = r.seq
			out = append(out, r)
		}
	}
	if snapLeft > 0 {
		return nil, 0, fmt.Errorf("checkpoint lacks %d records: %w", snapLeft, ErrJournal)
	}
	return out, last, nil
}

// recPayloadLimit is the largest payload a record of type typ may have.
func recPayloadLimit(typ uint8) uint32 {
	switch typ {
	case recTransport:
		return maxTransportPayload
	case recSRQRecvs:
		return maxSRQRecPayload
	case recFastReg:
		return maxFastRegPayload
	}
	return maxRecPayload
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// CheckJournal reports whether this daemon can read journal: its records'
// framing, versions and types (not whether a guest's memory still supports
// them; Restore checks that). A daemon handing over to another binary asks
// it first, and keeps serving if the successor cannot read its state.
func CheckJournal(journal []byte) (RestoreReport, error) {
	var rep RestoreReport
	recs, _, err := parseJournal(journal, &rep)
	if err != nil {
		return rep, fmt.Errorf("vdev: journal: %w", err)
	}
	rep.Records = len(recs)
	return rep, nil
}

// Journal features (JournalFeatures).
const (
	featureTransport = "transport"
	featureSRQ       = "srq"
	featureFastReg   = "fastreg"
)

// JournalFeatures names what this daemon's Restore understands beyond the
// journal's version: "transport" (RC transport records of a hand-over),
// "srq" (SRQ receive records of a hand-over) and "fastreg" (the fast
// registrations a hand-over keeps). A daemon asks its
// successor (check-state) and saves only what it understands
// (SaveTransportsFor).
func JournalFeatures() []string { return []string{featureTransport, featureSRQ, featureFastReg} }
