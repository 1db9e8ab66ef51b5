package soft

import (
	"encoding/binary"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/internal/crc"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// txBatch collects what one goroutine's work produces: packets for devices
// of the same fabric, processed in FIFO order by flush (never recursively,
// so a chain of request, ACK and next request runs in a loop, not on the
// stack), and coalesced ACKs. Packets for the wire go straight into the
// fabric's transmit ring, in order. Every entry point (PostSend, the
// receive loop, a timer) takes a batch, does its work under the QP locks it
// needs, releases them, then flushes.
type txBatch struct {
	f     *Fabric
	local []packet
	head  int
	arena []seg
	// acks are QPs whose responder has an ACK pending; flush sends one
	// per QP (ACK coalescing).
	acks, acksSpare []*qp
	// rx marks the receive loop's batch: it hands bulk transmission to
	// the transmit goroutine instead of doing the system calls itself.
	rx bool
}

// txMax is the number of datagrams handed to the wire at once.
const txMax = wire.BatchSize

// inlineMax is the most datagrams the receive loop sends itself (ACKs,
// short answers: latency); more go to the transmit goroutine.
const inlineMax = 8

func newTxBatch(f *Fabric) *txBatch { return &txBatch{f: f} }

// isLocal reports whether packets to g stay in process.
func (f *Fabric) isLocal(g [16]byte) bool {
	return !f.cfg.DisableLocalDelivery && f.lookupGID(g) != nil
}

// emit sends p: to a device of this fabric in process, or encoded to the
// wire. The caller holds the lock of the QP that owns p's payload
// segments; emit copies what it needs before returning. It reports
// whether p went to the wire ECN-capable (the packets a CNP answers).
func (t *txBatch) emit(p *packet) (ect bool) {
	f := t.f
	if f.isLocal(p.dst) {
		p.local = true
		p.v4 = p.dst.IsV4()
		if p.n > 0 && p.segs != nil {
			p.arenaOff = len(t.arena)
			t.arena = append(t.arena, p.segs...)
			p.arenaN = len(p.segs)
			p.segs = nil
		}
		t.local = append(t.local, *p)
		return false
	}
	if f.wire == nil {
		f.ctrs.inc(cntDropUnknownGID)
		return false
	}
	return t.encode(p)
}

// encode queues p on the transmit ring; it reports whether p went
// ECN-capable: every RoCE v2 packet but a CNP, unless congestion control
// is off.
func (t *txBatch) encode(p *packet) (ect bool) {
	f := t.f
	if p.v1 && !f.l2 {
		// Open refuses v1 devices on an IP wire; nothing to route by.
		f.ctrs.inc(cntTxErrors)
		return false
	}
	if !p.v1 && p.src.IsV4() != p.dst.IsV4() {
		f.ctrs.inc(cntTxErrors)
		return false
	}
	v4 := p.dst.IsV4()
	size := roce.DatagramSize(v4, p.op, int(p.n))
	if p.v1 {
		size = roce.PacketSizeV1(p.op, int(p.n))
	}
	if size > wire.MaxDatagram {
		f.ctrs.inc(cntTxDropOversize)
		return false
	}
	net := roce.NetFields{
		Src: p.src, Dst: p.dst, TClass: p.tclass, HopLimit: p.hopLimit,
		FlowLabel: p.flowLabel, SrcPort: p.srcPort,
	}
	ect = !p.v1 && !f.cc.Disabled && p.op != roce.CNP
	if ect && net.TClass&roce.ECNMask == 0 {
		net.TClass |= roce.ECNECT0 // ECN-capable: switches mark instead of dropping
	}
	if v4 && !p.v1 {
		net.ID = f.nextIPID()
	}
	tf := p.transportFields()
	slot := f.ring.reserve()
	var d []byte
	var off int
	if p.v1 {
		d, off = roce.BuildV1(slot.buf, &net, &tf, int(p.n))
	} else {
		d, off = roce.Build(slot.buf, &net, &tf, int(p.n))
	}
	if !p.v1 && p.n > 0 {
		// RoCE v2 with a payload: the ICRC runs over the payload as it
		// is copied in (one pass over the data), then over the pad.
		ipLen := roce.IPv4HeaderSize
		if !v4 {
			ipLen = roce.IPv6HeaderSize
		}
		c := roce.ICRCPrefix(d, ipLen, off)
		pl := d[off : off+int(p.n)]
		if p.data != nil {
			c = crc.CopyUpdate(c, pl, p.data)
		} else {
			var err error
			if c, err = gatherCRC(pl, p.segs, p.dataOff, c); err != nil {
				// The sender's memory went away under it (unmapped or
				// deregistered): send nothing; retransmission or the
				// local checks at completion time surface the error.
				f.ctrs.inc(cntTxErrors)
				slot.commit(wire.Datagram{})
				return false
			}
		}
		c = crc.Update(c, d[off+int(p.n):len(d)-roce.ICRCSize])
		binary.LittleEndian.PutUint32(d[len(d)-roce.ICRCSize:], c)
		slot.commit(wire.Datagram{Packet: d, SrcMAC: p.smac, DstMAC: p.dmac})
		return ect
	}
	switch {
	case p.n == 0:
	case p.data != nil:
		copy(d[off:off+int(p.n)], p.data)
	default:
		if err := gather(d[off:off+int(p.n)], p.segs, p.dataOff); err != nil {
			f.ctrs.inc(cntTxErrors)
			slot.commit(wire.Datagram{})
			return false
		}
	}
	switch {
	case p.v1:
		roce.SealICRCv1(d)
	case v4:
		roce.SealICRC(d, roce.IPv4HeaderSize)
	default:
		roce.SealICRC(d, roce.IPv6HeaderSize)
	}
	slot.commit(wire.Datagram{Packet: d, SrcMAC: p.smac, DstMAC: p.dmac, RoCEv1: p.v1})
	return ect
}

// flush delivers in-process packets until none are left, sends the
// coalesced ACKs that produced, then the wire batch.
func (t *txBatch) flush() {
	f := t.f
	for {
		for t.head < len(t.local) {
			p := t.local[t.head]
			t.head++
			f.ctrs.inc(cntLocalPackets)
			if d := f.lookupGID(p.dst); d != nil {
				d.deliver(t, &p)
			} else {
				f.ctrs.inc(cntDropUnknownGID)
			}
		}
		t.local = t.local[:0]
		t.head = 0
		t.arena = t.arena[:0]
		if len(t.acks) == 0 {
			break
		}
		acks := t.acks
		t.acks = t.acksSpare[:0]
		for i, q := range acks {
			q.sendPendingAck(t)
			acks[i] = nil
		}
		t.acksSpare = acks[:0]
	}
	r := f.ring
	if r == nil || !r.pending() {
		return
	}
	if t.rx && r.backlog() > inlineMax {
		r.kick()
		return
	}
	r.flushInline()
}

// gatherCRC is gather that continues the CRC state c (hash/crc32's
// convention) over the bytes it copies, in the same pass: each page run is
// checksummed while it is copied out of guest memory. A run without one
// host mapping (memory served through the client, or a run across two
// regions) is copied and then checksummed.
func gatherCRC(dst []byte, segs []seg, off uint64, c uint32) (uint32, error) {
	done := uint64(0)
	err := walkSegs(segs, off, uint64(len(dst)), func(s *seg, iova, cnt uint64) error {
		if err := s.enterErr(); err != nil {
			return err
		}
		defer s.leaveSeg()
		hook := s.copyHook()
		for cnt > 0 {
			if hook != nil && done > 0 {
				hook(s.mr)
			}
			gpa, n := pageRun(&s.mr.pages, iova, cnt)
			if n == 0 {
				return errShortPages
			}
			d := dst[done : done+n]
			if src, pin, err := s.mr.mem.Slice(gpa, n, false); err == nil {
				c = crc.CopyUpdate(c, d, src)
				pin.Release()
			} else {
				if err := s.mr.mem.ReadAt(d, gpa); err != nil {
					return err
				}
				c = crc.Update(c, d)
			}
			done, iova, cnt = done+n, iova+n, cnt-n
		}
		return nil
	})
	return c, err
}
