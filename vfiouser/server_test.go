package vfiouser_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

func dial(t testing.TB, path string) *vfiousertest.Client {
	t.Helper()
	nc, err := net.Dial("unix", path)
	require.NoError(t, err)
	c := vfiousertest.NewClient(nc.(*net.UnixConn))
	t.Cleanup(func() { c.Close() })
	return c
}

// TestServeManySockets: one server, several sockets (one per VM), several
// clients at once, each with its own device; Shutdown waits for them.
func TestServeManySockets(t *testing.T) {
	srv, devs := newServer(t, nil)
	dir := t.TempDir()
	var serveErrs sync.WaitGroup
	paths := []string{filepath.Join(dir, "vm1.sock"), filepath.Join(dir, "vm2.sock"), filepath.Join(dir, "vm3.sock")}
	for _, p := range paths {
		ln, err := vfiouser.Listen(p)
		require.NoError(t, err)
		serveErrs.Add(1)
		go func() {
			defer serveErrs.Done()
			assert.ErrorIs(t, srv.Serve(ln), vfiouser.ErrServerClosed)
		}()
	}
	var wg sync.WaitGroup
	clients := make([]*vfiousertest.Client, 6)
	for i := range clients {
		clients[i] = dial(t, paths[i%len(paths)])
	}
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := c.Negotiate(vfiousertest.QEMUCaps)
			if !assert.NoError(t, err) {
				return
			}
			if !assert.NoError(t, c.RegionWrite(vfiouser.RegionConfig, 4, []byte{2, 0}, false)) {
				return
			}
			for k := 0; k < 200; k++ {
				v := uint32(i<<16 | k)
				if !assert.NoError(t, c.Write32(bar1, testdev.RegScratch, v)) {
					return
				}
				got, err := c.Read32(bar1, testdev.RegScratch)
				if !assert.NoError(t, err) || !assert.Equal(t, v, got, "client %d sees only its own device", i) {
					return
				}
			}
		}()
	}
	wg.Wait()
	for range clients {
		<-devs
	}
	assert.Equal(t, len(clients), srv.Stats().Connections)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	go func() {
		time.Sleep(20 * time.Millisecond)
		for _, c := range clients[:3] {
			c.Close()
		}
	}()
	assert.ErrorIs(t, srv.Shutdown(ctx), context.DeadlineExceeded, "three clients stay: Shutdown gives up and closes them")
	serveErrs.Wait()
	assert.Zero(t, srv.Stats().Connections)
	_, err := net.Dial("unix", paths[0])
	assert.Error(t, err, "no longer listening")
	for _, c := range clients[3:] {
		_, err := c.Recv()
		assert.Error(t, err, "closed by the server")
	}
}

func TestShutdownWaitsForClients(t *testing.T) {
	srv, _ := newServer(t, nil)
	path := filepath.Join(t.TempDir(), "s.sock")
	ln, err := vfiouser.Listen(path)
	require.NoError(t, err)
	go srv.Serve(ln)
	c := dial(t, path)
	_, err = c.Negotiate("")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- srv.Shutdown(context.Background()) }()
	select {
	case <-done:
		t.Fatal("Shutdown returned with a client connected")
	case <-time.After(50 * time.Millisecond):
	}
	_, err = c.DeviceInfo()
	require.NoError(t, err, "existing clients are still served during Shutdown")
	c.Close()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Shutdown did not return after the client left")
	}
	assert.ErrorIs(t, srv.Serve(mustListen(t)), vfiouser.ErrServerClosed)
}

func mustListen(t testing.TB) net.Listener {
	ln, err := vfiouser.Listen(filepath.Join(t.TempDir(), "x.sock"))
	require.NoError(t, err)
	return ln
}

func TestListenReplacesStaleSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stale.sock")
	ln, err := vfiouser.Listen(path)
	require.NoError(t, err)
	_, err = vfiouser.Listen(path)
	assert.Error(t, err, "a live listener is not replaced")
	ln.SetUnlinkOnClose(false)
	ln.Close()
	_, err = os.Stat(path)
	require.NoError(t, err, "the socket file is left behind, as after a crash")
	ln2, err := vfiouser.Listen(path)
	require.NoError(t, err)
	ln2.Close()
}

