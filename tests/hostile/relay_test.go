package hostile

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// Environment of TestRelayPingPong, which runs inside a test-bed guest
// (tests/e2e TestRelayOverRxe boots it): our daemon relays a driven
// vmw_pvrdma device to kernel rxe, and a second guest runs stock
// ibv_rc_pingpong against it.
const (
	envRelayNetdev = "PVRDMA_RELAY_NETDEV" // the netdev to create the rxe link over
	envRelayGID    = "PVRDMA_RELAY_GID"    // the IPv4 address the driven VM binds as its GID
	envRelayIters  = "PVRDMA_RELAY_ITERS"
	// envRelayRdmacheck, if set, also serves hostverbs/soft's rdmacheck
	// (WRITE, READ and atomics both ways) on TCP 18520.
	envRelayRdmacheck = "PVRDMA_RELAY_RDMACHECK"
	// envRelayPerftest, if set, also serves perftest's ib_write_bw,
	// ib_read_bw and ib_atomic_bw (clients in the peer) on TCP 18531-18533.
	envRelayPerftest = "PVRDMA_RELAY_PERFTEST"
	// envRelaySocketDir, if set, is the socket directory of a running
	// `pvrdma-backend serve` to use instead of a daemon in this process.
	envRelaySocketDir = "PVRDMA_RELAY_SOCKET_DIR"
)

