package hostile

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
)

// Environment of TestRelayPingPong, which runs inside a test-bed guest
// (tests/e2e TestRelayOverRxe boots it): our daemon relays a driven
// vmw_pvrdma device to kernel rxe, and a second guest runs stock
// ibv_rc_pingpong against it.
const (
	envRelayNetdev = "PVRDMA_RELAY_NETDEV" // the netdev to create the rxe link over
	envRelayGID    = "PVRDMA_RELAY_GID"    // the IPv4 address the driven VM binds as its GID
	envRelayIters  = "PVRDMA_RELAY_ITERS"
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
	e := newEnvConfig(t, vdev.Limits{}, testLogger(t), func(c *backend.Config) {
		c.Fabric = backend.FabricConfig{CreateRXE: netdev}
	})
	st := e.d.Status()
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
		for _, g := range e.d.Status().Fabric.HostDevice.GIDs {
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
	p.qp.mustModify(0x39, vdev.QPAttr{State: 1, PortNum: 1})

	// ibv_rc_pingpong's exchange, server side: read the client's address,
	// connect, answer with ours, read its "done".
	ln, err := net.Listen("tcp", ":18515")
	require.NoError(t, err)
	defer ln.Close()
	require.NoError(t, ln.(*net.TCPListener).SetDeadline(time.Now().Add(3*time.Minute)))
	conn, err := ln.Accept()
	require.NoError(t, err)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	msg := make([]byte, len("0000:000000:000000:00000000000000000000000000000000")+1)
	_, err = io.ReadFull(conn, msg)
	require.NoError(t, err)
	var lid, rqpn, rpsn uint32
	var wgid string
	_, err = fmt.Sscanf(strings.TrimRight(string(msg), "\x00"), "%x:%x:%x:%s", &lid, &rqpn, &rpsn, &wgid)
	require.NoError(t, err, "client message %q", msg)
	rgid, err := wireGID(wgid)
	require.NoError(t, err)
	t.Logf("client: qpn %#x psn %#x gid %s", rqpn, rpsn, rgid)

	// Receives first (the client sends at once), then RTR and RTS.
	for i := range 16 {
		p.qp.postRecv(uint64(1000+i), p.mr.sge(uint64(i%8)*size, size))
	}
	p.qp.mustModify(0x129181|hostverbs.AttrRQPSN, vdev.QPAttr{State: 2, PathMTU: 3, DestQPNum: rqpn, RQPSN: rpsn,
		MaxDestRdAtomic: 1, MinRNRTimer: 12,
		AH: vdev.AHAttr{DGID: rgid, SGIDIndex: 0, HopLimit: 1, Flags: vdev.AHFlagGRH, PortNum: 1}})
	p.qp.mustModify(0x12e01, vdev.QPAttr{State: 3, Timeout: 14, RetryCnt: 7, RNRRetry: 7, SQPSN: myPSN, MaxRdAtomic: 1})
	reply := fmt.Sprintf("%04x:%06x:%06x:%s", 0, p.qp.qpn, myPSN, toWireGID(gid))
	copy(msg, append([]byte(reply), 0))
	_, err = conn.Write(msg)
	require.NoError(t, err)
	done := make([]byte, 5)
	_, err = io.ReadFull(conn, done)
	require.NoError(t, err)

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

	// The VM goes away: the host device keeps none of its objects.
	require.Positive(t, relayObjects(t, "qp"))
	conn.Close()
	ln.Close()
	v.Close()
	e.idle()
	for _, kind := range []string{"qp", "cq", "mr", "pd"} {
		require.Zero(t, relayObjects(t, kind), "%s left on the host device after the VM disconnected", kind)
	}
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
