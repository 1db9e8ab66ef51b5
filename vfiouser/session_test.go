package vfiouser_test

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// memKeeper keeps duplicates of a connection's descriptors, as systemd's
// file descriptor store does for the daemon.
type memKeeper struct {
	mu     sync.Mutex
	fds    map[string]int
	sess   *vfiouser.Session
	forgot []string
	hosts  []*vfiouser.Host
}

func newMemKeeper() *memKeeper { return &memKeeper{fds: map[string]int{}} }

func (k *memKeeper) Keep(name string, fd int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if _, ok := k.fds[name]; ok {
		return nil
	}
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	k.fds[name] = d
	return nil
}

func (k *memKeeper) Forget(name string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if fd, ok := k.fds[name]; ok {
		unix.Close(fd)
		delete(k.fds, name)
	}
	k.forgot = append(k.forgot, name)
}

func (k *memKeeper) Saved(s *vfiouser.Session) {
	b, _ := json.Marshal(s) // what a daemon writes to its state file
	var c vfiouser.Session
	_ = json.Unmarshal(b, &c)
	k.mu.Lock()
	k.sess = &c
	k.mu.Unlock()
}

// take hands the kept descriptors to a new server: the connection and the
// rest by name (duplicates: the keeper keeps its own).
func (k *memKeeper) take(t *testing.T) (*net.UnixConn, *vfiouser.Session, map[string]int) {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	files := map[string]int{}
	var uc *net.UnixConn
	for name, fd := range k.fds {
		d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
		if name != vfiouser.ConnName {
			files[name] = d
			continue
		}
		f := os.NewFile(uintptr(d), "kept-conn")
		nc, err := net.FileConn(f)
		f.Close()
		require.NoError(t, err)
		uc = nc.(*net.UnixConn)
	}
	require.NotNil(t, uc, "the connection was kept")
	require.NotNil(t, k.sess, "a session was saved")
	return uc, k.sess, files
}

func keptFactory(k *memKeeper, devs chan *testdev.Device, resumed chan bool) vfiouser.NewDeviceFunc {
	inner := testdev.Factory(devs)
	return func(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
		h.Keeper = k
		k.mu.Lock()
		k.hosts = append(k.hosts, h)
		k.mu.Unlock()
		resumed <- h.Resumed
		return inner(ctx, h)
	}
}

