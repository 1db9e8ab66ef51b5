package roce

import "encoding/binary"

// AtomicETH is the Atomic Extended Transport Header (IBA 9.3.4, figure
// 105), 28 bytes, on CMP_SWAP and FETCH_ADD requests:
//
//	 0                   1                   2                   3
//	 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                      Virtual Address (64)                     |
//	+                                                               +
//	|                                                               |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                            R_Key                              |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                  Swap (or Add) Data (64)                      |
//	+                                                               +
//	|                                                               |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                      Compare Data (64)                        |
//	+                                                               +
//	|                                                               |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
type AtomicETH []byte

// AtomicETHSize is the AtomicETH length.
const AtomicETHSize = 28

const (
	atomVA      = 0
	atomRKey    = 8
	atomSwapAdd = 12
	atomCompare = 20
)

// VA returns the remote virtual address (8-byte aligned when valid).
func (a AtomicETH) VA() uint64 { return binary.BigEndian.Uint64(a[atomVA:]) }

// RKey returns the remote key.
func (a AtomicETH) RKey() uint32 { return binary.BigEndian.Uint32(a[atomRKey:]) }

// SwapAdd returns the swap value (CMP_SWAP) or the addend (FETCH_ADD).
func (a AtomicETH) SwapAdd() uint64 { return binary.BigEndian.Uint64(a[atomSwapAdd:]) }

// Compare returns the compare value (CMP_SWAP).
func (a AtomicETH) Compare() uint64 { return binary.BigEndian.Uint64(a[atomCompare:]) }

// Encode writes the fields.
func (a AtomicETH) Encode(va uint64, rkey uint32, swapAdd, compare uint64) {
	binary.BigEndian.PutUint64(a[atomVA:], va)
	binary.BigEndian.PutUint32(a[atomRKey:], rkey)
	binary.BigEndian.PutUint64(a[atomSwapAdd:], swapAdd)
	binary.BigEndian.PutUint64(a[atomCompare:], compare)
}

// AtomicAckETH is the Atomic Acknowledge Extended Transport Header (IBA
// 9.3.6, figure 107), 8 bytes: the value the target held before the
// operation.
type AtomicAckETH []byte

// AtomicAckETHSize is the AtomicAckETH length.
const AtomicAckETHSize = 8

// OrigData returns the original remote data.
func (a AtomicAckETH) OrigData() uint64 { return binary.BigEndian.Uint64(a) }

// Encode writes the original remote data.
func (a AtomicAckETH) Encode(orig uint64) { binary.BigEndian.PutUint64(a, orig) }
