package vfiouser_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
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

// Hostile-client tests, one message at a time over a socketpair, in the
// manner of libvfio-user's test_request_errors.py: each malformed message
// gets an error reply with the right errno (or, where the stream cannot be
// trusted any more, a disconnect), every descriptor it carried is closed,
// and the connection keeps working afterwards.

// openFDs counts this process's open descriptors (server and client live
// in the same process).
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

func le32(v uint32) []byte { return []byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)} }

func payload(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

func regionAccess(region uint32, off uint64, count uint32, data []byte) []byte {
	p := make([]byte, vfiouser.RegionAccessSize+len(data))
	vfiouser.RegionAccess{Offset: off, Region: region, Count: count}.Encode(p)
	copy(p[vfiouser.RegionAccessSize:], data)
	return p
}

func irqSet(index, flags, start, count uint32, data []byte) []byte {
	p := make([]byte, vfiouser.IRQSetSize+len(data))
	vfiouser.IRQSet{Argsz: uint32(len(p)), Flags: flags, Index: index, Start: start, Count: count}.Encode(p)
	copy(p[vfiouser.IRQSetSize:], data)
	return p
}

func dmaMap(flags uint32, off, addr, size uint64) []byte {
	p := make([]byte, vfiouser.DMAMapSize)
	vfiouser.DMAMap{Argsz: vfiouser.DMAMapSize, Flags: flags, Offset: off, Address: addr, Size: size}.Encode(p)
	return p
}

func dmaUnmap(flags uint32, addr, size uint64) []byte {
	p := make([]byte, vfiouser.DMAUnmapSize)
	vfiouser.DMAUnmap{Argsz: vfiouser.DMAUnmapSize, Flags: flags, Address: addr, Size: size}.Encode(p)
	return p
}

func eventfds(t testing.TB, n int) []int {
	t.Helper()
	fds := make([]int, n)
	for i := range fds {
		fd, err := vfiousertest.Eventfd()
		require.NoError(t, err)
		fds[i] = fd
	}
	return fds
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

const (
	rw      = vfiouser.DMAFlagRead | vfiouser.DMAFlagWrite
	efdTrig = vfiouser.IRQSetDataEventfd | vfiouser.IRQSetActionTrigger
)

type hostileCase struct {
	name    string
	cmd     vfiouser.Command
	payload []byte
	fds     func(t testing.TB) []int // sent with the message, then closed by us
	want    syscall.Errno
}

func TestHostileMessages(t *testing.T) {
	srv, devs := newServer(t, func(c *vfiouser.Config) { c.MaxDMAMaps = 3 })
	c, _ := connect(t, srv, devs)
	memfd, ram, err := vfiousertest.Memfd(1 << 16)
	require.NoError(t, err)
	defer unix.Munmap(ram)
	defer unix.Close(memfd)
	require.NoError(t, c.DMAMap(0x10000, 0x8000, rw, memfd, 0))
	require.NoError(t, c.DMAMap(0x100000, 0x1000, vfiouser.DMAFlagRead, -1, 0))

	withMemfd := func(t testing.TB) []int {
		fd, err := unix.Dup(memfd)
		require.NoError(t, err)
		return []int{fd}
	}
	efds := func(n int) func(t testing.TB) []int { return func(t testing.TB) []int { return eventfds(t, n) } }
	pipeFD := func(t testing.TB) []int {
		var p [2]int
		require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
		return p[:]
	}
	huge := make([]byte, 64) // a REGION_WRITE whose count disagrees with its data

	cases := []hostileCase{
		// Sizes.
		{"dma map short", vfiouser.CmdDMAMap, make([]byte, 31), nil, syscall.EINVAL},
		{"dma map long", vfiouser.CmdDMAMap, make([]byte, 33), nil, syscall.EINVAL},
		{"dma unmap short", vfiouser.CmdDMAUnmap, make([]byte, 8), nil, syscall.EINVAL},
		{"get info empty", vfiouser.CmdDeviceGetInfo, nil, nil, syscall.EINVAL},
		{"get info argsz 8", vfiouser.CmdDeviceGetInfo, payload(le32(8), make([]byte, 12)), nil, syscall.EINVAL},
		{"region info short", vfiouser.CmdDeviceGetRegionInfo, make([]byte, 16), nil, syscall.EINVAL},
		{"irq info long", vfiouser.CmdDeviceGetIRQInfo, make([]byte, 17), nil, syscall.EINVAL},
		{"set irqs short", vfiouser.CmdDeviceSetIRQs, make([]byte, 19), nil, syscall.EINVAL},
		{"region read with data", vfiouser.CmdRegionRead, regionAccess(1, 0, 4, []byte{1, 2, 3, 4}), nil, syscall.EINVAL},
		{"region write count mismatch", vfiouser.CmdRegionWrite, regionAccess(1, 0, 4, huge), nil, syscall.EINVAL},
		{"region write count over data", vfiouser.CmdRegionWrite, regionAccess(1, 0, 1<<30, nil), nil, syscall.EINVAL},
		{"reset with payload", vfiouser.CmdDeviceReset, []byte{0}, nil, syscall.EINVAL},
		// Unknown and unsupported commands.
		{"command 0", 0, nil, nil, syscall.ENOSYS},
		{"command 14", 14, make([]byte, 8), nil, syscall.ENOSYS},
		{"command 0xffff", 0xffff, nil, nil, syscall.ENOSYS},
		{"dma read from client", vfiouser.CmdDMARead, make([]byte, 16), nil, syscall.EINVAL},
		{"io fds", vfiouser.CmdGetRegionIOFDs, make([]byte, 16), nil, syscall.ENOTSUP},
		{"device feature", vfiouser.CmdDeviceFeature, make([]byte, 8), nil, syscall.ENOTTY},
		{"mig data read", vfiouser.CmdMigDataRead, make([]byte, 8), nil, syscall.ENOTSUP},
		{"second version", vfiouser.CmdVersion, []byte{0, 0, 0, 0}, nil, syscall.EINVAL},
		// Region indexes and bounds.
		{"region info index 9", vfiouser.CmdDeviceGetRegionInfo, payload(le32(32), le32(0), le32(9), make([]byte, 20)), nil, syscall.EINVAL},
		{"region info index max", vfiouser.CmdDeviceGetRegionInfo, payload(le32(32), le32(0), le32(0xffffffff), make([]byte, 20)), nil, syscall.EINVAL},
		{"region info argsz 16", vfiouser.CmdDeviceGetRegionInfo, payload(le32(16), le32(0), le32(1), make([]byte, 20)), nil, syscall.EINVAL},
		{"read bad region", vfiouser.CmdRegionRead, regionAccess(12, 0, 4, nil), nil, syscall.EINVAL},
		{"read absent BAR3", vfiouser.CmdRegionRead, regionAccess(3, 0, 4, nil), nil, syscall.EINVAL},
		{"read past BAR1", vfiouser.CmdRegionRead, regionAccess(1, testdev.BAR1Size-2, 4, nil), nil, syscall.EINVAL},
		{"read offset overflow", vfiouser.CmdRegionRead, regionAccess(1, ^uint64(0)-1, 4, nil), nil, syscall.EINVAL},
		{"read too big", vfiouser.CmdRegionRead, regionAccess(2, 0, 2<<20, nil), nil, syscall.E2BIG},
		{"write past config", vfiouser.CmdRegionWrite, regionAccess(vfiouser.RegionConfig, 255, 2, []byte{1, 2}), nil, syscall.EINVAL},
		{"write to ROM region", vfiouser.CmdRegionWrite, regionAccess(vfiouser.RegionROM, 0, 1, []byte{1}), nil, syscall.EINVAL},
		// Interrupts.
		{"irq info index 5", vfiouser.CmdDeviceGetIRQInfo, payload(le32(16), le32(0), le32(5), le32(0)), nil, syscall.EINVAL},
		{"set irqs bad index", vfiouser.CmdDeviceSetIRQs, irqSet(7, efdTrig, 0, 1, nil), efds(1), syscall.EINVAL},
		{"set irqs two data types", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataNone|vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionTrigger, 0, 1, nil), nil, syscall.EINVAL},
		{"set irqs no action", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataNone, 0, 1, nil), nil, syscall.EINVAL},
		{"set irqs unknown flag", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig|1<<6, 0, 1, nil), efds(1), syscall.EINVAL},
		{"set irqs past vectors", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig, 3, 2, nil), efds(2), syscall.EINVAL},
		{"set irqs start overflow", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig, 0xffffffff, 2, nil), efds(2), syscall.EINVAL},
		{"set irqs fds count mismatch", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig, 0, 3, nil), efds(2), syscall.EINVAL},
		{"set irqs fds without eventfd flag", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 0, 1, nil), efds(1), syscall.EINVAL},
		{"set irqs count 0 start 1", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 1, 0, nil), nil, syscall.EINVAL},
		{"set irqs bool size", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataBool|vfiouser.IRQSetActionTrigger, 0, 2, []byte{1}), nil, syscall.EINVAL},
		{"set irqs trailing data", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionTrigger, 0, 1, []byte{1, 2, 3, 4}), nil, syscall.EINVAL},
		{"mask msi-x (not maskable)", vfiouser.CmdDeviceSetIRQs, irqSet(2, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionMask, 0, 1, nil), nil, syscall.EINVAL},
		{"mask ERR", vfiouser.CmdDeviceSetIRQs, irqSet(3, vfiouser.IRQSetDataNone|vfiouser.IRQSetActionMask, 0, 1, nil), nil, syscall.EINVAL},
		{"mask with eventfd", vfiouser.CmdDeviceSetIRQs, irqSet(0, vfiouser.IRQSetDataEventfd|vfiouser.IRQSetActionMask, 0, 1, nil), efds(1), syscall.EINVAL},
		{"pipe as eventfd", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig, 0, 2, nil), pipeFD, syscall.EINVAL},
		{"memfd as eventfd", vfiouser.CmdDeviceSetIRQs, irqSet(0, efdTrig, 0, 1, nil), withMemfd, syscall.EINVAL},
		{"17 fds (max_msg_fds 16)", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig, 0, 17, nil), efds(17), syscall.EINVAL},
		{"100 fds (kernel truncates)", vfiouser.CmdDeviceSetIRQs, irqSet(2, efdTrig, 0, 4, nil), efds(100), syscall.EINVAL},
		{"fds on a region read", vfiouser.CmdRegionRead, regionAccess(1, 0, 4, nil), efds(2), syscall.EINVAL},
		// DMA maps.
		{"map overlap", vfiouser.CmdDMAMap, dmaMap(rw, 0xc000, 0x14000, 0x4000), withMemfd, syscall.EEXIST},
		{"map aliased file range", vfiouser.CmdDMAMap, dmaMap(rw, 0x4000, 0x30000, 0x1000), withMemfd, syscall.EINVAL},
		{"map over fd-less", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0x100000, 0x1000), nil, syscall.EEXIST},
		{"map misaligned addr", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0x40800, 0x1000), withMemfd, syscall.EINVAL},
		{"map misaligned size", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0x40000, 0x1001), withMemfd, syscall.EINVAL},
		{"map misaligned offset", vfiouser.CmdDMAMap, dmaMap(rw, 0x10, 0x40000, 0x1000), withMemfd, syscall.EINVAL},
		{"map zero size", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0x40000, 0), nil, syscall.EINVAL},
		{"map wraps", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0xfffffffffffff000, 0x2000), nil, syscall.EINVAL},
		{"map no access", vfiouser.CmdDMAMap, dmaMap(0, 0, 0x40000, 0x1000), nil, syscall.EINVAL},
		{"map unknown flag", vfiouser.CmdDMAMap, dmaMap(rw|4, 0, 0x40000, 0x1000), withMemfd, syscall.EINVAL},
		{"map two fds", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0x40000, 0x1000), func(t testing.TB) []int { return append(withMemfd(t), withMemfd(t)...) }, syscall.EINVAL},
		{"map eventfd", vfiouser.CmdDMAMap, dmaMap(rw, 0, 0x40000, 0x1000), efds(1), syscall.ENODEV},
		{"map past end of file", vfiouser.CmdDMAMap, dmaMap(rw, 1<<40, 0x40000, 0x1000), withMemfd, syscall.EINVAL},
		{"unmap partial", vfiouser.CmdDMAUnmap, dmaUnmap(0, 0x10000, 0x1000), nil, syscall.ENOENT},
		{"unmap overlapping larger", vfiouser.CmdDMAUnmap, dmaUnmap(0, 0x10000, 0x10000), nil, syscall.ENOENT},
		{"unmap unmapped", vfiouser.CmdDMAUnmap, dmaUnmap(0, 0x200000, 0x1000), nil, syscall.ENOENT},
		{"unmap all with range", vfiouser.CmdDMAUnmap, dmaUnmap(vfiouser.UnmapFlagAll, 0x10000, 0x8000), nil, syscall.EINVAL},
		{"unmap dirty bitmap", vfiouser.CmdDMAUnmap, dmaUnmap(vfiouser.UnmapFlagDirtyBitmap, 0x10000, 0x8000), nil, syscall.ENOTSUP},
		{"unmap unknown flag", vfiouser.CmdDMAUnmap, dmaUnmap(8, 0x10000, 0x8000), nil, syscall.EINVAL},
		{"unmap argsz 8", vfiouser.CmdDMAUnmap, payload(le32(8), le32(0), make([]byte, 16)), nil, syscall.EINVAL},
		{"write multi not negotiated for this", vfiouser.CmdRegionWriteMulti, make([]byte, 8), nil, syscall.EINVAL},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := openFDs(t)
			var fds []int
			if tc.fds != nil {
				fds = tc.fds(t)
			}
			_, err := c.Call(tc.cmd, tc.payload, fds...)
			closeAll(fds)
			var re *vfiousertest.ReplyError
			require.ErrorAs(t, err, &re, "want an error reply")
			assert.Equal(t, tc.want, re.Errno)
			assert.Equal(t, before, openFDs(t), "every descriptor the message carried is closed")
		})
	}
	// The connection still works, and the state is unchanged.
	v, err := c.Read32(cfgReg, 0)
	require.NoError(t, err)
	assert.Equal(t, uint32(testdev.DeviceID)<<16|testdev.VendorID, v)
	require.NoError(t, c.DMAMap(0x20000, 0x1000, rw, memfd, 0x8000), "a third map is still allowed")
	var re *vfiousertest.ReplyError
	require.ErrorAs(t, c.DMAMap(0x30000, 0x1000, rw, -1, 0), &re, "max_dma_maps 3")
	assert.Equal(t, syscall.EINVAL, re.Errno)
	require.NoError(t, c.DMAUnmap(0, 0, vfiouser.UnmapFlagAll))
	require.NoError(t, c.DMAMap(0x30000, 0x1000, rw, -1, 0))
}

