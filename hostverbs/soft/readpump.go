package soft

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// READ responses over the wire are produced a burst at a time. A READ
// request may ask for up to 2 GiB (half a million packets); answering it
// whole on the goroutine that received it would hold the fabric's shared
// receive loop, and with it every other QP and VM of the fabric, for
// seconds. So an accepted READ (or a replayed duplicate) becomes a job on
// the QP's FIFO of READ responses: the receive loop sends its first
// readBurst packets, and the fabric's read pump sends the rest, pumpBurst
// packets per QP per turn, round-robin among the QPs that have READ
// responses to send. The FIFO keeps the responses in PSN order. While it
// holds work, the QP's responder executes no later request (a SEND, WRITE
// or atomic must not overtake the READ before it, IBA 9.5): it drops them
// and, once the READ responses are out, sends one PSN sequence NAK so the
// requester resends them at once (rxe instead queues those packets; a NAK
// costs one round trip and no copy). Duplicate READs are replayed through
// the same FIFO, at most one replay queued per QP and at most
// replayBurst replays per replayRefill, so a peer flooding duplicates
// gets its replays dropped and counted.

// readBurst is how many READ response packets the receive loop sends for
// a new READ (the whole of a READ up to 256 KiB at a 4 KiB MTU);
// pumpBurst is how many one QP sends per turn in the pump (the wire still
// gets them in batches of txMax; 4 halves a victim's p99 against 16, at the
// same READ throughput).
const (
	readBurst = 64
	pumpBurst = 4
)

// Duplicate READ replays per QP: a bucket of replayBurst, refilled one per
// replayRefill. A requester replays after a timeout or a response gap,
// far less often.
const (
	replayBurst  = 4
	replayRefill = time.Millisecond
)

// readJob is one READ's responses still to send.
type readJob struct {
	m      *mr // nil for a 0-byte READ
	rkey   uint32
	psn    roce.PSN // PSN of the first response
	va     uint64
	length uint32
	npkts  uint32
	next   uint32 // responses sent so far
	replay bool
}

// lastPSN is the PSN of the job's last response.
func (j *readJob) lastPSN() roce.PSN { return j.psn.Add(j.npkts - 1) }

// readFIFO is a QP's queued READ responses: a ring of max_dest_rd_atomic+1
// jobs (every resource plus one replay), allocated with the resources.
type readFIFO struct {
	jobs    []readJob
	head, n int
	// held: a request was dropped because READ responses were queued;
	// heldDup: a duplicate SEND/WRITE was. The drained FIFO answers with a
	// PSN sequence NAK, or an ACK.
	held, heldDup bool
	// Replay rate limit.
	tokens   int
	refilled time.Time
}

func (f *readFIFO) empty() bool { return f.n == 0 }
func (f *readFIFO) full() bool  { return f.n == len(f.jobs) }

// push queues j; false when the FIFO is full.
func (f *readFIFO) push(j readJob) bool {
	if f.n == len(f.jobs) {
		return false
	}
	f.jobs[(f.head+f.n)%len(f.jobs)] = j
	f.n++
	return true
}

func (f *readFIFO) front() *readJob { return &f.jobs[f.head] }

func (f *readFIFO) pop() {
	f.jobs[f.head] = readJob{}
	f.head = (f.head + 1) % len(f.jobs)
	f.n--
}

// clear drops every job (QP reset or error).
func (f *readFIFO) clear() {
	clear(f.jobs)
	f.head, f.n, f.held, f.heldDup = 0, 0, false, false
}

// find returns the queued job whose responses include psn, or nil.
func (f *readFIFO) find(psn roce.PSN) *readJob {
	for i := range f.n {
		j := &f.jobs[(f.head+i)%len(f.jobs)]
		if psn.InRange(j.psn, j.lastPSN()) {
			return j
		}
	}
	return nil
}

// hasReplay reports whether a replay is queued.
func (f *readFIFO) hasReplay() bool {
	for i := range f.n {
		if f.jobs[(f.head+i)%len(f.jobs)].replay {
			return true
		}
	}
	return false
}

// takeReplayToken spends one token of the replay bucket at now.
func (f *readFIFO) takeReplayToken(now time.Time) bool {
	if f.refilled.IsZero() {
		f.tokens, f.refilled = replayBurst, now
	}
	if d := now.Sub(f.refilled); d >= replayRefill {
		f.tokens = min(replayBurst, f.tokens+int(d/replayRefill))
		f.refilled = now
	}
	if f.tokens == 0 {
		return false
	}
	f.tokens--
	return true
}

// queueRead queues the responses of a READ from the wire and sends the
// first burst now, unless the QP is already waiting its turn in the pump
// (then the pump sends them, in order). rqMu is held.
func (q *qp) queueRead(tx *txBatch, j readJob) bool {
	r := &q.resp
	if !r.reads.push(j) {
		return false
	}
	if !q.inPump.Load() {
		q.pumpReadsLocked(tx, readBurst)
	}
	if !r.reads.empty() {
		q.dev.f.pump.add(q)
	}
	return true
}