// TestRelayPingPong: the daemon, with --create-rxe, serves a VM whose driver
// (this test, playing vmw_pvrdma over vfio-user) binds a GID, creates an RC
// QP and plays ibv_rc_pingpong's server: the same TCP exchange, then
// receive and send 4 KiB messages in turn, each received byte checked. A
// stock ibv_rc_pingpong in another guest is the client. Afterwards the VM
// disconnects and the host device holds none of its objects.
func TestRelayPingPong(t *testing.T) {
	netdev, gidIP := os.Getenv(envRelayNetdev), os.Getenv(envRelayGID)
	if netdev == "" || gidIP == "" {
		t.Skipf("%s and %s are not set (the relay e2e test runs this in a guest with rxe)", envRelayNetdev, envRelayGID)
	}
	iters := 100
	if s := os.Getenv(envRelayIters); s != "" {
		_, err := fmt.Sscan(s, &iters)
		require.NoError(t, err)
	}
	const size = 4096
	var e *env
	if dir := os.Getenv(envRelaySocketDir); dir != "" {
		// `pvrdma-backend serve --transport ibverbs --create-rxe NETDEV` runs
		// beside this test and serves VM vmPeer in dir.
		e = externalEnv(t, dir)
	} else {
		e = newEnvConfig(t, vdev.Limits{}, testLogger(t), func(c *backend.Config) {
			c.Fabric = backend.FabricConfig{CreateRXE: netdev}
			c.GIDAllow = []netip.Prefix{netip.PrefixFrom(netip.MustParseAddr(gidIP), 32)} // the pool
		})
	}
	st := e.status()
	require.NotNil(t, st.Fabric.HostDevice)
	t.Logf("host device: %+v", *st.Fabric.HostDevice)
	require.True(t, st.Fabric.HostDevice.CreatedRXE)
	require.Equal(t, "ibverbs", st.Transport)

	gid := hostverbs.GIDFromAddr(netip.MustParseAddr(gidIP))
	p := &endpoint{v: e.boot(vmPeer), gid: gid}
	v := p.v
	v.bindGID(0, gid)
	// The daemon adds the GID to the netdev; the kernel then enters it in
	// the rxe device's GID table.
	wantGID := fmt.Sprintf("%s RoCE v2", gid)
	require.Eventually(t, func() bool {
		for _, g := range e.status().Fabric.HostDevice.GIDs {
			if strings.HasSuffix(g, wantGID) {
				return true
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond, "GID %s never reached the host device's table", gid)
	p.uc = v.createUC(1)
	p.pd = v.createPD(p.uc)
	p.scq, p.rcq = v.createCQ(p.uc, 64), v.createCQ(p.uc, 64)
	p.mr = v.regMR(p.pd, mrIOVA, mrBytes, accRW)
	p.qp = v.createQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeRC,
		sendWR: qpDepth, recvWR: qpDepth, sendSGE: 1, recvSGE: 1, uar: p.uc})
	const myPSN = 0x1234
	p.qp.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1})

	// Receives first (the client sends at once), then RTR and RTS within
	// ibv_rc_pingpong's exchange.
	for i := range 16 {
		p.qp.postRecv(uint64(1000+i), p.mr.sge(uint64(i%8)*size, size))
	}
	ppExchange(t, 18515, func(rqpn, rpsn uint32, rgid hostverbs.GID) {
		t.Logf("client: qpn %#x psn %#x gid %s", rqpn, rpsn, rgid)
		p.qp.mustModify(0x129181|hostverbs.AttrRQPSN, abi.QPAttr{State: 2, PathMTU: 3, DestQPNum: rqpn, RQPSN: rpsn,
			MaxDestRdAtomic: 1, MinRNRTimer: 12,
			AH: abi.AHAttr{DGID: rgid, SGIDIndex: 0, HopLimit: 1, Flags: abi.AHFlagGRH, PortNum: 1}})
		p.qp.mustModify(0x12e01, abi.QPAttr{State: 3, Timeout: 14, RetryCnt: 7, RNRRetry: 7, SQPSN: myPSN, MaxRdAtomic: 1})
	}, p.qp.qpn, myPSN, gid)

	// The client fills its buffer with 0x7b and sends it; it receives into
	// the same buffer, so every later message echoes our last one: each
	// round trip is checked byte for byte.
	want := make([]byte, size)
	for i := range want {
		want[i] = 0x7b
	}
	ours := pattern(size, 5)
	p.mr.write(v, 8*size, ours)
	posted := 16
	start := time.Now()
	for i := range iters {
		c := p.rcq.wait()
		require.Equal(t, uint32(0), c.Status, "receive %d: %+v", i, c)
		require.Equal(t, uint32(size), c.ByteLen)
		slot := (c.WRID - 1000) % 8
		if got := p.mr.read(v, slot*size, size); !bytes.Equal(got, want) {
			t.Fatalf("receive %d: bytes differ from the first at %d", i, firstDiff(got, want))
		}
		want = ours
		p.qp.postRecv(uint64(1000+posted), p.mr.sge(uint64(posted%8)*size, size))
		posted++
		p.qp.postSend(sendWQE(uint64(i)), p.mr.sge(8*size, size))
		s := p.scq.wait()
		require.Equal(t, uint32(0), s.Status, "send %d: %+v", i, s)
	}
	el := time.Since(start)
	t.Logf("RELAY_PINGPONG iters=%d size=%d time=%v usec/iter=%.1f", iters, size, el.Round(time.Millisecond),
		float64(el.Microseconds())/float64(iters))

	relayUDPingPong(t, p, iters)
	if os.Getenv(envRelayRdmacheck) != "" {
		relayRDMAOps(t, p)
	}
	if os.Getenv(envRelayPerftest) != "" {
		for i, tool := range []string{"ib_write_bw", "ib_read_bw", "ib_atomic_bw"} {
			relayPerftestServer(t, p, tool, 18531+i)
		}
	}

	// The VM goes away: the host device keeps none of its objects.
	require.Positive(t, relayObjects(t, "qp"))
	v.Close()
	if e.d != nil {
		e.idle()
	} else {
		require.Eventually(t, func() bool { return !e.connected(vmPeer) }, 10*time.Second, 10*time.Millisecond, "the daemon saw the VM go")
	}
	for _, kind := range []string{"qp", "cq", "mr", "pd"} {
		require.Zero(t, relayObjects(t, kind), "%s left on the host device after the VM disconnected", kind)
	}
}

// acceptOne accepts the peer's one TCP connection on port (within 3
// minutes: the peer retries until we listen).
func acceptOne(t *testing.T, port int) net.Conn {
	t.Helper()
	ln, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
	require.NoError(t, err)
	defer ln.Close()
	require.NoError(t, ln.(*net.TCPListener).SetDeadline(time.Now().Add(3*time.Minute)))
	conn, err := ln.Accept()
	require.NoError(t, err)
	return conn
}

