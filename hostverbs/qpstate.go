package hostverbs

import (
	"fmt"
	"strings"
)

// The QP state machine (IBA 10.3.1, figure 137) and the attributes each
// Modify QP transition requires or allows (IBA 11.2.4.2, table 93; the same
// rules as the Linux IB core's ib_modify_qp_is_ok). Providers and the device
// model both validate against this one table.

// qpClass groups QP types whose masks agree: SMI and GSI share a column.
type qpClass uint8

const (
	classUD qpClass = iota
	classUC
	classRC
	classSpecial // SMI and GSI
	numClasses
)

func classOf(t QPType) (qpClass, bool) {
	switch t {
	case QPTypeUD:
		return classUD, true
	case QPTypeUC:
		return classUC, true
	case QPTypeRC:
		return classRC, true
	case QPTypeSMI, QPTypeGSI:
		return classSpecial, true
	}
	return 0, false
}

// transition is one (current, next) entry: whether it is allowed per class
// and which attributes it requires and allows besides AttrState.
type transition struct {
	valid [numClasses]bool
	req   [numClasses]AttrMask
	opt   [numClasses]AttrMask
}

const numStates = int(QPStateErr) + 1

// all marks a transition valid for every class.
var all = [numClasses]bool{true, true, true, true}

// qpTransitions is read-only data: [current][next].
var qpTransitions = func() (t [numStates][numStates]transition) {
	// Every state may go to RESET or ERR with no other attribute.
	for s := range numStates {
		t[s][QPStateReset].valid = all
		t[s][QPStateErr].valid = all
	}
	t[QPStateReset][QPStateInit] = transition{
		valid: all,
		req: [numClasses]AttrMask{
			classUD:      AttrPKeyIndex | AttrPort | AttrQKey,
			classUC:      AttrPKeyIndex | AttrPort | AttrAccessFlags,
			classRC:      AttrPKeyIndex | AttrPort | AttrAccessFlags,
			classSpecial: AttrPKeyIndex | AttrQKey,
		},
	}
	t[QPStateInit][QPStateInit] = transition{
		valid: all,
		opt: [numClasses]AttrMask{
			classUD:      AttrPKeyIndex | AttrPort | AttrQKey,
			classUC:      AttrPKeyIndex | AttrPort | AttrAccessFlags,
			classRC:      AttrPKeyIndex | AttrPort | AttrAccessFlags,
			classSpecial: AttrPKeyIndex | AttrQKey,
		},
	}
	t[QPStateInit][QPStateRTR] = transition{
		valid: all,
		req: [numClasses]AttrMask{
			classUC: AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN,
			classRC: AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN |
				AttrMaxDestRdAtomic | AttrMinRNRTimer,
		},
		opt: [numClasses]AttrMask{
			classUD:      AttrPKeyIndex | AttrQKey,
			classUC:      AttrAltPath | AttrAccessFlags | AttrPKeyIndex,
			classRC:      AttrAltPath | AttrAccessFlags | AttrPKeyIndex,
			classSpecial: AttrPKeyIndex | AttrQKey,
		},
	}
	t[QPStateRTR][QPStateRTS] = transition{
		valid: all,
		req: [numClasses]AttrMask{
			classUD:      AttrSQPSN,
			classUC:      AttrSQPSN,
			classRC:      AttrTimeout | AttrRetryCnt | AttrRNRRetry | AttrSQPSN | AttrMaxQPRdAtomic,
			classSpecial: AttrSQPSN,
		},
		opt: [numClasses]AttrMask{
			classUD:      AttrCurState | AttrQKey,
			classUC:      AttrCurState | AttrAltPath | AttrAccessFlags | AttrPathMigState,
			classRC:      AttrCurState | AttrAltPath | AttrAccessFlags | AttrMinRNRTimer | AttrPathMigState,
			classSpecial: AttrCurState | AttrQKey,
		},
	}
	rtsOpt := [numClasses]AttrMask{
		classUD:      AttrCurState | AttrQKey,
		classUC:      AttrCurState | AttrAccessFlags | AttrAltPath | AttrPathMigState,
		classRC:      AttrCurState | AttrAccessFlags | AttrAltPath | AttrPathMigState | AttrMinRNRTimer,
		classSpecial: AttrCurState | AttrQKey,
	}
	t[QPStateRTS][QPStateRTS] = transition{valid: all, opt: rtsOpt}
	t[QPStateRTS][QPStateSQD] = transition{
		valid: all,
		opt: [numClasses]AttrMask{
			classUD: AttrEnSQDAsyncNotify, classUC: AttrEnSQDAsyncNotify,
			classRC: AttrEnSQDAsyncNotify, classSpecial: AttrEnSQDAsyncNotify,
		},
	}
	t[QPStateSQD][QPStateRTS] = transition{valid: all, opt: rtsOpt}
	t[QPStateSQD][QPStateSQD] = transition{
		valid: all,
		opt: [numClasses]AttrMask{
			classUD: AttrPKeyIndex | AttrQKey,
			classUC: AttrAV | AttrAltPath | AttrAccessFlags | AttrPKeyIndex | AttrPathMigState,
			classRC: AttrPort | AttrAV | AttrTimeout | AttrRetryCnt | AttrRNRRetry |
				AttrMaxQPRdAtomic | AttrMaxDestRdAtomic | AttrAltPath | AttrAccessFlags |
				AttrPKeyIndex | AttrMinRNRTimer | AttrPathMigState,
			classSpecial: AttrPKeyIndex | AttrQKey,
		},
	}
	// SQE exists for UD, UC and the special QPs only: an RC send queue
	// error takes the QP to ERR (IBA 10.3.1.7).
	t[QPStateSQE][QPStateRTS] = transition{
		valid: [numClasses]bool{classUD: true, classUC: true, classSpecial: true},
		opt: [numClasses]AttrMask{
			classUD:      AttrCurState | AttrQKey,
			classUC:      AttrCurState | AttrAccessFlags,
			classSpecial: AttrCurState | AttrQKey,
		},
	}
	return t
}()

