package soft

import "sync/atomic"

// qpMap maps a device's QPNs to its QPs. Every received packet looks a QP
// up without a lock; QPs are created and destroyed under the device's
// lock, and each write copies one of qpShards maps, so that creating n
// QPs costs O(n^2/qpShards) copying instead of O(n^2) (one copied map made
// the 4096th QP take twice as long as the first).
type qpMap struct {
	shards [qpShards]atomic.Pointer[map[uint32]*qp]
}

const qpShards = 256

func (m *qpMap) shard(qpn uint32) *atomic.Pointer[map[uint32]*qp] {
	return &m.shards[qpn%qpShards]
}

// load returns the QP numbered qpn, or nil.
func (m *qpMap) load(qpn uint32) *qp {
	if p := m.shard(qpn).Load(); p != nil {
		return (*p)[qpn]
	}
	return nil
}

// store maps qpn to q; writers are serialized by the caller.
func (m *qpMap) store(qpn uint32, q *qp) {
	s := m.shard(qpn)
	var old map[uint32]*qp
	if p := s.Load(); p != nil {
		old = *p
	}
	next := make(map[uint32]*qp, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[qpn] = q
	s.Store(&next)
}

// deleteIf unmaps qpn if it maps to q; writers are serialized by the
// caller.
func (m *qpMap) deleteIf(qpn uint32, q *qp) {
	s := m.shard(qpn)
	p := s.Load()
	if p == nil || (*p)[qpn] != q {
		return
	}
	next := make(map[uint32]*qp, len(*p))
	for k, v := range *p {
		if k != qpn {
			next[k] = v
		}
	}
	s.Store(&next)
}

// clear unmaps every QP.
func (m *qpMap) clear() {
	for i := range m.shards {
		m.shards[i].Store(nil)
	}
}
