package vdev

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// DoorbellMode says how the guest's UAR doorbells (BAR2) reach the device.
type DoorbellMode int

const (
	// DoorbellsTrapped: every UAR write is a region write the client
	// forwards (with x-no-posted-writes, a synchronous round trip through
	// QEMU). Exact: each write is seen, in order.
	DoorbellsTrapped DoorbellMode = iota
	// DoorbellsMemory: the UAR pages of user contexts (1 and up) are
	// memory the device shares with the client (a memfd offered with a
	// sparse-mmap area, UARMmap), which QEMU maps into the guest: a
	// doorbell is a plain store, and a poller of the device's watches the
	// words and the rings (pollUAR). Page 0, the kernel's, stays trapped.
	// See docs/ARCHITECTURE.md, "Doorbells in memory", for what differs.
	DoorbellsMemory
)

// ParseDoorbellMode parses "trapped" (or "") and "memory".
func ParseDoorbellMode(s string) (DoorbellMode, error) {
	switch s {
	case "", "trapped":
		return DoorbellsTrapped, nil
	case "memory":
		return DoorbellsMemory, nil
	}
	return 0, fmt.Errorf("doorbell mode %q: want trapped or memory", s)
}

// String is the mode's name as ParseDoorbellMode takes it.
func (m DoorbellMode) String() string {
	if m == DoorbellsMemory {
		return "memory"
	}
	return "trapped"
}

// Doorbell kinds, for the counters (Stats.TrappedDoorbells,
// Stats.MemoryDoorbells).
const (
	dbQP = iota
	dbCQPoll
	dbCQArm
	dbSRQ
	dbKinds
)

// DoorbellCounts counts doorbells by kind.
type DoorbellCounts struct {
	QP, CQPoll, CQArm, SRQ uint64
}

func loadCounts(c *[dbKinds]atomic.Uint64) DoorbellCounts {
	return DoorbellCounts{QP: c[dbQP].Load(), CQPoll: c[dbCQPoll].Load(), CQArm: c[dbCQArm].Load(), SRQ: c[dbSRQ].Load()}
}

// The memory doorbell poller's pace: after a pass that found a doorbell
// it keeps passing (yielding the processor between passes) for
// uarSpinFor, then sleeps, from uarSleepMin doubling to uarSleepMax while
// nothing comes.
const (
	uarSpinFor  = 200 * time.Microsecond
	uarSleepMin = 50 * time.Microsecond
	uarSleepMax = time.Millisecond
	// uarSleepNoContext is the poller's sleep while the VM has no user
	// context (no process uses the device: nothing to watch).
	uarSleepNoContext = 20 * time.Millisecond
)

// The lost-arm safety net (pollUAR): a CQ of a context whose CQ word was
// written, that is not armed, and that got a CQE since or whose CQEs the
// guest has left unconsumed, gets a CQ notification once that has lasted
// its grace with cons_head unchanged. The grace starts at armGraceMin and
// doubles, up to armGraceMax, each time such a notification finds the CQEs
// consumed already (a consumer that polls is notified ever more rarely);
// one that finds CQEs waiting (a consumer waiting for the event) and a
// seen arm (a consumer that uses events) make it armGraceWaiter. The
// common pattern "arm, then poll until empty" overwrites its own arm with
// the empty poll's POLL: such a consumer's events all come this way.
const (
	armGraceWaiter = 50 * time.Microsecond
	armGraceMin    = 500 * time.Microsecond
	armGraceMax    = 128 * time.Millisecond
)

// uarMemory is the shared UAR BAR of a device in memory mode.
type uarMemory struct {
	fd  int
	mem []byte // BAR2Size bytes, MAP_SHARED: what the guest's stores hit
	// poller lifetime (nil while none runs).
	cancel context.CancelFunc
	done   chan struct{}
	// pages and scratch, guarded by Device.mu: the context pages whose QP,
	// CQ and SRQ words a pass found written.
	qpPages, cqPages, srqPages []bool
	suspects                   int // CQs with suspect set, at most (checkSuspects recounts)
	// contexts is how many user contexts the last pass found.
	contexts atomic.Int32
	// kick wakes the poller: a CQE for a user CQ (cq.memDB) or a suspect
	// CQ (cq.watched).
	kick chan struct{}
}

