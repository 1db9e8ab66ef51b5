package soft

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/wire"
)

// TestInvalidateWaitsForRead: a peer's 2 MiB READ of a fast-reg MR is
// under way (an in-process READ response is copied in one piece when the
// requester takes it; a hook pauses that copy after its first page) when
// the key is invalidated, by the owner's LOCAL_INV or by a SEND with
// invalidate from a peer on another QP, and once the invalidation has
// completed (LOCAL_INV returned, the owner's receive completed) the owner
// writes new bytes over the pages, as a guest reusing them would. The
// invalidation must not complete while the copy is under way: the READ
// then completes with the bytes from before the invalidation, or fails
// with a remote access error; never with bytes written after it.
//
// Over the wire ("two-fabrics") each response packet is copied as it is
// sent; the hook pauses the first one (the READ starts 0x200 into a page,
// so every packet's copy has two pieces) on the responder's receive loop,
// so only LOCAL_INV can come meanwhile. The packets whose copy starts
// after the invalidation are not sent, and the requester's retry of them
// gets a remote access error. In every case no byte written after the
// invalidation completed reaches the peer, even in a READ that fails.
func TestInvalidateWaitsForRead(t *testing.T) {
	inProcess := func(t *testing.T) (fa, fb *Fabric) {
		f, err := New(Config{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		return f, f
	}
	twoFabrics := func(t *testing.T) (fa, fb *Fabric) {
		net := wire.NewMemNet(3)
		t.Cleanup(net.Close)
		mk := func() *Fabric {
			f, err := New(Config{Wire: net.Attach(), LinkMTU: 9000})
			require.NoError(t, err)
			t.Cleanup(func() { _ = f.Close() })
			return f
		}
		return mk(), mk()
	}
	t.Run("local-inv", func(t *testing.T) { testInvalidateWaitsForRead(t, inProcess, false) })
	t.Run("send-with-invalidate", func(t *testing.T) { testInvalidateWaitsForRead(t, inProcess, true) })
	t.Run("two-fabrics-local-inv", func(t *testing.T) { testInvalidateWaitsForRead(t, twoFabrics, false) })
}

func testInvalidateWaitsForRead(t *testing.T, fabrics func(t *testing.T) (fa, fb *Fabric), remote bool) {
	const npages = 512
	const size = npages*guestmem.PageSize - 0x200
	fa, f := fabrics(t)
	a := newEndpoint(t, fa, "a", "10.0.0.1", 4<<20)
	b := newEndpoint(t, f, "b", "10.0.0.2", 4<<20)
	qa, _ := connectRC(t, a, b, defaultRC())
	qa2, qb2 := connectRC(t, a, b, defaultRC()) // the SEND with invalidate's
	require.NoError(t, qb2.PostRecv(&hostverbs.RecvWR{WRID: 3, SGL: sge(b, 0, 4096)}))

	fr, err := b.pd.(hostverbs.FastRegPD).AllocFastRegMR(hostverbs.FastRegAttr{MaxPages: npages})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fr.Dereg() })
	gpas := make([]guestmem.GPA, npages) // b's second and third MiB, pages reversed
	for i := range gpas {
		gpas[i] = guestmem.GPA(1<<20 + (npages-1-i)*guestmem.PageSize)
	}
	const iova = 0xffff888012300200
	pl, err := guestmem.NewPageList(iova, size, gpas)
	require.NoError(t, err)
	before, after := make([]byte, size), make([]byte, size)
	fill(before, 1)
	fill(after, 2)
	require.NoError(t, pl.WriteAt(b.mem, before, iova))
	key := fr.LKey()&^0xff | uint32(uint8(fr.LKey())+1)
	require.NoError(t, fr.Register(hostverbs.FastReg{Pages: pl, Access: hostverbs.AccessLocalWrite | hostverbs.AccessRemoteRead, Key: key}))

	paused, release := make(chan struct{}), make(chan struct{})
	waiting := make(chan struct{}, 1)
	var once sync.Once
	f.hooks.Store(&accessHooks{
		copying: func(m *mr) {
			once.Do(func() {
				close(paused)
				<-release
			})
		},
		waiting: func(*mr) {
			select {
			case waiting <- struct{}{}:
			default:
			}
		},
	})
	t.Cleanup(func() { f.hooks.Store(nil) })

	posted := make(chan error, 1)
	go func() {
		posted <- qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMARead, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, size), RemoteAddr: iova, RKey: key})
	}()
	select {
	case <-paused:
	case <-time.After(frTimeout):
		t.Fatal("the READ's copy never started")
	}

	// The owner invalidates, then reuses the pages once that completed.
	invalidated := make(chan error, 1)
	go func() {
		var err error
		if remote {
			err = qa2.PostSend(&hostverbs.SendWR{WRID: 2, Opcode: hostverbs.WRSendWithInv, Flags: hostverbs.SendSignaled,
				SGL: sge(a, size, 16), ImmData: key})
			if err == nil {
				select {
				case wc := <-b.ccq.ch:
					if wc.Status != hostverbs.WCSuccess || wc.Flags&hostverbs.WCFlagWithInvalidate == 0 {
						err = fmt.Errorf("the owner's receive: %+v", wc)
					}
				case <-time.After(frTimeout):
					err = fmt.Errorf("the owner's receive did not complete")
				}
			}
		} else {
			err = fr.Invalidate(key)
		}
		if err == nil {
			err = pl.WriteAt(b.mem, after, iova)
		}
		invalidated <- err
	}()
	done := false
	select {
	case <-waiting: // the invalidation waits for the copy under way
	case err := <-invalidated:
		require.NoError(t, err)
		t.Log("the invalidation completed during the READ's copy, and the pages were overwritten")
		done = true
	case <-time.After(frTimeout):
		t.Fatal("the invalidation neither completed nor waited")
	}
	close(release)
	require.NoError(t, <-posted)
	wc := a.ccq.wait(t, frTimeout)
	for wc.WRID != 1 { // the SEND with invalidate's completion
		wc = a.ccq.wait(t, frTimeout)
	}
	if !done {
		select {
		case err := <-invalidated:
			require.NoError(t, err)
		case <-time.After(frTimeout):
			t.Fatal("the invalidation did not complete after the READ")
		}
	}
	got := a.read(t, a.iova, size)
	t.Logf("the READ completed with %v", wc.Status)
	// Whatever the READ's status, the bytes written after the
	// invalidation completed never reached the peer (the data is random:
	// a block equal to the new bytes came from them).
	for off := 0; off+512 <= size; off += 512 {
		require.False(t, bytes.Equal(after[off:off+512], got[off:off+512]),
			"bytes written after the invalidation completed reached the peer at offset %#x", off)
	}
	switch wc.Status {
	case hostverbs.WCSuccess:
		require.True(t, bytes.Equal(before, got), "a READ that completed carries bytes written after the invalidation completed")
	case hostverbs.WCRemAccessErr:
	default:
		t.Fatalf("READ completed with %v", wc.Status)
	}
	st, _ := fr.Registration()
	require.Equal(t, hostverbs.MRFree, st)
}

