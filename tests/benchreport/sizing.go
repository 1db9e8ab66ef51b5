package main

import (
	"fmt"
	"strconv"
	"strings"
)

// sizingAnchor is the anchor of the scale section's sizing table, which
// README's sizing section links to.
const sizingAnchor = "sizing"

// sizingIntro says what the sizing table holds; the placeholder says it
// too, so that the link to it lands on words before the first run.
const sizingIntro = "What a VM, a QP, an MR, a CQ and a locked GiB of guest RAM cost the daemon, " +
	"taken from this section's results: `BenchmarkScale` at its largest VM count (per connected VM: " +
	"the increase of the process's anonymous memory, goroutines, threads and descriptors over the " +
	"daemon alone, idle and while every VM streams WRITEs; the page tables that map the VMs' locked RAM, " +
	"per GiB locked) and `BenchmarkObjects` (anonymous memory per object, the object's share of the " +
	"daemon's data structures and the provider's)."

// sizingPlaceholder is the sizing part of the scale section before its
// first run.
func sizingPlaceholder() string {
	return fmt.Sprintf("<a id=%q></a>\n\n### Sizing: what the daemon spends per VM and per object\n\n%s "+
		"The table appears here when the section is generated.\n\n", sizingAnchor, sizingIntro)
}

// sizingTable renders the sizing table from a scale run's results: every
// figure as the benchmark printed it; a cost the run did not measure says
// so. "" if the output has neither benchmark.
func sizingTable(out *Output) string {
	var scale, objects *Result
	scaleN := -1
	for _, p := range out.Packages {
		for i := range p.Results {
			r := &p.Results[i]
			switch r.Group() {
			case "BenchmarkScale":
				n, err := strconv.Atoi(strings.TrimPrefix(r.Sub(), "vms="))
				if err == nil && n > scaleN {
					scale, scaleN = r, n
				}
			case "BenchmarkObjects":
				objects = r
			}
		}
	}
	if scale == nil && objects == nil {
		return ""
	}
	metric := func(r *Result, unit string) string {
		if r != nil {
			for _, m := range r.Metrics {
				if m.Unit == unit {
					return m.Value
				}
			}
		}
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "<a id=%q></a>\n\n### Sizing: what the daemon spends per VM and per object\n\n%s", sizingAnchor, sizingIntro)
	if scale != nil {
		fmt.Fprintf(&b, " The VM figures are from `%s`.", scale.Name)
	}
	b.WriteString("\n\n| what | costs the daemon | source |\n|---|---|---|\n")
	row := func(what string, parts [][2]string, source string) {
		var have []string
		for _, p := range parts {
			if p[0] != "" {
				have = append(have, p[0]+" "+p[1])
			}
		}
		cost := strings.Join(have, ", ")
		if cost == "" {
			cost = "not measured in this run"
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", what, cell(cost), source)
	}
	row("a connected VM, idle", [][2]string{
		{metric(scale, "idle_rss_anon_MiB/vm"), "MiB anonymous memory"},
		{metric(scale, "idle_goroutines/vm"), "goroutines"},
		{metric(scale, "fds/vm"), "descriptors (2 of them the fake driver's)"},
	}, "`idle_rss_anon_MiB/vm`, `idle_goroutines/vm`, `fds/vm`")
	row("a connected VM, streaming WRITEs", [][2]string{
		{metric(scale, "busy_rss_anon_MiB/vm"), "MiB anonymous memory"},
		{metric(scale, "busy_goroutines/vm"), "goroutines"},
		{metric(scale, "busy_threads/vm"), "threads"},
	}, "`busy_rss_anon_MiB/vm`, `busy_goroutines/vm`, `busy_threads/vm`")
	row("a GiB of guest RAM, mapped and locked", [][2]string{
		{metric(scale, "pte_KiB/locked_GiB"), "KiB of page tables (the RAM itself is the guest's memfd, shared with its QEMU, and counts against `--max-locked-memory`)"},
	}, "`pte_KiB/locked_GiB`")
	for _, o := range []struct{ what, key string }{{"a QP", "qp"}, {"an MR", "mr"}, {"a CQ", "cq"}} {
		row(o.what, [][2]string{{metric(objects, o.key+"_anon_B_per_obj"), "bytes of anonymous memory"}},
			"`"+o.key+"_anon_B_per_obj`")
	}
	b.WriteString("\n")
	return b.String()
}
