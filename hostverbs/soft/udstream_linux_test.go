package soft

import (
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// TestUDTwoWayStream: two UD QPs stream small datagrams at each other, both ways at
// once, each side sending only while the peer has a receive posted for the datagram
// (the flow control tests/e2e TestUDStream's guests use) and reposting each receive as
// it completes, in process and over UDP through the kernel. Every datagram arrives,
// once, with its sequence number, and nothing is dropped.
func TestUDTwoWayStream(t *testing.T) {
	t.Run("local", func(t *testing.T) {
		udTwoWayStream(t, newFabric(t, Config{}), "10.0.0.1", "10.0.0.2")
	})
	t.Run("udp", func(t *testing.T) {
		needRoot(t)
		ns := newNetns(t, "lo")
		udTwoWayStream(t, newFabricOn(t, ns, Config{DisableLocalDelivery: true}, "udp"), "127.0.0.1", "127.0.0.2")
	})
}

func udTwoWayStream(t *testing.T, f *Fabric, ipA, ipB string) {
	const (
		qkey     = 0x11111111
		recvs    = 64    // receives each side keeps posted
		inFlight = 32    // unsignaled sends outstanding at most
		count    = 20000 // datagrams each way
		size     = 64
		slot     = 256         // a receive buffer: GRH + datagram, rounded up
		sendOff  = 64 << 10    // the send buffers: 2*inFlight slots of size bytes
		hang     = time.Minute // no completion for this long is a hang
	)
	type side struct {
		name        string
		e           *endpoint
		pl          guestmem.PageList
		q           hostverbs.QP
		reposted    atomic.Int64 // receives reposted so far (the peer's credit)
		seen        []bool
		recvd, dups int
	}
	a := newEndpoint(t, f, "a", ipA, 1<<20)
	b := newEndpoint(t, f, "b", ipB, 1<<20)
	sides := []*side{
		{name: "a", e: a, q: udQP(t, a, hostverbs.QPTypeUD, qkey), seen: make([]bool, count)},
		{name: "b", e: b, q: udQP(t, b, hostverbs.QPTypeUD, qkey), seen: make([]bool, count)},
	}
	for _, s := range sides {
		s.pl = s.e.mrPages(t)
		for i := range recvs {
			require.NoError(t, s.q.PostRecv(&hostverbs.RecvWR{WRID: uint64(i), SGL: sge(s.e, uint64(i)*slot, 40+size)}))
		}
	}
	run := func(s, p *side) error {
		pl := s.pl
		var sent, sendDone int64
		last := time.Now()
		for s.recvd < count || sendDone < count {
			if time.Since(last) > hang {
				return fmt.Errorf("%s: no completion for %v: sent %d (done %d), received %d, peer reposted %d",
					s.name, hang, sent, sendDone, s.recvd, p.reposted.Load())
			}
			for sent < count && sent < recvs+p.reposted.Load() && sent-sendDone < inFlight {
				off := uint64(sendOff + sent%(2*inFlight)*size)
				var seq [8]byte
				binary.LittleEndian.PutUint64(seq[:], uint64(sent))
				if err := pl.WriteAt(s.e.mem, seq[:], s.e.iova+off); err != nil {
					return err
				}
				flags := hostverbs.SendFlags(0)
				if sent%8 == 7 || sent == count-1 {
					flags = hostverbs.SendSignaled
				}
				if err := s.q.PostSend(&hostverbs.SendWR{WRID: uint64(sent), Opcode: hostverbs.WRSend, Flags: flags,
					SGL: sge(s.e, off, size), RemoteQPN: p.q.QPN(), RemoteQKey: qkey,
					AV: hostverbs.AddressVector{DGID: p.e.gid, HopLimit: 64, Port: 1}}); err != nil {
					return fmt.Errorf("%s: post send %d: %w", s.name, sent, err)
				}
				sent++
			}
			var wc hostverbs.WorkCompletion
			select {
			case wc = <-s.e.ccq.ch:
				last = time.Now()
			case <-time.After(time.Millisecond):
				continue
			}
			if wc.Status != hostverbs.WCSuccess {
				return fmt.Errorf("%s: completion %+v", s.name, wc)
			}
			if wc.Opcode == hostverbs.WCSend {
				sendDone = int64(wc.WRID) + 1
				continue
			}
			if wc.ByteLen != 40+size || wc.SrcQP != p.q.QPN() {
				return fmt.Errorf("%s: receive %+v: want %d bytes from QP %d", s.name, wc, 40+size, p.q.QPN())
			}
			var seq [8]byte
			if err := pl.ReadAt(s.e.mem, seq[:], s.e.iova+wc.WRID*slot+40); err != nil {
				return err
			}
			if n := binary.LittleEndian.Uint64(seq[:]); n >= count || s.seen[n] {
				s.dups++
			} else {
				s.seen[n] = true
			}
			s.recvd++
			if err := s.q.PostRecv(&hostverbs.RecvWR{WRID: wc.WRID, SGL: sge(s.e, wc.WRID*slot, 40+size)}); err != nil {
				return fmt.Errorf("%s: repost: %w", s.name, err)
			}
			s.reposted.Add(1)
		}
		return nil
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range sides {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = run(sides[i], sides[1-i]) }()
	}
	wg.Wait()
	for i, s := range sides {
		require.NoError(t, errs[i])
		assert.Equal(t, count, s.recvd, "%s received", s.name)
		assert.Zero(t, s.dups, "%s: duplicates or bad sequence numbers", s.name)
	}
	for k, v := range f.Counters() {
		if strings.HasPrefix(k, "drop_") {
			assert.Zero(t, v, k)
		}
	}
}
