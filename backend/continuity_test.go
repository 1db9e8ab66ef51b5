package backend

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// notifyReceiver reads sd_notify datagrams the way the service manager
// does and keeps what FDSTORE gives it: it checks the daemon's side of the
// protocol (message format, SCM_RIGHTS, names, removals). The system test
// with systemd itself is tests/packaging's TestCrashKeepsVMs.
type notifyReceiver struct {
	path string
	conn *net.UnixConn

	mu      sync.Mutex
	fds     map[string]int
	removed []string
	other   []string
}

func newNotifyReceiver(t *testing.T) *notifyReceiver {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	require.NoError(t, err)
	r := &notifyReceiver{path: path, conn: c, fds: map[string]int{}}
	go r.loop()
	t.Cleanup(func() {
		c.Close()
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, fd := range r.fds {
			unix.Close(fd)
		}
	})
	return r
}

func (r *notifyReceiver) loop() {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4*16))
	for {
		n, oobn, _, _, err := r.conn.ReadMsgUnix(buf, oob)
		if err != nil {
			return
		}
		var fds []int
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for i := range msgs {
				if f, err := unix.ParseUnixRights(&msgs[i]); err == nil {
					fds = append(fds, f...)
				}
			}
		}
		kv := map[string]string{}
		for _, line := range strings.Split(string(buf[:n]), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				kv[k] = v
			}
		}
		r.mu.Lock()
		switch {
		case kv["FDSTORE"] == "1" && len(fds) == 1:
			if old, ok := r.fds[kv["FDNAME"]]; ok {
				unix.Close(old)
			}
			r.fds[kv["FDNAME"]] = fds[0]
		case kv["FDSTOREREMOVE"] == "1":
			if fd, ok := r.fds[kv["FDNAME"]]; ok {
				unix.Close(fd)
				delete(r.fds, kv["FDNAME"])
			}
			r.removed = append(r.removed, kv["FDNAME"])
		default:
			for _, fd := range fds {
				unix.Close(fd)
			}
			r.other = append(r.other, string(buf[:n]))
		}
		r.mu.Unlock()
	}
}

// handBack returns duplicates of the stored descriptors, as LISTEN_FDS
// gives them to the next process.
func (r *notifyReceiver) handBack(t *testing.T) map[string]*os.File {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]*os.File{}
	for name, fd := range r.fds {
		d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
		out[name] = os.NewFile(uintptr(d), name)
	}
	return out
}

func (r *notifyReceiver) names() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var n []string
	for k := range r.fds {
		n = append(n, k)
	}
	return n
}

// runKeptDaemon runs a daemon with the store until stop is called.
func runKeptDaemon(t *testing.T, dir string, r *notifyReceiver, inherited map[string]*os.File, vms ...VMRequest) (*Daemon, func()) {
	t.Helper()
	return runKeptDaemonWith(t, Config{SocketDir: dir, VMs: vms}, r, inherited)
}

// runKeptDaemonWith is runKeptDaemon with more of the configuration.
func runKeptDaemonWith(t *testing.T, cfg Config, r *notifyReceiver, inherited map[string]*os.File) (*Daemon, func()) {
	t.Helper()
	store, err := OpenFDStore(r.path)
	require.NoError(t, err)
	logger, serving := servingLogger(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cfg.Logger, cfg.FDStore, cfg.Inherited = logger, store, inherited
	d, err := New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	waitServing(t, serving, done)
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
			store.Close()
		})
	}
	t.Cleanup(stop)
	return d, stop
}

