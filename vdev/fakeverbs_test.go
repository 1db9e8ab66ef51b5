package vdev

import (
	"encoding/binary"
	"fmt"
	"sync"
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// fakeVerbs is a minimal hostverbs.Device for command-layer tests: it
// hands out keys and QPNs, records every work request posted to it
// exactly as the device translated it, lets tests complete them by hand
// (in order, as a provider does: finish), flushes what it holds when a QP
// moves to ERR and discards it on RESET, and can be told to fail. Data movement is the real provider's job and is
// tested with hostverbs/soft.
type fakeVerbs struct {
	mu       sync.Mutex
	attr     hostverbs.DeviceAttr
	port     hostverbs.PortAttr
	gids     map[int]hostverbs.GIDEntry
	nextKey  uint32
	nextQPN  uint32
	live     map[string]int
	fail     map[string]error // method name -> error for its next call
	queueCap int              // PostSend/PostRecv return ErrQueueFull beyond this many outstanding (0: no cap)
	// autoComplete makes PostSend and PostRecv complete at once
	// (successfully, to the CQ's handler) without recording: the
	// benchmarks' provider.
	autoComplete bool
	// noForce refuses QPInitAttr.QPN and MRAttr keys with ErrNotSupported,
	// as the ibverbs relay does.
	noForce bool
	// noTransport makes SaveTransport and RestoreTransport fail with
	// ErrNotSupported.
	noTransport bool
	keys        map[uint32]bool // keys of live MRs
	qps         []*fakeQP
	srqs        []*fakeSRQ
	mrs         []*fakeMR
	frs         []*fakeFRMR
}

func newFakeVerbs() *fakeVerbs {
	return &fakeVerbs{
		attr: hostverbs.DeviceAttr{
			FWVersion: 0x100020003, MaxMRSize: 1 << 40, PageSizeCap: 4096, MaxQP: 256, MaxQPWR: 8192,
			MaxSGE: 8, MaxSGERd: 8, MaxCQ: 512, MaxCQE: 65536, MaxMR: 1024, MaxPD: 256, MaxQPRdAtom: 16,
			MaxQPInitRdAtom: 16, MaxAH: 1 << 20, MaxSRQ: 128, MaxSRQWR: 8192, MaxSRQSGE: 8,
			AtomicCap: hostverbs.AtomicHCA, LocalCAAckDelay: 15, MaxPKeys: 1, GIDTableLen: 64, PhysPortCnt: 1,
			DeviceCapFlags: hostverbs.DeviceCapMemMgtExtensions, MaxFastRegPageListLen: 256,
		},
		port: hostverbs.PortAttr{State: hostverbs.PortActive, MaxMTU: hostverbs.MTU4096, ActiveMTU: hostverbs.MTU1024,
			GIDTableLen: 64, MaxMsgSize: 1 << 31, PKeyTableLen: 1, ActiveWidth: 1, ActiveSpeed: 1, PhysState: 5},
		gids: map[int]hostverbs.GIDEntry{}, nextKey: 0x100, nextQPN: 0x11, live: map[string]int{},
		fail: map[string]error{}, keys: map[uint32]bool{},
	}
}

// qpnInUse reports whether a live QP has number n (mu held).
func (f *fakeVerbs) qpnInUse(n uint32) bool {
	for _, q := range f.qps {
		if !q.dead && q.qpn == n {
			return true
		}
	}
	return false
}

func (f *fakeVerbs) failNext(method string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail[method] = err
}

// check returns the injected error for method, if any (mu held).
func (f *fakeVerbs) check(method string) error {
	if err, ok := f.fail[method]; ok {
		delete(f.fail, method)
		return fmt.Errorf("fake %s: %w", method, err)
	}
	return nil
}

func (f *fakeVerbs) count(kind string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.live[kind]
}

func (f *fakeVerbs) Attr() hostverbs.DeviceAttr { return f.attr }

func (f *fakeVerbs) QueryPort(port uint8) (hostverbs.PortAttr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if port != 1 {
		return hostverbs.PortAttr{}, hostverbs.ErrInvalid
	}
	return f.port, f.check("QueryPort")
}

func (f *fakeVerbs) SetGID(index int, e hostverbs.GIDEntry) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("SetGID"); err != nil {
		return err
	}
	f.gids[index] = e
	return nil
}

