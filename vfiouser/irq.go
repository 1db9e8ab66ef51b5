package vfiouser

import (
	"fmt"
	"math/bits"
)

// DEVICE_GET_IRQ_INFO and DEVICE_SET_IRQS (vfio-user spec; semantics of
// VFIO's struct vfio_irq_set).

func (c *conn) handleGetIRQInfo(m *ownedMsg) (int, error) {
	in := DecodeIRQInfo(m.body)
	if in.Argsz < IRQInfoSize {
		return 0, fmt.Errorf("DEVICE_GET_IRQ_INFO argsz %d: %w", in.Argsz, ErrInvalid)
	}
	if uint64(in.Index) >= uint64(len(c.desc.IRQs)) {
		return 0, fmt.Errorf("DEVICE_GET_IRQ_INFO index %d of %d: %w", in.Index, len(c.desc.IRQs), ErrInvalid)
	}
	d := c.desc.IRQs[in.Index]
	p := c.payload(IRQInfoSize)
	IRQInfo{Argsz: IRQInfoSize, Flags: d.Flags | IRQInfoEventfd, Index: in.Index, Count: d.Count}.Encode(p)
	return IRQInfoSize, nil
}

// handleSetIRQs validates every field before acting, so a refused message
// changes nothing (its descriptors are closed by the caller):
//   - exactly one data type and one action, no other flag bits;
//   - index known, [start, start+count) inside the index's vectors;
//   - count 0 only as "disable all" (DATA_NONE|ACTION_TRIGGER, start 0);
//   - DATA_BOOL carries count bytes, the others no data;
//   - descriptors only with DATA_EVENTFD, and then none (de-assign, which
//     QEMU uses for "MSI-X on, no vector yet") or exactly count eventfds;
//   - MASK/UNMASK only on maskable indexes; ERR and REQ only TRIGGER.
func (c *conn) handleSetIRQs(m *ownedMsg) (int, error) {
	s := DecodeIRQSet(m.body)
	data := m.body[IRQSetSize:]
	dtype := s.Flags & IRQSetDataTypes
	action := s.Flags & IRQSetActionTypes
	fail := func(why string) (int, error) {
		return 0, fmt.Errorf("DEVICE_SET_IRQS index %d start %d count %d flags %#x (%d fds): %s: %w",
			s.Index, s.Start, s.Count, s.Flags, len(m.fds), why, ErrInvalid)
	}
	switch {
	case s.Argsz < IRQSetSize:
		return fail("argsz too small")
	case s.Flags&^(IRQSetDataTypes|IRQSetActionTypes) != 0:
		return fail("unknown flags")
	case bits.OnesCount32(dtype) != 1 || bits.OnesCount32(action) != 1:
		return fail("need one data type and one action")
	case uint64(s.Index) >= uint64(len(c.desc.IRQs)):
		return fail("no such interrupt index")
	}
	index := IRQIndex(s.Index)
	desc := c.desc.IRQs[s.Index]
	if s.Count == 0 {
		if s.Start != 0 || dtype != IRQSetDataNone || action != IRQSetActionTrigger || len(data) != 0 || len(m.fds) != 0 {
			return fail("count 0 is only 'disable all'")
		}
		c.irqs.deassign(index, 0, desc.Count)
		c.keepIRQs(index, 0, desc.Count, false)
		c.keepSaved()
		c.notifyIRQ(index, 0, desc.Count, IRQDeassigned)
		return 0, nil
	}
	if end := uint64(s.Start) + uint64(s.Count); end > uint64(desc.Count) {
		return fail("vectors out of range")
	}
	switch dtype {
	case IRQSetDataBool:
		if uint64(len(data)) != uint64(s.Count) {
			return fail("bool data does not match count")
		}
	default:
		if len(data) != 0 {
			return fail("unexpected data")
		}
	}
	if len(m.fds) != 0 && (dtype != IRQSetDataEventfd || uint64(len(m.fds)) != uint64(s.Count)) {
		return fail("descriptors do not match")
	}
	if (index == IRQErr || index == IRQReq) && action != IRQSetActionTrigger {
		return fail("ERR and REQ only trigger")
	}
	var bools []byte
	if dtype == IRQSetDataBool {
		bools = data
	}
	switch action {
	case IRQSetActionMask, IRQSetActionUnmask:
		if desc.Flags&IRQInfoMaskable == 0 {
			return fail("index is not maskable")
		}
		if dtype == IRQSetDataEventfd {
			return fail("mask notification eventfds are not supported")
		}
		masked := action == IRQSetActionMask
		err := c.irqs.setMasked(index, s.Start, s.Count, bools, masked)
		ev := IRQUnmasked
		if masked {
			ev = IRQMasked
		}
		c.keepSaved()
		c.notifyIRQ(index, s.Start, s.Count, ev)
		return 0, err
	}
	// ACTION_TRIGGER
	switch dtype {
	case IRQSetDataEventfd:
		if len(m.fds) == 0 {
			c.irqs.deassign(index, s.Start, s.Count)
			c.keepIRQs(index, s.Start, s.Count, false)
			c.keepSaved()
			c.notifyIRQ(index, s.Start, s.Count, IRQDeassigned)
			return 0, nil
		}
		for _, fd := range m.fds {
			if err := checkEventFD(fd); err != nil {
				return 0, fmt.Errorf("DEVICE_SET_IRQS %v: %w", index, err)
			}
		}
		c.irqs.assign(index, s.Start, m.fds)
		for i := range m.fds {
			m.fds[i] = -1 // the table owns them
		}
		if c.trace {
			c.log.Debug("interrupts assigned", "index", index, "start", s.Start, "count", s.Count)
		}
		c.keepIRQs(index, s.Start, uint32(len(m.fds)), true)
		c.keepSaved()
		c.notifyIRQ(index, s.Start, s.Count, IRQAssigned)
		return 0, nil
	default:
		return 0, c.irqs.clientTrigger(index, s.Start, s.Count, bools)
	}
}

func (c *conn) notifyIRQ(index IRQIndex, start, count uint32, ev IRQEvent) {
	if n, ok := c.dev.(IRQNotifier); ok {
		n.IRQChanged(index, start, count, ev)
	}
}
