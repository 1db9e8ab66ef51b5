package hostile

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// This file is the "QEMU + vmw_pvrdma probe" half of the harness: a VM is
// one vfio-user connection to the daemon with a memfd as its RAM, and the
// driver's probe sequence as the 6.1 driver was seen to run it (config
// space, MSI-X eventfds, DSR, DSRLOW/DSRHIGH, IMR, CTL ACTIVATE, ERR) and the
// device's command protocol (slot, REQUEST, ERR, vector 0, response).

const (
	ramSize   = 16 << 20
	firstPage = 1 << 20 // the page allocator starts above the first MiB
	uarPFN    = 0xfe800 // BAR2 where the firmware was seen to place it
	ringPages = 4       // PVRDMA_NUM_RING_PAGES
	// irqTimeout bounds every wait for an interrupt or a completion.
	irqTimeout = 10 * time.Second
)

// PCI config space registers the driver touches.
const (
	cfgCommand    = 0x04
	cfgCapPtr     = 0x34
	cmdMemory     = 1 << 1
	cmdBusMaster  = 1 << 2
	capIDMSIX     = 0x11
	msixCtrlOn    = 1 << 15
	msixCtrlMask  = 1 << 14
	bar1          = abi.RegsBAR
	bar2          = abi.UARBAR
	msixTrigger   = vfiouser.IRQSetDataEventfd | vfiouser.IRQSetActionTrigger
	memDecodeBits = cmdMemory | cmdBusMaster
)

// vm is one guest: a vfio-user connection, its RAM and interrupt
// eventfds, and the driver state of its PVRDMA function. It is used from
// one goroutine at a time (Close excepted, see vfiousertest.Client).
type vm struct {
	t     testing.TB
	e     *env
	name  string
	c     *vfiousertest.Client
	ram   []byte
	ramFD int
	irqs  [abi.NumVectors]int
	msix  uint64 // config offset of the MSI-X capability

	next                   uint64 // page allocator
	dsr, cmdSlot, respSlot uint64
	async, cqn             []uint64
	caps                   abi.Caps
	key                    uint64

	served    bool // the daemon made a device for this connection
	closeOnce sync.Once
	ramBytes  uint64 // guest RAM; 0 means ramSize
}

// ramLen is the VM's guest RAM size.
func (v *vm) ramLen() uint64 {
	if v.ramBytes != 0 {
		return v.ramBytes
	}
	return ramSize
}

