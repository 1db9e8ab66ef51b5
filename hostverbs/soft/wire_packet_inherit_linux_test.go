//go:build linux

package soft

import (
	"context"
	"encoding/binary"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// The packet wire's hand-over, on one host:
//
//	ns: PacketWire on brx (bridge) --- vx (port) ~~ vp: the test's packet socket, as a peer on the segment

// bridgePeer is a packet socket on the far end of a veth whose other end
// is a port of the bridge brx: what it sends reaches the bridge as from a
// host on the segment, and it sees what the bridge floods to that port.
type bridgePeer struct {
	ns *netns
	fd int
}

func newBridgePeer(t *testing.T) *bridgePeer {
	needRoot(t)
	ns := newNetns(t, "pi")
	ns.ip(t, "link", "add", "brx", "type", "bridge")
	ns.ip(t, "link", "add", "vx", "type", "veth", "peer", "name", "vp")
	ns.ip(t, "link", "set", "vx", "master", "brx", "up")
	ns.ip(t, "link", "set", "vp", "up")
	ns.ip(t, "link", "set", "brx", "up")
	// Carrier reaches the bridge through linkwatch (up to a second).
	require.Eventually(t, func() bool { return strings.Contains(ns.ip(t, "link", "show", "brx"), "state UP") },
		10*time.Second, 50*time.Millisecond)
	p := &bridgePeer{ns: ns}
	ns.do(t, func() {
		var err error
		p.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		require.NoError(t, err)
		require.NoError(t, unix.SetsockoptInt(p.fd, unix.SOL_PACKET, unix.PACKET_IGNORE_OUTGOING, 1))
		ifi, err := net.InterfaceByName("vp")
		require.NoError(t, err)
		require.NoError(t, unix.Bind(p.fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}))
	})
	t.Cleanup(func() { unix.Close(p.fd) })
	return p
}

var (
	inheritWireMAC = [6]byte{0x52, 0x54, 0, 0, 0, 0x01} // the fabric device's
	inheritPeerMAC = [6]byte{0x52, 0x54, 0, 0, 0, 0x02}
)

// send puts a RoCE v2 WRITE with psn on the segment, to the fabric
// device's MAC, tagged with vlan unless it is 0.
func (p *bridgePeer) send(t *testing.T, psn uint32, vlan uint16) {
	t.Helper()
	f := append(append([]byte{}, inheritWireMAC[:]...), inheritPeerMAC[:]...)
	if vlan != 0 {
		f = binary.BigEndian.AppendUint16(f, etherType8021Q)
		f = binary.BigEndian.AppendUint16(f, vlan)
	}
	f = binary.BigEndian.AppendUint16(f, unix.ETH_P_IP)
	f = append(f, buildDatagram("10.9.0.2", "10.9.0.1", roce.RCWriteOnly, 256, uint16(psn), psn)...)
	_, err := unix.Write(p.fd, f)
	require.NoError(t, err)
}

// captured waits for the next RoCE frame the bridge put on the segment.
func (p *bridgePeer) captured(t *testing.T) []byte {
	t.Helper()
	buf := make([]byte, 9000)
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		n, err := unix.Read(p.fd, buf)
		if err == nil && roceFrame(buf[:n]) {
			return buf[:n]
		}
		if err != nil {
			time.Sleep(time.Millisecond)
		}
	}
	t.Fatal("no RoCE frame from the bridge")
	return nil
}