func (f *fakeVerbs) ClearGID(index int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.gids, index)
	return nil
}

func (f *fakeVerbs) GID(index int) (hostverbs.GIDEntry, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	e, ok := f.gids[index]
	if !ok {
		return e, hostverbs.ErrNotFound
	}
	return e, nil
}

func (f *fakeVerbs) AllocPD() (hostverbs.PD, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("AllocPD"); err != nil {
		return nil, err
	}
	f.live["pd"]++
	return &fakePD{f: f}, nil
}

func (f *fakeVerbs) CreateCQ(attr hostverbs.CQAttr) (hostverbs.CQ, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("CreateCQ"); err != nil {
		return nil, err
	}
	f.live["cq"]++
	return &fakeCQ{f: f, attr: attr}, nil
}

func (f *fakeVerbs) Close() error { return nil }

type fakePD struct{ f *fakeVerbs }

func (p *fakePD) RegMR(attr hostverbs.MRAttr) (hostverbs.MR, error) {
	f := p.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("RegMR"); err != nil {
		return nil, err
	}
	m := &fakeMR{f: f, attr: attr}
	if attr.LKey != 0 || attr.RKey != 0 {
		if f.noForce {
			return nil, fmt.Errorf("fake: keys %#x/%#x: %w", attr.LKey, attr.RKey, hostverbs.ErrNotSupported)
		}
		if f.keys[attr.LKey] || f.keys[attr.RKey] {
			return nil, fmt.Errorf("fake: keys %#x/%#x: %w", attr.LKey, attr.RKey, hostverbs.ErrBusy)
		}
		m.lkey, m.rkey = attr.LKey, attr.RKey
		f.nextKey = max(f.nextKey, attr.LKey&^0xff, attr.RKey&^0xff)
	} else {
		for {
			f.nextKey += 0x100
			if !f.keys[f.nextKey|0x11] && !f.keys[f.nextKey|0x22] {
				break
			}
		}
		m.lkey, m.rkey = f.nextKey|0x11, f.nextKey|0x22
	}
	f.keys[m.lkey], f.keys[m.rkey] = true, true
	f.live["mr"]++
	f.mrs = append(f.mrs, m)
	return m, nil
}

func (p *fakePD) CreateQP(attr hostverbs.QPInitAttr) (hostverbs.QP, error) {
	f := p.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("CreateQP"); err != nil {
		return nil, err
	}
	q := &fakeQP{f: f, init: attr}
	switch {
	case attr.QPN != 0:
		if f.noForce {
			return nil, fmt.Errorf("fake: QPN %#x: %w", attr.QPN, hostverbs.ErrNotSupported)
		}
		if f.qpnInUse(attr.QPN) {
			return nil, fmt.Errorf("fake: QPN %#x: %w", attr.QPN, hostverbs.ErrBusy)
		}
		q.qpn = attr.QPN
		f.nextQPN = max(f.nextQPN, attr.QPN+1)
	case attr.Type == hostverbs.QPTypeGSI:
		q.qpn = 1
	default:
		for f.qpnInUse(f.nextQPN) {
			f.nextQPN++
		}
		q.qpn = f.nextQPN
		f.nextQPN++
	}
	f.live["qp"]++
	f.qps = append(f.qps, q)
	return q, nil
}

func (p *fakePD) CreateSRQ(attr hostverbs.SRQAttr) (hostverbs.SRQ, error) {
	f := p.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("CreateSRQ"); err != nil {
		return nil, err
	}
	f.live["srq"]++
	s := &fakeSRQ{f: f, attr: attr}
	f.srqs = append(f.srqs, s)
	return s, nil
}