// CheckQPModify reports whether a Modify QP with mask is allowed on a QP of
// type t in state cur: the transition to the requested state (attr.State
// if mask has AttrState, else cur) must exist, every required attribute
// must be in mask and no attribute outside the required and optional sets
// may be. The error wraps ErrInvalid and names the offending bits.
func CheckQPModify(t QPType, cur QPState, mask AttrMask, next QPState) error {
	c, ok := classOf(t)
	if !ok {
		return fmt.Errorf("modify qp: unknown qp type %v: %w", t, ErrInvalid)
	}
	if int(cur) >= numStates {
		return fmt.Errorf("modify qp: current state %v: %w", cur, ErrInvalid)
	}
	if mask&AttrState == 0 {
		next = cur
	}
	if int(next) >= numStates {
		return fmt.Errorf("modify qp: target state %v: %w", next, ErrInvalid)
	}
	if mask&^AttrAll != 0 {
		return fmt.Errorf("modify qp: undefined mask bits %#x: %w", uint32(mask&^AttrAll), ErrInvalid)
	}
	tr := &qpTransitions[cur][next]
	if !tr.valid[c] {
		return fmt.Errorf("modify %v qp: %v -> %v is not a valid transition: %w", t, cur, next, ErrInvalid)
	}
	if missing := tr.req[c] &^ mask; missing != 0 {
		return fmt.Errorf("modify %v qp %v -> %v: missing required attributes %v: %w", t, cur, next, missing, ErrInvalid)
	}
	if extra := mask &^ (tr.req[c] | tr.opt[c] | AttrState); extra != 0 {
		return fmt.Errorf("modify %v qp %v -> %v: attributes %v not allowed: %w", t, cur, next, extra, ErrInvalid)
	}
	return nil
}

// QPTransitionAttrs returns the attributes a transition requires and the
// ones it allows, and whether the transition exists for type t.
func QPTransitionAttrs(t QPType, cur, next QPState) (required, optional AttrMask, valid bool) {
	c, ok := classOf(t)
	if !ok || int(cur) >= numStates || int(next) >= numStates {
		return 0, 0, false
	}
	tr := &qpTransitions[cur][next]
	return tr.req[c], tr.opt[c], tr.valid[c]
}

var attrMaskNames = [...]string{"STATE", "CUR_STATE", "EN_SQD_ASYNC_NOTIFY", "ACCESS_FLAGS",
	"PKEY_INDEX", "PORT", "QKEY", "AV", "PATH_MTU", "TIMEOUT", "RETRY_CNT", "RNR_RETRY",
	"RQ_PSN", "MAX_QP_RD_ATOMIC", "ALT_PATH", "MIN_RNR_TIMER", "SQ_PSN", "MAX_DEST_RD_ATOMIC",
	"PATH_MIG_STATE", "CAP", "DEST_QPN"}

// String lists the set bits by their IB core names, e.g. "STATE|QKEY".
func (m AttrMask) String() string {
	if m == 0 {
		return "0"
	}
	var b strings.Builder
	for i, name := range attrMaskNames {
		if m&(1<<i) != 0 {
			if b.Len() > 0 {
				b.WriteByte('|')
			}
			b.WriteString(name)
		}
	}
	if rest := m &^ AttrAll; rest != 0 {
		if b.Len() > 0 {
			b.WriteByte('|')
		}
		fmt.Fprintf(&b, "%#x", uint32(rest))
	}
	return b.String()
}