// dial connects to VM name's socket and negotiates, as QEMU does at
// realize; nothing is mapped yet.
func (e *env) dial(name string) (*vm, error) {
	path := backend.SocketPath(e.socketDir, name)
	if e.d != nil {
		path = e.d.SocketPath(name)
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	v := &vm{t: e.t, e: e, name: name, c: vfiousertest.NewClient(conn), ramFD: -1, next: firstPage}
	for i := range v.irqs {
		v.irqs[i] = -1
	}
	e.track(v)
	if _, err := v.c.Negotiate(vfiousertest.QEMUCaps); err != nil {
		v.Close()
		return nil, fmt.Errorf("negotiate: %w", err)
	}
	v.served = true
	return v, nil
}

func (e *env) track(v *vm) {
	e.mu.Lock()
	e.vms[v] = struct{}{}
	e.mu.Unlock()
}

func (e *env) untrack(v *vm) {
	e.mu.Lock()
	delete(e.vms, v)
	e.mu.Unlock()
}

// connect is dial plus the rest of QEMU's realize and the firmware's and
// driver's PCI setup: guest RAM mapped, memory decode and bus mastering
// on, MSI-X enabled with an eventfd per vector.
func (e *env) connect(name string) *vm {
	e.t.Helper()
	v, err := e.dial(name)
	require.NoError(e.t, err)
	v.mapRAM()
	v.pciSetup()
	return v
}

// boot is connect plus the driver's probe.
func (e *env) boot(name string) *vm {
	e.t.Helper()
	v := e.connect(name)
	v.probe()
	return v
}

// mapRAM creates the guest's RAM and DMA-maps it at GPA 0.
func (v *vm) mapRAM() {
	v.t.Helper()
	fd, mem, err := guestRAM(int(v.ramLen()))
	require.NoError(v.t, err)
	v.ramFD, v.ram = fd, mem
	require.NoError(v.t, v.c.DMAMap(0, v.ramLen(), vfiouser.DMAFlagRead|vfiouser.DMAFlagWrite, fd, 0))
}

// guestRAM is QEMU's memory-backend-memfd with share=on and its default
// seal=on: a memfd sealed against shrinking and growing, mapped shared.
func guestRAM(size int) (int, []byte, error) {
	fd, err := unix.MemfdCreate("hostile-guest-ram", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err = unix.Ftruncate(fd, int64(size)); err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	}
	var mem []byte
	if err == nil {
		mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		_ = unix.Close(fd)
		return -1, nil, fmt.Errorf("guest RAM: %w", err)
	}
	return fd, mem, nil
}

// pciSetup checks the identity, turns on decode and bus mastering, finds
// the MSI-X capability, enables it and assigns one eventfd per vector.
func (v *vm) pciSetup() {
	v.t.Helper()
	info, err := v.c.DeviceInfo()
	require.NoError(v.t, err)
	require.EqualValues(v.t, vfiouser.NumPCIRegions, info.NumRegions)
	id := v.cfg32(0)
	require.Equal(v.t, uint32(abi.PCIDeviceID)<<16|abi.PCIVendorID, id)
	require.NoError(v.t, v.c.Write32(vfiouser.RegionConfig, cfgCommand, memDecodeBits))
	for p := uint64(v.cfg32(cfgCapPtr) & 0xff); p != 0; {
		hdr := v.cfg32(p)
		if hdr&0xff == capIDMSIX {
			v.msix = p
			break
		}
		p = uint64(hdr>>8) & 0xff
	}
	require.NotZero(v.t, v.msix, "no MSI-X capability")
	ctrl := uint16(v.cfg32(v.msix) >> 16)
	require.EqualValues(v.t, abi.NumVectors-1, ctrl&0x7ff, "MSI-X table size")
	var b [2]byte
	binary.LittleEndian.PutUint16(b[:], (ctrl|msixCtrlOn)&^msixCtrlMask)
	require.NoError(v.t, v.c.RegionWrite(vfiouser.RegionConfig, v.msix+2, b[:], false))
	for i := range v.irqs {
		if v.irqs[i] >= 0 {
			_ = unix.Close(v.irqs[i]) // re-setup after a reset: the server drops the old ones
		}
		fd, err := vfiousertest.Eventfd()
		require.NoError(v.t, err)
		v.irqs[i] = fd
	}
	require.NoError(v.t, v.c.SetIRQs(vfiouser.IRQMSIX, msixTrigger, 0, abi.NumVectors, nil, v.irqs[:]...))
}

func (v *vm) cfg32(off uint64) uint32 {
	v.t.Helper()
	x, err := v.c.Read32(vfiouser.RegionConfig, off)
	require.NoError(v.t, err)
	return x
}

// Close disconnects abruptly, as a QEMU that dies (or a guest powered
// off) does: no teardown traffic, just EOF. It waits until the daemon has
// torn the device down and releases the guest side's descriptors.
func (v *vm) Close() {
	v.closeOnce.Do(func() {
		v.e.untrack(v)
		_ = v.c.Close()
		for i, fd := range v.irqs {
			if fd >= 0 {
				_ = unix.Close(fd)
				v.irqs[i] = -1
			}
		}
		if v.ram != nil {
			_ = unix.Munmap(v.ram)
		}
		if v.ramFD >= 0 {
			_ = unix.Close(v.ramFD)
		}
		deadline := time.Now().Add(10 * time.Second)
		for v.served && v.e.connected(v.name) {
			if time.Now().After(deadline) {
				v.t.Errorf("VM %s still connected 10 s after its client closed", v.name)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
}

// Register access (BAR1), 32-bit as the ABI requires.

func (v *vm) reg(off uint64) uint32 {
	v.t.Helper()
	x, err := v.c.Read32(bar1, off)
	require.NoError(v.t, err)
	return x
}

func (v *vm) setReg(off uint64, x uint32) {
	v.t.Helper()
	require.NoError(v.t, v.c.Write32(bar1, off, x))
}

// doorbell writes a UAR doorbell: value x at offset off of UAR page uar.
func (v *vm) doorbell(uar uint32, off uint64, x uint32) {
	v.t.Helper()
	require.NoError(v.t, v.tryDoorbell(uar, off, x))
}

func (v *vm) tryDoorbell(uar uint32, off uint64, x uint32) error {
	return v.c.Write32(bar2, uint64(uar)*abi.UARPageSize+off, x)
}

// Guest memory.

func (v *vm) put32(gpa uint64, x uint32) { binary.LittleEndian.PutUint32(v.ram[gpa:], x) }
func (v *vm) put64(gpa uint64, x uint64) { binary.LittleEndian.PutUint64(v.ram[gpa:], x) }

// pages allocates n zeroed pages of guest RAM.
func (v *vm) pages(n int) []uint64 {
	v.t.Helper()
	out := make([]uint64, n)
	for i := range out {
		require.LessOrEqual(v.t, v.next+4096, v.ramLen(), "guest RAM exhausted")
		out[i] = v.next
		clear(v.ram[v.next : v.next+4096])
		v.next += 4096
	}
	return out
}

func (v *vm) page() uint64 { return v.pages(1)[0] }

// scattered allocates n pages in reverse order: page lists of real guests
// are not contiguous.
func (v *vm) scattered(n int) []uint64 {
	p := v.pages(n)
	for i := 0; i < n/2; i++ {
		p[i], p[n-1-i] = p[n-1-i], p[i]
	}
	return p
}

// pdir builds a two-level page directory (pvrdma_page_dir_init): one
// directory page of table addresses, tables of 512 page addresses.
func (v *vm) pdir(pages []uint64) uint64 {
	dir := v.page()
	ntables := max((len(pages)+511)/512, 1)
	tables := v.pages(ntables)
	for t := range tables {
		v.put64(dir+uint64(t)*8, tables[t])
		for i := 0; i < 512 && t*512+i < len(pages); i++ {
			v.put64(tables[t]+uint64(i)*8, pages[t*512+i])
		}
	}
	return dir
}

// Interrupts.

// irq returns and clears the count of vector n.
func (v *vm) irq(n int) uint64 {
	v.t.Helper()
	c, err := vfiousertest.ReadEventfd(v.irqs[n])
	require.NoError(v.t, err)
	return c
}

var errIRQTimeout = errors.New("interrupt did not arrive")

// waitIRQ waits for vector n to fire and returns its count.
func (v *vm) waitIRQ(n int, timeout time.Duration) (uint64, error) {
	deadline := time.Now().Add(timeout)
	for {
		c, err := vfiousertest.ReadEventfd(v.irqs[n])
		if err != nil || c > 0 {
			return c, err
		}
		ms := int(time.Until(deadline) / time.Millisecond)
		if ms <= 0 {
			return 0, fmt.Errorf("vector %d: %w", n, errIRQTimeout)
		}
		_, err = unix.Poll([]unix.PollFd{{Fd: int32(v.irqs[n]), Events: unix.POLLIN}}, ms)
		if err != nil && !errors.Is(err, syscall.EINTR) {
			return 0, err
		}
	}
}

// The DSR and the probe.

// layoutDSR writes the DSR as pvrdma_pci_probe does: command and response
// slot pages, async-event and CQ-notification rings of 4 pages each behind
// page directories, the UAR's page frame.
func (v *vm) layoutDSR() abi.DSR {
	v.dsr = v.page()
	v.cmdSlot, v.respSlot = v.page(), v.page()
	v.async, v.cqn = v.pages(ringPages), v.pages(ringPages)
	return abi.DSR{
		DriverVersion: abi.DeviceVersion, GOSInfo: 0x46, CmdSlot: v.cmdSlot, RespSlot: v.respSlot,
		AsyncRing: abi.RingPageInfo{NumPages: ringPages, PDirDMA: v.pdir(v.async)},
		CQRing:    abi.RingPageInfo{NumPages: ringPages, PDirDMA: v.pdir(v.cqn)},
		UARPFN:    uarPFN,
	}
}

// loadDSR lays out a DSR, lets mutate spoil it, writes it at v.dsr and
// hands it to the device (DSRLOW, then DSRHIGH). It returns ERR as it
// reads afterwards and the caps the device wrote (zero if none).
func (v *vm) loadDSR(mutate func(*abi.DSR)) (uint32, abi.Caps) {
	v.t.Helper()
	d := v.layoutDSR()
	if mutate != nil {
		mutate(&d)
	}
	d.Encode(v.ram[v.dsr:])
	v.setReg(abi.RegDSRLow, uint32(v.dsr))
	v.setReg(abi.RegDSRHigh, uint32(v.dsr>>32))
	var caps abi.Caps
	caps.Decode(v.ram[v.dsr+abi.DSRCapsOffset:])
	return v.reg(abi.RegErr), caps
}

// probe is pvrdma_pci_probe: VERSION, DSR, caps check, IMR, ACTIVATE,
// ERR must read 0.
func (v *vm) probe() {
	v.t.Helper()
	require.EqualValues(v.t, abi.DeviceVersion, v.reg(abi.RegVersion))
	_, caps := v.loadDSR(nil)
	require.EqualValues(v.t, abi.DeviceModeRoCE, caps.Mode)
	require.EqualValues(v.t, abi.GIDTypeFlagRoCEv2, caps.GIDTypes, "the driver compares gid_types with ==")
	require.NotZero(v.t, caps.MaxQP)
	v.caps = caps
	v.setReg(abi.RegIMR, 0)
	v.setReg(abi.RegCtl, abi.CtlActivate)
	require.Zero(v.t, v.reg(abi.RegErr), "ERR after ACTIVATE")
	// ACTIVATE with the port up reports PORT_ACTIVE on the async ring.
	require.Equal(v.t, []abi.EQE{{Type: 9, Info: 1}}, v.events())
	_, err := v.waitIRQ(abi.VectorAsync, irqTimeout)
	require.NoError(v.t, err)
}

// Commands.

type encoder interface{ Encode([]byte) }

// result is what the driver sees of a command: ERR after REQUEST, and the
// response slot (the union's bytes) once vector 0 fired.
type result struct {
	err  uint32
	hdr  abi.RespHdr
	resp []byte
	key  uint64
	code uint32
}

// post writes a request (header with a fresh response key plus req) into
// the command slot, writes REQUEST, reads ERR and waits for vector 0, as
// pvrdma_cmd_post does. The response slot is poisoned first so that a
// response the device did not write is visible.
func (v *vm) post(code uint32, req encoder) result {
	v.t.Helper()
	slot := v.ram[v.cmdSlot : v.cmdSlot+abi.CmdReqSize]
	clear(slot)
	v.key++
	abi.CmdHdr{Response: v.key, Cmd: code}.Encode(slot)
	if req != nil {
		req.Encode(slot)
	}
	return v.request(code)
}

// request runs whatever is in the command slot.
func (v *vm) request(code uint32) result {
	v.t.Helper()
	rsp := v.ram[v.respSlot : v.respSlot+abi.CmdRespSize]
	for i := range rsp {
		rsp[i] = 0xEE
	}
	v.irq(abi.VectorResponse)
	v.setReg(abi.RegRequest, 0)
	r := result{err: v.reg(abi.RegErr), key: v.key, code: code}
	n, err := v.waitIRQ(abi.VectorResponse, irqTimeout)
	require.NoError(v.t, err, "every command raises vector 0")
	require.EqualValues(v.t, 1, n)
	r.resp = append([]byte(nil), rsp...)
	r.hdr.Decode(r.resp)
	return r
}

// mustCmd posts a command that must succeed and returns its response.
func (v *vm) mustCmd(code uint32, req encoder) []byte {
	v.t.Helper()
	r := v.post(code, req)
	require.Zero(v.t, r.err, "%s: ERR %d", vdev.CommandName(code), r.err)
	r.requireResp(v.t, 0)
	return r.resp
}

// requireResp checks the response header: key echoed, the command's
// response code, and errno in err.
func (r result) requireResp(t testing.TB, errno syscall.Errno) {
	t.Helper()
	require.Equal(t, r.key, r.hdr.Response, "response key echoed")
	require.EqualValues(t, abi.RespFlag|r.code, r.hdr.Ack, "response code")
	require.EqualValues(t, errno, r.hdr.Err, "response err")
}

// failCmd posts a command that must fail with errno, both in ERR (the
// only thing the driver checks first) and in the response header.
func (v *vm) failCmd(code uint32, req encoder, errno syscall.Errno) {
	v.t.Helper()
	r := v.post(code, req)
	require.EqualValues(v.t, errno, r.err, "%s: ERR", vdev.CommandName(code))
	r.requireResp(v.t, errno)
}

// Device rings (async events and CQ notifications) with the driver's
// arithmetic: (pages-1)*4096/size slots, not a power of two, indices
// masked with 2*slots-1 (ringbuf.Geometry explains the arithmetic).

func ringValid(idx, max uint32) bool { return idx&^(2*max-1) == 0 }
func ringInc(idx, max uint32) uint32 { return (idx + 1) & (2*max - 1) }

// drainRing consumes every entry of a device ring (rx half of the state
// page) and returns the entries' first 8 bytes.
func (v *vm) drainRing(pages []uint64, size uint32) [][8]byte {
	v.t.Helper()
	slots := uint32((ringPages - 1) * 4096 / size)
	state := pages[0] + 8
	var out [][8]byte
	for {
		tail, head := load32(v.ram, state), load32(v.ram, state+4)
		require.True(v.t, ringValid(tail, slots) && ringValid(head, slots), "device ring state %#x/%#x", tail, head)
		if tail == head {
			return out
		}
		off := uint64(head&(slots-1)) * uint64(size)
		var e [8]byte
		copy(e[:size], v.ram[pages[1+off/4096]+off%4096:])
		out = append(out, e)
		store32(v.ram, state+4, ringInc(head, slots))
	}
}

// events drains the async event ring.
func (v *vm) events() []abi.EQE {
	var out []abi.EQE
	for _, b := range v.drainRing(v.async, abi.EQESize) {
		var e abi.EQE
		e.Decode(b[:])
		out = append(out, e)
	}
	return out
}

// notifications drains the CQ-notification ring.
func (v *vm) notifications() []uint32 {
	var out []uint32
	for _, b := range v.drainRing(v.cqn, abi.CQNESize) {
		out = append(out, binary.LittleEndian.Uint32(b[:]))
	}
	return out
}