// TestResumeKeepsConnection: a server whose connection's descriptors were
// kept goes away; the client sees no end of stream; a new server resumes
// the connection from the kept descriptors and session, and guest memory,
// interrupts and unmapping work as before.
func TestResumeKeepsConnection(t *testing.T) {
	k := newMemKeeper()
	devs := make(chan *testdev.Device, 4)
	resumed := make(chan bool, 4)
	cfg := vfiouser.Config{NewDevice: keptFactory(k, devs, resumed), Logger: testLogger(t)}
	srv1, err := vfiouser.NewServer(cfg)
	require.NoError(t, err)

	s, cl, err := vfiousertest.Socketpair()
	require.NoError(t, err)
	done1 := make(chan error, 1)
	go func() { done1 <- srv1.ServeConn(s, "first") }()
	c := vfiousertest.NewClient(cl)
	defer c.Close()
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	require.False(t, <-resumed)
	<-devs

	const ramSize = 1 << 20
	fd, ram, err := vfiousertest.Memfd(ramSize)
	require.NoError(t, err)
	defer unix.Munmap(ram)
	require.NoError(t, c.DMAMap(0, ramSize/2, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, 0))
	require.NoError(t, c.DMAMap(ramSize/2, ramSize/2, vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, ramSize/2))
	unix.Close(fd)
	vecs := make([]int, testdev.Vectors)
	for i := range vecs {
		vecs[i], err = vfiousertest.Eventfd()
		require.NoError(t, err)
		defer unix.Close(vecs[i])
	}
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, testdev.Vectors, nil, vecs...))

	k.mu.Lock()
	names := len(k.fds)
	sess := k.sess
	k.mu.Unlock()
	require.Equal(t, 1+1+testdev.Vectors, names, "the connection, one file for two maps of it, and each vector's eventfd")
	require.Len(t, sess.DMA, 2)
	require.Equal(t, sess.DMA[0].File, sess.DMA[1].File)
	require.Len(t, sess.IRQs, testdev.Vectors)

	// The daemon lets go of the connection on purpose (a crash would too,
	// with less ceremony): the keeper keeps it, the client sees nothing.
	k.mu.Lock()
	for _, h := range k.hosts {
		h.StopKeeping()
	}
	k.mu.Unlock()
	require.NoError(t, srv1.Close())
	<-done1
	require.NoError(t, c.ExpectSilence(100*time.Millisecond), "no end of stream while the keeper holds the socket")

	srv2, err := vfiouser.NewServer(cfg)
	require.NoError(t, err)
	defer srv2.Close()
	uc, sess, files := k.take(t)
	done2 := make(chan error, 1)
	go func() { done2 <- srv2.Resume(uc, "second", sess, files) }()
	require.True(t, <-resumed, "the factory is told the connection is resumed")
	dev := <-devs

	// The new device sees the same guest memory (both maps) and raises
	// interrupts through the same eventfds.
	cfgWrite(t, c, 0x04, 0x06, 0x01) // memory, bus master
	cfgWrite(t, c, 0x40+2, 0x03, 0x80)
	assert.True(t, dev.Fn.BusMaster())
	writeRegs(t, c, map[uint64]uint32{testdev.RegDMALo: ramSize/2 - 100, testdev.RegDMAHi: 0, testdev.RegDMALen: 300, testdev.RegDMASeed: 9})
	runDMA(t, c, testdev.DMAFill)
	assert.Zero(t, reg(t, c, testdev.RegDMAErr))
	assert.Equal(t, testdev.Pattern(9, 300), ram[ramSize/2-100:ramSize/2+200])
	require.NoError(t, c.Write32(bar1, testdev.RegIRQ, 1))
	n, _ := vfiousertest.ReadEventfd(vecs[1])
	assert.Equal(t, uint64(1), n, "vector 1 fires through the kept eventfd")

	// Unmapping after the resume lets the file go once its last map goes.
	require.NoError(t, c.DMAUnmap(0, ramSize/2, 0))
	k.mu.Lock()
	assert.NotContains(t, k.forgot, sess.DMA[0].File)
	k.mu.Unlock()
	require.NoError(t, c.DMAUnmap(ramSize/2, ramSize/2, 0))
	k.mu.Lock()
	assert.Contains(t, k.forgot, sess.DMA[0].File)
	assert.Len(t, k.sess.DMA, 0)
	k.mu.Unlock()

	// The client leaves: everything is forgotten.
	c.Close()
	select {
	case <-done2:
	case <-time.After(5 * time.Second):
		t.Fatal("resumed connection did not end")
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	assert.Empty(t, k.fds, "the keeper let go of every descriptor")
}