// TestRestartKeepsConnection: a daemon with a descriptor store gives it a
// VM's connection, guest memory file and interrupt eventfds as they arrive;
// stopped, it leaves them there; the QEMU (here the test's client) sees no
// end of stream; the next daemon, handed the descriptors back, registers
// the VM again (it was registered through the control socket), resumes the
// connection with its PCI state, and serves the same guest memory. When
// the client leaves, its descriptors leave the store and its state goes.
func TestRestartKeepsConnection(t *testing.T) {
	r := newNotifyReceiver(t)
	dir := t.TempDir()
	_, stop1 := runKeptDaemon(t, dir, r, nil)
	ctl := NewControlClient(filepath.Join(dir, "control.sock"))
	_, err := ctl.AddVM(context.Background(), VMRequest{Name: "kv1", MemBytes: 64 << 20})
	require.NoError(t, err)

	c := dialVM(t, filepath.Join(dir, "kv1.sock"))
	defer c.Close()
	fd, _, err := vfiousertest.Memfd(64 << 20)
	require.NoError(t, err)
	require.NoError(t, c.DMAMap(0, 64<<20, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, 0))
	unix.Close(fd)
	ev, err := vfiousertest.Eventfd()
	require.NoError(t, err)
	defer unix.Close(ev)
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, 1, nil, ev))
	require.NoError(t, c.Write32(vfiouser.RegionConfig, 4, 0x0006)) // memory decode + bus master
	ver, err := c.Read32(1, 0)
	require.NoError(t, err)
	require.Equal(t, uint32(20), ver)
	require.Eventually(t, func() bool { return len(r.names()) == 3 }, 5*time.Second, 5*time.Millisecond, "stored: %v", r.names())
	names := r.names()
	assert.ElementsMatch(t, []string{"kv1.conn", "kv1.i2-0"}, filterOut(names, "kv1.m"), names)
	assert.Len(t, names, 3, "the connection, the memory file and one eventfd: %v", names)
	for _, f := range []string{"vm.json", "session.json", "pci.state"} {
		assert.FileExists(t, filepath.Join(dir, "state", "kv1", f))
	}

	stop1()
	require.NoError(t, c.ExpectSilence(200*time.Millisecond), "the store holds the connection: no end of stream")

	d2, _ := runKeptDaemon(t, dir, r, r.handBack(t))
	require.Eventually(t, func() bool {
		st := d2.Status()
		return len(st.VMs) == 1 && st.VMs[0].Connected
	}, 10*time.Second, 10*time.Millisecond, "the VM is registered again and its connection resumed")
	cmd, err := c.Read32(vfiouser.RegionConfig, 4)
	require.NoError(t, err)
	assert.Equal(t, uint32(0x0006), cmd&0xffff, "the command register the guest wrote survived")
	ver, err = c.Read32(1, 0)
	require.NoError(t, err)
	assert.Equal(t, uint32(20), ver, "BAR1 decodes: the resumed device answers")
	assert.Equal(t, uint64(64<<20), d2.Status().VMs[0].LockedBytes, "guest memory mapped again from the kept file")

	c.Close()
	require.Eventually(t, func() bool { return len(r.names()) == 0 }, 10*time.Second, 10*time.Millisecond,
		"the client left: its descriptors leave the store (%v)", r.names())
	assert.NoFileExists(t, filepath.Join(dir, "state", "kv1", "session.json"))
	assert.FileExists(t, filepath.Join(dir, "state", "kv1", "vm.json"), "the VM stays registered")
}

func filterOut(names []string, prefix string) []string {
	var out []string
	for _, n := range names {
		if !strings.HasPrefix(n, prefix) {
			out = append(out, n)
		}
	}
	return out
}

// TestFDStoreNames: names the protocol cannot carry are refused before
// anything is sent.
func TestFDStoreNames(t *testing.T) {
	r := newNotifyReceiver(t)
	s, err := OpenFDStore(r.path)
	require.NoError(t, err)
	defer s.Close()
	for _, bad := range []string{"", "a:b", "a b", "a\nFDSTOREREMOVE=1", strings.Repeat("x", 256)} {
		assert.Error(t, s.Store(bad, 0), "%q", bad)
		assert.Error(t, s.Remove(bad), "%q", bad)
	}
	_, err = OpenFDStore("")
	assert.Error(t, err)
}

