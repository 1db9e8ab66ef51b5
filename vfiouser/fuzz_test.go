package vfiouser_test

import (
	"encoding/binary"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// FuzzServe drives the whole server (decoder, dispatcher, DMA maps,
// interrupts, the PCI function model and the test device) with an
// arbitrary client byte stream over the in-memory transport, with real
// descriptors attached where the input says. Input format, repeated:
//
//	u8 kind | u16 length | length bytes
//
// The bytes form one segment of the stream; kind&3 descriptors go with it
// (kind&4: eventfds, else 64 KiB memfds). Invariants checked after every
// run: no panic, every descriptor closed, every message the server wrote
// is well-formed, and every reply answers a command that wanted one.
func FuzzServe(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	srv, err := vfiouser.NewServer(vfiouser.Config{
		NewDevice:  testdev.Factory(nil),
		Logger:     slog.New(slog.NewTextHandler(io.Discard, nil)),
		MaxDMAMaps: 8,
		DMATimeout: 50 * time.Millisecond,
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		before := countFDs(t)
		segs := decodeSegments(t, data)
		out, _ := srv.ServeStream(segs)
		checkOutput(t, segs, out)
		if after := countFDs(t); after != before {
			t.Fatalf("descriptors leaked: %d open before, %d after", before, after)
		}
	})
}

func countFDs(t testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func decodeSegments(t testing.TB, data []byte) []vfiouser.Segment {
	var segs []vfiouser.Segment
	for len(data) >= 3 && len(segs) < 256 {
		kind := data[0]
		n := int(binary.LittleEndian.Uint16(data[1:]))
		data = data[3:]
		n = min(n, len(data))
		seg := vfiouser.Segment{Data: data[:n]}
		data = data[n:]
		for i := 0; i < int(kind&3); i++ {
			var fd int
			var err error
			if kind&4 != 0 {
				fd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
			} else {
				fd, err = unix.MemfdCreate("fuzz", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
				if err == nil {
					err = unix.Ftruncate(fd, 64<<10)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			seg.FDs = append(seg.FDs, fd)
		}
		if len(seg.Data) == 0 && len(seg.FDs) > 0 {
			seg.Data = []byte{0} // descriptors travel with at least one byte
		}
		if len(seg.Data) > 0 {
			segs = append(segs, seg)
		}
	}
	return segs
}

// checkOutput verifies the server's messages against the input commands.
func checkOutput(t testing.TB, segs []vfiouser.Segment, out [][]byte) {
	var stream []byte
	for _, s := range segs {
		stream = append(stream, s.Data...)
	}
	wanted := map[uint16]int{} // id -> commands that want a reply
	for len(stream) >= vfiouser.HeaderSize {
		h := vfiouser.DecodeHeader(stream)
		if h.Type() == vfiouser.FlagCommand && !h.NoReply() {
			wanted[h.ID]++
		}
		if h.Size < vfiouser.HeaderSize || int(h.Size) > len(stream) {
			break
		}
		stream = stream[h.Size:]
	}
	for _, m := range out {
		if len(m) < vfiouser.HeaderSize {
			t.Fatalf("server wrote %d bytes: shorter than a header", len(m))
		}
		h := vfiouser.DecodeHeader(m)
		if int(h.Size) != len(m) {
			t.Fatalf("server message %v has %d bytes", h, len(m))
		}
		if !h.IsReply() {
			if h.Command != vfiouser.CmdDMARead && h.Command != vfiouser.CmdDMAWrite {
				t.Fatalf("server sent command %v", h.Command)
			}
			continue
		}
		if h.Flags&vfiouser.FlagError != 0 && len(m) != vfiouser.HeaderSize {
			t.Fatalf("error reply with payload: %v", h)
		}
		if wanted[h.ID] == 0 {
			t.Fatalf("reply %v answers no command that wanted one", h)
		}
		wanted[h.ID]--
	}
}

// Seed corpus: message sequences shaped like those QEMU 11 sends at realize.
func fuzzSeeds() [][]byte {
	var id uint16
	msg := func(cmd vfiouser.Command, flags uint32, p []byte) []byte {
		id++
		b := make([]byte, vfiouser.HeaderSize+len(p))
		vfiouser.Header{ID: id, Command: cmd, Size: uint32(len(b)), Flags: flags}.Encode(b)
		copy(b[vfiouser.HeaderSize:], p)
		return b
	}
	seg := func(kind byte, b []byte) []byte {
		out := []byte{kind, byte(len(b)), byte(len(b) >> 8)}
		return append(out, b...)
	}
	version := msg(vfiouser.CmdVersion, 0, append([]byte{0, 0, 0, 0}, append([]byte(`{"capabilities":{"max_msg_fds":16,"write_multiple":true}}`), 0)...))
	qemu := func() []byte {
		var s []byte
		s = append(s, seg(0, version)...)
		s = append(s, seg(1, msg(vfiouser.CmdDMAMap, 0, dmaMap(rw, 0, 0, 0x10000)))...)
		s = append(s, seg(0, msg(vfiouser.CmdDMAMap, 0, dmaMap(vfiouser.DMAFlagRead, 0, 0xfffc0000, 0x40000)))...)
		s = append(s, seg(0, msg(vfiouser.CmdDeviceGetInfo, 0, payload(le32(16), make([]byte, 12))))...)
		for _, r := range []uint32{0, 1, 2, 7} {
			s = append(s, seg(0, msg(vfiouser.CmdDeviceGetRegionInfo, 0, payload(le32(32), le32(0), le32(r), make([]byte, 20))))...)
		}
		s = append(s, seg(0, msg(vfiouser.CmdDeviceGetIRQInfo, 0, payload(le32(16), le32(0), le32(3), le32(0))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionRead, 0, regionAccess(vfiouser.RegionConfig, 0, 256, nil)))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(vfiouser.RegionConfig, 0x10, 4, le32(0xffffffff))))...)
		s = append(s, seg(5, msg(vfiouser.CmdDeviceSetIRQs, 0, irqSet(0, efdTrig, 0, 1, nil)))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(vfiouser.RegionConfig, 4, 2, []byte{7, 1})))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(vfiouser.RegionConfig, 0x42, 2, []byte{3, 0x80})))...)
		s = append(s, seg(7, msg(vfiouser.CmdDeviceSetIRQs, 0, irqSet(2, efdTrig, 0, 3, nil)))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionRead, 0, regionAccess(1, 0, 4, nil)))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, vfiouser.FlagNoReply, regionAccess(1, testdev.RegScratch, 4, le32(9))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(1, testdev.RegIRQ, 4, le32(1))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(1, testdev.RegDMALen, 4, le32(64))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(1, testdev.RegDMACmd, 4, le32(testdev.DMAFill))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionRead, 0, regionAccess(0, testdev.PBAOffset, 8, nil)))...)
		s = append(s, seg(0, msg(vfiouser.CmdDeviceReset, 0, nil))...)
		s = append(s, seg(0, msg(vfiouser.CmdDMAUnmap, 0, dmaUnmap(0, 0xfffc0000, 0x40000)))...)
		return s
	}
	fdless := func() []byte {
		var s []byte
		s = append(s, seg(0, version)...)
		s = append(s, seg(0, msg(vfiouser.CmdDMAMap, 0, dmaMap(rw, 0, 0x100000, 0x10000)))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(vfiouser.RegionConfig, 4, 2, []byte{6, 0})))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(1, testdev.RegDMALo, 4, le32(0x100000))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(1, testdev.RegDMALen, 4, le32(16))))...)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWrite, 0, regionAccess(1, testdev.RegDMACmd, 4, le32(testdev.DMACheck))))...)
		reply := make([]byte, vfiouser.HeaderSize+16+16)
		vfiouser.Header{ID: 1, Command: vfiouser.CmdDMARead, Size: uint32(len(reply)), Flags: vfiouser.FlagReply}.Encode(reply)
		s = append(s, seg(0, reply)...)
		return s
	}
	multi := func() []byte {
		var s []byte
		s = append(s, seg(0, version)...)
		e := make([]byte, vfiouser.MultiEntrySize)
		vfiouser.RegionAccess{Offset: 4, Region: 1, Count: 4}.Encode(e)
		s = append(s, seg(0, msg(vfiouser.CmdRegionWriteMulti, 0, payload([]byte{1, 0, 0, 0, 0, 0, 0, 0}, e)))...)
		return s
	}
	hostile := func() []byte {
		var s []byte
		s = append(s, seg(0, version)...)
		s = append(s, seg(3, msg(vfiouser.CmdDeviceSetIRQs, 0, irqSet(2, efdTrig, 0, 3, nil))[:20])...)
		return s
	}
	return [][]byte{qemu(), fdless(), multi(), hostile(), seg(0, version)}
}