func (p *fakePD) Dealloc() error {
	p.f.mu.Lock()
	defer p.f.mu.Unlock()
	p.f.live["pd"]--
	return nil
}

// AllocFastRegMR makes a fast-reg MR with the fake's key rules (a forced
// key, or the next free one); it keeps its state as the soft provider does.
func (p *fakePD) AllocFastRegMR(attr hostverbs.FastRegAttr) (hostverbs.FastRegMR, error) {
	f := p.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check("AllocFastRegMR"); err != nil {
		return nil, err
	}
	m := &fakeFRMR{fakeMR: fakeMR{f: f}, max: attr.MaxPages}
	if attr.Key != 0 {
		if f.noForce {
			return nil, fmt.Errorf("fake: key %#x: %w", attr.Key, hostverbs.ErrNotSupported)
		}
		if f.keys[attr.Key] {
			return nil, fmt.Errorf("fake: key %#x: %w", attr.Key, hostverbs.ErrBusy)
		}
		m.lkey = attr.Key
		f.nextKey = max(f.nextKey, attr.Key&^0xff)
	} else {
		for {
			f.nextKey += 0x100
			if !f.keys[f.nextKey|0x33] {
				break
			}
		}
		m.lkey = f.nextKey | 0x33
	}
	m.rkey = m.lkey
	f.keys[m.lkey] = true
	f.live["mr"]++
	f.mrs = append(f.mrs, &m.fakeMR)
	f.frs = append(f.frs, m)
	return m, nil
}

// fakeFRMR is a fast-reg MR of the fake: free or valid under a key.
type fakeFRMR struct {
	fakeMR
	max   int
	valid bool
	reg   hostverbs.FastReg
}

func (m *fakeFRMR) Register(r hostverbs.FastReg) error {
	m.f.mu.Lock()
	defer m.f.mu.Unlock()
	if err := m.f.check("Register"); err != nil {
		return err
	}
	switch {
	case m.valid:
		return fmt.Errorf("fake: MR %#x valid: %w", m.lkey, hostverbs.ErrBusy)
	case r.Key>>8 != m.lkey>>8 || len(r.Pages.Pages) > m.max:
		return fmt.Errorf("fake: key %#x, %d pages: %w", r.Key, len(r.Pages.Pages), hostverbs.ErrInvalid)
	}
	delete(m.f.keys, m.lkey)
	m.valid, m.reg, m.lkey, m.rkey = true, r, r.Key, r.Key
	m.f.keys[m.lkey] = true
	return nil
}

func (m *fakeFRMR) Invalidate(key uint32) error {
	m.f.mu.Lock()
	defer m.f.mu.Unlock()
	if key != m.lkey {
		return fmt.Errorf("fake: invalidate %#x, the MR has %#x: %w", key, m.lkey, hostverbs.ErrInvalid)
	}
	m.valid = false
	return nil
}

func (m *fakeFRMR) Registration() (hostverbs.MRState, hostverbs.FastReg) {
	m.f.mu.Lock()
	defer m.f.mu.Unlock()
	if !m.valid {
		return hostverbs.MRFree, hostverbs.FastReg{}
	}
	return hostverbs.MRValid, m.reg
}

// frmrs returns the fake's fast-reg MRs, oldest first.
func (f *fakeVerbs) frmrs(t testing.TB) []*fakeFRMR {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := append([]*fakeFRMR(nil), f.frs...)
	if len(out) == 0 {
		t.Fatal("no fast-reg MR")
	}
	return out
}

type fakeMR struct {
	f          *fakeVerbs
	lkey, rkey uint32
	attr       hostverbs.MRAttr
	dead       bool
}

func (m *fakeMR) LKey() uint32 { return m.lkey }
func (m *fakeMR) RKey() uint32 { return m.rkey }
func (m *fakeMR) Dereg() error {
	m.f.mu.Lock()
	defer m.f.mu.Unlock()
	if err := m.f.check("Dereg"); err != nil {
		return err
	}
	m.dead = true
	delete(m.f.keys, m.lkey)
	delete(m.f.keys, m.rkey)
	m.f.live["mr"]--
	return nil
}