func TestVersionErrors(t *testing.T) {
	srv, _ := newServer(t, nil)
	c := vfiousertest.Pair(t, srv)
	var re *vfiousertest.ReplyError
	expect := func(err error, errno syscall.Errno) {
		t.Helper()
		require.ErrorAs(t, err, &re)
		assert.Equal(t, errno, re.Errno)
	}
	_, err := c.DeviceInfo()
	expect(err, syscall.EINVAL) // before VERSION
	_, err = c.Call(vfiouser.CmdVersion, []byte{0, 0})
	expect(err, syscall.EINVAL)
	_, err = c.Call(vfiouser.CmdVersion, payload([]byte{0, 0, 0, 0}, []byte(`{"capabilities":{}}`)))
	expect(err, syscall.EINVAL) // not NUL-terminated
	_, err = c.Negotiate(`{"capabilities":{"max_msg_fds":-1}}`)
	expect(err, syscall.EINVAL)
	_, err = c.Negotiate(`{"capabilities":{"max_data_xfer_size":"big"}}`)
	expect(err, syscall.EINVAL)
	_, err = c.Negotiate(`{"capabilities":{"pgsizes":8192}}`)
	expect(err, syscall.ENOTSUP)
	_, err = c.Negotiate(`{"capabilities":{}} {}`)
	expect(err, syscall.EINVAL)
	_, err = c.Call(vfiouser.CmdVersion, payload([]byte{0, 0, 0, 0}, []byte("{\x00}\x00")))
	expect(err, syscall.EINVAL)
	_, err = c.Negotiate(`{"capabilities":{"pad":"` + strings.Repeat("x", 5000) + `"}}`)
	expect(err, syscall.EINVAL)
	// Unknown members are ignored; no write_multiple offered, none echoed.
	caps, err := c.Negotiate(`{"capabilities":{"future":{"x":1},"max_msg_fds":4},"other":true}`)
	require.NoError(t, err)
	assert.Nil(t, caps.Capabilities.WriteMultiple)
	assert.Equal(t, 1<<20, caps.Capabilities.MaxDataXferSize)
	assert.Equal(t, 4096, int(caps.Capabilities.PgSizes))
	_, err = c.Call(vfiouser.CmdRegionWriteMulti, make([]byte, 8))
	expect(err, syscall.ENOTSUP)
}

