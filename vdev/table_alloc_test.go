package vdev

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTableLowestFree: the table hands out the lowest free handle, as a
// scan of every slot would, through random allocations, frees and sets.
func TestTableLowestFree(t *testing.T) {
	tb := newTable[*int](1, 300)
	live := map[uint32]bool{}
	lowest := func() (uint32, bool) {
		for h := uint32(1); h < 300; h++ {
			if !live[h] {
				return h, true
			}
		}
		return 0, false
	}
	r := rand.New(rand.NewPCG(1, 2))
	v := new(int)
	for range 20000 {
		switch op := r.IntN(10); {
		case op < 5:
			want, ok := lowest()
			h, got := tb.alloc(v)
			require.Equal(t, ok, got)
			if ok {
				require.Equal(t, want, h)
				live[h] = true
			}
		case op < 9:
			h := uint32(r.IntN(310))
			tb.free(h)
			delete(live, h)
		default:
			h := uint32(r.IntN(310))
			ok := tb.set(h, v)
			require.Equal(t, h >= 1 && h < 300 && !live[h], ok, "set %d", h)
			if ok {
				live[h] = true
			}
		}
		require.Equal(t, len(live), tb.len())
	}
}