// receivePSNs receives from w until it has n packets (or 5 s passed) and
// returns their PSNs in order of arrival.
func receivePSNs(t *testing.T, w *wire.PacketWire, n int) []uint32 {
	t.Helper()
	bufs, out := make([][]byte, 64), make([][]byte, 64)
	for i := range bufs {
		bufs[i] = make([]byte, wire.MaxDatagram)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	// Receive notices its context only between frames: a timer closing
	// the wire bounds the wait for one that never comes.
	stop := time.AfterFunc(5*time.Second, func() { w.Close() })
	defer stop.Stop()
	var psns []uint32
	for len(psns) < n && ctx.Err() == nil {
		k, err := w.Receive(ctx, 0, bufs, out)
		if err != nil {
			break
		}
		for i := range k {
			var rp roce.Packet
			require.NoError(t, rp.Parse(out[i]))
			psns = append(psns, uint32(rp.BTH.PSN()))
		}
	}
	return psns
}

// receivesNothing checks that a Receive on w returns nothing within d
// (its context's end).
func receivesNothing(t *testing.T, w *wire.PacketWire, d time.Duration, msg string) {
	t.Helper()
	bufs, out := [][]byte{make([]byte, wire.MaxDatagram)}, make([][]byte, 1)
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	k, err := w.Receive(ctx, 0, bufs, out)
	assert.ErrorIs(t, err, context.DeadlineExceeded, msg)
	assert.Zero(t, k, msg)
}

// inheritedCopy is the successor's copy of w's socket, as exec or the
// descriptor store passes it.
func inheritedCopy(t *testing.T, w *wire.PacketWire) *os.File {
	t.Helper()
	socks := w.ReceiveSockets()
	require.Len(t, socks, 1)
	dup, err := unix.FcntlInt(uintptr(socks["packet"]), unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	return os.NewFile(uintptr(dup), "packet")
}

// TestPacketWireInheritKeepsQueued: a packet wire that pauses receiving
// leaves the frames it captures in the kernel and still sends; a
// successor that inherits its socket (a live upgrade, systemd's
// descriptor store) takes it over, paused until its QPs are back, and
// then receives every frame captured in between, in order. Descriptors
// that are not such a socket (a UDP socket, a packet socket on another
// device, a packet socket of another type) are not taken. A paused
// Receive returns when the wire closes.
func TestPacketWireInheritKeepsQueued(t *testing.T) {
	p := newBridgePeer(t)
	var w1 *wire.PacketWire
	var err error
	p.ns.do(t, func() { w1, err = wire.NewPacketWire(wire.PacketWireConfig{Interface: "brx"}) })
	require.NoError(t, err)
	t.Cleanup(func() { w1.Close() })
	assert.Zero(t, w1.Adopted())
	w1.PauseReceive()

	// Sending goes on through the same socket.
	d := buildDatagram("10.9.0.1", "10.9.0.2", roce.RCWriteOnly, 64, 0, 99)
	sent, err := w1.Transmit([]wire.Datagram{{Packet: d, SrcMAC: inheritWireMAC, DstMAC: inheritPeerMAC}})
	require.NoError(t, err)
	require.Equal(t, 1, sent)
	f := p.captured(t)
	assert.Equal(t, d, f[14:14+len(d)], "sent while receiving is paused")

	const n = 40
	for i := range n {
		p.send(t, uint32(i), 0)
	}
	time.Sleep(50 * time.Millisecond)
	receivesNothing(t, w1, 100*time.Millisecond, "a paused wire takes nothing from the kernel")

	// Not the wire's socket: left alone.
	var others []*os.File
	p.ns.do(t, func() {
		udp, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		others = append(others, os.NewFile(uintptr(udp), "udp"))
		for _, o := range []struct {
			dev string
			typ int
		}{{"vp", unix.SOCK_RAW}, {"brx", unix.SOCK_DGRAM}} {
			fd, err := unix.Socket(unix.AF_PACKET, o.typ|unix.SOCK_CLOEXEC, 0)
			require.NoError(t, err)
			others = append(others, os.NewFile(uintptr(fd), o.dev))
			ifi, err := net.InterfaceByName(o.dev)
			require.NoError(t, err)
			require.NoError(t, unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}))
		}
	})
	inherit := append(others, inheritedCopy(t, w1))
	require.NoError(t, w1.Close())

	var w2 *wire.PacketWire
	p.ns.do(t, func() {
		w2, err = wire.NewPacketWire(wire.PacketWireConfig{Interface: "brx", Inherit: inherit, Paused: true})
	})
	require.NoError(t, err)
	t.Cleanup(func() { w2.Close() })
	for _, f := range inherit {
		require.ErrorIs(t, f.Close(), os.ErrClosed, "the wire closed every inherited file")
	}
	assert.Equal(t, 1, w2.Adopted())
	receivesNothing(t, w2, 100*time.Millisecond, "paused until the successor resumes it")

	w2.ResumeReceive()
	want := make([]uint32, n)
	for i := range want {
		want[i] = uint32(i)
	}
	assert.Equal(t, want, receivePSNs(t, w2, n), "every frame captured across the hand-over, in order")

	// Paused again, a receiver blocked in Receive waits at the gate and
	// returns when the wire closes.
	w2.PauseReceive()
	done := make(chan error, 1)
	go func() {
		bufs, out := [][]byte{make([]byte, wire.MaxDatagram)}, make([][]byte, 1)
		_, err := w2.Receive(context.Background(), 0, bufs, out)
		done <- err
	}()
	p.send(t, n, 0)
	select {
	case err := <-done:
		t.Fatalf("a paused wire returned from Receive: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	require.NoError(t, w2.Close())
	select {
	case err := <-done:
		assert.ErrorIs(t, err, hostverbs.ErrClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("Receive did not return after Close")
	}
}

// TestPacketWireInheritOtherVLAN: a successor on another VLAN takes the
// socket over with its own filter, and drops what the predecessor's
// filter let in (untagged frames): they are not of its VLAN.
func TestPacketWireInheritOtherVLAN(t *testing.T) {
	p := newBridgePeer(t)
	var w1, w2 *wire.PacketWire
	var err error
	p.ns.do(t, func() { w1, err = wire.NewPacketWire(wire.PacketWireConfig{Interface: "brx", Paused: true}) })
	require.NoError(t, err)
	t.Cleanup(func() { w1.Close() })
	for i := range 3 {
		p.send(t, uint32(i), 0)
	}
	time.Sleep(50 * time.Millisecond)
	inherit := []*os.File{inheritedCopy(t, w1)}
	require.NoError(t, w1.Close())

	p.ns.do(t, func() {
		w2, err = wire.NewPacketWire(wire.PacketWireConfig{Interface: "brx", VLAN: 100, Inherit: inherit})
	})
	require.NoError(t, err)
	t.Cleanup(func() { w2.Close() })
	assert.Equal(t, 1, w2.Adopted())
	p.send(t, 7, 0)   // not its VLAN
	p.send(t, 8, 100) // its VLAN
	assert.Equal(t, []uint32{8}, receivePSNs(t, w2, 1))
}
