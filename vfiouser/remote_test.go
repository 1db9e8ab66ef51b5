package vfiouser_test

import (
	"context"
	"errors"
	"hash/crc32"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// hostServer serves test devices and hands out each connection's Host.
func hostServer(t testing.TB, mod func(*vfiouser.Config)) (*vfiouser.Server, chan *vfiouser.Host) {
	t.Helper()
	hosts := make(chan *vfiouser.Host, 4)
	cfg := vfiouser.Config{Logger: testLogger(t), DMATimeout: 2 * time.Second,
		NewDevice: func(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
			d, err := testdev.New(h)
			if err != nil {
				return nil, err
			}
			hosts <- h
			return d.Fn, nil
		}}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := vfiouser.NewServer(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	return srv, hosts
}

// TestRemoteDMAFromOtherGoroutines: device goroutines read and write guest
// memory that came without a descriptor while the serve loop waits for
// client commands; the serve loop delivers their replies. Replies from the
// client and its commands interleave.
func TestRemoteDMAFromOtherGoroutines(t *testing.T) {
	srv, hosts := hostServer(t, nil)
	c := vfiousertest.Pair(t, srv)
	_, err := c.Negotiate(`{"capabilities":{"max_data_xfer_size":65536}}`)
	require.NoError(t, err)
	h := <-hosts
	ram := make([]byte, 1<<20)
	c.ServeMemory(0x100000, ram)
	require.NoError(t, c.DMAMap(0x100000, 1<<20, rw, -1, 0))

	const workers = 4
	var wg sync.WaitGroup
	var failed atomic.Int32
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := guestmem.GPA(0x100000 + w*0x40000)
			data := testdev.Pattern(uint32(w*31), 0x30000) // several 64 KiB requests
			if err := h.Memory.WriteAt(data, base+0x100); err != nil {
				t.Errorf("worker %d write: %v", w, err)
				failed.Add(1)
				return
			}
			got := make([]byte, len(data))
			if err := h.Memory.ReadAt(got, base+0x100); err != nil {
				t.Errorf("worker %d read: %v", w, err)
				failed.Add(1)
				return
			}
			if string(got) != string(data) {
				t.Errorf("worker %d read back different bytes", w)
				failed.Add(1)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	// The client keeps issuing commands; Recv answers DMA requests.
	polls := 0
loop:
	for {
		select {
		case <-done:
			break loop
		default:
		}
		_, err := c.DeviceInfo()
		require.NoError(t, err)
		polls++
	}
	require.Zero(t, failed.Load())
	assert.Equal(t, testdev.Pattern(31, 0x30000), ram[0x40100:0x70100])
	assert.GreaterOrEqual(t, c.DMARequests(), workers*2*3, "64 KiB chunks (client max_data_xfer_size)")
	t.Logf("%d DMA requests answered during %d client commands", c.DMARequests(), polls)
}

// TestRemoteDMATimeout: a client that does not answer makes the request
// fail after DMATimeout; a late answer is dropped and the connection goes
// on.
func TestRemoteDMATimeout(t *testing.T) {
	srv, hosts := hostServer(t, func(c *vfiouser.Config) { c.DMATimeout = 150 * time.Millisecond })
	c := vfiousertest.Pair(t, srv)
	_, err := c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	h := <-hosts
	ram := make([]byte, 0x1000)
	c.ServeMemory(0x5000, ram)
	require.NoError(t, c.DMAMap(0x5000, 0x1000, rw, -1, 0))

	start := time.Now()
	err = h.Memory.ReadAt(make([]byte, 8), 0x5000) // nobody reads the request
	assert.ErrorIs(t, err, vfiouser.ErrTimeout)
	assert.GreaterOrEqual(t, time.Since(start), 150*time.Millisecond)
	// The client now sees the stale request, answers it, and carries on.
	_, err = c.DeviceInfo()
	require.NoError(t, err)
	assert.Equal(t, 1, c.DMARequests())
	_, err = c.DeviceInfo()
	require.NoError(t, err)
}

// TestRemoteDMADisconnect: a pending request fails when the client goes.
func TestRemoteDMADisconnect(t *testing.T) {
	srv, hosts := hostServer(t, func(c *vfiouser.Config) { c.DMATimeout = 10 * time.Second })
	c := vfiousertest.Pair(t, srv)
	_, err := c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	h := <-hosts
	require.NoError(t, c.DMAMap(0x5000, 0x1000, rw, -1, 0))
	errc := make(chan error, 1)
	go func() { errc <- h.Memory.WriteAt([]byte{1, 2, 3}, 0x5000) }()
	time.Sleep(50 * time.Millisecond)
	c.Close()
	select {
	case err := <-errc:
		assert.ErrorIs(t, err, vfiouser.ErrDisconnected)
	case <-time.After(5 * time.Second):
		t.Fatal("pending DMA did not fail on disconnect")
	}
	// After the disconnect the memory is gone.
	waitFor(t, func() bool { return srv.Stats().Connections == 0 })
	assert.ErrorIs(t, h.Memory.ReadAt(make([]byte, 1), 0x5000), guestmem.ErrUnmapped)
}

// TestRequireSharedMemory: a device that needs RAM in place gets a clear
// error for fd-less RAM (naming the QEMU options), and no message is sent.
func TestRequireSharedMemory(t *testing.T) {
	srv, err := vfiouser.NewServer(vfiouser.Config{Logger: testLogger(t),
		NewDevice: func(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
			return &sharedDev{h: h}, nil
		}})
	require.NoError(t, err)
	defer srv.Close()
	c := vfiousertest.Pair(t, srv)
	_, err = c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	require.NoError(t, c.DMAMap(0, 0x100000, rw, -1, 0), "the map itself is accepted")
	b, err := c.RegionRead(0, 0, 4)
	require.NoError(t, err)
	assert.Equal(t, []byte{0xee, 0xee, 0xee, 0xee}, b, "device saw an error")
	assert.Zero(t, c.DMARequests())
}

type sharedDev struct{ h *vfiouser.Host }

func (d *sharedDev) Describe() vfiouser.Description {
	return vfiouser.Description{Regions: []vfiouser.Region{{Size: 4096, Read: true, Write: true}}, RequireSharedMemory: true}
}

func (d *sharedDev) ReadRegion(index uint32, off uint64, p []byte) error {
	err := d.h.Memory.ReadAt(make([]byte, 4), 0x1000)
	if errors.Is(err, guestmem.ErrNotShared) && strings.Contains(err.Error(), "memory-backend-memfd") && strings.Contains(err.Error(), "share=on") {
		for i := range p {
			p[i] = 0xee
		}
	}
	return nil
}

func (d *sharedDev) WriteRegion(uint32, uint64, []byte) error { return nil }
func (d *sharedDev) Reset(vfiouser.ResetReason) error         { return nil }
func (d *sharedDev) Close() error                             { return nil }

// TestTriggerRacesSetIRQs: device goroutines trigger while the client keeps
// replacing and removing the eventfds. Run with -race: no data race, no
// write to a closed descriptor (which would show as EBADF errors or, worse,
// a write into a reused descriptor), and the final assignment works.
func TestTriggerRacesSetIRQs(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, dev := connect(t, srv, devs)
	cfgWrite(t, c, 4, 0x06, 0)       // memory + bus master
	cfgWrite(t, c, 0x42, 0x03, 0x80) // MSI-X on
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var bad atomic.Int32
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := dev.Fn.TriggerMSIX(w); err != nil {
					bad.Add(1)
				}
				runtime.Gosched()
			}
		}()
	}
	for i := 0; i < 60; i++ {
		fds := eventfds(t, 4)
		require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, efdTrig, 0, 4, nil, fds...))
		closeAll(fds)
		if i%3 == 0 {
			require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 0, 0, nil))
		}
	}
	close(stop)
	wg.Wait()
	assert.Zero(t, bad.Load(), "TriggerMSIX never failed (pending or delivered)")
	fds := eventfds(t, 4)
	defer closeAll(fds)
	require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, efdTrig, 0, 4, nil, fds...))
	for v := 0; v < 3; v++ {
		vfiousertest.ReadEventfd(fds[v]) // pending deliveries from the race
		require.NoError(t, dev.Fn.TriggerMSIX(v))
		n, err := vfiousertest.ReadEventfd(fds[v])
		require.NoError(t, err)
		assert.Equal(t, uint64(1), n)
	}
}

