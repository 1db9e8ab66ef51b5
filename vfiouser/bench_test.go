package vfiouser_test

import (
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// BenchmarkRegionWriteRoundTrip measures what every PVRDMA doorbell costs:
// a non-posted REGION_WRITE of 4 bytes to a BAR register (through the PCI
// function model to the device callback) and its reply, over a unix
// socket. The reference, measured in the same run with the same client
// loop and message sizes, is a bare unix-socket ping-pong: a goroutine
// that reads the 36-byte request and writes a 32-byte reply. ns/op is the
// vfio-user round trip; baseline-ns/op the ping-pong; ratio their quotient
// (target <= 1.5). allocs/op counts the server side too (same process).
func BenchmarkRegionWriteRoundTrip(b *testing.B) {
	const reqSize = vfiouser.HeaderSize + vfiouser.RegionAccessSize + 4
	const repSize = vfiouser.HeaderSize + vfiouser.RegionAccessSize

	// Reference: bare ping-pong.
	bs, bc, err := vfiousertest.Socketpair()
	if err != nil {
		b.Fatal(err)
	}
	defer bc.Close()
	go func() {
		defer bs.Close()
		var req [reqSize]byte
		var rep [repSize]byte
		for {
			if _, err := io.ReadFull(bs, req[:]); err != nil {
				return
			}
			copy(rep[:], req[:repSize])
			if _, err := bs.Write(rep[:]); err != nil {
				return
			}
		}
	}()

	// vfio-user: a real connection to a test device.
	srv, err := vfiouser.NewServer(vfiouser.Config{NewDevice: testdev.Factory(nil),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	c := vfiousertest.Pair(b, srv)
	if _, err := c.Negotiate(vfiousertest.QEMUCaps); err != nil {
		b.Fatal(err)
	}
	if err := c.RegionWrite(vfiouser.RegionConfig, 4, []byte{0x06, 0}, false); err != nil {
		b.Fatal(err)
	}
	req := c.Build(vfiouser.CmdRegionWrite, 0, regionAccess(bar1, testdev.RegScratch, 4, le32(0x1234)))

	loop := func(conn *net.UnixConn, n int) time.Duration {
		var rep [repSize]byte
		start := time.Now()
		for i := 0; i < n; i++ {
			if _, err := conn.Write(req); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(conn, rep[:]); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	loop(bc, 1000) // warm up both paths
	loop(c.Conn(), 1000)
	if v, err := c.Read32(bar1, testdev.RegScratch); err != nil || v != 0x1234 {
		b.Fatalf("the writes did not reach the device: %#x, %v", v, err)
	}

	b.ReportAllocs()
	b.StopTimer()
	base := loop(bc, b.N)
	b.StartTimer()
	vu := loop(c.Conn(), b.N)
	b.StopTimer()
	b.ReportMetric(float64(base.Nanoseconds())/float64(b.N), "baseline-ns/op")
	b.ReportMetric(float64(vu)/float64(base), "ratio")
}