// TestFabricSocketsKept: in IP mode the daemon gives the store its UDP
// wire's port 4791 sockets; what arrives while no daemon runs waits in
// them, and the next daemon takes them over (instead of binding new ones)
// and receives it.
func TestFabricSocketsKept(t *testing.T) {
	inNewNetns(t, func() {
		hostNS, err := netns.Get()
		require.NoError(t, err)
		defer hostNS.Close()
		peerNS := fabricPeer(t, "10.78.0.1/24", "10.78.0.2/24")

		// While no daemon runs, a peer sends three datagrams (not RoCE:
		// the wire counts them as failing the ICRC).
		require.NoError(t, netns.Set(peerNS))
		s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, netns.Set(hostNS))
		require.NoError(t, err)
		defer unix.Close(s)
		send := func() {
			to := &unix.SockaddrInet4{Port: 4791, Addr: [4]byte{10, 78, 0, 1}}
			for i := range 3 {
				require.NoError(t, unix.Sendto(s, bytes.Repeat([]byte{0x5a + byte(i)}, 64), 0, to))
			}
		}
		// The UDP wire's receive sockets: two per family.
		names := []string{"udp4", "udp4.1", "udp6", "udp6.1"}
		checkFabricSocketsKept(t, FabricConfig{Netdev: "fab0", WireQueues: 2}, names, send)
	})
}

// TestFabricPacketSocketKept: in L2 mode the daemon gives the store its
// packet wire's socket on the bridge; the frames it captures while no
// daemon runs wait in it, and the next daemon takes it over (instead of
// opening a new one) and receives them.
func TestFabricPacketSocketKept(t *testing.T) {
	inNewNetns(t, func() {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "fabbr"}}
		require.NoError(t, netlink.LinkAdd(br))
		require.NoError(t, netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fab0"}, PeerName: "fab1"}))
		for _, name := range []string{"fab0", "fab1", "fabbr"} {
			link, err := netlink.LinkByName(name)
			require.NoError(t, err)
			if name == "fab0" {
				require.NoError(t, netlink.LinkSetMaster(link, br))
			}
			require.NoError(t, netlink.LinkSetUp(link))
		}
		// Carrier reaches the bridge through linkwatch (up to a second).
		// Polled here: the namespace is this thread's.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			link, err := netlink.LinkByName("fabbr")
			require.NoError(t, err)
			if link.Attrs().OperState == netlink.OperUp {
				break
			}
			require.True(t, time.Now().Before(deadline), "the bridge has no carrier")
		}

		// A host on the segment (behind fab1) sends three frames while no
		// daemon runs: RoCE v2, but without their ICRC.
		s, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		defer unix.Close(s)
		peer, err := netlink.LinkByName("fab1")
		require.NoError(t, err)
		send := func() {
			nf := roce.NetFields{Src: netip.MustParseAddr("::ffff:10.78.0.2").As16(), Dst: netip.MustParseAddr("::ffff:10.78.0.1").As16(),
				HopLimit: 64, SrcPort: 0xc0de}
			for i := range 3 {
				tf := roce.TransportFields{BTH: roce.BTHFields{Opcode: roce.RCSendOnly, PKey: roce.DefaultPKey, DestQP: 0x77, PSN: roce.PSN(i)}}
				d, _ := roce.Build(make([]byte, roce.DatagramSize(true, roce.RCSendOnly, 64)), &nf, &tf, 64)
				frame := append([]byte{0x52, 0x54, 0, 0, 0, 1, 0x52, 0x54, 0, 0, 0, 2, 0x08, 0x00}, d...) // to 52:54:00:00:00:01, IPv4
				require.NoError(t, unix.Sendto(s, frame, 0, &unix.SockaddrLinklayer{Ifindex: peer.Attrs().Index, Halen: 6}))
			}
		}
		checkFabricSocketsKept(t, FabricConfig{Bridge: "fabbr"}, []string{"packet"}, send)
	})
}