// ppExchange is ibv_*_pingpong's TCP exchange, server side, on port: it
// reads the client's address, calls connect with it, answers with
// (qpn, psn, gid) and reads the client's "done".
func ppExchange(t *testing.T, port int, connect func(rqpn, rpsn uint32, rgid hostverbs.GID), qpn, psn uint32, gid hostverbs.GID) {
	t.Helper()
	conn := acceptOne(t, port)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	msg := make([]byte, len("0000:000000:000000:00000000000000000000000000000000")+1)
	_, err := io.ReadFull(conn, msg)
	require.NoError(t, err)
	var lid, rqpn, rpsn uint32
	var wgid string
	_, err = fmt.Sscanf(strings.TrimRight(string(msg), "\x00"), "%x:%x:%x:%s", &lid, &rqpn, &rpsn, &wgid)
	require.NoError(t, err, "client message %q", msg)
	rgid, err := wireGID(wgid)
	require.NoError(t, err)
	connect(rqpn, rpsn, rgid)
	reply := fmt.Sprintf("%04x:%06x:%06x:%s", 0, qpn, psn, toWireGID(gid))
	copy(msg, append([]byte(reply), 0))
	_, err = conn.Write(msg)
	require.NoError(t, err)
	_, err = io.ReadFull(conn, make([]byte, 5))
	require.NoError(t, err)
}

// relayUDPingPong plays ibv_ud_pingpong's server on port 18516 with a UD QP
// of the driven VM: 1 KiB messages after a 40-byte GRH, echoed back and
// forth and checked like the RC ones.
func relayUDPingPong(t *testing.T, p *endpoint, iters int) {
	const size, slot = 1024, 2048
	v := p.v
	q := v.createQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeUD,
		sendWR: qpDepth, recvWR: qpDepth, sendSGE: 1, recvSGE: 1, uar: p.uc})
	const qkey, myPSN = 0x11111111, 0x4321
	q.mustModify(hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrQKey,
		abi.QPAttr{State: 1, PortNum: 1, QKey: qkey})
	for i := range 16 {
		q.postRecv(uint64(2000+i), p.mr.sge(uint64(i%8)*slot, 40+size))
	}
	var rqpn uint32
	var rgid hostverbs.GID
	ppExchange(t, 18516, func(qpn, _ uint32, gid hostverbs.GID) {
		rqpn, rgid = qpn, gid
		q.mustModify(hostverbs.AttrState, abi.QPAttr{State: 2})
		q.mustModify(hostverbs.AttrState|hostverbs.AttrSQPSN, abi.QPAttr{State: 3, SQPSN: myPSN})
	}, q.qpn, myPSN, p.gid)
	t.Logf("UD client: qpn %#x gid %s", rqpn, rgid)
	want := make([]byte, size)
	for i := range want {
		want[i] = 0x7b
	}
	ours := pattern(size, 9)
	p.mr.write(v, 8*slot, ours)
	h := abi.SQWQEHdr{Opcode: uint32(hostverbs.WRSend), SendFlags: uint32(hostverbs.SendSignaled)}
	abi.WRUD{RemoteQPN: rqpn, RemoteQKey: qkey, AV: abi.AV{PortPD: 1<<24 | p.pd, DGID: rgid, HopLimit: 1}}.Encode(h.WR[:])
	posted := 16
	start := time.Now()
	for i := range iters {
		c := p.rcq.wait()
		require.Equal(t, uint32(0), c.Status, "UD receive %d: %+v", i, c)
		require.Equal(t, uint32(40+size), c.ByteLen)
		off := (c.WRID-2000)%8*slot + 40
		if got := p.mr.read(v, off, size); !bytes.Equal(got, want) {
			t.Fatalf("UD receive %d: bytes differ from the first at %d", i, firstDiff(got, want))
		}
		want = ours
		q.postRecv(uint64(2000+posted), p.mr.sge(uint64(posted%8)*slot, 40+size))
		posted++
		h.WRID = uint64(i)
		q.postSend(h, p.mr.sge(8*slot, size))
		s := p.scq.wait()
		require.Equal(t, uint32(0), s.Status, "UD send %d: %+v", i, s)
	}
	t.Logf("RELAY_UD_PINGPONG iters=%d size=%d time=%v", iters, size, time.Since(start).Round(time.Millisecond))
}

