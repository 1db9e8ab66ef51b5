package soft

import (
	"fmt"
	"math"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Congestion control is DCQCN (Zhu et al., "Congestion Control for
// Large-Scale RDMA Deployments", SIGCOMM 2015), as RoCE NICs run it:
//
//   - Every RoCE v2 packet leaves ECN-capable (ECT(0)); a switch on the
//     path marks it Congestion Experienced (CE) when its queue builds.
//   - The notification point (the receiving QP) answers CE-marked packets
//     with a CNP (BTH opcode 0x81) to the QP that sent them, at most one
//     per QP per CNPInterval.
//   - The reaction point (the sending QP) keeps a current rate Rc, a
//     target rate Rt and alpha, the estimate of how congested the path
//     is. A CNP cuts the rate: Rt = Rc, Rc = Rc * (1 - alpha/2), alpha
//     grows towards 1. Without CNPs alpha decays every AlphaPeriod, and
//     every RateIncreasePeriod (timer) and every ByteCounter bytes sent
//     (byte counter) the rate rises: fast recovery (Rc halfway to Rt) for
//     the first FastRecoverySteps events of both, then additive increase
//     (Rt += AIRate) once one of them passed it, hyper increase (Rt +=
//     i * HAIRate) once both did. The requester paces its packets to Rc.
//
// Timers are evaluated lazily, when the QP sends or a CNP arrives, so an
// idle QP costs nothing; a QP that has never received a CNP is not paced
// at all, one that has is paced at Rc (up to the line rate) for good.
//
// A CNP carries nothing but addresses and the destination QPN, so whoever
// can send from a QP's peer's address can forge one. Two rules keep a
// flood of them from slowing a QP more than real congestion would:
//
//   - The reaction point cuts at most once per RateReductionPeriod (as
//     NICs do: mlx5's rate_reduce_monitor_period); a CNP within the period
//     after a cut is counted (rx_cnp_coalesced) and changes nothing. The
//     period is the notification point's CNPInterval: real congestion
//     asks for at most one cut per CNPInterval, and loses one only when
//     jitter brings two CNPs closer together than they left (5-15% of
//     the incast test's CNPs are coalesced).
//   - A CNP answers ECN-capable packets: one for a QP that has none of
//     them unacknowledged and sent none to that peer within CNPWindow (an
//     idle QP, one that never sent, or one whose traffic stays in
//     process) is dropped (rx_cnp_unsolicited).

// CongestionConfig parameterises DCQCN. Zero fields take the defaults of
// DefaultCongestion.
type CongestionConfig struct {
	// Disabled turns congestion control off: packets leave Not-ECT, CE
	// marks are not answered and CNPs are ignored.
	Disabled bool
	// LineRate is the rate of a QP that has seen no congestion, and the
	// cap of every rate, in bits per second.
	LineRate float64
	// MinRate is the lowest rate a cut goes to, in bits per second.
	MinRate float64
	// CNPInterval is the least time between two CNPs one QP sends.
	CNPInterval time.Duration
	// RateReductionPeriod is the least time between two rate cuts of one
	// QP, the reaction point's rate reduction period: CNPs that arrive
	// within it after a cut are counted (rx_cnp_coalesced) and otherwise
	// ignored, so a flood of forged CNPs cuts no more often than real
	// congestion does. Zero means CNPInterval, the default: a notification
	// point sends a QP at most one CNP per CNPInterval, so the harshest
	// real congestion asks for one cut per CNPInterval, and a flood gets
	// no more; a shorter period would let a flood cut faster than any
	// notification point asks, a longer one would drop more real CNPs
	// (already, CNPs that jitter brings closer together than they left
	// are coalesced).
	RateReductionPeriod time.Duration
	// CNPWindow is how long after a QP's last ECN-capable packet to its
	// peer (request, ACK or READ response) a CNP for the QP is still
	// taken as an answer to its traffic, once none of its requests is
	// unacknowledged (while some are, they may sit in a congested queue,
	// and CNPs are taken whatever the window). A CNP for a QP that sent
	// nothing ECN-capable within the window (idle, never sent, or only in
	// process, where nothing is ECN-capable) is unsolicited: dropped and
	// counted (rx_cnp_unsolicited). The default, 20 ms, bounds a round
	// trip through congested queues rather than a few RTTs of an idle
	// path: a CNP comes back a round trip after the marked packet left,
	// and a congested queue holds a packet for milliseconds (the incast
	// test's 512 KiB into 400 Mb/s, 10.5 ms), while a paced QP sends a
	// burst and then waits (at 100 Mb/s, 16 KiB every 1.3 ms). A QP that
	// keeps sending keeps the stamp fresh whatever the window.
	CNPWindow time.Duration
	// AlphaG is the gain g of alpha's moving average.
	AlphaG float64
	// AlphaPeriod is how often alpha decays without CNPs.
	AlphaPeriod time.Duration
	// RateIncreasePeriod is the rate increase timer.
	RateIncreasePeriod time.Duration
	// ByteCounter is the rate increase byte counter, in bytes.
	ByteCounter uint64
	// FastRecoverySteps is F: the timer and byte counter events of fast
	// recovery.
	FastRecoverySteps int
	// AIRate and HAIRate are the additive and hyper increase steps, in
	// bits per second.
	AIRate, HAIRate float64
}

// DefaultCongestion is DCQCN's parameter set: the paper's g (1/256),
// alpha timer (55 us), CNP interval (50 us), byte counter (10 MB) and F (5);
// the rate timer, increase steps and minimum rate of NVIDIA's published
// adapter defaults (rpg_time_reset 300 us, rpg_ai_rate 5 Mb/s,
// rpg_hai_rate 50 Mb/s, rpg_min_rate 1 Mb/s); a 25 Gb/s line rate; a rate
// reduction period of one CNP interval and a 20 ms CNP window (see their
// fields).
func DefaultCongestion() CongestionConfig {
	return CongestionConfig{
		LineRate:            25e9,
		MinRate:             1e6,
		CNPInterval:         50 * time.Microsecond,
		RateReductionPeriod: 50 * time.Microsecond,
		CNPWindow:           20 * time.Millisecond,
		AlphaG:              1.0 / 256,
		AlphaPeriod:         55 * time.Microsecond,
		RateIncreasePeriod:  300 * time.Microsecond,
		ByteCounter:         10 << 20,
		FastRecoverySteps:   5,
		AIRate:              5e6,
		HAIRate:             50e6,
	}
}

// withDefaults fills zero fields and checks the result.
func (c CongestionConfig) withDefaults() (CongestionConfig, error) {
	d := DefaultCongestion()
	orDefault(&c.LineRate, d.LineRate)
	orDefault(&c.MinRate, d.MinRate)
	orDefault(&c.CNPInterval, d.CNPInterval)
	orDefault(&c.RateReductionPeriod, c.CNPInterval)
	orDefault(&c.CNPWindow, d.CNPWindow)
	orDefault(&c.AlphaG, d.AlphaG)
	orDefault(&c.AlphaPeriod, d.AlphaPeriod)
	orDefault(&c.RateIncreasePeriod, d.RateIncreasePeriod)
	orDefault(&c.ByteCounter, d.ByteCounter)
	orDefault(&c.FastRecoverySteps, d.FastRecoverySteps)
	orDefault(&c.AIRate, d.AIRate)
	orDefault(&c.HAIRate, d.HAIRate)
	switch {
	case c.LineRate < 1e6 || c.LineRate > 1e13 || c.MinRate <= 0 || c.MinRate > c.LineRate:
		return c, fmt.Errorf("congestion control: rates: line %g, min %g b/s: %w", c.LineRate, c.MinRate, hostverbs.ErrInvalid)
	case c.AlphaG <= 0 || c.AlphaG >= 1:
		return c, fmt.Errorf("congestion control: g %g: want 0 < g < 1: %w", c.AlphaG, hostverbs.ErrInvalid)
	case c.CNPInterval < 0 || c.RateReductionPeriod < 0 || c.CNPWindow < 0 ||
		c.AlphaPeriod < time.Microsecond || c.RateIncreasePeriod < time.Microsecond:
		return c, fmt.Errorf("congestion control: periods: %w", hostverbs.ErrInvalid)
	case c.FastRecoverySteps < 1 || c.AIRate < 0 || c.HAIRate < 0:
		return c, fmt.Errorf("congestion control: increase steps: %w", hostverbs.ErrInvalid)
	}
	return c, nil
}

// pktOverhead is what the pacer adds to a packet's payload: Ethernet,
// IPv4, UDP, BTH and ICRC.
const pktOverhead = 14 + 20 + 8 + 12 + 4

// orDefault sets *v to d if *v is the zero value.
func orDefault[T comparable](v *T, d T) {
	var zero T
	if *v == zero {
		*v = d
	}
}

// paceBurst is how far ahead of its rate a paced QP may send: a burst of
// this many bytes' worth of time goes at once, so that a low rate does not
// mean one timer per packet. At higher rates the burst is paceBurstTime's
// worth of the rate instead: Go's timers fire about a millisecond late
// when the process is idle, and a smaller burst would cap the rate at a
// burst per millisecond.
const (
	paceBurst     = 16 << 10
	paceBurstTime = 250 * time.Microsecond
)

// maxCatchUp bounds the timer events one lazy evaluation applies (a QP
// idle for long simply recovers to line rate).
const maxCatchUp = 4096

// rateState is one QP's DCQCN reaction point and pacer (sqMu held).
type rateState struct {
	limited bool    // a CNP has come: the QP is paced at rc (at most the line rate) from now on
	rc, rt  float64 // current and target rate, bits per second
	alpha   float64
	alphaAt time.Time // start of the current alpha period
	timerAt time.Time // start of the current rate increase period
	timerN  int       // rate increase timer events since the last cut
	bytesN  int       // byte counter events since the last cut
	bytes   uint64    // bytes sent since the last byte counter event
	cutAt   time.Time // the last rate cut
	next    time.Time // pacing: when the next packet may go
	cnps    uint64    // CNPs this QP's requester received (cut or not)
}

// rate returns the QP's current rate in bits per second.
func (s *rateState) rate(c *CongestionConfig) float64 {
	if !s.limited {
		return c.LineRate
	}
	return s.rc
}

// advance applies the alpha and rate-increase timer events due by now.
func (s *rateState) advance(c *CongestionConfig, now time.Time) {
	if !s.limited {
		return
	}
	if n := now.Sub(s.alphaAt) / c.AlphaPeriod; n > 0 {
		s.alpha *= math.Pow(1-c.AlphaG, float64(n))
		s.alphaAt = s.alphaAt.Add(n * c.AlphaPeriod)
	}
	n := now.Sub(s.timerAt) / c.RateIncreasePeriod
	if n <= 0 {
		return
	}
	s.timerAt = s.timerAt.Add(n * c.RateIncreasePeriod)
	for range min(int(n), maxCatchUp) {
		s.timerN++
		s.increase(c)
		if !s.limited {
			return
		}
	}
}

// increase is one rate increase event (timer or byte counter).
func (s *rateState) increase(c *CongestionConfig) {
	f := c.FastRecoverySteps
	switch {
	case max(s.timerN, s.bytesN) < f: // fast recovery
	case min(s.timerN, s.bytesN) >= f: // hyper increase
		s.rt += float64(min(s.timerN, s.bytesN)-f+1) * c.HAIRate
	default: // additive increase
		s.rt += c.AIRate
	}
	s.rt = min(s.rt, c.LineRate)
	s.rc = min((s.rt+s.rc)/2, c.LineRate)
	// Recovered to line rate, the QP stays paced at it: released, it
	// would send its whole window at once into the queue that just
	// drained.
}

// onCNP is the reaction to a CNP: the rate cut, at most one per
// RateReductionPeriod. It reports whether it cut: a CNP within the period
// after the last cut is only counted.
func (s *rateState) onCNP(c *CongestionConfig, now time.Time) bool {
	s.cnps++
	if s.limited && now.Sub(s.cutAt) < c.RateReductionPeriod {
		return false
	}
	s.advance(c, now)
	if !s.limited {
		s.limited = true
		s.rc, s.rt, s.alpha = c.LineRate, c.LineRate, 1
		s.next = time.Time{} // the burst allowance is there from the start
	}
	s.rt = s.rc
	s.rc = max(s.rc*(1-s.alpha/2), c.MinRate)
	s.alpha = (1-c.AlphaG)*s.alpha + c.AlphaG
	s.alphaAt, s.timerAt, s.cutAt = now, now, now
	s.timerN, s.bytesN, s.bytes = 0, 0, 0
	return true
}

// wait returns how long the QP must wait before its next packet (0: now).
func (s *rateState) wait(c *CongestionConfig, now time.Time) time.Duration {
	if !s.limited {
		return 0
	}
	s.advance(c, now)
	if !s.limited || !now.Before(s.next) {
		return 0
	}
	return s.next.Sub(now)
}

// sent accounts a packet of n bytes sent at now: the pacer's next slot and
// the byte counter.
func (s *rateState) sent(c *CongestionConfig, now time.Time, n int) {
	if !s.limited {
		return
	}
	burst := max(float64(paceBurst*8)/s.rc, paceBurstTime.Seconds())
	earliest := now.Add(-time.Duration(burst * 1e9))
	if s.next.Before(earliest) {
		s.next = earliest
	}
	s.next = s.next.Add(time.Duration(float64(n*8) / s.rc * 1e9))
	s.bytes += uint64(n)
	for s.bytes >= c.ByteCounter && s.limited {
		s.bytes -= c.ByteCounter
		s.bytesN++
		s.increase(c)
	}
}

// QPRate is the congestion state of one QP.
type QPRate struct {
	// Device is the device's (the VM's) name, QPN the QP.
	Device string
	QPN    uint32
	// Rate is the QP's current rate in bits per second (the line rate
	// when not limited); Target is DCQCN's target rate.
	Rate, Target float64
	// Alpha is the congestion estimate (0-1).
	Alpha float64
	// Limited: a CNP came, and the QP is paced at Rate from then on.
	Limited bool
	// CNPs is how many CNPs the QP received.
	CNPs uint64
}

// QPRates returns the congestion state of every QP of the fabric that has
// received a CNP.
func (f *Fabric) QPRates() []QPRate {
	f.mu.Lock()
	devs := make([]*device, 0, len(f.devices))
	for d := range f.devices {
		devs = append(devs, d)
	}
	f.mu.Unlock()
	var out []QPRate
	now := f.clock.Now()
	for _, d := range devs {
		d.mu.Lock()
		qps := make([]*qp, 0, len(d.all))
		for q := range d.all {
			qps = append(qps, q)
		}
		d.mu.Unlock()
		for _, q := range qps {
			q.sqMu.Lock()
			if q.cc.cnps > 0 {
				q.cc.advance(&f.cc, now)
				r := QPRate{Device: d.cfg.Name, QPN: q.qpn, Rate: q.cc.rate(&f.cc), Target: q.cc.rt,
					Alpha: q.cc.alpha, Limited: q.cc.limited, CNPs: q.cc.cnps}
				if !r.Limited {
					r.Target = f.cc.LineRate
				}
				out = append(out, r)
			}
			q.sqMu.Unlock()
		}
	}
	return out
}
