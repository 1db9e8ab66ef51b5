package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testRun(section string) Run {
	return Run{
		Section:  section,
		Command:  "go test -run '^$' -bench . ./x",
		Date:     time.Date(2026, 11, 27, 23, 33, 58, 0, time.UTC),
		Commit:   "a46b0fedff24",
		Machine:  Machine{CPU: "AMD EPYC", Cores: 2, MemKiB: 24 << 20, Kernel: "6.1.0", Go: "go1.26.8"},
		Before:   Load{"0.10", "0.20", "0.30"},
		After:    Load{"1.00", "0.50", "0.40"},
		Duration: 53 * time.Second,
	}
}

// Every figure of the raw output is in the section as the benchmark printed it, beside
// the run's provenance.
func TestRenderSectionCarriesEveryFigure(t *testing.T) {
	for _, name := range []string{"device", "wire", "scale", "incast", "hosts", "handover", "vm", "relay"} {
		t.Run(name, func(t *testing.T) {
			s, ok := sectionByName(name)
			require.True(t, ok)
			raw := filepath.Join("testdata", name+".txt")
			md, err := render(s, testRun(name), raw)
			require.NoError(t, err)
			out := parseFile(t, name+".txt")
			for _, p := range out.Packages {
				for _, r := range p.Results {
					for _, m := range r.Metrics {
						assert.Contains(t, md, "| `"+m.Unit+"` |", "%s %s", r.Name, m.Unit)
						assert.Contains(t, md, " "+m.Value+" |", "%s %s", r.Name, m.Unit)
					}
				}
				for _, l := range p.Printed {
					assert.Contains(t, md, clip(l))
				}
			}
			for _, want := range []string{"| Date | 2026-11-27 23:33 UTC |", "| Commit | a46b0fedff24 |",
				"| Machine | AMD EPYC, 2 cores", "Linux 6.1.0, go1.26.8 |", "| Load average before (after) | 0.10 0.20 0.30 (1.00 0.50 0.40) |",
				"| Run | passed in 53s |", "```sh\ngo test -run '^$' -bench . ./x\n```", "<a id=\"" + name + "\"></a>"} {
				assert.Contains(t, md, want)
			}
			assert.NotContains(t, md, "machine was busy", "load 0.10 is quiet")
			assert.Regexp(t, `(?m)^<!-- section: `+name+` generated=2026-11-27T23:33:58Z commit=a46b0fedff24 -->$`, md)
		})
	}
}

func TestRenderSaysWhenBusy(t *testing.T) {
	s, _ := sectionByName("device")
	run := testRun("device")
	run.Before = Load{"10.64", "7.27", "4.09"}
	md, err := render(s, run, filepath.Join("testdata", "device.txt"))
	require.NoError(t, err)
	assert.Contains(t, md, "**The machine was busy** (1-minute load average 10.64")
}

func TestRenderRefusesFailedOrEmptyOutput(t *testing.T) {
	s, _ := sectionByName("device")
	dir := t.TempDir()
	failed := filepath.Join(dir, "f.txt")
	require.NoError(t, os.WriteFile(failed, []byte("--- FAIL: BenchmarkX-2\nFAIL\n"), 0o644))
	_, err := render(s, testRun("device"), failed)
	assert.ErrorContains(t, err, "failure")
	empty := filepath.Join(dir, "e.txt")
	require.NoError(t, os.WriteFile(empty, []byte("PASS\n"), 0o644))
	_, err = render(s, testRun("device"), empty)
	assert.ErrorContains(t, err, "no benchmark results")
}

// Regenerating one section leaves every other section of the report as it was.
func TestRegenerateOneSectionKeepsTheOthers(t *testing.T) {
	dir := t.TempDir()
	report := filepath.Join(dir, "BENCHMARKS.md")
	var discard strings.Builder
	require.NoError(t, run("all", report, "", "", "", true, &discard, &discard))
	first, err := os.ReadFile(report)
	require.NoError(t, err)
	assert.Equal(t, len(sections), strings.Count(string(first), "**Not generated yet on this commit.**"))

	// Two sections rendered from kept runs (the -from path).
	raw := filepath.Join(dir, "raw")
	require.NoError(t, os.MkdirAll(raw, 0o755))
	for _, name := range []string{"scale", "wire"} {
		b, err := os.ReadFile(filepath.Join("testdata", name+".txt"))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(raw, name+".txt"), b, 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(raw, name+".json"),
			[]byte(`{"section":"`+name+`","command":"go test x","date":"2026-11-27T23:47:32Z","commit":"abc","machine":{"cores":2},"load_before":["0.1","0.1","0.1"],"load_after":["0.2","0.2","0.2"],"duration_ns":1000000000}`), 0o644))
	}
	require.NoError(t, run("scale", report, "", "", raw, false, &discard, &discard))
	withScale, err := os.ReadFile(report)
	require.NoError(t, err)
	require.NoError(t, run("wire", report, "", "", raw, false, &discard, &discard))
	both, err := os.ReadFile(report)
	require.NoError(t, err)

	before, after := parseReport(string(withScale)), parseReport(string(both))
	for _, s := range sections {
		if s.Name == "wire" {
			assert.NotEqual(t, before.Sections[s.Name], after.Sections[s.Name])
			continue
		}
		assert.Equal(t, before.Sections[s.Name], after.Sections[s.Name], "section %s changed", s.Name)
	}
	assert.Contains(t, after.Sections["scale"], "| `MB/s` | 302.68 | 219.11 |")
	assert.Regexp(t, regexp.MustCompile(`\| \[scale\]\(#scale\) \| [^|]+ \| 2026-11-27T23:47:32Z \| abc \|`), string(both))
	assert.Equal(t, len(sections)-2, strings.Count(string(both), "**Not generated yet on this commit.**"))

	// A failed run leaves its section as it was.
	require.NoError(t, os.WriteFile(filepath.Join(raw, "scale.json"), []byte(`{"section":"scale","exit_error":"exit status 1"}`), 0o644))
	require.Error(t, run("scale", report, "", "", raw, false, &discard, &discard))
	again, err := os.ReadFile(report)
	require.NoError(t, err)
	assert.Equal(t, string(both), string(again))
}