func TestVersionMajorDisconnects(t *testing.T) {
	srv, _ := newServer(t, nil)
	c := vfiousertest.Pair(t, srv)
	_, err := c.Call(vfiouser.CmdVersion, []byte{1, 0, 0, 0})
	var re *vfiousertest.ReplyError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, syscall.ENOTSUP, re.Errno)
	_, err = c.Recv()
	assert.ErrorIs(t, err, io.EOF, "the server closes after refusing the version")
}

func TestBadHeaders(t *testing.T) {
	srv, devs := newServer(t, nil)
	t.Run("unexpected reply is dropped", func(t *testing.T) {
		c, _ := connect(t, srv, devs)
		b := make([]byte, vfiouser.HeaderSize+8)
		vfiouser.Header{ID: 77, Command: vfiouser.CmdDMARead, Size: uint32(len(b)), Flags: vfiouser.FlagReply}.Encode(b)
		require.NoError(t, c.SendRaw(b))
		require.NoError(t, c.ExpectSilence(50*time.Millisecond))
		_, err := c.DeviceInfo()
		require.NoError(t, err, "the connection goes on")
	})
	t.Run("flags", func(t *testing.T) {
		c, _ := connect(t, srv, devs)
		for _, flags := range []uint32{vfiouser.FlagError, 0x40, 0x80000000} {
			id, err := c.Send(vfiouser.CmdDeviceReset, flags, nil)
			require.NoError(t, err)
			_, err = c.Expect(id, vfiouser.CmdDeviceReset)
			assert.ErrorIs(t, err, syscall.EINVAL, "flags %#x", flags)
		}
		// A message of unknown type (neither command nor reply) is dropped.
		_, err := c.Send(vfiouser.CmdDeviceReset, 2, nil)
		require.NoError(t, err)
		require.NoError(t, c.ExpectSilence(50*time.Millisecond))
		_, err = c.DeviceInfo()
		require.NoError(t, err)
	})
	t.Run("size below header", func(t *testing.T) {
		c, _ := connect(t, srv, devs)
		b := make([]byte, vfiouser.HeaderSize)
		vfiouser.Header{ID: 9, Command: vfiouser.CmdDeviceReset, Size: 8}.Encode(b)
		require.NoError(t, c.SendRaw(b))
		_, err := c.Expect(9, vfiouser.CmdDeviceReset)
		assert.ErrorIs(t, err, syscall.EINVAL)
		_, err = c.Recv()
		assert.ErrorIs(t, err, io.EOF, "an untrustworthy stream ends the connection")
	})
	t.Run("size above max", func(t *testing.T) {
		c, _ := connect(t, srv, devs)
		b := make([]byte, vfiouser.HeaderSize)
		vfiouser.Header{ID: 10, Command: vfiouser.CmdRegionWrite, Size: 0xffffffff}.Encode(b)
		require.NoError(t, c.SendRaw(b))
		_, err := c.Expect(10, vfiouser.CmdRegionWrite)
		assert.ErrorIs(t, err, syscall.E2BIG)
		_, err = c.Recv()
		assert.ErrorIs(t, err, io.EOF)
	})
	t.Run("oversized posted write ends silently", func(t *testing.T) {
		c, _ := connect(t, srv, devs)
		b := make([]byte, vfiouser.HeaderSize)
		vfiouser.Header{ID: 11, Command: vfiouser.CmdRegionWrite, Size: 0x7fffffff, Flags: vfiouser.FlagNoReply}.Encode(b)
		require.NoError(t, c.SendRaw(b))
		_, err := c.Recv()
		assert.ErrorIs(t, err, io.EOF, "no reply to a posted message, not even an error")
	})
}