type fakeCQ struct {
	f     *fakeVerbs
	attr  hostverbs.CQAttr
	depth int
}

func (c *fakeCQ) Resize(depth int) error {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	c.depth = depth
	return c.f.check("Resize")
}

func (c *fakeCQ) Destroy() error {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	c.f.live["cq"]--
	return nil
}

type fakeQP struct {
	f     *fakeVerbs
	qpn   uint32
	init  hostverbs.QPInitAttr
	attr  hostverbs.QPAttr
	mods  []hostverbs.AttrMask
	sends []hostverbs.SendWR
	recvs []hostverbs.RecvWR
	// outSends and outRecvs are the WRIDs of the WRs the QP holds (posted,
	// not completed), oldest first.
	outSends, outRecvs []uint64
	dead               bool
	wc                 hostverbs.WorkCompletion
	// xport stands for the QP's transport state (PSNs): SaveTransport
	// saves it, RestoreTransport sets it; frozen is set between
	// SaveTransport and ResumeTransport (or a post or modify).
	xport  uint64
	frozen bool
}

func (q *fakeQP) QPN() uint32 { return q.qpn }

func (q *fakeQP) Modify(attr *hostverbs.QPAttr, mask hostverbs.AttrMask) error {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	if err := q.f.check("Modify"); err != nil {
		return err
	}
	q.frozen = false
	if mask&hostverbs.AttrState != 0 {
		switch {
		case attr.State == hostverbs.QPStateReset:
			q.outSends, q.outRecvs = nil, nil // discarded without completions
		case attr.State == hostverbs.QPStateErr && q.attr.State != hostverbs.QPStateErr:
			q.flushLocked()
		}
		q.attr.State = attr.State
	}
	if mask&hostverbs.AttrAV != 0 {
		q.attr.AV = attr.AV
	}
	if mask&hostverbs.AttrDestQPN != 0 {
		q.attr.DestQPN = attr.DestQPN
	}
	if mask&hostverbs.AttrQKey != 0 {
		q.attr.QKey = attr.QKey
	}
	q.mods = append(q.mods, mask)
	return nil
}

func (q *fakeQP) Query() (hostverbs.QPAttr, error) {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	return q.attr, nil
}

func (q *fakeQP) PostSend(wr *hostverbs.SendWR) error {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	if q.f.autoComplete {
		q.wc = hostverbs.WorkCompletion{WRID: wr.WRID, Opcode: hostverbs.WCSend, QPN: q.qpn, QPContext: q.init.Context}
		for _, s := range wr.SGL {
			q.wc.ByteLen += s.Length
		}
		q.init.SendCQ.(*fakeCQ).attr.Handler.Complete(&q.wc)
		return nil
	}
	if err := q.f.check("PostSend"); err != nil {
		return err
	}
	q.frozen = false
	if q.f.queueCap > 0 && len(q.sends) >= q.f.queueCap {
		return hostverbs.ErrQueueFull
	}
	c := *wr
	c.SGL = append([]hostverbs.SGE(nil), wr.SGL...) // the device reuses its buffers
	q.sends = append(q.sends, c)
	q.outSends = append(q.outSends, wr.WRID)
	return nil
}

func (q *fakeQP) PostRecv(wr *hostverbs.RecvWR) error {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	if q.f.autoComplete {
		q.wc = hostverbs.WorkCompletion{WRID: wr.WRID, Opcode: hostverbs.WCRecv, QPN: q.qpn, QPContext: q.init.Context}
		q.init.RecvCQ.(*fakeCQ).attr.Handler.Complete(&q.wc)
		return nil
	}
	if err := q.f.check("PostRecv"); err != nil {
		return err
	}
	q.frozen = false
	if q.f.queueCap > 0 && len(q.recvs) >= q.f.queueCap {
		return hostverbs.ErrQueueFull
	}
	c := *wr
	c.SGL = append([]hostverbs.SGE(nil), wr.SGL...)
	q.recvs = append(q.recvs, c)
	q.outRecvs = append(q.outRecvs, wr.WRID)
	return nil
}

