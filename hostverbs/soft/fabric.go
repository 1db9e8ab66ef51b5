package soft

import (
	"context"
	"errors"
	"fmt"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/ratelog"
)

// Config parameterises a Fabric.
type Config struct {
	// Wire carries traffic to GIDs that no device of this fabric owns. Nil
	// means an in-process fabric: only its own devices are reachable.
	Wire wire.Wire
	// Clock is the fabric's time: retransmission and RNR timers, pacing,
	// DCQCN's timers, the CNP interval and window and the READ replay
	// budget all read it. Nil means RealClock; tests of behaviour in time
	// use a ManualClock.
	Clock Clock
	// DefaultTOS is the IP TOS (DSCP << 2 | ECN) of packets whose address
	// vector has traffic class 0: the seeds' default_roce_tos.
	DefaultTOS uint8
	// LinkMTU is the IP MTU of the network the Wire uses; the ports'
	// active MTU is the largest IB MTU whose packets fit (as rxe derives
	// it from its netdev). 0 means 1500 with a Wire and no limit (4096)
	// without one.
	LinkMTU int
	// DisableLocalDelivery sends traffic between this fabric's own devices
	// through the Wire too (the kernel path), instead of copying it in
	// process. For tests and benchmarks of the wire path.
	DisableLocalDelivery bool
	// Window caps the PSNs a requester may have unacknowledged; 0 means 256.
	Window int
	// Congestion configures DCQCN congestion control (on by default;
	// Congestion.Disabled turns it off).
	Congestion CongestionConfig
	// Logger is the fabric's logger; nil means slog.Default().
	Logger *slog.Logger
}

// Fabric is a software RoCE v2 switch: the hostverbs.Provider whose
// devices (one per VM) reach each other in process, and everything else
// through a Wire. Inbound packets are demultiplexed by destination GID to
// a device, then by destination QPN to a QP; every device has its own QPN
// and key spaces.
type Fabric struct {
	cfg       Config
	log       *slog.Logger
	lim       *ratelog.Limiter // what peers provoke
	clock     Clock
	wire      wire.Wire
	activeMTU hostverbs.MTU
	window    uint32
	cc        CongestionConfig

	mu      sync.Mutex // guards devices and writers of gids
	devices map[*device]struct{}
	gids    atomic.Pointer[map[hostverbs.GID]*device]

	// l2 is set when the wire carries Ethernet frames (a linkWire): RoCE
	// v1 devices need it.
	l2 bool
	// wireChecksICRC is set when the wire checks every ICRC itself.
	wireChecksICRC bool

	ipID   atomic.Uint32
	ctrs   counters
	txPool sync.Pool
	ring   *txRing
	pump   *readPump

	cancel context.CancelFunc
	rxDone sync.WaitGroup
	closed atomic.Bool

	// hooks: tests' view of accesses and invalidations (nil).
	hooks atomic.Pointer[accessHooks]
}

// New creates a fabric and, if cfg.Wire is set, starts receiving from it.
func New(cfg Config) (*Fabric, error) {
	f := &Fabric{
		cfg:     cfg,
		log:     cfg.Logger,
		clock:   cfg.Clock,
		wire:    cfg.Wire,
		devices: make(map[*device]struct{}),
		window:  uint32(cfg.Window),
	}
	if f.log == nil {
		f.log = slog.Default()
	}
	f.lim = ratelog.New(f.log, 0)
	_, f.l2 = cfg.Wire.(wire.LinkWire)
	if cw, ok := cfg.Wire.(wire.ICRCCheckingWire); ok {
		f.wireChecksICRC = cw.ChecksICRC()
	}
	if cfg.Wire == nil {
		f.l2 = true // in process: any version
	}
	if f.clock == nil {
		f.clock = RealClock{}
	}
	if f.window == 0 {
		f.window = 256
	}
	cc, err := cfg.Congestion.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("soft fabric: %w", err)
	}
	f.cc = cc
	if f.window > 1<<22 {
		return nil, fmt.Errorf("soft fabric: window %d too large: %w", cfg.Window, hostverbs.ErrInvalid)
	}
	f.activeMTU = hostverbs.MTU4096
	if f.wire != nil || cfg.LinkMTU != 0 {
		link := cfg.LinkMTU
		if link == 0 {
			link = 1500
		}
		f.activeMTU = mtuForLink(link)
		if f.activeMTU == 0 {
			return nil, fmt.Errorf("soft fabric: link MTU %d is below the smallest RoCE MTU: %w", link, hostverbs.ErrInvalid)
		}
	}
	empty := map[hostverbs.GID]*device{}
	f.gids.Store(&empty)
	f.ipID.Store(uint32(time.Now().UnixNano()))
	f.txPool.New = func() any { return newTxBatch(f) }
	if f.wire != nil {
		ctx, cancel := context.WithCancel(context.Background())
		f.cancel = cancel
		f.ring = newTxRing(f)
		f.pump = newReadPump(f)
		f.rxDone.Add(2)
		go f.ring.run(ctx, f.rxDone.Done)
		go f.pump.run(ctx, f.rxDone.Done)
		for q := range f.wire.Queues() {
			f.rxDone.Add(1)
			go f.receiveLoop(ctx, q)
		}
	}
	return f, nil
}

