package vdev

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// TestSoftUDRecvSLIsRoCEPacketType: a user QP's UD receive CQE carries in
// its sl what the packet came as, RoCE v2 over IPv4 (0xa) or over IPv6
// (0x9), as RoCE hardware reports it to user space. UCX's UD transport
// relies on it: it takes sl&7 == 2 to mean that the destination address
// is the last 4 bytes of the receive buffer's 40-byte GRH area (the IPv4
// header's), and otherwise reads the GRH's 16-byte DGID there, and drops
// the datagram unless that is one of the port's GIDs. With sl 0 it read
// an IPv4 header as a GID and dropped every datagram, so that its
// perftest over ud_verbs stalled with nothing counted anywhere. The test
// checks the sl and, as UCX does, that the address it designates is the
// receiver's.
func TestSoftUDRecvSLIsRoCEPacketType(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ga, gb   hostverbs.GID
		sl       uint8
		dst      func(grh []byte) []byte // where UCX reads the destination for this sl
		dstOfGID func(g hostverbs.GID) []byte
	}{
		{"ipv4", hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 15: 5}, hostverbs.GID{10: 0xff, 11: 0xff, 12: 10, 13: 77, 15: 6}, 0xa,
			func(grh []byte) []byte { return grh[36:40] }, func(g hostverbs.GID) []byte { return g[12:] }},
		{"ipv6", hostverbs.GID{0: 0xfd, 15: 5}, hostverbs.GID{0: 0xfd, 15: 6}, 0x9,
			func(grh []byte) []byte { return grh[24:40] }, func(g hostverbs.GID) []byte { return g[:] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newSoftFabric(t)
			a, b := newSoftSide(t, f, "ud-a", tc.ga), newSoftSide(t, f, "ud-b", tc.gb)
			qa := a.g.createQP(qpSpec{pd: a.pd, scq: a.scq, rcq: a.rcq, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
			qb := b.g.createQP(qpSpec{pd: b.pd, scq: b.scq, rcq: b.rcq, typ: hostverbs.QPTypeUD, sendWR: 4, recvWR: 4, sendSGE: 1, recvSGE: 1, uar: 1})
			qa.udToRTS(0x1ee7a330)
			qb.udToRTS(0x1ee7a330)
			qb.postRecv(7, b.sge(0, 40+64))
			a.mr.write(a.g, 0, randBytes(64, 1))
			h := wqe(hostverbs.WRSend, 8, hostverbs.SendSignaled)
			abi.WRUD{RemoteQPN: qb.qpn, RemoteQKey: 0x1ee7a330, AV: abi.AV{PortPD: 1<<24 | a.pd, DGID: tc.gb, HopLimit: 64}}.Encode(h.WR[:])
			qa.postSend(h, a.sge(0, 64))
			r := waitCQE(t, b.rcq)
			require.EqualValues(t, hostverbs.WCSuccess, r.Status)
			assert.EqualValues(t, 40+64, r.ByteLen)
			assert.EqualValues(t, 1, r.WCFlags, "IBV_WC_GRH alone")
			assert.EqualValues(t, tc.sl, r.SL, "sl: RoCE v2 (0x8) and the L3 header")
			grh := b.mr.read(b.g, 0, 40)
			assert.Equal(t, tc.dstOfGID(tc.gb), tc.dst(grh), "the destination where the sl says it is")
			assert.EqualValues(t, hostverbs.WCSuccess, waitCQE(t, a.scq).Status)
		})
	}
}
