package main

import (
	"fmt"
	"regexp"
	"strings"
	"time"
)

// Run is one section's run: what was run, where and when, and what it printed.
type Run struct {
	Section  string        `json:"section"`
	Command  string        `json:"command"` // shell-quoted, environment overrides first
	Date     time.Time     `json:"date"`
	Commit   string        `json:"commit"`
	Machine  Machine       `json:"machine"`
	Before   Load          `json:"load_before"`
	After    Load          `json:"load_after"`
	Duration time.Duration `json:"duration_ns"`
	ExitErr  string        `json:"exit_error,omitempty"`
}

// maxPrinted caps the lines of a package's printed output in the report; the raw
// output keeps them all.
const maxPrinted = 400

// renderSection writes a section's markdown from its run and parsed output.
func renderSection(s Section, run Run, out *Output, rawPath string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "<!-- section: %s generated=%s commit=%s -->\n", s.Name, run.Date.UTC().Format(time.RFC3339), strings.Fields(run.Commit)[0])
	writeHeading(&b, s)
	fmt.Fprintf(&b, "| | |\n|---|---|\n")
	fmt.Fprintf(&b, "| Date | %s |\n", run.Date.UTC().Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(&b, "| Commit | %s |\n", cell(run.Commit))
	fmt.Fprintf(&b, "| Machine | %s |\n", cell(run.Machine.String()))
	fmt.Fprintf(&b, "| Load average before (after) | %s (%s) |\n", run.Before, run.After)
	fmt.Fprintf(&b, "| Run | %s in %s |\n\n", map[bool]string{true: "passed", false: "failed"}[run.ExitErr == "" && !out.Failed],
		run.Duration.Round(time.Second))
	if run.Before.Busy() {
		fmt.Fprintf(&b, "**The machine was busy** (1-minute load average %s at the start, 0.5 or more): "+
			"other work shared the cores, so absolute figures are low and noisy; ratios against a reference "+
			"measured in the same run hold better.\n\n", run.Before[0])
	}
	fmt.Fprintf(&b, "Command (from the repository root):\n\n```sh\n%s\n```\n\n", run.Command)
	if s.Sizing {
		b.WriteString(sizingTable(out))
	}
	for _, p := range out.Packages {
		renderPackage(&b, p, rawPath)
	}
	fmt.Fprintf(&b, "<!-- end section: %s -->\n", s.Name)
	return b.String()
}

// renderPlaceholder is a section that has not been generated.
func renderPlaceholder(s Section) string {
	var b strings.Builder
	fmt.Fprintf(&b, "<!-- section: %s generated=never -->\n", s.Name)
	writeHeading(&b, s)
	fmt.Fprintf(&b, "Command (from the repository root):\n\n```sh\n%s\n```\n\n", shellJoin(append([]string{"go", "test"}, s.Args...)))
	fmt.Fprintf(&b, "**Not generated yet on this commit.** Run `make bench-report BENCH_SECTIONS=%s` on a quiet machine.\n\n", s.Name)
	if s.Sizing {
		b.WriteString(sizingPlaceholder())
	}
	fmt.Fprintf(&b, "<!-- end section: %s -->\n", s.Name)
	return b.String()
}

func writeHeading(b *strings.Builder, s Section) {
	fmt.Fprintf(b, "<a id=%q></a>\n\n## %s: %s\n\n", s.Name, s.Name, s.Title)
	fmt.Fprintf(b, "%s Part of `%s`.\n\n", s.About, s.Target)
}