// newUARMemory creates the shared UAR memory, or with kept > 0 takes a
// duplicate of that file (a predecessor's, which the guest's mapping still
// names: a restarted daemon must watch the same memory). A kept file that
// is not a regular file of BAR2Size bytes at least is refused.
func newUARMemory(kept int) (*uarMemory, error) {
	var fd int
	var err error
	if kept > 0 {
		var st unix.Stat_t
		if err := unix.Fstat(kept, &st); err != nil {
			return nil, fmt.Errorf("kept UAR file: %w", err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size < BAR2Size {
			return nil, fmt.Errorf("kept UAR file (mode %#o, %d bytes) is not a file of %d bytes: %w", st.Mode, st.Size, BAR2Size, syscall.EINVAL)
		}
		if fd, err = unix.FcntlInt(uintptr(kept), unix.F_DUPFD_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("kept UAR file: %w", err)
		}
	} else {
		if fd, err = unix.MemfdCreate("pvrdma-uar", unix.MFD_CLOEXEC); err != nil {
			return nil, fmt.Errorf("UAR memfd: %w", err)
		}
		if err := unix.Ftruncate(fd, BAR2Size); err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("UAR memfd size: %w", err)
		}
	}
	mem, err := unix.Mmap(fd, 0, BAR2Size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("UAR memfd map: %w", err)
	}
	return &uarMemory{fd: fd, mem: mem, kick: make(chan struct{}, 1),
		qpPages: make([]bool, UARPages), cqPages: make([]bool, UARPages), srqPages: make([]bool, UARPages)}, nil
}

// word returns UAR page page's doorbell word at off (0, 4 or 8).
func (u *uarMemory) word(page uint32, off uint64) *uint32 {
	return (*uint32)(unsafe.Pointer(&u.mem[uint64(page)*abi.UARPageSize+off]))
}

// clearPage zeroes a page's doorbell words (a new context starts clean:
// what a previous owner or a hostile guest left there is no doorbell).
func (u *uarMemory) clearPage(page uint32) {
	for _, off := range []uint64{abi.UARQPOffset, abi.UARCQOffset, abi.UARSRQOffset} {
		atomic.StoreUint32(u.word(page, off), 0)
	}
}

// close unmaps and closes the memory; a second call does nothing. The
// poller must have stopped.
func (u *uarMemory) close() {
	if u.mem == nil {
		return
	}
	_ = unix.Munmap(u.mem)
	_ = unix.Close(u.fd)
	u.mem, u.fd = nil, -1
}

// releaseUARMemory stops the poller and releases the shared UAR memory of
// a device that will not serve (a restore that failed: the caller drops
// it without Close).
func (d *Device) releaseUARMemory() {
	d.stopUARM.Do(d.stopUARPoller)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.uarm != nil {
		d.uarm.close()
	}
}

// UARMmap describes the shared UAR memory of a device in memory mode: the
// file fd holds BAR2 from file offset 0, and the client may map the BAR's
// bytes offset to offset+size (every page but the kernel's page 0). ok is
// false in trapped mode. The device owns the file descriptor.
func (d *Device) UARMmap() (fd int, offset, size uint64, ok bool) {
	if d.uarm == nil || d.uarm.mem == nil {
		return -1, 0, 0, false
	}
	return d.uarm.fd, abi.UARPageSize, BAR2Size - abi.UARPageSize, true
}

// DoorbellMode returns the device's doorbell mode.
func (d *Device) DoorbellMode() DoorbellMode {
	if d.uarm != nil {
		return DoorbellsMemory
	}
	return DoorbellsTrapped
}

// startUARPoller starts the goroutine that watches the shared UAR pages
// until stopUARPoller.
func (d *Device) startUARPoller() {
	ctx, cancel := context.WithCancel(context.Background())
	d.uarm.cancel, d.uarm.done = cancel, make(chan struct{})
	go func() {
		defer close(d.uarm.done)
		d.runUARPoller(ctx)
	}()
}

func (d *Device) stopUARPoller() {
	if d.uarm == nil || d.uarm.cancel == nil {
		return
	}
	d.uarm.cancel()
	<-d.uarm.done
	d.uarm.cancel = nil
}

// runUARPoller passes over the shared UAR pages until ctx ends: adaptive
// and bounded, busy (yielding) for uarSpinFor after the last activity (a
// doorbell seen, or a CQE written for a user CQ: its consumer is about to
// poll, re-arm and post), then sleeping longer and longer, up to
// uarSleepMax. An event-driven consumer rings only after its CQE came, so
// the CQE's wake-up is what makes its doorbells seen at once, not a sleep
// later.
func (d *Device) runUARPoller(ctx context.Context) {
	sleep := uarSleepMin
	var last time.Time
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		now := time.Now()
		rung, due := d.pollUAR(now)
		if rung {
			last, sleep = now, uarSleepMin
		}
		if now.Sub(last) < uarSpinFor {
			if ctx.Err() != nil {
				return
			}
			select {
			case <-d.uarm.kick:
				last = now // a CQE came for a user CQ: keep watching
			default:
			}
			runtime.Gosched()
			continue
		}
		wait := sleep
		if !due.IsZero() {
			// A suspect CQ's grace ends: pass then, not a sleep later.
			wait = max(min(wait, due.Sub(now)), 0)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-d.uarm.kick:
			if !t.Stop() {
				<-t.C
			}
			// A CQE for a user CQ (or a suspect's): the guest is about
			// to poll and post; watch closely for a while.
			last, sleep = time.Now(), uarSleepMin
			continue
		}
		sleep = min(2*sleep, uarSleepMax)
		if d.uarm.contexts.Load() == 0 {
			sleep = uarSleepNoContext
		}
	}
}