// relayRDMAOps is the Go side of hostverbs/soft/testdata/interop/rdmacheck.c
// played by the driven VM: the peer (rdmacheck over its rxe) WRITEs, READs
// and runs both atomics on our MR, then we do the same on its memory, each
// side checking content. The exchange is rdmacheck's packed little-endian
// struct {qpn, psn, rkey, pad uint32; addr uint64; gid [16]byte}.
func relayRDMAOps(t *testing.T, p *endpoint) {
	const (
		writeArea = 0
		readArea  = 1 << 20
		counter   = 2 << 20
		scratch   = 3 << 20
		msgArea   = 4<<20 - 4096
		n         = 256 << 10
		iova      = 0x7f3b_0000_0000
		myPSN     = 0x4242
	)
	type info struct {
		QPN, PSN, RKey, Pad uint32
		Addr                uint64
		GID                 [16]byte
	}
	pat := func(seed uint32, i int) byte { return byte(uint32(i)*seed + seed/2) }
	v := p.v
	mr := v.regMR(p.pd, iova, 4<<20, accRW|uint32(hostverbs.AccessRemoteAtomic))
	src := make([]byte, n)
	for i := range src {
		src[i] = pat(11, i)
	}
	mr.write(v, readArea, src)
	var w8 [8]byte
	binary.LittleEndian.PutUint64(w8[:], 5000)
	mr.write(v, counter, w8[:])
	q := v.createQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeRC,
		sendWR: qpDepth, recvWR: qpDepth, sendSGE: 1, recvSGE: 1, uar: p.uc})
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1, AccessFlags: accRW | uint32(hostverbs.AccessRemoteAtomic)})
	for i := range 4 {
		q.postRecv(uint64(100+i), mr.sge(msgArea+uint64(i)*64, 64))
	}
	conn := acceptOne(t, 18520)
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	var peer info
	require.NoError(t, binary.Read(conn, binary.LittleEndian, &peer))
	require.NoError(t, binary.Write(conn, binary.LittleEndian, info{QPN: q.qpn, PSN: myPSN, RKey: mr.rkey, Addr: iova, GID: p.gid}))
	conn.Close()
	q.mustModify(0x129181|hostverbs.AttrRQPSN, abi.QPAttr{State: 2, PathMTU: 3, DestQPNum: peer.QPN, RQPSN: peer.PSN,
		MaxDestRdAtomic: 4, MinRNRTimer: 12,
		AH: abi.AHAttr{DGID: peer.GID, SGIDIndex: 0, HopLimit: 64, Flags: abi.AHFlagGRH, PortNum: 1}})
	q.mustModify(0x12e01, abi.QPAttr{State: 3, Timeout: 14, RetryCnt: 7, RNRRetry: 7, SQPSN: myPSN, MaxRdAtomic: 4})

	// Phase A: the peer works on our memory, then says so.
	c := p.rcq.wait()
	require.Equal(t, uint32(0), c.Status, "%+v", c)
	require.Equal(t, uint32(hostverbs.WCRecvRDMAWithImm), c.Opcode, "WRITE with immediate first: %+v", c)
	c = p.rcq.wait()
	require.Equal(t, uint32(0), c.Status, "%+v", c)
	require.Equal(t, "A-DONE", strings.TrimRight(string(mr.read(v, msgArea+(c.WRID-100)*64, 16)), "\x00"))
	got := mr.read(v, writeArea, n)
	for i := range got {
		if got[i] != pat(7, i) {
			t.Fatalf("byte %d written by the peer is %#x, want %#x", i, got[i], pat(7, i))
		}
	}
	require.Equal(t, uint64(42), binary.LittleEndian.Uint64(mr.read(v, counter, 8)), "5000 +7, then 5007 -> 42")

	// Phase B: we work on the peer's memory.
	for i := range src {
		src[i] = pat(17, i)
	}
	mr.write(v, scratch, src)
	post := func(h abi.SQWQEHdr, sge abi.SGE) {
		q.postSend(h, sge)
		c := p.scq.wait()
		require.Equal(t, uint32(0), c.Status, "WR %d: %+v", h.WRID, c)
	}
	rdma := func(wrid uint64, op hostverbs.WROpcode, raddr uint64) abi.SQWQEHdr {
		h := abi.SQWQEHdr{WRID: wrid, Opcode: uint32(op), SendFlags: uint32(hostverbs.SendSignaled)}
		abi.WRRDMA{RemoteAddr: raddr, RKey: peer.RKey}.Encode(h.WR[:])
		return h
	}
	atomic := func(wrid uint64, op hostverbs.WROpcode, cmpAdd, swap uint64) abi.SQWQEHdr {
		h := abi.SQWQEHdr{WRID: wrid, Opcode: uint32(op), SendFlags: uint32(hostverbs.SendSignaled)}
		abi.WRAtomic{RemoteAddr: peer.Addr + counter, CompareAdd: cmpAdd, Swap: swap, RKey: peer.RKey}.Encode(h.WR[:])
		return h
	}
	post(rdma(1, hostverbs.WRRDMAWrite, peer.Addr+writeArea), mr.sge(scratch, n))
	post(rdma(2, hostverbs.WRRDMARead, peer.Addr+readArea), mr.sge(scratch+n, n))
	got = mr.read(v, scratch+n, n)
	for i := range got {
		if got[i] != pat(13, i) {
			t.Fatalf("byte %d read from the peer is %#x, want %#x", i, got[i], pat(13, i))
		}
	}
	post(atomic(3, hostverbs.WRAtomicFetchAndAdd, 3, 0), mr.sge(scratch+2*n, 8))
	require.Equal(t, uint64(1000), binary.LittleEndian.Uint64(mr.read(v, scratch+2*n, 8)))
	post(atomic(4, hostverbs.WRAtomicCmpAndSwp, 1003, 77), mr.sge(scratch+2*n+8, 8))
	require.Equal(t, uint64(1003), binary.LittleEndian.Uint64(mr.read(v, scratch+2*n+8, 8)))
	mr.write(v, scratch+3*n, append([]byte("B-DONE"), make([]byte, 10)...))
	post(sendWQE(5), mr.sge(scratch+3*n, 16))
	c = p.rcq.wait()
	require.Equal(t, uint32(0), c.Status, "%+v", c)
	require.Equal(t, "C-OK", strings.TrimRight(string(mr.read(v, msgArea+(c.WRID-100)*64, 16)), "\x00"), "the peer's verdict")
	t.Logf("RELAY_RDMACHECK WRITE, READ, FETCH_ADD, CMP_SWAP both ways, WRITE_WITH_IMM, SEND: ok")
}