// flushLocked completes every WR the QP holds with WR_FLUSH_ERR, sends
// first, as a provider does when the QP enters ERR (f.mu held).
func (q *fakeQP) flushLocked() {
	sends, recvs := q.outSends, q.outRecvs
	q.outSends, q.outRecvs = nil, nil
	for _, id := range sends {
		q.complete(false, hostverbs.WorkCompletion{WRID: id, Status: hostverbs.WCWRFlushErr})
	}
	for _, id := range recvs {
		q.complete(true, hostverbs.WorkCompletion{WRID: id, Status: hostverbs.WCWRFlushErr})
	}
}

// finish completes the QP's oldest outstanding send (or receive) with wc
// after retiring skip older ones silently, as a provider completes
// unsignaled sends, and returns the WRID it completed.
func (q *fakeQP) finish(t testing.TB, recv bool, skip int, wc hostverbs.WorkCompletion) uint64 {
	t.Helper()
	q.f.mu.Lock()
	out := &q.outSends
	if recv {
		out = &q.outRecvs
	}
	if len(*out) <= skip {
		q.f.mu.Unlock()
		t.Fatalf("QP %#x holds %d WRs (recv %v), cannot complete number %d", q.qpn, len(*out), recv, skip+1)
	}
	wc.WRID = (*out)[skip]
	*out = (*out)[skip+1:]
	q.f.mu.Unlock()
	q.complete(recv, wc)
	return wc.WRID
}

// retire drops the QP's n oldest outstanding sends without a completion,
// as a provider retires unsignaled sends that succeeded.
func (q *fakeQP) retire(n int) {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	q.outSends = q.outSends[n:]
}

// outstanding returns how many sends (or receives) the QP holds.
func (q *fakeQP) outstanding(recv bool) int {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	if recv {
		return len(q.outRecvs)
	}
	return len(q.outSends)
}

func (q *fakeQP) Destroy() error {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	q.dead = true
	q.f.live["qp"]--
	return nil
}

// take returns and forgets the WRs posted so far.
func (q *fakeQP) take() ([]hostverbs.SendWR, []hostverbs.RecvWR) {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	s, r := q.sends, q.recvs
	q.sends, q.recvs = nil, nil
	return s, r
}

// complete pushes a completion for this QP to its CQ's handler, as a
// provider goroutine would.
func (q *fakeQP) complete(recv bool, wc hostverbs.WorkCompletion) {
	wc.QPN, wc.QPContext = q.qpn, q.init.Context
	cq := q.init.SendCQ.(*fakeCQ)
	if recv {
		cq = q.init.RecvCQ.(*fakeCQ)
	}
	cq.attr.Handler.Complete(&wc)
}

// The fake's transport state: "FAKETS", the QPN (u32), the QP state (u8)
// and xport (u64).
const fakeTSLen = 6 + 4 + 1 + 8

// SendsDrained reports whether the fake holds no send.
func (q *fakeQP) SendsDrained() bool {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	return len(q.outSends) == 0
}

// SaveTransport saves xport of an RC QP that holds no send and freezes it.
func (q *fakeQP) SaveTransport() ([]byte, error) {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	switch err := q.f.check("SaveTransport"); {
	case err != nil:
		return nil, err
	case q.f.noTransport || q.init.Type != hostverbs.QPTypeRC:
		return nil, fmt.Errorf("fake save transport: %w", hostverbs.ErrNotSupported)
	case len(q.outSends) > 0:
		return nil, fmt.Errorf("fake save transport: %d sends: %w", len(q.outSends), hostverbs.ErrBusy)
	}
	q.frozen = true
	b := append([]byte("FAKETS"), 0, 0, 0, 0, byte(q.attr.State), 0, 0, 0, 0, 0, 0, 0, 0)
	binary.LittleEndian.PutUint32(b[6:], q.qpn)
	binary.LittleEndian.PutUint64(b[11:], q.xport)
	return b, nil
}