// headerAllowance is what rxe subtracts from the netdev MTU for the
// headers of a RoCE packet (RXE_MAX_HDR_LENGTH).
const headerAllowance = 80

func mtuForLink(link int) hostverbs.MTU {
	for m := hostverbs.MTU4096; m >= hostverbs.MTU256; m-- {
		if m.Bytes() <= link-headerAllowance {
			return m
		}
	}
	return 0
}

// ActiveMTU is the path MTU the fabric's ports report as active.
func (f *Fabric) ActiveMTU() hostverbs.MTU { return f.activeMTU }

// Open creates a device for one VM.
func (f *Fabric) Open(cfg hostverbs.DeviceConfig) (hostverbs.Device, error) {
	if f.closed.Load() {
		return nil, fmt.Errorf("open device %q: %w", cfg.Name, hostverbs.ErrClosed)
	}
	if cfg.Memory == nil {
		return nil, fmt.Errorf("open device %q: no guest memory: %w", cfg.Name, hostverbs.ErrInvalid)
	}
	switch cfg.RoCEMode {
	case 0, hostverbs.GIDTypeRoCEv2:
	case hostverbs.GIDTypeRoCEv1:
		if !f.l2 {
			return nil, fmt.Errorf("open device %q: RoCE v1 needs an Ethernet (L2) fabric: v1 packets carry no IP header and cannot be routed: %w", cfg.Name, hostverbs.ErrNotSupported)
		}
	default:
		return nil, fmt.Errorf("open device %q: RoCE mode %v: %w", cfg.Name, cfg.RoCEMode, hostverbs.ErrInvalid)
	}
	d := newDevice(f, cfg)
	f.mu.Lock()
	f.devices[d] = struct{}{}
	f.mu.Unlock()
	return d, nil
}

// Close stops the fabric. Its devices must have been closed.
func (f *Fabric) Close() error {
	f.mu.Lock()
	n := len(f.devices)
	f.mu.Unlock()
	if n > 0 {
		return fmt.Errorf("close fabric: %d devices still open: %w", n, hostverbs.ErrBusy)
	}
	if !f.closed.CompareAndSwap(false, true) {
		return nil
	}
	defer f.lim.Flush()
	if f.wire != nil {
		f.cancel()
		err := f.wire.Close()
		f.rxDone.Wait()
		if err != nil {
			return fmt.Errorf("close fabric wire: %w", err)
		}
	}
	return nil
}

// Counters returns the fabric's statistics summed with its devices'.
func (f *Fabric) Counters() map[string]uint64 {
	m := make(map[string]uint64, numCounters)
	f.ctrs.addTo(m)
	if cw, ok := f.wire.(wire.CountingWire); ok {
		cw.Counters(m)
	}
	f.mu.Lock()
	for d := range f.devices {
		d.ctrs.addTo(m)
	}
	f.mu.Unlock()
	return m
}

// lookupGID returns the device owning g, or nil.
func (f *Fabric) lookupGID(g hostverbs.GID) *device { return (*f.gids.Load())[g] }

// bindGID makes d the owner of g; it fails if another device owns it.
func (f *Fabric) bindGID(g hostverbs.GID, d *device) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := *f.gids.Load()
	if o, ok := old[g]; ok {
		if o == d {
			return nil
		}
		return fmt.Errorf("gid %v is bound by device %q: %w", g, o.cfg.Name, hostverbs.ErrBusy)
	}
	next := make(map[hostverbs.GID]*device, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[g] = d
	f.gids.Store(&next)
	return nil
}

// unbindGID drops g if d owns it.
func (f *Fabric) unbindGID(g hostverbs.GID, d *device) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := *f.gids.Load()
	if old[g] != d {
		return
	}
	next := make(map[hostverbs.GID]*device, len(old))
	for k, v := range old {
		if k != g {
			next[k] = v
		}
	}
	f.gids.Store(&next)
}

// removeDevice forgets a closed device, keeping its statistics in the
// fabric's: the fabric's counters never go back when a VM leaves.
func (f *Fabric) removeDevice(d *device) {
	f.mu.Lock()
	delete(f.devices, d)
	for i := range d.ctrs {
		f.ctrs[i].Add(d.ctrs[i].Load())
	}
	f.mu.Unlock()
}

// nextIPID returns a non-zero IPv4 identification: rxe sends DF packets
// with incrementing non-zero IDs, and a raw socket would replace a zero.
func (f *Fabric) nextIPID() uint16 {
	for {
		if id := uint16(f.ipID.Add(1)); id != 0 {
			return id
		}
	}
}

func (f *Fabric) getTx() *txBatch  { return f.txPool.Get().(*txBatch) }
func (f *Fabric) putTx(t *txBatch) { f.txPool.Put(t) }

