//go:build vm && linux

package soft

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
	"github.com/stretchr/testify/require"
)

// Interop with Linux rxe: a guest of the test bed runs soft-RoCE on its
// vmxnet3 (rdma link add rxe0 type rxe netdev eth0) on a bridge whose host
// side carries 10.77.0.254; our fabric runs on a kernel wire in the
// bridge's namespace with a device whose GID is ::ffff:10.77.0.254.

const (
	hostIP  = "10.77.0.254"
	guestIP = "10.77.0.1"
)

type interopEnv struct {
	img *vm.Image
	nw  *vm.Network
	f   *Fabric
	ep  *endpoint
}

func newInteropEnv(t *testing.T) *interopEnv {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{HostAddr: hostIP + "/24"})
	require.NoError(t, err)
	var w *KernelWire
	require.NoError(t, nw.Do(func() error {
		var err error
		w, err = NewKernelWire(KernelWireConfig{})
		return err
	}))
	f, err := New(Config{Wire: w, LinkMTU: 1500})
	require.NoError(t, err)
	t.Cleanup(func() {
		t.Logf("fabric counters: %v", nonZero(f.Counters()))
		_ = f.Close()
	})
	ep := newEndpoint(t, f, "host", hostIP, 8<<20)
	return &interopEnv{img: img, nw: nw, f: f, ep: ep}
}

func nonZero(m map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

// ppDest is rc_pingpong's out-of-band address: "%04x:%06x:%06x:%s", the
// GID as 32 hex digits of its bytes in order; the message is sent with its
// terminating NUL (52 bytes).
type ppDest struct {
	lid, qpn, psn uint32
	gid           hostverbs.GID
}

const ppMsgLen = len("0000:000000:000000:00000000000000000000000000000000") + 1

func (d ppDest) encode() []byte {
	s := fmt.Sprintf("%04x:%06x:%06x:%s", d.lid, d.qpn, d.psn, hex.EncodeToString(d.gid[:]))
	return append([]byte(s), 0)
}

func parsePPDest(b []byte) (ppDest, error) {
	var d ppDest
	s := strings.TrimRight(string(b), "\x00")
	parts := strings.Split(s, ":")
	if len(parts) != 4 || len(parts[3]) != 32 {
		return d, fmt.Errorf("bad pingpong address %q", s)
	}
	if _, err := fmt.Sscanf(parts[0]+" "+parts[1]+" "+parts[2], "%x %x %x", &d.lid, &d.qpn, &d.psn); err != nil {
		return d, fmt.Errorf("bad pingpong address %q: %w", s, err)
	}
	g, err := hex.DecodeString(parts[3])
	if err != nil {
		return d, err
	}
	copy(d.gid[:], g)
	return d, nil
}

// pingPong runs rc_pingpong's data phase on qp: each side sends after both
// its previous send and a receive completed; the client sends first. Every
// received message must be size bytes of 0x7b (what rc_pingpong's buffer
// holds and what we send back).
func pingPong(t *testing.T, e *endpoint, qp hostverbs.QP, client bool, size, iters int) {
	const depth = 64
	pattern := bytes.Repeat([]byte{0x7b}, size)
	e.write(t, e.iova, pattern)
	recvOff := func(i int) uint64 { return uint64(size) + uint64(i%depth)*uint64(size) }
	for i := range depth {
		require.NoError(t, qp.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(e, recvOff(i), size)}))
	}
	send := func() {
		require.NoError(t, qp.PostSend(&hostverbs.SendWR{WRID: 1 << 40, Opcode: hostverbs.WRSend,
			Flags: hostverbs.SendSignaled, SGL: sge(e, 0, size)}))
	}
	sent, recvd, pendingSend, pendingRecv := 0, 0, false, true
	if client {
		send()
		pendingSend = true
	}
	for sent < iters || recvd < iters {
		wc := e.ccq.wait(t, 60*time.Second)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "completion %+v after %d sent, %d received", wc, sent, recvd)
		if wc.WRID == 1<<40 {
			sent++
			pendingSend = false
		} else {
			require.Equal(t, uint32(size), wc.ByteLen)
			got := e.read(t, e.iova+recvOff(int(wc.WRID)), size)
			require.True(t, bytes.Equal(pattern, got), "message %d differs", recvd)
			require.NoError(t, qp.PostRecv(&hostverbs.RecvWR{WRID: wc.WRID + depth, SGL: sge(e, recvOff(int(wc.WRID)), size)}))
			recvd++
			pendingRecv = false
		}
		if sent < iters && !pendingSend && !pendingRecv {
			send()
			pendingSend, pendingRecv = true, true
		}
	}
}