func TestPostedWritesNeverAnswered(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, dev := connect(t, srv, devs)
	require.NoError(t, c.RegionWrite(cfgReg, 4, []byte{0x02, 0}, false))
	require.NoError(t, c.RegionWrite(bar1, testdev.RegScratch, le32(5), true))
	require.NoError(t, c.RegionWrite(bar1, testdev.BAR1Size, le32(5), true)) // out of range: refused silently
	require.NoError(t, c.RegionWrite(40, 0, le32(5), true))                  // bad region: refused silently
	_, err := c.Send(vfiouser.CmdDeviceGetInfo, vfiouser.FlagNoReply, nil)   // malformed and posted
	require.NoError(t, err)
	require.NoError(t, c.ExpectSilence(100*time.Millisecond))
	v, err := c.Read32(bar1, testdev.RegScratch) // ordered after the posted writes
	require.NoError(t, err)
	assert.Equal(t, uint32(5), v)
	assert.Equal(t, uint32(5), dev.Scratch())
	st := srv.Stats()
	assert.Equal(t, uint64(4), st.Posted)
	assert.Equal(t, uint64(3), st.Errors)
}

func TestWriteMulti(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, dev := connect(t, srv, devs) // QEMU caps offer write_multiple
	require.NoError(t, c.RegionWrite(cfgReg, 4, []byte{0x02, 0}, false))
	entry := func(region uint32, off uint64, data []byte) []byte {
		e := make([]byte, vfiouser.MultiEntrySize)
		vfiouser.RegionAccess{Offset: off, Region: region, Count: uint32(len(data))}.Encode(e)
		copy(e[vfiouser.RegionAccessSize:], data)
		return e
	}
	multi := func(entries ...[]byte) []byte {
		p := make([]byte, 8)
		le := uint64(len(entries))
		for i := 0; i < 8; i++ {
			p[i] = byte(le >> (8 * i))
		}
		return payload(append([][]byte{p}, entries...)...)
	}
	m, err := c.Call(vfiouser.CmdRegionWriteMulti, multi(entry(bar1, testdev.RegScratch, le32(1)), entry(bar1, testdev.RegCounter, le32(100)), entry(bar1, testdev.RegScratch, le32(9))))
	require.NoError(t, err)
	assert.Equal(t, []byte{3, 0, 0, 0, 0, 0, 0, 0}, m.Body)
	assert.Equal(t, uint32(9), dev.Scratch(), "applied in order")
	assert.Equal(t, uint32(102), dev.Counter())

	bad := []struct {
		name string
		p    []byte
	}{
		{"count 0", multi()},
		{"count vs size", payload(multi(entry(bar1, 4, le32(1)))[:8], entry(bar1, 4, le32(1))[:20])},
		{"entry 9 bytes", multi(entry(bar1, 4, le32(1)), func() []byte { e := entry(bar1, 4, nil); e[12] = 9; return e }())},
		{"entry out of range", multi(entry(bar1, 4, le32(2)), entry(bar1, testdev.BAR1Size-2, le32(3)))},
		{"entry bad region", multi(entry(99, 0, le32(2)))},
	}
	for _, tc := range bad {
		_, err := c.Call(vfiouser.CmdRegionWriteMulti, tc.p)
		assert.ErrorIs(t, err, syscall.EINVAL, tc.name)
	}
	assert.Equal(t, uint32(9), dev.Scratch(), "a refused message applies none of its writes")
	_, err = c.Send(vfiouser.CmdRegionWriteMulti, vfiouser.FlagNoReply, multi(entry(bar1, testdev.RegScratch, le32(44))))
	require.NoError(t, err)
	require.NoError(t, c.ExpectSilence(50*time.Millisecond))
	assert.Equal(t, uint32(44), dev.Scratch())
}