func TestServeFD(t *testing.T) {
	srv, devs := newServer(t, nil)
	// An inherited connected socket.
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- srv.ServeFD(fds[0]) }()
	f := os.NewFile(uintptr(fds[1]), "client")
	nc, err := net.FileConn(f)
	f.Close()
	require.NoError(t, err)
	c := vfiousertest.NewClient(nc.(*net.UnixConn))
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	<-devs
	c.Close()
	require.NoError(t, <-done)

	// An inherited listening socket.
	path := filepath.Join(t.TempDir(), "fd.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	lf, err := ln.File()
	require.NoError(t, err)
	ln.SetUnlinkOnClose(false)
	ln.Close()
	// ServeFD owns the descriptor it is given: hand it a dup and close lf,
	// or lf's finalizer would later close a number the process has reused
	// (it once closed the next test's listener).
	lfd, err := unix.Dup(int(lf.Fd()))
	require.NoError(t, err)
	require.NoError(t, lf.Close())
	go func() { done <- srv.ServeFD(lfd) }()
	c2 := dial(t, path)
	_, err = c2.Negotiate("")
	require.NoError(t, err)
	srv.Close()
	assert.ErrorIs(t, <-done, vfiouser.ErrServerClosed)

	assert.Error(t, srv.ServeFD(int(os.Stdin.Fd())+1000), "not a descriptor")
}

func TestConfigValidation(t *testing.T) {
	nd := testdev.Factory(nil)
	for _, cfg := range []vfiouser.Config{
		{},
		{NewDevice: nd, MaxMsgFDs: 17},
		{NewDevice: nd, MaxDataXfer: 100},
		{NewDevice: nd, MaxDataXfer: 128 << 20},
		{NewDevice: nd, MaxDMAMaps: 70000},
	} {
		_, err := vfiouser.NewServer(cfg)
		assert.Error(t, err, "%+v", cfg)
	}
}

// TestFactoryFailure: a device that cannot be made closes the connection.
func TestFactoryFailure(t *testing.T) {
	srv, err := vfiouser.NewServer(vfiouser.Config{Logger: testLogger(t),
		NewDevice: func(context.Context, *vfiouser.Host) (vfiouser.Device, error) {
			return nil, errors.New("no capacity")
		}})
	require.NoError(t, err)
	s, c, err := vfiousertest.Socketpair()
	require.NoError(t, err)
	defer c.Close()
	assert.ErrorContains(t, srv.ServeConn(s, "x"), "no capacity")
	_, err = c.Read(make([]byte, 1))
	assert.Error(t, err)
}

// mmapDev offers a memfd-backed region with two mappable areas.
type mmapDev struct{ fd int }

func (d *mmapDev) Describe() vfiouser.Description {
	return vfiouser.Description{PCI: true, Regions: []vfiouser.Region{
		{Size: 0x10000, Read: true, Write: true, Mmap: &vfiouser.RegionMmap{FD: d.fd, Offset: 0x2000,
			Areas: []vfiouser.MmapArea{{Offset: 0x1000, Size: 0x1000}, {Offset: 0x8000, Size: 0x8000}}}},
		{Size: 0x1000, Read: true, Mmap: &vfiouser.RegionMmap{FD: d.fd}},
	}}
}
func (d *mmapDev) ReadRegion(uint32, uint64, []byte) error  { return nil }
func (d *mmapDev) WriteRegion(uint32, uint64, []byte) error { return nil }
func (d *mmapDev) Reset(vfiouser.ResetReason) error         { return nil }
func (d *mmapDev) Close() error                             { return nil }

