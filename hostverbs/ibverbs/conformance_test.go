//go:build linux && cgo

package ibverbs

import (
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/conformance"
)

// The tests below need an RDMA device: they run inside a test-bed guest with
// kernel rxe (rxe_vm_test.go boots it), where PVRDMA_IBDEV names it.

func testProvider(t *testing.T) (*Provider, hostverbs.GID) { return testProviderTB(t) }

func testProviderTB(t testing.TB) (*Provider, hostverbs.GID) { return testProviderBusy(t, 0) }

// testProviderBusy is testProviderTB with Config.BusyPoll set.
func testProviderBusy(t testing.TB, busy time.Duration) (*Provider, hostverbs.GID) {
	t.Helper()
	dev := os.Getenv("PVRDMA_IBDEV")
	if dev == "" {
		t.Skip("PVRDMA_IBDEV is not set (the VM test runs this in a guest with rxe)")
	}
	p, err := New(Config{Device: dev, BusyPoll: busy, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	tbl, err := p.GIDTable()
	require.NoError(t, err)
	for _, g := range tbl {
		if g.Type == hostverbs.GIDTypeRoCEv2 && g.GID.IsV4() {
			return p, g.GID
		}
	}
	t.Fatalf("%s has no RoCE v2 IPv4 GID: %+v", dev, tbl)
	return nil, hostverbs.GID{}
}

// TestConformanceRelay runs the providers' suite against the relay: two VM
// devices on one host device talk to each other through it.
func TestConformanceRelay(t *testing.T) {
	p, gid := testProvider(t)
	runConformance(t, p, gid)
}

// TestConformanceRelayBusyPoll is TestConformanceRelay with the relay's
// busy polling on (Config.BusyPoll): completions taken while the CQs are
// unarmed, and the arming after the polling window, lose nothing.
func TestConformanceRelayBusyPoll(t *testing.T) {
	p, gid := testProviderBusy(t, time.Millisecond)
	runConformance(t, p, gid)
}

func runConformance(t *testing.T, p *Provider, gid hostverbs.GID) {
	conformance.Run(t, conformance.Env{
		Open: func(t *testing.T, name string, mem *guestmem.Memory, lim hostverbs.Limits, events func(hostverbs.AsyncEvent)) (hostverbs.Device, hostverbs.GID) {
			d, err := p.Open(hostverbs.DeviceConfig{Name: name, Memory: mem, Limits: lim, Events: events})
			require.NoError(t, err)
			require.NoError(t, d.SetGID(0, hostverbs.GIDEntry{GID: gid, Type: hostverbs.GIDTypeRoCEv2}))
			return d, gid
		},
	})
}

// TestUnknownGIDRefused: an AV whose source GID the host table does not
// hold fails with a clear error, not a silent fallback.
func TestUnknownGIDRefused(t *testing.T) {
	p, gid := testProvider(t)
	mem := guestmem.New()
	d, err := p.Open(hostverbs.DeviceConfig{Name: "gid", Memory: mem})
	require.NoError(t, err)
	defer d.Close()
	other := gid
	other[15] ^= 0x55
	require.NoError(t, d.SetGID(1, hostverbs.GIDEntry{GID: other, Type: hostverbs.GIDTypeRoCEv2}))
	pd, err := d.AllocPD()
	require.NoError(t, err)
	h := nopHandler{}
	cq, err := d.CreateCQ(hostverbs.CQAttr{Depth: 16, Handler: h})
	require.NoError(t, err)
	q, err := pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: cq, RecvCQ: cq,
		Cap: hostverbs.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}})
	require.NoError(t, err)
	require.NoError(t, q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateInit, Port: 1},
		hostverbs.AttrState|hostverbs.AttrPKeyIndex|hostverbs.AttrPort|hostverbs.AttrAccessFlags))
	err = q.Modify(&hostverbs.QPAttr{State: hostverbs.QPStateRTR, PathMTU: hostverbs.MTU1024, DestQPN: 5,
		AV: hostverbs.AddressVector{DGID: gid, SGIDIndex: 1, HopLimit: 64}},
		hostverbs.AttrState|hostverbs.AttrAV|hostverbs.AttrPathMTU|hostverbs.AttrDestQPN|hostverbs.AttrRQPSN|
			hostverbs.AttrMaxDestRdAtomic|hostverbs.AttrMinRNRTimer)
	require.ErrorIs(t, err, hostverbs.ErrNotFound)
	require.Contains(t, err.Error(), "is not in")
	_, err = pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeGSI, SendCQ: cq, RecvCQ: cq,
		Cap: hostverbs.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}})
	require.ErrorIs(t, err, hostverbs.ErrNotSupported)
}

type nopHandler struct{}

func (nopHandler) Complete(*hostverbs.WorkCompletion) {}