// connectTo moves a fresh RC QP to RTS towards an rc_pingpong peer.
func connectToPP(t *testing.T, e *endpoint, qp hostverbs.QP, rem ppDest, myPSN uint32) {
	require.NoError(t, qp.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024,
		DestQPN: rem.qpn, RQPSN: rem.psn, MaxDestRdAtomic: 1, MinRNRTimer: 12,
		AV: hostverbs.AddressVector{DGID: rem.gid, HopLimit: 64, Port: 1}},
		hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|
			hostverbs.AttrRQPSN|hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer))
	require.NoError(t, qp.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTS, Timeout: 14, RetryCnt: 7,
		RNRRetry: 7, SQPSN: myPSN, MaxRdAtomic: 1},
		hostverbs.AttrState|hostverbs.AttrTimeout|hostverbs.AttrRetryCnt|hostverbs.AttrRNRRetry|
			hostverbs.AttrSQPSN|hostverbs.AttrMaxQPRdAtomic))
}

func rxeGuest(name, ip, scenario string) vm.Config {
	return vm.Config{Name: name, Modules: []string{"ib_core", "ib_uverbs"}, Timeout: 6 * time.Minute,
		NICs:     []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:01", IP: ip + "/24"}},
		Scenario: scenario}
}

func TestInteropRxeRCPingPong(t *testing.T) {
	env := newInteropEnv(t)
	ctx := context.Background()
	const iters, size = 500, 4096
	var ln net.Listener
	require.NoError(t, env.nw.Do(func() error {
		var err error
		ln, err = net.Listen("tcp4", hostIP+":18515")
		return err
	}))
	defer ln.Close()

	g, err := vm.Start(ctx, t, env.img, env.nw, rxeGuest("rxepp", guestIP, fmt.Sprintf(`
pvt_rxe eth0
g=$(pvt_gid_index rxe0 %[1]s)
echo "=== client"
pvt_retry 60 ibv_rc_pingpong -d rxe0 -g $g -n %[2]d -s %[3]d %[4]s
echo "=== server"
ibv_rc_pingpong -d rxe0 -g $g -n %[2]d -s %[3]d -p 18516
echo "=== end"
`, guestIP, iters, size, hostIP)))
	require.NoError(t, err)

	// Phase 1: the guest is the client, we are the server.
	conn, err := ln.Accept()
	require.NoError(t, err)
	_ = conn.SetDeadline(time.Now().Add(2 * time.Minute))
	buf := make([]byte, ppMsgLen)
	_, err = io.ReadFull(conn, buf)
	require.NoError(t, err)
	rem, err := parsePPDest(buf)
	require.NoError(t, err)
	t.Logf("guest client: qpn %#x psn %#x gid %v", rem.qpn, rem.psn, rem.gid)
	qp := createRC(t, env.ep, defaultRC())
	myPSN := rand.Uint32() & 0xffffff
	connectToPP(t, env.ep, qp, rem, myPSN)
	_, err = conn.Write(ppDest{qpn: qp.QPN(), psn: myPSN, gid: env.ep.gid}.encode())
	require.NoError(t, err)
	_, _ = conn.Read(buf) // "done"
	conn.Close()
	pingPong(t, env.ep, qp, false, size, iters)
	require.NoError(t, qp.Destroy())

	// Phase 2: the guest is the server on 18516, we are the client.
	qp2 := createRC(t, env.ep, defaultRC())
	myPSN = rand.Uint32() & 0xffffff
	var c net.Conn
	deadline := time.Now().Add(3 * time.Minute)
	for {
		require.NoError(t, env.nw.Do(func() error {
			var err error
			c, err = net.DialTimeout("tcp4", guestIP+":18516", 2*time.Second)
			if err != nil {
				c = nil
			}
			return nil
		}))
		if c != nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	require.NotNil(t, c, "guest rc_pingpong server never listened")
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	_, err = c.Write(ppDest{qpn: qp2.QPN(), psn: myPSN, gid: env.ep.gid}.encode())
	require.NoError(t, err)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	rem2, err := parsePPDest(buf)
	require.NoError(t, err)
	_, err = c.Write([]byte("done\x00"))
	require.NoError(t, err)
	c.Close()
	connectToPP(t, env.ep, qp2, rem2, myPSN)
	pingPong(t, env.ep, qp2, true, size, iters)

	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	for _, side := range []string{"client", "server"} {
		out := vm.Section(res.Output, side)
		pp, err := vm.ParsePingPong(out)
		require.NoError(t, err, "%s:\n%s", side, out)
		require.EqualValues(t, iters, pp.Iters)
		require.Contains(t, out, "::ffff:"+hostIP, "the guest saw our GID")
		t.Logf("INTEROP rxe ibv_rc_pingpong guest=%s %dB x %d: %.2f Mbit/s, %.2f usec/iter", side, size, iters, pp.Mbps, pp.UsecPerIter)
	}
}