// checkFabricSocketsKept runs a daemon on fab under the store and checks
// that it stores the fabric's sockets (names, none inherited), stops it,
// has send put three packets with a bad ICRC on the fabric, and checks
// that the next daemon takes the sockets over and receives them (counted
// as dropped for their ICRC).
func checkFabricSocketsKept(t *testing.T, fab FabricConfig, names []string, send func()) {
	t.Helper()
	var stored []string
	for _, n := range names {
		stored = append(stored, fabricFDPrefix+n)
	}
	r := newNotifyReceiver(t)
	cfg := Config{SocketDir: t.TempDir(), Fabric: fab}
	d1, stop1 := runKeptDaemonWith(t, cfg, r, nil)
	require.Eventually(t, func() bool {
		n := r.names()
		return !slices.ContainsFunc(stored, func(s string) bool { return !slices.Contains(n, s) })
	}, 5*time.Second, 5*time.Millisecond, "stored: %v", r.names())
	assert.Zero(t, d1.Status().Counters["wire_rx_sockets_inherited"])
	stop1()

	send()

	d2, _ := runKeptDaemonWith(t, cfg, r, r.handBack(t))
	assert.Equal(t, uint64(len(names)), d2.Status().Counters["wire_rx_sockets_inherited"], "every receive socket taken over")
	require.Eventually(t, func() bool { return d2.Status().Counters["drop_bad_icrc"] == 3 }, 5*time.Second, 5*time.Millisecond,
		"what arrived while no daemon ran is received: %v", d2.Status().Counters)
	r.mu.Lock()
	removed := slices.Clone(r.removed)
	r.mu.Unlock()
	assert.Contains(t, removed, stored[0], "taken out of the store while the fabric starts")
	// Put back once the fabric runs again: not ordered with the first
	// packets received.
	assert.Eventually(t, func() bool {
		n := r.names()
		return !slices.ContainsFunc(stored, func(s string) bool { return !slices.Contains(n, s) })
	}, 5*time.Second, 5*time.Millisecond, "and put back: %v", r.names())
}

// TestCountersOutliveRestart: a connected VM's counters are checkpointed
// while it runs (Config.CounterCheckpoint), so the daemon that takes the
// connection back after a crash or restart counts on from them; and they
// go with the connection when its QEMU leaves.
func TestCountersOutliveRestart(t *testing.T) {
	r := newNotifyReceiver(t)
	dir := t.TempDir()
	vm := VMRequest{Name: "kc1", MemBytes: 64 << 20}
	cfg := Config{SocketDir: dir, VMs: []VMRequest{vm}, CounterCheckpoint: 20 * time.Millisecond}
	d1, stop1 := runKeptDaemonWith(t, cfg, r, nil)
	c := dialVM(t, filepath.Join(dir, "kc1.sock"))
	defer c.Close()
	require.NoError(t, c.Write32(vfiouser.RegionConfig, 4, 0x0006))
	// BAR1 reads wider than the register window: refused, and counted.
	const bad = 5
	for range bad {
		_, err := c.RegionRead(1, 2, 16)
		require.Error(t, err)
	}
	counter := func(d *Daemon) uint64 {
		st := d.Status()
		if len(st.VMs) != 1 || !st.VMs[0].Connected {
			return 0
		}
		return st.VMs[0].Counters["bad_bar_accesses"]
	}
	require.Equal(t, uint64(bad), counter(d1))
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(dir, "state", "kc1", "counters.json"))
		return err == nil
	}, 5*time.Second, 5*time.Millisecond, "the counters are checkpointed")
	time.Sleep(50 * time.Millisecond) // a checkpoint after the last access
	stop1()

	cfg.VMs = nil // registered again from the state directory
	d2, _ := runKeptDaemonWith(t, cfg, r, r.handBack(t))
	require.Eventually(t, func() bool { return counter(d2) == bad }, 10*time.Second, 10*time.Millisecond,
		"the successor counts on from the checkpoint: %d", counter(d2))
	_, err := c.RegionRead(1, 2, 16)
	require.Error(t, err)
	assert.Equal(t, uint64(bad+1), counter(d2))

	c.Close()
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(dir, "state", "kc1", "counters.json"))
		return errors.Is(err, os.ErrNotExist)
	}, 10*time.Second, 10*time.Millisecond, "the connection's counters go with it")
}

