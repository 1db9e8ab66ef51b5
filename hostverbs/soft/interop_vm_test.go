//go:build vm && linux

package soft

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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
	var w wire.Wire
	require.NoError(t, nw.Do(func() error {
		var err error
		if interopWire() == "raw" {
			w, err = wire.NewKernelWire(wire.KernelWireConfig{})
		} else {
			w, err = wire.NewUDPWire(wire.UDPWireConfig{})
		}
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

// interopWire is the kernel wire the interop tests run on: the default
// UDP wire, or the raw one with PVRDMA_INTEROP_WIRE=raw.
func interopWire() string { return os.Getenv("PVRDMA_INTEROP_WIRE") }

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

// pingPongGuest is an rxe guest that runs tool (ibv_rc_pingpong or
// ibv_ud_pingpong) first as the client of our server on port 18515, then
// as the server on port 18516.
func pingPongGuest(name, tool string, iters, size int) vm.Config {
	return rxeGuest(name, guestIP, fmt.Sprintf(`
pvt_rxe eth0
g=$(pvt_gid_index rxe0 %[1]s)
echo "=== client"
pvt_retry 60 %[5]s -d rxe0 -g $g -n %[2]d -s %[3]d %[4]s
echo "=== server"
%[5]s -d rxe0 -g $g -n %[2]d -s %[3]d -p 18516
echo "=== end"
`, guestIP, iters, size, hostIP, tool))
}

// listen opens a TCP listener on the host side of the bridge, closed when
// the test ends.
func (env *interopEnv) listen(t *testing.T, port string) net.Listener {
	t.Helper()
	var ln net.Listener
	require.NoError(t, env.nw.Do(func() error {
		var err error
		ln, err = net.Listen("tcp4", hostIP+":"+port)
		return err
	}))
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

func TestInteropRxeRCPingPong(t *testing.T) {
	env := newInteropEnv(t)
	ctx := context.Background()
	const iters, size = 500, 4096
	ln := env.listen(t, "18515")

	g, err := vm.Start(ctx, t, env.img, env.nw, pingPongGuest("rxepp", "ibv_rc_pingpong", iters, size))
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

// udPingPong is ud_pingpong's data phase: like rc_pingpong, with a 40-byte
// GRH ahead of every received payload.
func udPingPong(t *testing.T, e *endpoint, qp hostverbs.QP, rem ppDest, client bool, size, iters int) {
	const depth = 64
	pattern := bytes.Repeat([]byte{0x7b}, size)
	e.write(t, e.iova, pattern)
	slot := uint64(size + 40)
	recvOff := func(i int) uint64 { return uint64(size) + uint64(i%depth)*slot }
	for i := range depth {
		require.NoError(t, qp.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(e, recvOff(i), int(slot))}))
	}
	send := func() {
		require.NoError(t, qp.PostSend(&hostverbs.SendWR{WRID: 1 << 40, Opcode: hostverbs.WRSend,
			Flags: hostverbs.SendSignaled, SGL: sge(e, 0, size),
			AV:        hostverbs.AddressVector{DGID: rem.gid, HopLimit: 64, Port: 1},
			RemoteQPN: rem.qpn, RemoteQKey: 0x11111111}))
	}
	sent, recvd, pendingSend, pendingRecv := 0, 0, false, true
	if client {
		send()
		pendingSend = true
	}
	for sent < iters || recvd < iters {
		wc := e.ccq.wait(t, 60*time.Second)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "completion %+v", wc)
		if wc.WRID == 1<<40 {
			sent++
			pendingSend = false
		} else {
			require.Equal(t, uint32(40+size), wc.ByteLen)
			require.Equal(t, rem.qpn, wc.SrcQP)
			require.Equal(t, hostverbs.NetworkIPv4, wc.NetworkHdrType)
			got := e.read(t, e.iova+recvOff(int(wc.WRID)), 40+size)
			grh := got[20:40]
			require.Equal(t, byte(0x45), grh[0], "IPv4 header in the GRH")
			require.Equal(t, byte(17), grh[9])
			require.Equal(t, rem.gid[12:], grh[12:16], "GRH source is the guest")
			require.True(t, bytes.Equal(pattern, got[40:]), "message %d differs", recvd)
			require.NoError(t, qp.PostRecv(&hostverbs.RecvWR{WRID: wc.WRID + depth, SGL: sge(e, recvOff(int(wc.WRID)), int(slot))}))
			recvd++
			pendingRecv = false
		}
		if sent < iters && !pendingSend && !pendingRecv {
			send()
			pendingSend, pendingRecv = true, true
		}
	}
}

func dialRetry(t *testing.T, nw *vm.Network, addr string) net.Conn {
	var c net.Conn
	deadline := time.Now().Add(3 * time.Minute)
	for c == nil && time.Now().Before(deadline) {
		require.NoError(t, nw.Do(func() error {
			var err error
			if c, err = net.DialTimeout("tcp4", addr, 2*time.Second); err != nil {
				c = nil
			}
			return nil
		}))
		if c == nil {
			time.Sleep(500 * time.Millisecond)
		}
	}
	require.NotNil(t, c, "%s never listened", addr)
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	return c
}

func TestInteropRxeUDPingPong(t *testing.T) {
	env := newInteropEnv(t)
	ctx := context.Background()
	const iters, size = 300, 512
	ln := env.listen(t, "18515")
	g, err := vm.Start(ctx, t, env.img, env.nw, pingPongGuest("rxeud", "ibv_ud_pingpong", iters, size))
	require.NoError(t, err)

	newUD := func() hostverbs.QP {
		q := udQP(t, env.ep, hostverbs.QPTypeUD, 0x11111111)
		return q
	}
	// The guest is the client.
	conn, err := ln.Accept()
	require.NoError(t, err)
	_ = conn.SetDeadline(time.Now().Add(2 * time.Minute))
	buf := make([]byte, ppMsgLen)
	_, err = io.ReadFull(conn, buf)
	require.NoError(t, err)
	rem, err := parsePPDest(buf)
	require.NoError(t, err)
	qp := newUD()
	_, err = conn.Write(ppDest{qpn: qp.QPN(), psn: 1, gid: env.ep.gid}.encode())
	require.NoError(t, err)
	_, _ = conn.Read(buf)
	conn.Close()
	udPingPong(t, env.ep, qp, rem, false, size, iters)
	require.NoError(t, qp.Destroy())

	// The guest is the server.
	qp2 := newUD()
	c := dialRetry(t, env.nw, guestIP+":18516")
	_, err = c.Write(ppDest{qpn: qp2.QPN(), psn: 2, gid: env.ep.gid}.encode())
	require.NoError(t, err)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	rem2, err := parsePPDest(buf)
	require.NoError(t, err)
	_, _ = c.Write([]byte("done\x00"))
	c.Close()
	udPingPong(t, env.ep, qp2, rem2, true, size, iters)

	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	for _, side := range []string{"client", "server"} {
		out := vm.Section(res.Output, side)
		pp, err := vm.ParsePingPong(out)
		require.NoError(t, err, "%s:\n%s", side, out)
		require.EqualValues(t, iters, pp.Iters)
		t.Logf("INTEROP rxe ibv_ud_pingpong guest=%s %dB x %d: %.2f Mbit/s, %.2f usec/iter", side, size, iters, pp.Mbps, pp.UsecPerIter)
	}
}

// rdmaInfo is rdmacheck's exchange record (testdata/interop/rdmacheck.c).
type rdmaInfo struct {
	QPN, PSN, RKey, Pad uint32
	Addr                uint64
	GID                 [16]byte
}

// buildRdmacheck builds the guest's checker against the host's libibverbs
// (bookworm's rdma-core, the same as the guest's). `make deps` installs gcc
// and libibverbs-dev; without them the test fails rather than skipping, so
// an interop path never goes untested unnoticed.
func buildRdmacheck(t *testing.T) string {
	out := filepath.Join(t.TempDir(), "rdmacheck")
	b, err := exec.Command("gcc", "-O2", "-Wall", "-o", out, "testdata/interop/rdmacheck.c", "-libverbs").CombinedOutput()
	if err != nil {
		t.Fatalf("cannot build the guest's rdmacheck (run `make deps`: it needs gcc and libibverbs-dev): %v\n%s", err, b)
	}
	return out
}

func patByte(seed uint32, i int) byte { return byte(uint32(i)*seed + seed/2) }

// RDMA WRITE, READ and both atomics, both ways, checked by content on both
// sides against rxe.
func TestInteropRxeRDMAOps(t *testing.T) {
	bin := buildRdmacheck(t)
	env := newInteropEnv(t)
	e := env.ep
	ctx := context.Background()
	const (
		writeArea = 0
		readArea  = 1 << 20
		counter   = 2 << 20
		scratch   = 3 << 20
		msgArea   = 4<<20 - 4096
		n         = 256 << 10
	)
	src := make([]byte, n)
	for i := range src {
		src[i] = patByte(11, i)
	}
	e.write(t, e.iova+readArea, src)
	var w8 [8]byte
	binary.LittleEndian.PutUint64(w8[:], 5000)
	e.write(t, e.iova+counter, w8[:])

	ln := env.listen(t, "18520")
	g, err := vm.Start(ctx, t, env.img, env.nw, func() vm.Config {
		c := rxeGuest("rxeops", guestIP, fmt.Sprintf(`
pvt_rxe eth0
g=$(pvt_gid_index rxe0 %[1]s)
pvt_retry 60 /usr/bin/rdmacheck %[2]s 18520 rxe0 $g
`, guestIP, hostIP))
		c.HostFiles = map[string]string{"/usr/bin/rdmacheck": bin}
		return c
	}())
	require.NoError(t, err)

	qp := createRC(t, e, defaultRC())
	for i := range 4 {
		require.NoError(t, qp.PostRecv(&hostverbs.RecvWR{WRID: uint64(100 + i), SGL: sge(e, msgArea+uint64(i)*64, 64)}))
	}
	conn, err := ln.Accept()
	require.NoError(t, err)
	_ = conn.SetDeadline(time.Now().Add(2 * time.Minute))
	var peer rdmaInfo
	require.NoError(t, binary.Read(conn, binary.LittleEndian, &peer))
	me := rdmaInfo{QPN: qp.QPN(), PSN: 0x4242, RKey: e.mr.RKey(), Addr: e.iova, GID: e.gid}
	require.NoError(t, binary.Write(conn, binary.LittleEndian, &me))
	conn.Close()
	o := defaultRC()
	o.mtu = hostverbs.MTU1024
	o.rdAtomic = 4
	rtsRC(t, qp, &endpoint{gid: hostverbs.GID(peer.GID)}, peer.QPN, peer.PSN, me.PSN, o)

	// Phase A: the guest works on our memory, then says so.
	var msgs []hostverbs.WorkCompletion
	for len(msgs) < 2 {
		wc := e.ccq.wait(t, 2*time.Minute)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		msgs = append(msgs, wc)
	}
	require.Equal(t, hostverbs.WCRecvRDMAWithImm, msgs[0].Opcode, "WRITE with immediate first")
	require.Equal(t, uint32(0x12345678), binary.BigEndian.Uint32(binary.LittleEndian.AppendUint32(nil, msgs[0].ImmData)))
	require.Equal(t, "A-DONE", strings.TrimRight(string(e.read(t, e.iova+msgArea+64, 16)), "\x00"))
	got := e.read(t, e.iova+writeArea, n)
	for i := range got {
		require.Equal(t, patByte(7, i), got[i], "byte %d written by rxe", i)
	}
	require.Equal(t, uint64(42), binary.LittleEndian.Uint64(e.read(t, e.iova+counter, 8)), "5000 +7 then 5007 -> 42")

	// Phase B: we work on the guest's memory.
	for i := range src {
		src[i] = patByte(17, i)
	}
	e.write(t, e.iova+scratch, src)
	post := func(wr hostverbs.SendWR) hostverbs.WorkCompletion {
		wr.Flags |= hostverbs.SendSignaled
		require.NoError(t, qp.PostSend(&wr))
		wc := e.ccq.wait(t, time.Minute)
		require.Equal(t, hostverbs.WCSuccess, wc.Status, "%+v", wc)
		return wc
	}
	post(hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, SGL: sge(e, scratch, n), RemoteAddr: peer.Addr + writeArea, RKey: peer.RKey})
	post(hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRRDMARead, SGL: sge(e, scratch+n, n), RemoteAddr: peer.Addr + readArea, RKey: peer.RKey})
	got = e.read(t, e.iova+scratch+n, n)
	for i := range got {
		require.Equal(t, patByte(13, i), got[i], "byte %d read from rxe", i)
	}
	post(hostverbs.SendWR{WRID: 3, Opcode: hostverbs.WRAtomicFetchAndAdd, SGL: sge(e, scratch+2*n, 8), RemoteAddr: peer.Addr + counter, RKey: peer.RKey, CompareAdd: 3})
	require.Equal(t, uint64(1000), binary.LittleEndian.Uint64(e.read(t, e.iova+scratch+2*n, 8)))
	post(hostverbs.SendWR{WRID: 4, Opcode: hostverbs.WRAtomicCmpAndSwp, SGL: sge(e, scratch+2*n+8, 8), RemoteAddr: peer.Addr + counter, RKey: peer.RKey, CompareAdd: 1003, Swap: 77})
	require.Equal(t, uint64(1003), binary.LittleEndian.Uint64(e.read(t, e.iova+scratch+2*n+8, 8)))
	e.write(t, e.iova+scratch+3*n, append([]byte("B-DONE"), make([]byte, 10)...))
	post(hostverbs.SendWR{WRID: 5, Opcode: hostverbs.WRSend, SGL: sge(e, scratch+3*n, 16)})
	wc := e.ccq.wait(t, time.Minute)
	require.Equal(t, hostverbs.WCSuccess, wc.Status)
	require.Equal(t, "C-OK", strings.TrimRight(string(e.read(t, e.iova+msgArea+uint64(wc.WRID-100)*64, 16)), "\x00"), "the guest's verdict")

	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	require.Contains(t, res.Output, "rdmacheck: ALL OK")
	t.Logf("INTEROP rxe rdmacheck: WRITE/READ/FETCH_ADD/CMP_SWAP both ways, WRITE_WITH_IMM, SEND: ok")
}