// ResumeTransport unfreezes the QP.
func (q *fakeQP) ResumeTransport() {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	q.frozen = false
}

// RestoreTransport checks a state as untrusted and sets xport.
func (q *fakeQP) RestoreTransport(b []byte) error {
	q.f.mu.Lock()
	defer q.f.mu.Unlock()
	switch err := q.f.check("RestoreTransport"); {
	case err != nil:
		return err
	case q.f.noTransport:
		return fmt.Errorf("fake restore transport: %w", hostverbs.ErrNotSupported)
	case len(b) != fakeTSLen || string(b[:6]) != "FAKETS":
		return fmt.Errorf("fake restore transport: %d bytes: %w", len(b), hostverbs.ErrInvalid)
	case binary.LittleEndian.Uint32(b[6:]) != q.qpn || hostverbs.QPState(b[10]) != q.attr.State:
		return fmt.Errorf("fake restore transport: another QP's: %w", hostverbs.ErrInvalid)
	case len(q.outSends) > 0:
		return fmt.Errorf("fake restore transport: %w", hostverbs.ErrBusy)
	}
	q.xport = binary.LittleEndian.Uint64(b[11:])
	return nil
}

// fakeSRQ holds every receive posted to it (recvs, oldest first) until a
// test takes some (takeRecvs); frozen is set between SaveRecvs and
// ResumeRecvs (or a post or modify).
type fakeSRQ struct {
	f      *fakeVerbs
	attr   hostverbs.SRQAttr
	recvs  []hostverbs.RecvWR
	frozen bool
}

func (s *fakeSRQ) PostRecv(wr *hostverbs.RecvWR) error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	if err := s.f.check("SRQPostRecv"); err != nil {
		return err
	}
	s.frozen = false
	if s.f.queueCap > 0 && len(s.recvs) >= s.f.queueCap {
		return hostverbs.ErrQueueFull
	}
	c := *wr
	c.SGL = append([]hostverbs.SGE(nil), wr.SGL...)
	s.recvs = append(s.recvs, c)
	return nil
}

// SaveRecvs returns the receives the fake holds and freezes it (noTransport:
// it cannot).
func (s *fakeSRQ) SaveRecvs() ([]hostverbs.RecvWR, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	switch err := s.f.check("SaveRecvs"); {
	case err != nil:
		return nil, err
	case s.f.noTransport:
		return nil, fmt.Errorf("fake save recvs: %w", hostverbs.ErrNotSupported)
	}
	s.frozen = true
	out := make([]hostverbs.RecvWR, len(s.recvs))
	for i, r := range s.recvs {
		out[i] = hostverbs.RecvWR{WRID: r.WRID, SGL: append([]hostverbs.SGE(nil), r.SGL...)}
	}
	return out, nil
}

// ResumeRecvs unfreezes the fake.
func (s *fakeSRQ) ResumeRecvs() {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	s.frozen = false
}

// takeRecvs removes the n oldest receives, as QPs take them, and returns
// their WRIDs.
func (s *fakeSRQ) takeRecvs(n int) []uint64 {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	ids := recvIDs(s.recvs[:n])
	s.recvs = s.recvs[n:]
	return ids
}

func (s *fakeSRQ) Modify(attr hostverbs.SRQAttr, mask hostverbs.SRQAttrMask) error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	s.frozen = false
	if mask&hostverbs.SRQAttrLimit != 0 {
		s.attr.Limit = attr.Limit
	}
	return nil
}

func (s *fakeSRQ) Query() (hostverbs.SRQAttr, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	return s.attr, nil
}

func (s *fakeSRQ) Destroy() error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	s.f.live["srq"]--
	return nil
}
