//go:build vm

package vfiouser_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// syncBuffer is a log sink the server writes from many goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// vmServer serves test devices on a socket for QEMU and records each
// connection's host and device.
type vmServer struct {
	srv    *vfiouser.Server
	sock   string
	logs   *syncBuffer
	hosts  chan *vfiouser.Host
	devs   chan *testdev.Device
	served chan error
}

func startVMServer(t *testing.T) *vmServer {
	t.Helper()
	s := &vmServer{logs: &syncBuffer{}, hosts: make(chan *vfiouser.Host, 4), devs: make(chan *testdev.Device, 4), served: make(chan error, 1)}
	log := slog.New(slog.NewTextHandler(s.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	srv, err := vfiouser.NewServer(vfiouser.Config{Logger: log,
		NewDevice: func(ctx context.Context, h *vfiouser.Host) (vfiouser.Device, error) {
			d, err := testdev.New(h)
			if err != nil {
				return nil, err
			}
			s.hosts <- h
			s.devs <- d
			return d.Fn, nil
		}})
	require.NoError(t, err)
	s.srv = srv
	dir, err := os.MkdirTemp("", "vfiouser-vm")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	s.sock = filepath.Join(dir, "dev.sock")
	ln, err := vfiouser.Listen(s.sock)
	require.NoError(t, err)
	go func() { s.served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-s.served
		t.Logf("server log:\n%s", s.logs.String())
	})
	return s
}

func (s *vmServer) deviceArg(noPosted bool) string {
	return fmt.Sprintf(`{"driver":"vfio-user-pci","socket":{"type":"unix","path":%q},"addr":"05.1","x-no-posted-writes":%v}`, s.sock, noPosted)
}

// qemuMessages returns QEMU's own stderr lines from a console capture.
func qemuMessages(console string) []string {
	var out []string
	for _, l := range strings.Split(console, "\n") {
		if strings.HasPrefix(l, "qemu: ") {
			out = append(out, l)
		}
	}
	return out
}

// TestVMGuestSeesDevice boots a guest with the test device served by this
// process at 00:05.1 next to a vmxnet3 at 05.0. The guest checks the PCI
// identity, BARs and MSI-X capability with lspci, pokes the registers with
// devmem (reaching our callbacks), and drives the device's DMA engine:
// into a reserved range of its memfd RAM (the server's mapping) in both
// directions, and over the BIOS ROM, which QEMU maps without a descriptor
// (server-to-client DMA_READ through QEMU). QEMU must log nothing.
func TestVMGuestSeesDevice(t *testing.T) {
	ctx := context.Background()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	s := startVMServer(t)

	const resv = 0x10000000 // 64 KiB the guest kernel leaves alone (memmap=)
	g, err := vm.Start(ctx, t, img, nil, vm.Config{
		Name:       "vfiouser",
		NICs:       []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: "52:54:00:77:00:01"}},
		ExtraArgs:  []string{"-device", s.deviceArg(true)},
		Modules:    []string{},
		KernelArgs: fmt.Sprintf("memmap=64K$%#x", resv),
		Timeout:    3 * time.Minute,
		Scenario: fmt.Sprintf(`
D=/sys/bus/pci/devices/0000:00:05.1
lspci -nn -s 05.0
bar() { printf '%%d' "$(sed -n "$(($1 + 1))p" $D/resource | cut -d' ' -f1)"; }
B0=$(bar 0); B1=$(bar 1); B2=$(bar 2)
rd() { echo "$1=$(devmem $(($2)) 32)"; }
wr() { devmem $(($1)) 32 $(($2)); }
dma() { wr B1+0x1c $1; while [ "$(devmem $((B1 + 0x30)) 32)" != 0x00000000 ]; do :; done; }
setpci -s 05.1 COMMAND=0x0107
echo "command=$(setpci -s 05.1 COMMAND)"
lspci -nn -vv -s 05.1
rd magic B1
wr B1+4 0xcafef00d
rd scratch B1+4
wr B1+8 40
rd counter B1+8
rd pba B0+0x800
rd bar2 B2+0x123450
# DMA over the last 64 KiB of the firmware ROM below 4 GiB, which QEMU
# maps without a descriptor (DMA_READ through QEMU).
wr B1+0x10 0xffff0000; wr B1+0x14 0; wr B1+0x18 0x10000; dma 2
rd romerr B1+0x28
rd romcrc B1+0x24
# Guest writes reserved RAM, the device reads it.
wr %[1]d 0x11223344; wr %[1]d+4 0x55667788; wr %[1]d+8 0x99aabbcc; wr %[1]d+12 0xddeeff00
wr B1+0x10 %[1]d; wr B1+0x18 16; dma 2
rd ramerr B1+0x28
rd ramcrc B1+0x24
# The device writes reserved RAM, the guest reads it.
wr B1+0x10 %[1]d+0x100; wr B1+0x20 0x40; dma 1
rd fillerr B1+0x28
rd fill0 %[1]d+0x100
rd fill1 %[1]d+0x104
# Bus master off: the device refuses DMA.
setpci -s 05.1 COMMAND=0x0003
dma 2
rd nobm B1+0x28
`, resv),
	})
	require.NoError(t, err)
	var host *vfiouser.Host
	var dev *testdev.Device
	select {
	case host = <-s.hosts:
		dev = <-s.devs
	case <-time.After(time.Minute):
		t.Fatal("QEMU did not connect")
	}
	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	out := res.Output

	// PCI identity, BARs and the MSI-X capability as the guest sees them.
	assert.Regexp(t, `(?m)^00:05\.0 .*\[15ad:07b0\]`, out, "vmxnet3 at 05.0")
	assert.Regexp(t, `(?m)^00:05\.1 Unclassified device \[00ff\]: .*\[1b36:0005\] \(rev 01\)`, out)
	assert.Regexp(t, `Subsystem: .*\[1b36:1100\]`, out)
	assert.Regexp(t, `Region 0: Memory at [0-9a-f]+ \(32-bit, non-prefetchable\) \[size=4K\]`, out)
	assert.Regexp(t, `Region 1: Memory at [0-9a-f]+ \(32-bit, non-prefetchable\) \[size=4K\]`, out)
	assert.Regexp(t, `Region 2: Memory at [0-9a-f]+ \(64-bit, prefetchable\) \[size=2M\]`, out)
	assert.Regexp(t, `Capabilities: \[40\] MSI-X: Enable- Count=4 Masked-`, out)
	assert.Regexp(t, `Vector table: BAR=0 offset=00000000`, out)
	assert.Regexp(t, `PBA: BAR=0 offset=00000800`, out)
	assert.Regexp(t, `Interrupt: pin A`, out)
	assert.Regexp(t, `Control: I/O\+ Mem\+ BusMaster\+ .* SERR\+`, out, "the command register as written")

	val := func(name string) uint64 {
		m := regexp.MustCompile(`(?m)^` + name + `=0x([0-9A-Fa-f]+)$`).FindStringSubmatch(out)
		if !assert.NotNil(t, m, "%s in the guest output", name) {
			return 0
		}
		v, err := strconv.ParseUint(m[1], 16, 64)
		require.NoError(t, err)
		return v
	}
	// Register accesses reached our callbacks and returned our values.
	assert.Equal(t, uint64(testdev.Magic), val("magic"))
	assert.Equal(t, uint64(0xcafef00d), val("scratch"))
	assert.Equal(t, uint64(1+40), val("counter"), "one write before, then +40")
	assert.Zero(t, val("pba"), "PBA read forwarded to us")
	assert.Equal(t, uint64(0x123450), val("bar2"))
	assert.Contains(t, out, "command=0107")

	// DMA through QEMU over the ROM, against the firmware file QEMU loaded
	// (the fd-less read-only map that ends at 4 GiB: qboot or SeaBIOS).
	logs := s.logs.String()
	fw := regexp.MustCompile(`DMA_MAP .* addr=(0xfff[0-9a-f]+0000) size=(\d+) flags=1 fd=false`).FindAllStringSubmatch(logs, -1)
	require.NotEmpty(t, fw, "the firmware ROM is mapped without a descriptor")
	fwSize, _ := strconv.Atoi(fw[len(fw)-1][2])
	var rom []byte
	for _, f := range []string{"usr/share/qemu/qboot.rom", "usr/share/seabios/bios-256k.bin", "usr/share/seabios/bios.bin"} {
		if b, err := os.ReadFile(filepath.Join(img.QEMUDir, "root", f)); err == nil && len(b) == fwSize {
			rom = b
			t.Logf("firmware %s (%d bytes) at %s", f, fwSize, fw[len(fw)-1][1])
			break
		}
	}
	require.NotNil(t, rom, "firmware file of %d bytes", fwSize)
	assert.Zero(t, val("romerr"), "DMA_READ of the ROM through QEMU")
	assert.Equal(t, uint64(crc32.ChecksumIEEE(rom[len(rom)-0x10000:])), val("romcrc"), "the device read the ROM QEMU maps below 4 GiB")
	// DMA in place in the memfd.
	ram := []byte{0x44, 0x33, 0x22, 0x11, 0x88, 0x77, 0x66, 0x55, 0xcc, 0xbb, 0xaa, 0x99, 0x00, 0xff, 0xee, 0xdd}
	assert.Zero(t, val("ramerr"))
	assert.Equal(t, uint64(crc32.ChecksumIEEE(ram)), val("ramcrc"), "the device read what the guest wrote")
	assert.Zero(t, val("fillerr"))
	pat := testdev.Pattern(0x40, 8)
	assert.Equal(t, uint64(binary.LittleEndian.Uint32(pat[0:])), val("fill0"), "the guest read what the device wrote")
	assert.Equal(t, uint64(binary.LittleEndian.Uint32(pat[4:])), val("fill1"))
	assert.Equal(t, uint64(1), val("nobm"), "EPERM without bus mastering")

	// Server side: QEMU assigned the ERR eventfd, sent no posted writes.
	assert.Greater(t, dev.Accesses(), uint64(10))
	assert.Contains(t, logs, "index=ERR", "QEMU assigned the error eventfd")
	assert.NotContains(t, logs, "level=WARN")
	assert.NotContains(t, logs, "level=ERROR")
	st := s.srv.Stats()
	t.Logf("server stats while the guest is gone: %+v", st)
	assert.Empty(t, qemuMessages(res.Console), "QEMU printed nothing: no error, warning or timeout")

	// QEMU exited: the connection ends, memory unmapped, device reset.
	deadline := time.Now().Add(10 * time.Second)
	for s.srv.Stats().Connections != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	st = s.srv.Stats()
	assert.Zero(t, st.Connections)
	assert.Zero(t, st.LockedBytes)
	assert.Zero(t, dev.Scratch(), "reset on disconnect")
	assert.Contains(t, logs, "vfio-user client negotiated")
	_ = host
	t.Logf("TIMING boot-to-init=%v scenario=%v total=%v", res.Timings.BootToInit.Round(time.Millisecond),
		res.Timings.Scenario.Round(time.Millisecond), res.Timings.Total.Round(time.Millisecond))
}