// syncDMADev reads guest memory from inside its region write callback: the
// serve goroutine itself waits for the client's DMA reply, reading the
// socket (and queueing client commands) until it arrives. Clients that
// serve DMA concurrently with their MMIO (unlike QEMU) allow this.
type syncDMADev struct {
	h   *vfiouser.Host
	sum uint32
	err error
}

func (d *syncDMADev) Describe() vfiouser.Description {
	return vfiouser.Description{Regions: []vfiouser.Region{{Size: 0x10000, Read: true, Write: true}}}
}

func (d *syncDMADev) ReadRegion(_ uint32, _ uint64, p []byte) error {
	le32 := []byte{byte(d.sum), byte(d.sum >> 8), byte(d.sum >> 16), byte(d.sum >> 24)}
	copy(p, le32)
	return nil
}

func (d *syncDMADev) WriteRegion(_ uint32, off uint64, p []byte) error {
	buf := make([]byte, 0x3000)
	d.err = d.h.Memory.ReadAt(buf, guestmem.GPA(0x200000+off))
	d.sum = crc32.ChecksumIEEE(buf)
	return d.err
}
func (d *syncDMADev) Reset(vfiouser.ResetReason) error { return nil }
func (d *syncDMADev) Close() error                     { return nil }

func TestRemoteDMAInsideHandler(t *testing.T) {
	devs := make(chan *syncDMADev, 1)
	srv, err := vfiouser.NewServer(vfiouser.Config{Logger: testLogger(t),
		NewDevice: func(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
			d := &syncDMADev{h: h}
			devs <- d
			return d, nil
		}})
	require.NoError(t, err)
	defer srv.Close()
	c := vfiousertest.Pair(t, srv)
	_, err = c.Negotiate(`{"capabilities":{"max_data_xfer_size":4096}}`)
	require.NoError(t, err)
	ram := testdev.Pattern(5, 0x10000)
	c.ServeMemory(0x200000, ram)
	require.NoError(t, c.DMAMap(0x200000, 0x10000, rw, -1, 0))
	for _, off := range []uint64{0, 0x1000, 0x2345} {
		require.NoError(t, c.RegionWrite(0, off, []byte{1}, false))
		v, err := c.Read32(0, 0)
		require.NoError(t, err)
		assert.Equal(t, crc32.ChecksumIEEE(ram[off:off+0x3000]), v)
	}
	assert.Equal(t, 9, c.DMARequests(), "three 4 KiB requests per write")
}