// TestResumeRefusesBadSession: a session that does not match the kept
// descriptors or the server's limits is refused before anything is mapped.
func TestResumeRefusesBadSession(t *testing.T) {
	devs := make(chan *testdev.Device, 4)
	srv, err := vfiouser.NewServer(vfiouser.Config{NewDevice: testdev.Factory(devs), Logger: testLogger(t)})
	require.NoError(t, err)
	defer srv.Close()
	peer := vfiouser.SessionPeer{MaxMsgFDs: 16, MaxDataXfer: 1 << 20, MaxDMAMaps: 100, PageSizes: 4096}
	memfd, ram, err := vfiousertest.Memfd(1 << 16)
	require.NoError(t, err)
	defer unix.Munmap(ram)
	defer unix.Close(memfd)
	name, err := vfiouser.FileName(memfd)
	require.NoError(t, err)
	ev, err := vfiousertest.Eventfd()
	require.NoError(t, err)
	defer unix.Close(ev)
	for _, tc := range []struct {
		what string
		s    vfiouser.Session
		file string
		fd   int
	}{
		{"version", vfiouser.Session{Version: 99, Peer: peer}, "", -1},
		{"peer", vfiouser.Session{Version: 1}, "", -1},
		{"unaligned map", vfiouser.Session{Version: 1, Peer: peer, DMA: []vfiouser.SessionDMA{{Addr: 1, Size: 4096, Prot: 3}}}, "", -1},
		{"missing file", vfiouser.Session{Version: 1, Peer: peer, DMA: []vfiouser.SessionDMA{{Size: 4096, Prot: 3, File: "mx"}}}, "", -1},
		{"file too short", vfiouser.Session{Version: 1, Peer: peer, DMA: []vfiouser.SessionDMA{{Size: 1 << 20, Prot: 3, File: name}}}, name, memfd},
		{"file is another", vfiouser.Session{Version: 1, Peer: peer, DMA: []vfiouser.SessionDMA{{Size: 4096, Prot: 3, File: "m1-2-2"}}}, "m1-2-2", ev},
		{"irq not eventfd", vfiouser.Session{Version: 1, Peer: peer, IRQs: []vfiouser.SessionIRQ{{Index: vfiouser.IRQMSIX, File: "i2-0"}}}, "i2-0", memfd},
		{"vector out of range", vfiouser.Session{Version: 1, Peer: peer, IRQs: []vfiouser.SessionIRQ{{Index: vfiouser.IRQMSIX, Vector: 999, File: "i2-999"}}}, "i2-999", ev},
	} {
		s, cl, err := vfiousertest.Socketpair()
		require.NoError(t, err)
		files := map[string]int{}
		if tc.fd >= 0 {
			d, err := unix.FcntlInt(uintptr(tc.fd), unix.F_DUPFD_CLOEXEC, 0)
			require.NoError(t, err)
			files[tc.file] = d
		}
		err = srv.Resume(s, tc.what, &tc.s, files)
		assert.Error(t, err, tc.what)
		cl.Close()
	}
	assert.Zero(t, srv.Stats().LockedBytes, "nothing stays mapped")
}

// TestHoldParksAtMessageBoundaries: a held server answers nothing new
// (requests wait in the socket), a request under way is answered, and
// Release serves what waited, in order.
func TestHoldParksAtMessageBoundaries(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, dev := connect(t, srv, devs)
	cfgWrite(t, c, 0x04, 0x02, 0x00) // memory decode
	require.NoError(t, c.Write32(bar1, testdev.RegScratch, 1))

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, srv.Hold(ctx))
	require.NoError(t, srv.Hold(ctx), "holding twice is fine")
	id, err := c.Send(vfiouser.CmdRegionWrite, 0, regionWrite(bar1, testdev.RegScratch, 2))
	require.NoError(t, err)
	require.NoError(t, c.ExpectSilence(100*time.Millisecond), "a held connection answers nothing")
	assert.Equal(t, uint32(1), dev.Scratch(), "nor executes it")

	srv.Release()
	_, err = c.Expect(id, vfiouser.CmdRegionWrite)
	require.NoError(t, err)
	assert.Equal(t, uint32(2), dev.Scratch(), "the request that waited is served after Release")
	v, err := c.Read32(bar1, testdev.RegScratch)
	require.NoError(t, err)
	assert.Equal(t, uint32(2), v)
}

func regionWrite(region uint32, off uint64, v uint32) []byte {
	p := make([]byte, vfiouser.RegionAccessSize+4)
	vfiouser.RegionAccess{Offset: off, Region: region, Count: 4}.Encode(p)
	p[vfiouser.RegionAccessSize] = byte(v)
	return p
}