// rxBatch is how many datagrams one Receive call may return.
const rxBatch = wire.BatchSize

// drainPackets returns how many packets the receive loop takes in before
// it sends the ACKs it owes: a quarter of the window (64 at the default
// 256), so that a requester whose ACKs another receive goroutine handles
// (the wire steers each QP's packets to one queue: the two ends of a
// stream between QPs of this fabric are on two) gets its window opened
// while its first packets are still being taken in, and keeps sending
// beside the responder instead of waiting for the whole window's ACK.
func (f *Fabric) drainPackets() int { return max(1, int(f.window)/4) }

// drainTime bounds how long the receive loop holds its ACKs while packets
// keep arriving: far below the local ACK timeouts requesters use (the
// verbs tools' 14 is 67 ms), long enough for a ping-pong between two QPs
// of this fabric to make about ten round trips per ACK each way.
const drainTime = 200 * time.Microsecond

// receiveLoop reads datagrams from the wire and processes each batch on
// this goroutine; what the batch provokes (ACKs, read responses, more
// requests) is transmitted at the end of the batch.
func (f *Fabric) receiveLoop(ctx context.Context, queue int) {
	defer f.rxDone.Done()
	bufs := make([][]byte, rxBatch)
	backing := make([]byte, rxBatch*wire.MaxDatagram)
	for i := range bufs {
		bufs[i] = backing[i*wire.MaxDatagram : (i+1)*wire.MaxDatagram : (i+1)*wire.MaxDatagram]
	}
	out := make([][]byte, rxBatch)
	tx := newTxBatch(f)
	tx.rx = true
	pw, _ := f.wire.(wire.PollingWire)
	lw, _ := f.wire.(wire.LinkWire)
	var rp roce.Packet
	var p packet
	for {
		n, err := f.wire.Receive(ctx, queue, bufs, out)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, hostverbs.ErrClosed) {
				return
			}
			f.lim.Warn("receive", "soft fabric: receive", "err", err)
			f.ctrs.inc(cntTxErrors)
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		for i := range n {
			if lw != nil {
				fi := lw.Frame(queue, i)
				f.receive(tx, out[i], &fi, &rp, &p)
				continue
			}
			f.receive(tx, out[i], nil, &rp, &p)
		}
		// Before sending the ACKs this work produced, let the goroutines
		// its completions woke run (a consumer answering a message is
		// latency-critical, an ACK is not), and take in what arrived
		// meanwhile (often that answer), up to drainPackets packets or
		// drainTime so the ACKs are not held back under load. The ACKs
		// wait only while packets keep coming: once nothing has arrived,
		// they go.
		for got, t0, drain := n, time.Now(), f.drainPackets(); ; {
			runtime.Gosched()
			if pw == nil || got >= drain || time.Since(t0) >= drainTime {
				break
			}
			n, err := pw.TryReceive(queue, bufs, out)
			if err != nil || n == 0 {
				break
			}
			for i := range n {
				f.receiveDatagram(tx, out[i], &rp, &p)
			}
			got += n
		}
		tx.flush()
	}
}

// receiveDatagram runs the stateless gate on one datagram from the wire
// and hands it to the device owning its destination GID.
func (f *Fabric) receiveDatagram(tx *txBatch, d []byte, rp *roce.Packet, p *packet) {
	f.receive(tx, d, nil, rp, p)
}

// receive is receiveDatagram for a datagram captured in an Ethernet frame
// (fi nil: not captured): the device owning the destination GID takes it
// only if the frame was addressed to that device's own MAC, so a frame
// built for one VM's NIC cannot reach another VM that binds the same
// address. An Ethertype 0x8915 frame holds a RoCE v1 packet.
func (f *Fabric) receive(tx *txBatch, d []byte, fi *wire.FrameInfo, rp *roce.Packet, p *packet) {
	f.ctrs.inc(cntRxPackets)
	f.ctrs.add(cntRxBytes, uint64(len(d)))
	var err error
	if fi != nil && fi.RoCEv1 {
		err = rp.ParseV1(d)
	} else {
		err = rp.Parse(d)
	}
	if err != nil {
		f.ctrs.inc(parseDropCounter(err))
		return
	}
	if !f.wireChecksICRC && !rp.ICRCValid() {
		f.ctrs.inc(cntDropICRC)
		return
	}
	dst := hostverbs.GID(rp.DstGID())
	dev := f.lookupGID(dst)
	if dev == nil {
		f.ctrs.inc(cntDropUnknownGID)
		return
	}
	if fi != nil && fi.DstMAC != dev.cfg.MAC {
		f.ctrs.inc(cntDropWrongMAC)
		return
	}
	p.fromWire(rp)
	if !rp.V1 && rp.TClass()&roce.ECNMask == roce.ECNCE {
		p.ce = true
		dev.ctrs.inc(cntRxECNCE)
	}
	dev.deliver(tx, p)
}
