package ringbuf

// Empty reports whether the guest has consumed everything produced: its
// cons_head (loaded once) equals prod_tail. An invalid cons_head is an
// ErrIndex.
func (p *Producer) Empty() (bool, error) {
	h, err := p.head.load(p.mem, p.geo)
	if err != nil {
		return false, err
	}
	return h == p.tail.val, nil
}

// HeadIndex loads the guest's cons_head once; an invalid one is an
// ErrIndex. With TailIndex it tells how far the guest has consumed.
func (p *Producer) HeadIndex() (uint32, error) { return p.head.load(p.mem, p.geo) }
