package soft

import (
	"errors"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// txBatch collects what one goroutine's work produces: datagrams for the
// wire, sent in batches, and packets for devices of the same fabric, which
// are processed in FIFO order by flush (never recursively, so a chain of
// request, ACK and next request runs in a loop, not on the stack). Every
// entry point (PostSend, the receive loop, a timer) takes a batch, does its
// work under the QP locks it needs, releases them, then flushes.
type txBatch struct {
	f     *Fabric
	bufs  [][]byte
	dgs   []Datagram
	n     int
	local []packet
	head  int
	arena []seg
	// acks are QPs whose responder has an ACK pending; flush sends one
	// per QP (ACK coalescing).
	acks, acksSpare []*qp
}

// txMax is the number of datagrams handed to the wire at once.
const txMax = 64

func newTxBatch(f *Fabric) *txBatch {
	t := &txBatch{f: f}
	if f.wire != nil {
		backing := make([]byte, txMax*MaxDatagram)
		t.bufs = make([][]byte, txMax)
		for i := range t.bufs {
			t.bufs[i] = backing[i*MaxDatagram : (i+1)*MaxDatagram : (i+1)*MaxDatagram]
		}
		t.dgs = make([]Datagram, txMax)
	}
	return t
}

// isLocal reports whether packets to g stay in process.
func (f *Fabric) isLocal(g [16]byte) bool {
	return !f.cfg.DisableLocalDelivery && f.lookupGID(g) != nil
}

// emit sends p: to a device of this fabric in process, or encoded to the
// wire. The caller holds the lock of the QP that owns p's payload
// segments; emit copies what it needs before returning.
func (t *txBatch) emit(p *packet) {
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
		return
	}
	if f.wire == nil {
		f.ctrs.inc(cntDropUnknownGID)
		return
	}
	t.encode(p)
}

// encode appends p to the wire batch.
func (t *txBatch) encode(p *packet) {
	f := t.f
	if p.src.IsV4() != p.dst.IsV4() {
		f.ctrs.inc(cntTxErrors)
		return
	}
	v4 := p.dst.IsV4()
	if roce.DatagramSize(v4, p.op, int(p.n)) > MaxDatagram {
		f.ctrs.inc(cntTxDropOversize)
		return
	}
	if t.n == txMax {
		t.flushWire()
	}
	net := roce.NetFields{
		Src: p.src, Dst: p.dst, TClass: p.tclass, HopLimit: p.hopLimit,
		FlowLabel: p.flowLabel, SrcPort: p.srcPort,
	}
	if v4 {
		net.ID = f.nextIPID()
	}
	tf := p.transportFields()
	d, off := roce.Build(t.bufs[t.n], &net, &tf, int(p.n))
	switch {
	case p.n == 0:
	case p.data != nil:
		copy(d[off:off+int(p.n)], p.data)
	default:
		if err := gather(d[off:off+int(p.n)], p.segs, p.dataOff); err != nil {
			// The sender's memory went away under it (unmapped or
			// deregistered): send nothing; retransmission or the local
			// checks at completion time surface the error.
			f.ctrs.inc(cntTxErrors)
			return
		}
	}
	ipLen := roce.IPv6HeaderSize
	if v4 {
		ipLen = roce.IPv4HeaderSize
	}
	roce.SealICRC(d, ipLen)
	t.dgs[t.n] = Datagram{Packet: d, SrcMAC: p.smac, DstMAC: p.dmac}
	t.n++
}

// flushWire hands the pending datagrams to the wire.
func (t *txBatch) flushWire() {
	if t.n == 0 {
		return
	}
	f := t.f
	dgs := t.dgs[:t.n]
	for len(dgs) > 0 {
		sent, err := f.wire.Transmit(dgs)
		for _, d := range dgs[:sent] {
			f.ctrs.add(cntTxBytes, uint64(len(d.Packet)))
		}
		f.ctrs.add(cntTxPackets, uint64(sent))
		dgs = dgs[sent:]
		if err != nil {
			// The datagram at the head was refused: count it, skip it.
			if errors.Is(err, errOversize) {
				f.ctrs.inc(cntTxDropOversize)
			} else {
				f.ctrs.inc(cntTxErrors)
			}
			if len(dgs) > 0 {
				dgs = dgs[1:]
			}
		} else if sent == 0 {
			f.ctrs.inc(cntTxErrors)
			break
		}
	}
	t.n = 0
}

// errOversize is what a Wire returns for a datagram larger than the path
// allows (EMSGSIZE).
var errOversize = errors.New("datagram exceeds the path MTU")

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
	t.flushWire()
}