// pollUAR makes one pass over the shared UAR pages of the live user
// contexts and reports whether any doorbell word was written. Each word
// is read with an atomic swap to 0, so the guest's next store is always
// seen. A store overwrites the one before it, so a word is evidence that
// its kind of doorbell was rung on that page, not of which object: a QP
// word drains every QP of the context (their rings' producer indices are
// the record of the work posted), an SRQ word every SRQ; a CQ word is
// applied as the trapped path would (an arm arms that CQ) and makes every
// other CQ of the context a suspect of a lost arm (the safety net).
// Words that name nothing the context owns are counted
// (Stats.MemoryBadDoorbells).
func (d *Device) pollUAR(now time.Time) (rung bool, due time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.pollUARLocked(now)
}

// pollUARLocked is pollUAR with mu held.
func (d *Device) pollUARLocked(now time.Time) (rung bool, due time.Time) {
	u := d.uarm
	if d.dbHeld {
		return false, time.Time{} // held: the words wait in memory
	}
	if u == nil || u.mem == nil || d.closed || d.dsr == nil {
		if u != nil {
			u.contexts.Store(0)
		}
		return false, time.Time{}
	}
	d.stats.dbPasses.Add(1)
	u.contexts.Store(int32(d.ucs.len()))
	anyQP, anySRQ, anyCQ := false, false, false
	d.ucs.each(func(page uint32, _ *uctx) {
		if page == 0 || page >= UARPages {
			return
		}
		if v := atomic.SwapUint32(u.word(page, abi.UARQPOffset), 0); v != 0 {
			rung, anyQP = true, true
			u.qpPages[page] = true
			d.stats.memDBs[dbQP].Add(1)
			if q, ok := d.qps.get(v & abi.UARHandleMask); !ok || q.uar != page || v&(abi.UARQPSend|abi.UARQPRecv) == 0 {
				d.stats.memBad.Add(1)
			}
		}
		if v := atomic.SwapUint32(u.word(page, abi.UARCQOffset), 0); v != 0 {
			rung, anyCQ = true, true
			u.cqPages[page] = true
			d.memCQDoorbell(page, v)
		}
		if v := atomic.SwapUint32(u.word(page, abi.UARSRQOffset), 0); v != 0 {
			rung, anySRQ = true, true
			u.srqPages[page] = true
			d.stats.memDBs[dbSRQ].Add(1)
			if s, ok := d.srqs.get(v & abi.UARHandleMask); !ok || s.uar != page || v&abi.UARSRQRecv == 0 {
				d.stats.memBad.Add(1)
			}
		}
	})
	if rung {
		// The guest goes on: a hand-over in progress is abandoned.
		d.resumeTransportsLocked()
	}
	// Receives first, every QP's and SRQ's, then sends: a receive the
	// guest posted before a send (of another QP: a loopback peer) is
	// posted before it, as its earlier doorbell would have had it.
	qpRung := func(q *qp) bool { return q.uar < UARPages && u.qpPages[q.uar] && q.sq != nil }
	if anyQP {
		d.qps.each(func(_ uint32, q *qp) {
			if qpRung(q) {
				guardSlow()
				d.postRecvs(q)
			}
		})
	}
	if anySRQ {
		d.srqs.each(func(_ uint32, s *srq) {
			if s.uar < UARPages && u.srqPages[s.uar] && s.ring != nil {
				guardSlow()
				d.postSRQ(s)
			}
		})
		clear(u.srqPages)
	}
	if anyQP {
		d.qps.each(func(_ uint32, q *qp) {
			if qpRung(q) {
				d.postSends(q, false)
			}
		})
		clear(u.qpPages)
	}
	if anyCQ {
		if d.stalled > 0 {
			d.resumeStalled()
		}
		d.cqs.each(func(_ uint32, c *cq) {
			if c.uar >= UARPages || !u.cqPages[c.uar] || c.suspect {
				return
			}
			c.mu.Lock()
			armed, tail := c.armed != armNone, c.ring.TailIndex()
			c.mu.Unlock()
			if !armed {
				c.suspect, c.suspectSince, c.suspectTail = true, time.Time{}, tail
				c.watched.Store(true)
				u.suspects++
			}
		})
		clear(u.cqPages)
	}
	if u.suspects > 0 {
		due = d.checkSuspects(now)
	}
	return rung, due
}

