package hostile

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// BenchmarkObjects (make bench-scale) has one VM of the fake driver create
// 16k CQs, 16k QPs and 64k MRs through the daemon's command channel, or as
// many as the device advertises if fewer (the per-VM limits raised; the
// soft transport's own caps are 8192 CQs and 4096 QPs), then destroy them
// all. For each
// kind it reports the creation rate of the first and of the last 1024 and
// their ratio (flat is 1: no cost that grows with the objects a VM has),
// the daemon process's anonymous memory per object, and how long the
// teardown of all of them took. PVRDMA_OBJECTS_SCALE=0.25 runs a quarter
// of the counts. Run it with -benchtime 1x.
func BenchmarkObjects(b *testing.B) {
	scale := 1.0
	if s := os.Getenv("PVRDMA_OBJECTS_SCALE"); s != "" {
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || f <= 0 || f > 1 {
			b.Fatalf("PVRDMA_OBJECTS_SCALE=%q: want a fraction in (0, 1]", s)
		}
		scale = f
	}
	nCQ, nQP, nMR := int(16384*scale), int(16384*scale), int(65536*scale)
	for range b.N {
		lim := vdev.Limits{MaxCQ: nCQ + 2, MaxQP: nQP, MaxMR: nMR, MaxBytes: 8 << 30}
		e := newEnvConfig(b, lim, stderrLogger(), func(c *backend.Config) {
			c.VMs = []backend.VMRequest{{Name: "objs", MemBytes: 64 << 20}}
		})
		v, err := e.dial("objs")
		require.NoError(b, err)
		v.ramBytes = 64 << 20
		v.mapRAM()
		v.pciSetup()
		v.probe()
		// Within the caps the device advertises (two CQs are the QPs').
		nCQ, nQP, nMR := min(nCQ, int(v.caps.MaxCQ)-2), min(nQP, int(v.caps.MaxQP)), min(nMR, int(v.caps.MaxMR))
		fmt.Printf("OBJECTS device caps: %d CQs, %d QPs, %d MRs\n", v.caps.MaxCQ, v.caps.MaxQP, v.caps.MaxMR)
		uc := v.createUC(1)
		pd := v.createPD(uc)

		// The device copies page lists at creation: every object of a
		// kind names the same guest pages (a benchmark of the daemon's
		// cost, not of guest memory).
		cqPagesList := v.pages(cqPages(1))
		cqDir := v.pdir(cqPagesList)
		mrDir := v.pdir(v.pages(1))
		scq, rcq := v.createCQ(uc, 16), v.createCQ(uc, 16)
		_, qpReq := v.layoutQP(qpSpec{pd: pd, scq: scq, rcq: rcq, typ: hostverbs.QPTypeRC,
			sendWR: 1, recvWR: 1, sendSGE: 1, recvSGE: 1, uar: uc})

		type kind struct {
			name    string
			n       int
			create  func() uint32
			destroy func(h uint32)
		}
		kinds := []kind{
			{"cq", nCQ, func() uint32 {
				var r abi.CreateCQResp
				r.Decode(v.mustCmd(abi.CmdCreateCQ, abi.CreateCQ{PDirDMA: cqDir, CtxHandle: uc, CQE: 1, NChunks: uint32(len(cqPagesList))}))
				return r.CQHandle
			}, func(h uint32) { v.mustCmd(abi.CmdDestroyCQ, abi.DestroyCQ{CQHandle: h}) }},
			{"qp", nQP, func() uint32 {
				var r abi.CreateQPResp
				r.Decode(v.mustCmd(abi.CmdCreateQP, qpReq))
				return r.QPHandle
			}, func(h uint32) { v.mustCmd(abi.CmdDestroyQP, abi.DestroyQP{QPHandle: h}) }},
			{"mr", nMR, func() uint32 {
				var r abi.CreateMRResp
				r.Decode(v.mustCmd(abi.CmdCreateMR, abi.CreateMR{Start: mrIOVA, Length: 4096, PDirDMA: mrDir,
					PDHandle: pd, AccessFlags: accRW, NChunks: 1}))
				return r.MRHandle
			}, func(h uint32) { v.mustCmd(abi.CmdDestroyMR, abi.DestroyMR{MRHandle: h}) }},
		}
		const batch = 1024
		handles := map[string][]uint32{}
		for _, k := range kinds {
			runtime.GC()
			before := procStatusKB(b, "RssAnon")
			var first, last time.Duration
			hs := make([]uint32, 0, k.n)
			start := time.Now()
			for i := range k.n {
				if i%batch == 0 {
					start = time.Now()
				}
				hs = append(hs, k.create())
				if (i+1)%batch == 0 || i+1 == k.n {
					d := time.Since(start)
					if i < batch {
						first = d
					}
					last = d
				}
			}
			runtime.GC()
			perObj := float64(procStatusKB(b, "RssAnon")-before) * 1024 / float64(k.n)
			handles[k.name] = hs
			firstRate, lastRate := float64(batch)/first.Seconds(), float64(batch)/last.Seconds()
			b.ReportMetric(firstRate, k.name+"_first_per_s")
			b.ReportMetric(lastRate, k.name+"_last_per_s")
			b.ReportMetric(lastRate/firstRate, k.name+"_x_last_first")
			b.ReportMetric(perObj, k.name+"_anon_B_per_obj")
			fmt.Printf("OBJECTS %d %ss: first 1024 at %.0f/s, last at %.0f/s (%.2fx), %.0f B of anonymous memory each\n",
				k.n, k.name, firstRate, lastRate, lastRate/firstRate, perObj)
		}
		start := time.Now()
		for i := len(kinds) - 1; i >= 0; i-- { // MRs, QPs, then their CQs
			for _, h := range handles[kinds[i].name] {
				kinds[i].destroy(h)
			}
		}
		teardown := time.Since(start)
		total := nCQ + nQP + nMR
		b.ReportMetric(teardown.Seconds(), "teardown_s")
		fmt.Printf("OBJECTS teardown of all %d objects: %v (%.1f us each)\n", total, teardown.Round(time.Millisecond),
			teardown.Seconds()*1e6/float64(total))
		v.Close()
	}
}