// perftestKeys is perftest's KEY_PRINT_FMT_GID message (108 bytes with
// its NUL): lid, out_reads, qpn, psn, rkey, vaddr, 16 GID bytes, srqn.
type perftestKeys struct {
	lid, outReads, qpn, psn, rkey, srqn uint32
	vaddr                               uint64
	gid                                 hostverbs.GID
}

const perftestKeysLen = 108

func (k perftestKeys) format() []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "%04x:%04x:%06x:%06x:%08x:%016x:", k.lid, k.outReads, k.qpn, k.psn, k.rkey, k.vaddr)
	for _, x := range k.gid {
		fmt.Fprintf(&b, "%02x:", x)
	}
	fmt.Fprintf(&b, "%08x:", k.srqn)
	out := make([]byte, perftestKeysLen)
	copy(out, b.String())
	return out
}

func parsePerftestKeys(msg []byte) (perftestKeys, bool) {
	f := strings.Split(strings.TrimRight(string(msg), "\x00"), ":")
	if len(f) < 23 {
		return perftestKeys{}, false
	}
	var k perftestKeys
	var err error
	num := func(s string, bits int) uint64 {
		v, e := strconv.ParseUint(s, 16, bits)
		if e != nil {
			err = e
		}
		return v
	}
	k.lid, k.outReads, k.qpn, k.psn = uint32(num(f[0], 32)), uint32(num(f[1], 32)), uint32(num(f[2], 32)), uint32(num(f[3], 32))
	k.rkey, k.vaddr = uint32(num(f[4], 32)), num(f[5], 64)
	for i := range 16 {
		k.gid[i] = byte(num(f[6+i], 8))
	}
	k.srqn = uint32(num(f[22], 32))
	return k, err == nil
}