// memCQDoorbell applies a CQ word found in memory. mu held.
func (d *Device) memCQDoorbell(page, v uint32) {
	if v&abi.UARCQPoll != 0 {
		d.stats.memDBs[dbCQPoll].Add(1)
	}
	arm := v&(abi.UARCQArm|abi.UARCQArmSol) != 0
	if arm {
		d.stats.memDBs[dbCQArm].Add(1)
	}
	c, ok := d.cqs.get(v & abi.UARHandleMask)
	if !ok || c.uar != page || v&(abi.UARCQPoll|abi.UARCQArm|abi.UARCQArmSol) == 0 {
		d.stats.memBad.Add(1)
		return
	}
	switch {
	case v&abi.UARCQArm != 0:
		c.arm(armNext)
	case v&abi.UARCQArmSol != 0:
		c.arm(armSolicited)
	}
	if arm {
		c.grace = armGraceWaiter // its consumer arms: notify a lost arm soon
		if c.suspect {
			c.suspect = false
			c.watched.Store(false)
			d.uarm.suspects--
		}
	}
}

// checkSuspects is the lost-arm safety net: a suspect CQ that is armed
// again needs nothing; one that got a CQE since it became a suspect (the
// completion a lost arm would have notified), or whose guest has left CQEs
// unconsumed (cons_head short of prod_tail), gets a CQ notification once
// that has lasted its grace with cons_head unchanged. It returns when the
// earliest grace running ends (zero: none runs). (The new CQE counts
// even if it was consumed: another thread may poll the CQ while one waits
// for its event.) mu held.
func (d *Device) checkSuspects(now time.Time) (due time.Time) {
	n := 0
	d.cqs.each(func(_ uint32, c *cq) {
		if !c.suspect {
			return
		}
		n++
		c.mu.Lock()
		armed, dead := c.armed != armNone, c.dead
		head, err := c.ring.HeadIndex()
		tail := c.ring.TailIndex()
		pending := err == nil && (head != tail || tail != c.suspectTail)
		c.mu.Unlock()
		switch {
		case armed || dead || err != nil:
			c.suspect = false
			c.watched.Store(false)
			n--
		case !pending:
			c.suspectSince = time.Time{}
		case c.suspectSince.IsZero() || head != c.suspectHead:
			c.suspectSince, c.suspectHead = now, head
			if end := now.Add(c.graceOrDefault()); due.IsZero() || end.Before(due) {
				due = end
			}
		case now.Sub(c.suspectSince) >= c.graceOrDefault():
			c.suspect = false
			c.watched.Store(false)
			n--
			if head != tail {
				// CQEs wait unconsumed: a consumer waiting for this
				// event, likely; keep its grace short.
				c.grace = armGraceWaiter
			} else {
				// All consumed already: a consumer that polls.
				c.grace = min(2*max(c.grace, armGraceMin), armGraceMax)
			}
			d.stats.armSafetyNets.Add(1)
			d.pushCQNotify(c.handle)
		}
	})
	d.uarm.suspects = n // destroyed CQs and a reset leave the count
	return due
}

// kickUAR wakes the poller (a CQE for a user CQ: its consumer is about to
// ring; for a suspect CQ, its grace starts).
func (d *Device) kickUAR() {
	if u := d.uarm; u != nil {
		select {
		case u.kick <- struct{}{}:
		default:
		}
	}
}

// graceOrDefault is the CQ's grace (armGraceMin until the safety net or
// an arm classified its consumer). Device.mu held.
func (c *cq) graceOrDefault() time.Duration {
	if c.grace == 0 {
		return armGraceMin
	}
	return c.grace
}

// armedNow reports whether the CQ is armed.
func (c *cq) armedNow() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.armed != armNone
}