func TestSelectSections(t *testing.T) {
	all, err := selectSections("all")
	require.NoError(t, err)
	assert.Len(t, all, len(sections))
	two, err := selectSections("scale, device")
	require.NoError(t, err)
	require.Len(t, two, 2)
	assert.Equal(t, "device", two[0].Name, "report order, not the list's")
	_, err = selectSections("device,nosuch")
	assert.ErrorContains(t, err, `no section "nosuch"`)
}

func TestBenchtimeOverride(t *testing.T) {
	d, _ := sectionByName("device")
	assert.Contains(t, strings.Join(d.withBenchtime("100ms"), " "), "-benchtime 100ms")
	assert.Contains(t, strings.Join(d.withBenchtime(""), " "), "-benchtime 2s")
	v, _ := sectionByName("vm")
	assert.Contains(t, strings.Join(v.withBenchtime("100ms"), " "), "-benchtime 1x", "a scenario runs once")
	assert.Equal(t, `go test -run '^$' -bench 'Scale|Objects'`, shellJoin([]string{"go", "test", "-run", "^$", "-bench", "Scale|Objects"}))
}

// TestCommandLineEnv: the environment goes before go test as assignments a
// shell takes (only the value quoted), and the command runs as printed.
func TestCommandLineEnv(t *testing.T) {
	cmd := commandLineEnv([]string{"HOME=/root", "GOFLAGS=-buildvcs=false -trimpath", "PVRDMA_SCALE_N=8,32", "PVRDMA_X="},
		[]string{"-run", "^$", "-bench", "Scale|Objects", "./tests/hostile"})
	assert.Equal(t, `GOFLAGS='-buildvcs=false -trimpath' PVRDMA_SCALE_N=8,32 PVRDMA_X='' go test -run '^$' -bench 'Scale|Objects' ./tests/hostile`, cmd)
	// A shell runs it: its assignments reach the command (go replaced by env).
	assign, _, _ := strings.Cut(cmd, " go test ")
	out, err := exec.Command("sh", "-c", assign+" env | grep -E '^(GOFLAGS|PVRDMA_)' | sort").Output()
	require.NoError(t, err)
	assert.Equal(t, "GOFLAGS=-buildvcs=false -trimpath\nPVRDMA_SCALE_N=8,32\nPVRDMA_X=\n", string(out))
}

// TestSizingTable: the scale section carries the sizing table README links
// to, its figures copied from the results (the largest VM count's), a cost
// the run did not measure said so; the placeholder carries the anchor.
func TestSizingTable(t *testing.T) {
	s, ok := sectionByName("scale")
	require.True(t, ok)
	md, err := render(s, testRun("scale"), filepath.Join("testdata", "scale.txt"))
	require.NoError(t, err)
	require.Contains(t, md, `<a id="sizing"></a>`)
	require.Contains(t, md, "The VM figures are from `BenchmarkScale/vms=8`.")
	require.Contains(t, md, "| a connected VM, idle | 0.2691 MiB anonymous memory, 2.000 goroutines, 10.00 descriptors (2 of them the fake driver's) |")
	require.Contains(t, md, "| a connected VM, streaming WRITEs | 0.7711 MiB anonymous memory, 2.000 goroutines, 0.3000 threads |")
	require.Contains(t, md, "| a QP | 4275 bytes of anonymous memory |")
	require.Contains(t, md, "| an MR | 956.5 bytes of anonymous memory |")
	require.Contains(t, md, "| a CQ | 1002 bytes of anonymous memory |")
	require.Contains(t, md, "| a GiB of guest RAM, mapped and locked | not measured in this run |", "this output predates the page-table metric")
	require.Less(t, strings.Index(md, "### Sizing"), strings.Index(md, "### `tests/hostile`"), "the table before the results")

	ph := renderPlaceholder(s)
	require.Contains(t, ph, `<a id="sizing"></a>`)
	require.Contains(t, ph, "The table appears here when the section is generated.")
	other, _ := sectionByName("wire")
	require.NotContains(t, renderPlaceholder(other), "sizing")
	require.Empty(t, sizingTable(&Output{}))
}