// TestTeardownLeavesNothing: a VM's device closed with objects still open
// (a VM killed mid-run) leaves no PD, MR, CQ or QP on the host device, as
// `rdma resource show` counts them for this process.
func TestTeardownLeavesNothing(t *testing.T) {
	p, gid := testProvider(t)
	fdsBefore := openFDs(t)
	var devs []hostverbs.Device
	for i := range 2 {
		mem := conformance.MemfdMemory(t, 1<<20)
		d, err := p.Open(hostverbs.DeviceConfig{Name: "td", Memory: mem})
		require.NoError(t, err)
		require.NoError(t, d.SetGID(0, hostverbs.GIDEntry{GID: gid, Type: hostverbs.GIDTypeRoCEv2}))
		pd, err := d.AllocPD()
		require.NoError(t, err)
		cq, err := d.CreateCQ(hostverbs.CQAttr{Depth: 64, Handler: nopHandler{}})
		require.NoError(t, err)
		for range 3 {
			_, err := pd.CreateQP(hostverbs.QPInitAttr{Type: hostverbs.QPTypeRC, SendCQ: cq, RecvCQ: cq,
				Cap: hostverbs.QPCap{MaxSendWR: 8, MaxRecvWR: 8, MaxSendSGE: 1, MaxRecvSGE: 1}})
			require.NoError(t, err)
		}
		pl, err := guestmem.NewPageList(0x10000+uint64(i)*0x1000, 3*guestmem.PageSize, []guestmem.GPA{0x3000, 0x1000, 0x2000})
		require.NoError(t, err)
		_, err = pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite})
		require.NoError(t, err)
		devs = append(devs, d)
	}
	require.NotZero(t, countMine(t, "qp"), "the objects are visible before teardown")
	require.NotZero(t, countMine(t, "mr"))
	for _, d := range devs {
		require.NoError(t, d.Close())
	}
	for _, kind := range []string{"qp", "cq", "mr", "pd"} {
		require.Zero(t, countMine(t, kind), "%s left after the devices closed", kind)
	}
	require.Equal(t, fdsBefore, openFDs(t), "descriptors left after the devices closed")
}

func openFDs(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		l, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil || strings.Contains(l, "memfd:conformance") {
			continue // ReadDir's own descriptor; the test's guest memory (freed at cleanup)
		}
		out = append(out, e.Name()+"->"+l)
	}
	return out
}

// countMine counts this process's objects of a kind in `rdma -j resource
// show KIND`, which names the creating thread (any of our thread IDs).
func countMine(t *testing.T, kind string) int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	require.NoError(t, err)
	mine := map[int]bool{}
	for _, e := range tasks {
		if id, err := strconv.Atoi(e.Name()); err == nil {
			mine[id] = true
		}
	}
	out, err := exec.Command("rdma", "-j", "resource", "show", kind).Output()
	require.NoError(t, err, "rdma resource show %s", kind)
	var ents []map[string]any
	require.NoError(t, json.Unmarshal(out, &ents), "%s", out)
	n := 0
	defer func() {
		if n == 0 {
			t.Logf("rdma -j resource show %s (pid %d): %s", kind, os.Getpid(), out)
		}
	}()
	for _, e := range ents {
		if pid, ok := e["pid"].(float64); ok && mine[int(pid)] {
			n++
		}
	}
	return n
}

// TestAliasMappingsCapped: an MR's pages each cost a mapping (runs of
// contiguous pages share one), and mappings are the daemon's, shared by all
// VMs: a VM whose page list would need more than its share is refused
// before anything is mapped, and its later MRs still register.
func TestAliasMappingsCapped(t *testing.T) {
	p, gid := testProvider(t)
	mem := conformance.MemfdMemory(t, 1<<20)
	d, err := p.Open(hostverbs.DeviceConfig{Name: "runs", Memory: mem})
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, d.SetGID(0, hostverbs.GIDEntry{GID: gid, Type: hostverbs.GIDTypeRoCEv2}))
	pd, err := d.AllocPD()
	require.NoError(t, err)
	pages := make([]guestmem.GPA, maxRunsPerDevice+1)
	for i := range pages {
		pages[i] = guestmem.GPA(i%2) * 2 * guestmem.PageSize // 0, 0x2000, 0, ...: every page its own run
	}
	pl, err := guestmem.NewPageList(0x10000000, uint64(len(pages))*guestmem.PageSize, pages)
	require.NoError(t, err)
	_, err = pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite})
	require.ErrorIs(t, err, hostverbs.ErrNoResources)
	require.Contains(t, err.Error(), "page runs")
	pl, err = guestmem.NewPageList(0x10000000, 64*guestmem.PageSize, make([]guestmem.GPA, 64))
	require.NoError(t, err)
	mr, err := pd.RegMR(hostverbs.MRAttr{Pages: pl, Access: hostverbs.AccessLocalWrite})
	require.NoError(t, err, "64 runs of the same page after the refusal")
	require.NoError(t, mr.Dereg())
	p.mu.Lock()
	require.Zero(t, p.runs, "every run returned")
	p.mu.Unlock()
}