func renderPackage(b *strings.Builder, p *Package, rawPath string) {
	name := strings.TrimPrefix(p.Path, modulePath+"/")
	if name == "" {
		name = "(no package line)"
	}
	fmt.Fprintf(b, "### `%s`\n\n", name)
	if p.CPU != "" {
		fmt.Fprintf(b, "CPU as go test reports it: %s.\n\n", cell(p.CPU))
	}
	// One table per benchmark group: a row per metric, a column per sub-benchmark.
	type group struct {
		name    string
		results []Result
	}
	var groups []*group
	byName := map[string]*group{}
	for _, r := range p.Results {
		g := byName[r.Group()]
		if g == nil {
			g = &group{name: r.Group()}
			byName[r.Group()] = g
			groups = append(groups, g)
		}
		g.results = append(g.results, r)
	}
	for _, g := range groups {
		fmt.Fprintf(b, "#### %s\n\n", g.name)
		cols := make([]string, len(g.results))
		seen := map[string]int{}
		for i, r := range g.results {
			c := r.Sub()
			if c == "" {
				c = "value"
			}
			seen[c]++
			if n := seen[c]; n > 1 {
				c = fmt.Sprintf("%s (run %d)", c, n)
			}
			cols[i] = c
		}
		var units []string
		have := map[string]bool{}
		for _, r := range g.results {
			for _, m := range r.Metrics {
				if !have[m.Unit] {
					have[m.Unit] = true
					units = append(units, m.Unit)
				}
			}
		}
		fmt.Fprintf(b, "| metric | %s |\n|---|%s\n", strings.Join(cellAll(cols), " | "), strings.Repeat("---:|", len(cols)))
		fmt.Fprintf(b, "| iterations | %s |\n", strings.Join(iterations(g.results), " | "))
		for _, u := range units {
			vals := make([]string, len(g.results))
			for i, r := range g.results {
				vals[i] = ""
				for _, m := range r.Metrics {
					if m.Unit == u {
						vals[i] = m.Value
					}
				}
			}
			fmt.Fprintf(b, "| `%s` | %s |\n", u, strings.Join(vals, " | "))
		}
		b.WriteString("\n")
	}
	if len(p.Printed) > 0 {
		lines := make([]string, 0, min(len(p.Printed), maxPrinted))
		for _, l := range p.Printed[:min(len(p.Printed), maxPrinted)] {
			lines = append(lines, clip(l))
		}
		more := len(p.Printed) - len(lines)
		fmt.Fprintf(b, "Printed by the benchmarks:\n\n```text\n%s\n```\n\n", fence(strings.Join(lines, "\n")))
		if more > 0 {
			fmt.Fprintf(b, "(%d more lines in the raw output, %s.)\n\n", more, rawPath)
		}
	}
}

// maxLine is the longest printed line the report shows whole (the test bed logs QEMU
// command lines); the raw output has the rest.
const maxLine = 240

// clip shortens a long printed line, saying how much of it the raw output keeps.
func clip(l string) string {
	r := []rune(l)
	if len(r) <= maxLine {
		return l
	}
	return fmt.Sprintf("%s … (%d more characters in the raw output)", string(r[:maxLine]), len(r)-maxLine)
}

func iterations(rs []Result) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.N
	}
	return out
}

// cell makes s safe inside a markdown table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}

func cellAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = cell(s)
	}
	return out
}

// fence keeps printed text from closing its code block.
func fence(s string) string { return strings.ReplaceAll(s, "```", "ˋˋˋ") }

// Report is the report file: its sections' markdown by name.
type Report struct {
	Sections map[string]string
}

var sectionRE = regexp.MustCompile(`(?ms)^<!-- section: (\S+)[^\n]*-->\n.*?^<!-- end section: (\S+) -->\n`)

// parseReport finds the sections of an existing report (their markdown kept verbatim).
func parseReport(text string) Report {
	r := Report{Sections: map[string]string{}}
	for _, m := range sectionRE.FindAllStringSubmatch(text, -1) {
		if m[1] == m[2] {
			r.Sections[m[1]] = m[0]
		}
	}
	return r
}

var metaRE = regexp.MustCompile(`^<!-- section: \S+ generated=(\S+)(?: commit=(\S+))? -->`)

// render writes the whole report: the header, a table of the sections, then every
// section in order (a placeholder for those never generated).
func (r Report) render() string {
	var b strings.Builder
	b.WriteString(reportHeader)
	b.WriteString("| section | what | generated | commit |\n|---|---|---|---|\n")
	for _, s := range sections {
		gen, com := "not yet", ""
		if m := metaRE.FindStringSubmatch(r.Sections[s.Name]); m != nil && m[1] != "never" {
			gen, com = m[1], m[2]
		}
		fmt.Fprintf(&b, "| [%s](#%s) | %s | %s | %s |\n", s.Name, s.Name, s.Title, gen, com)
	}
	b.WriteString("\n")
	for _, s := range sections {
		text, ok := r.Sections[s.Name]
		if !ok {
			text = renderPlaceholder(s)
		}
		b.WriteString(text)
		b.WriteString("\n")
	}
	return strings.TrimRight(b.String(), "\n") + "\n"
}

const reportHeader = `# Benchmark report

Generated by ` + "`make bench-report`" + ` (` + "`tests/benchreport`" + `) from the benchmarks' own output: every
figure below is as the benchmark printed it, in the run the section names. Do not edit this file
by hand; regenerate it, or one section, with ` + "`make bench-report`" + ` or
` + "`make bench-report BENCH_SECTIONS=wire,scale`" + `, on a machine nothing else is using. Each section
says when, on which commit and machine, with what load and with which command it was measured;
sections regenerated separately may come from different commits. The raw output of the last run
of each section is kept in ` + "`out/bench/`" + ` (not committed).

Most benchmarks print a ratio against a reference measured in the same run (a bare socket
ping-pong, a UDP blast, memcpy, rxe in the guest, a plain libibverbs program): on a shared or
small machine the ratios are the figures to compare, the absolute values move with the machine.

`