// TestReservationsOutliveRestart: the GIDs reserved to each VM are kept in
// the state directory, so a daemon that takes over (a crash, an upgrade)
// keeps refusing them to other VMs while their owner's QEMU is away; the
// reservations of a VM no longer registered are dropped.
func TestReservationsOutliveRestart(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{SocketDir: dir, KeepState: true, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	d1, err := New(cfg)
	require.NoError(t, err)
	for _, vm := range []string{"rv1", "rv2", "rv3"} {
		_, err := d1.AddVM(VMRequest{Name: vm})
		require.NoError(t, err)
	}
	a, b := netip.MustParseAddr("10.0.77.1"), netip.MustParseAddr("10.0.77.3")
	all := func(netip.Addr) bool { return true }
	// As a guest's GID binds reserve them (vmSession.checkGID).
	for vm, ga := range map[string]netip.Addr{"rv1": a, "rv3": b} {
		changed, err := d1.owners.reserve(vm, ga, all)
		require.NoError(t, err)
		require.True(t, changed)
		d1.saveReservations()
	}
	// rv3's registration is gone when the next daemon starts (its
	// reservation with it); d1 dies without an orderly stop (which would
	// take the state directory).
	require.NoError(t, os.RemoveAll(filepath.Join(dir, "state", "rv3")))

	for _, s := range d1.vms { // their sockets go as with the process
		s.stop()
	}
	d2, err := New(cfg)
	require.NoError(t, err)
	defer d2.close()
	_, err = d2.owners.reserve("rv2", a, all)
	require.ErrorIs(t, err, ErrGIDRefused, "rv1's GID stays rv1's")
	var res []string
	for _, v := range d2.Status().VMs {
		if v.Name == "rv1" {
			res = v.ReservedGIDs
		}
	}
	assert.Contains(t, res, "10.0.77.1")
	assert.NotContains(t, d2.owners.snapshot(), "rv3", "a VM no longer registered keeps nothing")
	changed, err := d2.owners.reserve("rv2", b, all)
	require.NoError(t, err, "so its GID is free again")
	require.True(t, changed)
}

// TestHalfMessageThenReconnect: a QEMU of a kept connection (read one
// whole message at a time) dies after 7 bytes of a message header, and a
// new QEMU connects to the VM's socket at once. The daemon notices the
// hang-up at once, so the VM's new connection is served: it negotiates and
// its device answers. (Before, the old connection stayed until the partial
// header's 5 s wait ran out, beyond the 2 s a new connection waits for the
// old one, and the new QEMU was turned away.)
func TestHalfMessageThenReconnect(t *testing.T) {
	r := newNotifyReceiver(t)
	dir := t.TempDir()
	d, _ := runKeptDaemon(t, dir, r, nil)
	ctl := NewControlClient(filepath.Join(dir, "control.sock"))
	_, err := ctl.AddVM(context.Background(), VMRequest{Name: "kv2", MemBytes: 64 << 20})
	require.NoError(t, err)
	sock := filepath.Join(dir, "kv2.sock")

	c := dialVM(t, sock)
	require.Eventually(t, func() bool { return slices.Contains(r.names(), "kv2.conn") }, 10*time.Second, 5*time.Millisecond,
		"the connection is kept")
	hdr := make([]byte, vfiouser.HeaderSize)
	vfiouser.Header{ID: 7, Command: vfiouser.CmdDeviceGetInfo, Size: vfiouser.HeaderSize + vfiouser.DeviceInfoSize}.Encode(hdr)
	require.NoError(t, c.SendRaw(hdr[:7]))
	require.NoError(t, c.Close())

	c2 := dialVM(t, sock) // the VERSION handshake: the device was made
	defer c2.Close()
	require.NoError(t, c2.Write32(vfiouser.RegionConfig, 4, 0x0006)) // memory decode + bus master
	ver, err := c2.Read32(1, 0)
	require.NoError(t, err)
	assert.Equal(t, uint32(20), ver, "the new connection's device answers")
	st := d.Status()
	require.Len(t, st.VMs, 1)
	assert.True(t, st.VMs[0].Connected)
}