// TestLocalInvWaitsForWrite: a peer's 2 MiB WRITE into a fast-reg MR is
// being copied (in process, in one piece; a hook pauses it after its
// first page) when the owner invalidates the key with LOCAL_INV and, once
// that completes, writes its own bytes over the pages, as a guest reusing
// them would. The invalidation waits for the WRITE's copy, so the pages
// end up holding the owner's bytes only: none of the WRITE lands on them
// after the invalidation completed.
func TestLocalInvWaitsForWrite(t *testing.T) {
	const npages = 512
	const size = npages*guestmem.PageSize - 0x200
	f, err := New(Config{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	a := newEndpoint(t, f, "a", "10.0.0.1", 4<<20)
	b := newEndpoint(t, f, "b", "10.0.0.2", 4<<20)
	qa, _ := connectRC(t, a, b, defaultRC())
	fr, err := b.pd.(hostverbs.FastRegPD).AllocFastRegMR(hostverbs.FastRegAttr{MaxPages: npages})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fr.Dereg() })
	gpas := make([]guestmem.GPA, npages)
	for i := range gpas {
		gpas[i] = guestmem.GPA(1<<20 + (npages-1-i)*guestmem.PageSize)
	}
	const iova = 0xffff888012300200
	pl, err := guestmem.NewPageList(iova, size, gpas)
	require.NoError(t, err)
	key := fr.LKey()&^0xff | uint32(uint8(fr.LKey())+1)
	require.NoError(t, fr.Register(hostverbs.FastReg{Pages: pl,
		Access: hostverbs.AccessLocalWrite | hostverbs.AccessRemoteWrite, Key: key}))
	written, owners := make([]byte, size), make([]byte, size)
	fill(written, 3)
	fill(owners, 4)
	a.write(t, a.iova, written)

	paused, release := make(chan struct{}), make(chan struct{})
	waiting := make(chan struct{}, 1)
	var once sync.Once
	f.hooks.Store(&accessHooks{
		copying: func(*mr) { once.Do(func() { close(paused); <-release }) },
		waiting: func(*mr) {
			select {
			case waiting <- struct{}{}:
			default:
			}
		},
	})
	t.Cleanup(func() { f.hooks.Store(nil) })
	posted := make(chan error, 1)
	go func() {
		posted <- qa.PostSend(&hostverbs.SendWR{WRID: 1, Opcode: hostverbs.WRRDMAWrite, Flags: hostverbs.SendSignaled,
			SGL: sge(a, 0, size), RemoteAddr: iova, RKey: key})
	}()
	select {
	case <-paused:
	case <-time.After(frTimeout):
		t.Fatal("the WRITE's copy never started")
	}
	reused := make(chan error, 1)
	go func() {
		err := fr.Invalidate(key)
		if err == nil {
			err = pl.WriteAt(b.mem, owners, iova)
		}
		reused <- err
	}()
	done := false
	select {
	case <-waiting:
	case err := <-reused:
		require.NoError(t, err)
		t.Log("the invalidation completed during the WRITE's copy, and the owner wrote its pages")
		done = true
	case <-time.After(frTimeout):
		t.Fatal("the invalidation neither completed nor waited")
	}
	close(release)
	require.NoError(t, <-posted)
	wc := a.ccq.wait(t, frTimeout)
	if !done {
		select {
		case err := <-reused:
			require.NoError(t, err)
		case <-time.After(frTimeout):
			t.Fatal("the invalidation did not complete after the WRITE")
		}
	}
	t.Logf("the WRITE completed with %v", wc.Status)
	got := make([]byte, size)
	require.NoError(t, pl.ReadAt(b.mem, got, iova))
	require.True(t, bytes.Equal(owners, got), "the WRITE landed on pages the owner reused after its invalidation completed")
}