// replayRead answers a duplicate READ from the wire (IBA 9.7.5.1.2): its
// responses are sent again from the requested PSN. A duplicate of
// responses still queued moves that job back to it; a duplicate of
// responses already sent queues a replay. Either costs a token of the
// QP's replay bucket, and one replay at most is queued. rqMu is held.
func (q *qp) replayRead(tx *txBatch, j readJob) {
	r := &q.resp
	if cur := r.reads.find(j.psn); cur != nil {
		off := j.psn.Distance(cur.psn)
		if off >= cur.next {
			return // not sent yet: it goes out anyway
		}
		if !r.reads.takeReplayToken(q.dev.f.clock.Now()) {
			q.dev.ctrs.inc(cntDropReplayLimited)
			return
		}
		cur.next = off
		return
	}
	if r.reads.hasReplay() || !r.reads.takeReplayToken(q.dev.f.clock.Now()) {
		q.dev.ctrs.inc(cntDropReplayLimited)
		return
	}
	if !q.queueRead(tx, j) {
		q.dev.ctrs.inc(cntDropReplayLimited)
	}
}

// pumpReadsLocked sends up to budget READ response packets from the FIFO
// and, once it is empty, the answer to the requests held meanwhile. It
// reports whether responses remain. rqMu is held.
func (q *qp) pumpReadsLocked(tx *txBatch, budget uint32) bool {
	r := &q.resp
	f := &r.reads
	if f.empty() {
		return false
	}
	q.flushAckLocked(tx)
	for budget > 0 && !f.empty() {
		j := f.front()
		n := min(budget, j.npkts-j.next)
		if !q.sendReadRange(tx, j, n, q.mtu) {
			// The MR went away (deregistered): stop answering; the
			// requester's retry meets the R_Key check.
			q.dev.ctrs.inc(cntDropDupRead)
			f.pop()
			continue
		}
		budget -= n
		if j.next == j.npkts {
			f.pop()
		}
	}
	if !f.empty() {
		return true
	}
	switch {
	case f.held:
		q.dev.ctrs.inc(cntTxNAKSeq)
		q.respAck(tx, roce.NAKPSNSequenceError, r.psn)
		r.sentNAK = true
	case f.heldDup:
		q.pendAck(tx, r.psn.Sub(1))
	}
	f.held, f.heldDup = false, false
	return false
}

// sendReadRange sends the next n responses of j; false if its MR no longer
// grants them.
func (q *qp) sendReadRange(tx *txBatch, j *readJob, n uint32, mtu uint64) bool {
	r := &q.resp
	if j.length > 0 {
		off := uint64(j.next) * mtu
		end := min(uint64(j.length), uint64(j.next+n)*mtu)
		if q.checkRKey(j.rkey, j.va+off, end-off, hostverbs.AccessRemoteRead) != j.m {
			return false
		}
	}
	// guard: the copy, whenever it happens (now for the wire, when the
	// requester takes it in process), holds the registration and fails
	// if the key was invalidated since this check.
	r.readSeg[0] = seg{mr: j.m, iova: j.va, n: uint64(j.length), guard: true}
	for k := range n {
		i := j.next + k
		var p packet
		q.fillNet(&p)
		off := uint64(i) * mtu
		sz := min(mtu, uint64(j.length)-min(off, uint64(j.length)))
		p.op = pick(i == 0, i == j.npkts-1, roce.RCReadResponseFirst, roce.RCReadResponseMiddle,
			roce.RCReadResponseLast, roce.RCReadResponseOnly)
		p.info = p.op.Info()
		p.psn = j.psn.Add(i)
		p.syn, p.msn = roce.SyndromeACKUnlimited, r.msn
		if sz > 0 {
			p.segs, p.dataOff, p.n = r.readSeg[:], off, uint32(sz)
		}
		q.emitToPeer(tx, &p)
	}
	j.next += n
	return true
}

// readPump is the fabric's goroutine that sends queued READ responses, a
// burst per QP per turn.
type readPump struct {
	f    *Fabric
	mu   sync.Mutex
	qps  []*qp // waiting their turn, FIFO
	wake chan struct{}
}

func newReadPump(f *Fabric) *readPump {
	return &readPump{f: f, wake: make(chan struct{}, 1)}
}

// add gives q a turn, unless it is waiting for one already.
func (p *readPump) add(q *qp) {
	p.mu.Lock()
	if !q.inPump.Load() {
		q.inPump.Store(true)
		p.qps = append(p.qps, q)
	}
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// next takes the QP whose turn it is, or nil.
func (p *readPump) next() *qp {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.qps) == 0 {
		return nil
	}
	q := p.qps[0]
	copy(p.qps, p.qps[1:])
	p.qps[len(p.qps)-1] = nil
	p.qps = p.qps[:len(p.qps)-1]
	return q
}

// run sends READ responses until ctx ends.
func (p *readPump) run(ctx context.Context, done func()) {
	defer done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
		}
		// One batch across turns: the wire gets the responses in
		// batches of txMax, however small the turns.
		tx := p.f.getTx()
		for q := p.next(); q != nil; q = p.next() {
			q.rqMu.Lock()
			more := false
			if !q.dead && q.state != hostverbs.QPStateErr && q.state != hostverbs.QPStateReset {
				more = q.pumpReadsLocked(tx, pumpBurst)
			}
			// Cleared under rqMu: a READ queued after this sees the QP
			// out of the pump and sends its first burst itself.
			q.inPump.Store(false)
			q.rqMu.Unlock()
			if r := p.f.ring; r.backlog() >= txMax {
				tx.flush()
			}
			if more {
				p.add(q)
			}
			// Let the goroutines the fabric's other traffic woke run
			// between turns.
			runtime.Gosched()
		}
		tx.flush()
		p.f.putTx(tx)
	}
}