func TestRegionInfoSparseMmap(t *testing.T) {
	fd, mem, err := vfiousertest.Memfd(0x20000)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	defer unix.Close(fd)
	srv, err := vfiouser.NewServer(vfiouser.Config{Logger: testLogger(t),
		NewDevice: func(context.Context, *vfiouser.Host) (vfiouser.Device, error) { return &mmapDev{fd: fd}, nil }})
	require.NoError(t, err)
	defer srv.Close()
	c := vfiousertest.Pair(t, srv)
	_, err = c.Negotiate("")
	require.NoError(t, err)

	// argsz too small for the capability: argsz says what is needed.
	ri, caps, fds, err := c.RegionInfo(0, vfiouser.RegionInfoSize)
	require.NoError(t, err)
	closeAll(fds)
	assert.Len(t, fds, 1, "a mappable region comes with its descriptor")
	want := uint32(vfiouser.RegionInfoSize + vfiouser.SparseMmapHeaderSize + 2*vfiouser.SparseAreaSize)
	assert.Equal(t, want, ri.Argsz)
	assert.Equal(t, vfiouser.RegionFlagRead|vfiouser.RegionFlagWrite|vfiouser.RegionFlagMmap, ri.Flags)
	assert.Empty(t, caps)

	ri, caps, fds, err = c.RegionInfo(0, want)
	require.NoError(t, err)
	require.Len(t, fds, 1)
	assert.Equal(t, vfiouser.RegionFlagRead|vfiouser.RegionFlagWrite|vfiouser.RegionFlagMmap|vfiouser.RegionFlagCaps, ri.Flags)
	assert.Equal(t, uint32(vfiouser.RegionInfoSize), ri.CapOffset)
	assert.Equal(t, uint64(0x2000), ri.Offset)
	require.Len(t, caps, vfiouser.SparseMmapHeaderSize+2*vfiouser.SparseAreaSize)
	assert.Equal(t, []byte{1, 0, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0}, caps[:16], "id 1 version 1 next 0, 2 areas")
	assert.Equal(t, uint64(0x8000), le64(caps[32:]))
	// The descriptor maps the device's memory.
	copy(mem[0x2000+0x1000:], "hello")
	m, err := unix.Mmap(fds[0], 0x2000, 0x2000, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(m[0x1000:0x1005]))
	unix.Munmap(m)
	closeAll(fds)

	ri, caps, fds, err = c.RegionInfo(1, 64)
	require.NoError(t, err)
	closeAll(fds)
	assert.Equal(t, vfiouser.RegionFlagRead|vfiouser.RegionFlagMmap, ri.Flags, "whole-region mmap needs no capability")
	assert.Empty(t, caps)
	_, err = c.RegionRead(1, 0, 4)
	require.NoError(t, err)
	err = c.RegionWrite(1, 0, []byte{1}, false)
	assert.ErrorIs(t, err, syscall.EPERM, "read-only region")
}

func le64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

func TestDescriptionValidation(t *testing.T) {
	for i, d := range []vfiouser.Description{
		{Regions: make([]vfiouser.Region, 101)},
		{IRQs: make([]vfiouser.IRQ, 51)},
		{IRQs: []vfiouser.IRQ{{Count: 4096}}},
		{Regions: []vfiouser.Region{{Size: 0x1000, Mmap: &vfiouser.RegionMmap{FD: -1}}}},
		{Regions: []vfiouser.Region{{Size: 0x1000, Mmap: &vfiouser.RegionMmap{FD: 0, Areas: []vfiouser.MmapArea{{Offset: 0x800, Size: 0x1000}}}}}},
	} {
		srv, err := vfiouser.NewServer(vfiouser.Config{Logger: testLogger(t),
			NewDevice: func(context.Context, *vfiouser.Host) (vfiouser.Device, error) { return &fixedDev{d}, nil }})
		require.NoError(t, err)
		s, c, err := vfiousertest.Socketpair()
		require.NoError(t, err)
		assert.ErrorIs(t, srv.ServeConn(s, fmt.Sprint(i)), vfiouser.ErrInvalid, "description %d", i)
		c.Close()
	}
}

type fixedDev struct{ d vfiouser.Description }

func (f *fixedDev) Describe() vfiouser.Description           { return f.d }
func (f *fixedDev) ReadRegion(uint32, uint64, []byte) error  { return nil }
func (f *fixedDev) WriteRegion(uint32, uint64, []byte) error { return nil }
func (f *fixedDev) Reset(vfiouser.ResetReason) error         { return nil }
func (f *fixedDev) Close() error                             { return nil }
