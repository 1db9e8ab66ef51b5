package roce

import "encoding/binary"

// RETH is the RDMA Extended Transport Header (IBA 9.3.3, figure 104),
// 16 bytes, on RDMA WRITE FIRST/ONLY and RDMA READ requests:
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
//	|                          DMA Length                           |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
type RETH []byte

// RETHSize is the RETH length.
const RETHSize = 16

const (
	rethVA     = 0
	rethRKey   = 8
	rethDMALen = 12
)

// VA returns the remote virtual address.
func (r RETH) VA() uint64 { return binary.BigEndian.Uint64(r[rethVA:]) }

// RKey returns the remote key.
func (r RETH) RKey() uint32 { return binary.BigEndian.Uint32(r[rethRKey:]) }

// DMALength returns the length of the whole RDMA operation in bytes.
func (r RETH) DMALength() uint32 { return binary.BigEndian.Uint32(r[rethDMALen:]) }

// Encode writes the fields.
func (r RETH) Encode(va uint64, rkey, dmaLen uint32) {
	binary.BigEndian.PutUint64(r[rethVA:], va)
	binary.BigEndian.PutUint32(r[rethRKey:], rkey)
	binary.BigEndian.PutUint32(r[rethDMALen:], dmaLen)
}
