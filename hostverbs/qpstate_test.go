package hostverbs

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The masks the stock guest stack really sends (MODIFY_QP as seen from
// bookworm's ibv_rc_pingpong and the kernel's GSI QP) must all pass.
func TestCheckQPModifyAcceptsObservedSequences(t *testing.T) {
	for _, tc := range []struct {
		name      string
		typ       QPType
		cur, next QPState
		mask      AttrMask
	}{
		{"rc_pingpong reset->init", QPTypeRC, QPStateReset, QPStateInit, 0x39},
		{"rc_pingpong init->rtr", QPTypeRC, QPStateInit, QPStateRTR, 0x129181},
		{"rc_pingpong rtr->rts", QPTypeRC, QPStateRTR, QPStateRTS, 0x12e01},
		{"rdma-cm init->init access", QPTypeRC, QPStateInit, QPStateInit, AttrAccessFlags},
		{"rdma-cm rts->err", QPTypeRC, QPStateRTS, QPStateErr, 0x1},
		{"ud_pingpong reset->init", QPTypeUD, QPStateReset, QPStateInit, 0x71},
		{"ud_pingpong init->rtr", QPTypeUD, QPStateInit, QPStateRTR, 0x1},
		{"ud_pingpong rtr->rts", QPTypeUD, QPStateRTR, QPStateRTS, 0x10001},
		{"gsi reset->init", QPTypeGSI, QPStateReset, QPStateInit, 0x51},
		{"gsi init->rtr", QPTypeGSI, QPStateInit, QPStateRTR, 0x1},
		{"gsi rtr->rts", QPTypeGSI, QPStateRTR, QPStateRTS, 0x10001},
		{"any -> reset", QPTypeRC, QPStateSQD, QPStateReset, AttrState},
		{"reset -> err", QPTypeUD, QPStateReset, QPStateErr, AttrState},
		{"rts attrs without state", QPTypeRC, QPStateRTS, QPStateRTS, AttrMinRNRTimer | AttrAccessFlags},
		{"rts -> sqd notify", QPTypeRC, QPStateRTS, QPStateSQD, AttrState | AttrEnSQDAsyncNotify},
		{"sqd -> sqd path", QPTypeRC, QPStateSQD, QPStateSQD, AttrState | AttrTimeout | AttrAV},
		{"ud sqe -> rts", QPTypeUD, QPStateSQE, QPStateRTS, AttrState | AttrCurState},
		{"rts -> rts cur_state", QPTypeUD, QPStateRTS, QPStateRTS, AttrState | AttrCurState | AttrQKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.NoError(t, CheckQPModify(tc.typ, tc.cur, tc.mask, tc.next))
		})
	}
}

func TestCheckQPModifyRejects(t *testing.T) {
	for _, tc := range []struct {
		name      string
		typ       QPType
		cur, next QPState
		mask      AttrMask
		msg       string
	}{
		{"rc rtr without min_rnr_timer", QPTypeRC, QPStateInit, QPStateRTR, 0x129181 &^ AttrMinRNRTimer, "MIN_RNR_TIMER"},
		{"rc rtr without av", QPTypeRC, QPStateInit, QPStateRTR, 0x129181 &^ AttrAV, "AV"},
		{"rc rts without timeout", QPTypeRC, QPStateRTR, QPStateRTS, 0x12e01 &^ AttrTimeout, "TIMEOUT"},
		{"init -> rts skips rtr", QPTypeRC, QPStateInit, QPStateRTS, 0x12e01, "not a valid transition"},
		{"rtr -> rtr", QPTypeRC, QPStateRTR, QPStateRTR, AttrState, "not a valid transition"},
		{"attrs in rtr without state", QPTypeRC, QPStateRTR, QPStateRTR, AttrQKey, "not a valid transition"},
		{"ud init with access flags", QPTypeUD, QPStateReset, QPStateInit, 0x71 | AttrAccessFlags, "ACCESS_FLAGS"},
		{"gsi init with port", QPTypeGSI, QPStateReset, QPStateInit, 0x51 | AttrPort, "PORT"},
		{"cur_state from reset", QPTypeRC, QPStateReset, QPStateInit, 0x39 | AttrCurState, "CUR_STATE"},
		{"rc from sqe", QPTypeRC, QPStateSQE, QPStateRTS, AttrState, "not a valid transition"},
		{"rc qkey", QPTypeRC, QPStateRTS, QPStateRTS, AttrQKey, "QKEY"},
		{"undefined bit", QPTypeRC, QPStateRTS, QPStateRTS, 1 << 25, "undefined"},
		{"unknown type", QPType(9), QPStateReset, QPStateInit, AttrState, "unknown qp type"},
		{"bad state", QPTypeRC, QPState(7), QPStateErr, AttrState, "state"},
		{"bad target", QPTypeRC, QPStateRTS, QPState(200), AttrState, "target"},
		{"reset -> rtr", QPTypeUD, QPStateReset, QPStateRTR, AttrState, "not a valid transition"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckQPModify(tc.typ, tc.cur, tc.mask, tc.next)
			require.ErrorIs(t, err, ErrInvalid)
			assert.Contains(t, err.Error(), tc.msg)
		})
	}
}

// Every state can reach RESET and ERR; nothing else is reachable from ERR.
func TestQPTransitionsShape(t *testing.T) {
	for _, typ := range []QPType{QPTypeRC, QPTypeUC, QPTypeUD, QPTypeGSI, QPTypeSMI} {
		for cur := QPStateReset; cur <= QPStateErr; cur++ {
			_, _, ok := QPTransitionAttrs(typ, cur, QPStateReset)
			assert.True(t, ok, "%v %v->RESET", typ, cur)
			_, _, ok = QPTransitionAttrs(typ, cur, QPStateErr)
			assert.True(t, ok, "%v %v->ERR", typ, cur)
		}
		for next := QPStateInit; next < QPStateErr; next++ {
			_, _, ok := QPTransitionAttrs(typ, QPStateErr, next)
			assert.False(t, ok, "%v ERR->%v", typ, next)
		}
		req, opt, ok := QPTransitionAttrs(typ, QPStateReset, QPStateInit)
		assert.True(t, ok)
		assert.Zero(t, req&opt, "a bit is never both required and optional")
		assert.NotZero(t, req&AttrPKeyIndex, "%v needs a P_Key index", typ)
	}
	_, _, ok := QPTransitionAttrs(QPType(77), QPStateReset, QPStateInit)
	assert.False(t, ok)
}

func TestAttrMaskString(t *testing.T) {
	assert.Equal(t, "STATE|ACCESS_FLAGS|PKEY_INDEX|PORT", AttrMask(0x39).String())
	assert.Equal(t, "0", AttrMask(0).String())
	assert.Equal(t, "DEST_QPN|0x200000", (AttrDestQPN | 1<<21).String())
}