// relayPerftestServer is the passive side of a perftest bandwidth test
// (ib_write_bw, ib_read_bw, ib_atomic_bw run as clients in the peer)
// played by the driven VM through the relay. perftest's TCP exchanges are
// fixed-size messages the client writes first; the server answers each
// with one of the same size: its own keys for the key messages (108
// bytes), the client's own bytes for the others (version, buffer and MTU
// parameters, reports), which agree by construction. Our MR is filled
// with a marker first: the WRITE test must overwrite it, the atomic test
// must change it.
func relayPerftestServer(t *testing.T, p *endpoint, tool string, port int) {
	const (
		iova   = 0x7f3c_0000_0000
		size   = 1 << 20 // perftest uses twice its 64 KiB message per QP
		marker = 0xee
		myPSN  = 0x5151
	)
	v := p.v
	mr := v.regMR(p.pd, iova, size, accRW|uint32(hostverbs.AccessRemoteAtomic))
	fill := make([]byte, size)
	for i := range fill {
		fill[i] = marker
	}
	mr.write(v, 0, fill)
	q := v.createQP(qpSpec{pd: p.pd, scq: p.scq, rcq: p.rcq, typ: hostverbs.QPTypeRC,
		sendWR: qpDepth, recvWR: qpDepth, sendSGE: 1, recvSGE: 1, uar: p.uc})
	q.mustModify(0x39, abi.QPAttr{State: 1, PortNum: 1, AccessFlags: accRW | uint32(hostverbs.AccessRemoteAtomic)})
	mine := perftestKeys{outReads: 16, qpn: q.qpn, psn: myPSN, rkey: mr.rkey, vaddr: iova, gid: p.gid}

	conn := acceptOne(t, port)
	defer conn.Close()
	mtu := uint32(3)
	connected := false
	buf := make([]byte, 512)
	for {
		_ = conn.SetDeadline(time.Now().Add(2 * time.Minute))
		n, err := conn.Read(buf)
		if err != nil {
			break // the client closed after its "done"
		}
		msg := buf[:n]
		switch {
		case n == perftestKeysLen:
			k, ok := parsePerftestKeys(msg)
			require.True(t, ok, "%s: keys %q", tool, msg)
			if !connected {
				q.mustModify(0x129181|hostverbs.AttrRQPSN, abi.QPAttr{State: 2, PathMTU: mtu, DestQPNum: k.qpn, RQPSN: k.psn,
					MaxDestRdAtomic: 16, MinRNRTimer: 12,
					AH: abi.AHAttr{DGID: k.gid, SGIDIndex: 0, HopLimit: 64, Flags: abi.AHFlagGRH, PortNum: 1}})
				q.mustModify(0x12e01, abi.QPAttr{State: 3, Timeout: 14, RetryCnt: 7, RNRRetry: 7, SQPSN: myPSN, MaxRdAtomic: 16})
				connected = true
				t.Logf("%s: client qpn %#x psn %#x gid %s, out_reads %d", tool, k.qpn, k.psn, k.gid, k.outReads)
			}
			_, err = conn.Write(mine.format())
		case n == 5 && string(msg) == "done\x00":
			continue
		default:
			if n == 2 && msg[0] >= '1' && msg[0] <= '5' {
				mtu = uint32(msg[0] - '0') // check_mtu: the client's MTU code as text
			}
			_, err = conn.Write(msg)
		}
		require.NoError(t, err)
	}
	require.True(t, connected, "%s never sent its keys", tool)
	got := mr.read(v, 0, 64<<10)
	changed := 0
	for _, b := range got {
		if b != marker {
			changed++
		}
	}
	switch tool {
	case "ib_write_bw":
		require.Greater(t, changed, 0, "ib_write_bw wrote nothing into our MR")
	case "ib_atomic_bw":
		require.Greater(t, changed, 0, "ib_atomic_bw changed nothing in our MR")
	}
	t.Logf("RELAY_PERFTEST %s: %d of the first 64 KiB of our MR changed", tool, changed)
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// relayObjects counts the user objects of one kind on the host's RDMA
// devices (`rdma -j resource show KIND`; the kernel's own have no pid).
func relayObjects(t *testing.T, kind string) int {
	t.Helper()
	out, err := exec.Command("rdma", "-j", "resource", "show", kind).Output()
	require.NoError(t, err)
	var ents []map[string]any
	require.NoError(t, json.Unmarshal(out, &ents), "%s", out)
	n := 0
	for _, e := range ents {
		if _, ok := e["pid"]; ok {
			n++
		}
	}
	t.Logf("rdma resource show %s: %d with a pid", kind, n)
	return n
}

// toWireGID and wireGID convert a GID to and from rdma-core's pingpong
// wire form: four 32-bit words, each the host's value byte-swapped to big
// endian and printed as 8 hex digits, which comes to the GID's 16 bytes in
// order as 32 hex digits.
func toWireGID(g hostverbs.GID) string { return hex.EncodeToString(g[:]) }

func wireGID(s string) (hostverbs.GID, error) {
	var g hostverbs.GID
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != 16 {
		return g, fmt.Errorf("wire GID %q: want 32 hex digits", s)
	}
	copy(g[:], b)
	return g, nil
}