// TestVMPostedWrites runs QEMU's default posted BAR writes (No_reply
// REGION_WRITEs, no x-no-posted-writes): the server must never answer them
// (QEMU drops the connection on an unexpected reply), and a read after them
// sees their effect, since messages are handled in order.
func TestVMPostedWrites(t *testing.T) {
	ctx := context.Background()
	img, err := vm.EnsureImage(ctx, t.Logf)
	require.NoError(t, err)
	s := startVMServer(t)
	g, err := vm.Start(ctx, t, img, nil, vm.Config{
		Name:      "posted",
		NICs:      []vm.NIC{{Model: "vmxnet3", Addr: "05.0", MAC: "52:54:00:77:00:02"}},
		ExtraArgs: []string{"-device", s.deviceArg(false)},
		Modules:   []string{},
		Timeout:   3 * time.Minute,
		Scenario: `
D=/sys/bus/pci/devices/0000:00:05.1
B1=$(printf '%d' "$(sed -n 2p $D/resource | cut -d' ' -f1)")
setpci -s 05.1 COMMAND=0x0006
i=0
while [ $i -lt 200 ]; do devmem $((B1 + 8)) 32 1; i=$((i + 1)); done
devmem $((B1 + 4)) 32 0x600dbeef
echo "counter=$(devmem $((B1 + 8)) 32)"
echo "scratch=$(devmem $((B1 + 4)) 32)"
`,
	})
	require.NoError(t, err)
	var dev *testdev.Device
	select {
	case <-s.hosts:
		dev = <-s.devs
	case <-time.After(time.Minute):
		t.Fatal("QEMU did not connect")
	}
	posted := make(chan uint64, 1)
	go func() { // sample the counter while the guest is still connected
		var last uint64
		for i := 0; i < 6000; i++ {
			if st := s.srv.Stats(); st.Connections == 1 {
				last = st.Posted
			} else if last > 0 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		posted <- last
	}()
	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	assert.Contains(t, res.Output, "counter=0x000000C9", "200 posted adds, then the scratch write")
	assert.Contains(t, res.Output, "scratch=0x600DBEEF")
	assert.GreaterOrEqual(t, <-posted, uint64(201), "the writes came posted")
	assert.Empty(t, qemuMessages(res.Console), "no unexpected reply, no error")
	assert.NotContains(t, s.logs.String(), "level=WARN")
	_ = dev
}