func TestPipelinedCommands(t *testing.T) {
	srv, devs := newServer(t, nil)
	c, _ := connect(t, srv, devs)
	var all []byte
	var ids []uint16
	for i := 0; i < 50; i++ {
		all = append(all, c.Build(vfiouser.CmdRegionRead, 0, regionAccess(cfgReg, 0, 4, nil))...)
		ids = append(ids, uint16(len(ids)+2)) // Negotiate used id 1
	}
	require.NoError(t, c.SendRaw(all))
	for _, id := range ids {
		m, err := c.Expect(id, vfiouser.CmdRegionRead)
		require.NoError(t, err)
		assert.Equal(t, le32(testdev.DeviceID<<16|testdev.VendorID), m.Body[16:])
	}
}

// TestTruncatedMessages: a client that goes away in the middle of a
// message (after the header, in the body, with descriptors in flight)
// leaves nothing behind.
func TestTruncatedMessages(t *testing.T) {
	srv, devs := newServer(t, nil)
	for _, cut := range []int{3, vfiouser.HeaderSize, vfiouser.HeaderSize + 10} {
		before := openFDs(t)
		c, _ := connect(t, srv, devs)
		fds := eventfds(t, 3)
		msg := c.Build(vfiouser.CmdDeviceSetIRQs, 0, irqSet(2, efdTrig, 0, 3, nil))
		require.NoError(t, c.SendRaw(msg[:cut], fds...))
		closeAll(fds)
		c.Close()
		waitFor(t, func() bool { return srv.Stats().Connections == 0 })
		assert.Equal(t, before, openFDs(t), "cut at %d: the descriptors of the cut message are closed", cut)
	}
}