// TestUnmapWaitsForInFlight: DMA_UNMAP replies only after the device has
// stopped using the region (vfio-user spec: the server must release all
// references before replying).
func TestUnmapWaitsForInFlight(t *testing.T) {
	srv, hosts := hostServer(t, nil)
	c := vfiousertest.Pair(t, srv)
	_, err := c.Negotiate(vfiousertest.QEMUCaps)
	require.NoError(t, err)
	h := <-hosts
	fd, mem, err := vfiousertest.Memfd(0x10000)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	defer unix.Close(fd)
	require.NoError(t, c.DMAMap(0x40000, 0x10000, rw, fd, 0))
	b, pin, err := h.Memory.Slice(0x41000, 0x100, true) // a device access in flight
	require.NoError(t, err)
	copy(b, "in place")
	assert.Equal(t, "in place", string(mem[0x1000:0x1008]))

	id, err := c.Send(vfiouser.CmdDMAUnmap, 0, dmaUnmap(0, 0x40000, 0x10000))
	require.NoError(t, err)
	require.NoError(t, c.ExpectSilence(100*time.Millisecond), "no reply while the region is in use")
	pin.Release()
	_, err = c.Expect(id, vfiouser.CmdDMAUnmap)
	require.NoError(t, err)
	_, _, err = h.Memory.Slice(0x41000, 0x100, false)
	assert.ErrorIs(t, err, guestmem.ErrUnmapped)
	assert.Zero(t, srv.Stats().LockedBytes)
}