// TestDisconnectCleansUp: after a client with mapped memory and assigned
// interrupts disconnects (EOF is QEMU's only shutdown signal), the memory
// is unmapped, every descriptor closed, the device reset and closed, no
// goroutine is left, and the server takes the next client.
func TestDisconnectCleansUp(t *testing.T) {
	srv, devs := newServer(t, nil)
	runtime.GC()
	fdsBefore := openFDs(t)
	goBefore := runtime.NumGoroutine()
	for round := 0; round < 5; round++ {
		s, cc, err := vfiousertest.Socketpair()
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- srv.ServeConn(s, "leak") }()
		c := vfiousertest.NewClient(cc)
		_, err = c.Negotiate(vfiousertest.QEMUCaps)
		require.NoError(t, err)
		dev := <-devs
		memfd, ram, err := vfiousertest.Memfd(1 << 20)
		require.NoError(t, err)
		require.NoError(t, c.DMAMap(0, 1<<20, rw, memfd, 0))
		require.NoError(t, c.DMAMap(0xfffc0000, 0x40000, vfiouser.DMAFlagRead, -1, 0))
		efd := eventfds(t, 5)
		require.NoError(t, c.SetIRQs(vfiouser.IRQMSIX, efdTrig, 0, 4, nil, efd[:4]...))
		require.NoError(t, c.SetIRQs(vfiouser.IRQErr, efdTrig, 0, 1, nil, efd[4]))
		require.NoError(t, c.RegionWrite(bar1, testdev.RegScratch, le32(3), true))
		assert.Equal(t, uint64(1<<20), srv.Stats().LockedBytes)
		closeAll(efd)
		unix.Close(memfd)
		unix.Munmap(ram)
		require.NoError(t, c.Close())
		select {
		case err := <-done:
			assert.NoError(t, err, "EOF is a clean end")
		case <-time.After(5 * time.Second):
			t.Fatal("connection did not end")
		}
		assert.Zero(t, dev.Scratch(), "device reset on disconnect")
		st := srv.Stats()
		assert.Zero(t, st.Connections)
		assert.Zero(t, st.LockedBytes)
	}
	waitFor(t, func() bool { return runtime.NumGoroutine() <= goBefore })
	assert.LessOrEqual(t, runtime.NumGoroutine(), goBefore, "no goroutine left behind")
	assert.Equal(t, fdsBefore, openFDs(t), "no descriptor left behind")
}

func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}

// countingHandler counts the records logged with each message.
type countingHandler struct {
	mu sync.Mutex
	n  map[string]int
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.n[r.Message]++
	h.mu.Unlock()
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func (h *countingHandler) count(msg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n[msg]
}

// TestClientLogFloodBounded: 5000 DEVICE_RESETs and 5000 stray replies
// from a client write a handful of log lines, not one each (issue 23:
// 5000 resets wrote 5000 lines); every reset is still carried out.
func TestClientLogFloodBounded(t *testing.T) {
	h := &countingHandler{n: map[string]int{}}
	srv, devs := newServer(t, func(c *vfiouser.Config) { c.Logger = slog.New(h) })
	c, _ := connect(t, srv, devs)
	const n = 5000
	for range n {
		_, err := c.Call(vfiouser.CmdDeviceReset, nil)
		require.NoError(t, err, "every reset is carried out and answered")
	}
	b := make([]byte, vfiouser.HeaderSize)
	for i := range n {
		vfiouser.Header{ID: uint16(i), Command: vfiouser.CmdDMARead, Size: vfiouser.HeaderSize, Flags: vfiouser.FlagReply}.Encode(b)
		require.NoError(t, c.SendRaw(b))
	}
	_, err := c.DeviceInfo() // the stray replies were read before this answer
	require.NoError(t, err)
	assert.LessOrEqual(t, h.count("device reset by client"), 2, "resets logged once per interval")
	assert.LessOrEqual(t, h.count("unexpected reply from client"), 2, "stray replies logged once per interval")
}
