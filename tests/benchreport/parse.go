package main

import (
	"bufio"
	"io"
	"regexp"
	"strings"
)

// A Result is one benchmark result line of `go test -bench`: the name (without its
// -GOMAXPROCS suffix), the iterations and the metrics in the order printed, each value
// as the benchmark printed it.
type Result struct {
	Name    string // e.g. BenchmarkScale/vms=8
	Procs   string // the -N suffix go test appends (GOMAXPROCS), "" if none
	N       string
	Metrics []Metric
}

// A Metric is one "value unit" pair of a result line.
type Metric struct {
	Value, Unit string
}

// Group is the benchmark's top-level name (before the first '/').
func (r Result) Group() string {
	g, _, _ := strings.Cut(r.Name, "/")
	return g
}

// Sub is the sub-benchmark's name below the group ("" for a top-level benchmark).
func (r Result) Sub() string {
	_, s, _ := strings.Cut(r.Name, "/")
	return s
}

// A Package is what one test binary printed: its results in order, and every other line
// it printed (the benchmarks' own tables and logs) in order.
type Package struct {
	Path    string // import path from the "pkg:" line
	CPU     string // from the "cpu:" line
	Results []Result
	Printed []string
	Failed  bool // a FAIL line, a --- FAIL block or a panic
}

// Output is a whole `go test -bench` run, one or more packages.
type Output struct {
	Packages []*Package
	Failed   bool
}

var (
	// A result line: the name, whitespace, the iteration count and value-unit pairs.
	resultRE = regexp.MustCompile(`^(Benchmark\S+?)(?:-(\d+))?\s+(\d+)((?:\s+[-+0-9.eE]+(?:\s+\S+)?)+)\s*$`)
	// The results of a benchmark whose name was printed before it ran, on a line of
	// their own (the benchmark printed something in between).
	bareResultRE = regexp.MustCompile(`^\s*(\d+)((?:\s+[-+0-9.eE]+\s+\S+)+)\s*$`)
	// A benchmark name printed before the run, followed by whatever the benchmark
	// printed first.
	pendingRE = regexp.MustCompile(`^(Benchmark\S+?)(?:-(\d+))?\s*\t(.*)$`)
	numberRE  = regexp.MustCompile(`^[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?$`)
)

// Parse reads the output of `go test -bench` (one or more packages, not -v) and splits it
// into results and the lines the benchmarks printed. Lines go test itself prints for
// every run (goos, goarch, pkg, cpu, PASS, ok) are left out.
func Parse(r io.Reader) (*Output, error) {
	out := &Output{}
	var cur *Package
	pkg := func() *Package {
		if cur == nil {
			cur = &Package{}
			out.Packages = append(out.Packages, cur)
		}
		return cur
	}
	var pending *Result // a name printed before its results
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		switch {
		case strings.HasPrefix(line, "goos: "), strings.HasPrefix(line, "goarch: "):
			// A new test binary starts with goos; its pkg line names it.
			if strings.HasPrefix(line, "goos: ") && cur != nil && (cur.Path != "" || len(cur.Results) > 0) {
				cur = nil
			}
			continue
		case strings.HasPrefix(line, "pkg: "):
			p := pkg()
			if p.Path != "" {
				cur = nil
				p = pkg()
			}
			p.Path = strings.TrimSpace(strings.TrimPrefix(line, "pkg: "))
			continue
		case strings.HasPrefix(line, "cpu: "):
			pkg().CPU = strings.TrimSpace(strings.TrimPrefix(line, "cpu: "))
			continue
		case line == "PASS":
			continue
		case strings.HasPrefix(line, "ok  \t"), strings.HasPrefix(line, "ok \t"):
			cur, pending = nil, nil
			continue
		case strings.HasPrefix(line, "?   \t"):
			continue // a package without test files
		case line == "FAIL", strings.HasPrefix(line, "FAIL\t"), strings.HasPrefix(line, "--- FAIL"),
			strings.HasPrefix(line, "panic: "), strings.HasPrefix(line, "exit status "):
			pkg().Failed = true
			out.Failed = true
			if strings.HasPrefix(line, "FAIL\t") {
				pkg().Printed = append(pkg().Printed, line)
				cur, pending = nil, nil
				continue
			}
		}
		if m := resultRE.FindStringSubmatch(line); m != nil {
			if ms, ok := metrics(m[4]); ok {
				pkg().Results = append(pkg().Results, Result{Name: m[1], Procs: m[2], N: m[3], Metrics: ms})
				pending = nil
				continue
			}
		}
		if pending != nil {
			if m := bareResultRE.FindStringSubmatch(line); m != nil {
				if ms, ok := metrics(m[2]); ok {
					r := *pending
					r.N, r.Metrics = m[1], ms
					pkg().Results = append(pkg().Results, r)
					pending = nil
					continue
				}
			}
		}
		if m := pendingRE.FindStringSubmatch(line); m != nil {
			pending = &Result{Name: m[1], Procs: m[2]}
			if rest := strings.TrimSpace(m[3]); rest != "" {
				if m2 := bareResultRE.FindStringSubmatch(rest); m2 != nil {
					if ms, ok := metrics(m2[2]); ok {
						r := *pending
						r.N, r.Metrics = m2[1], ms
						pkg().Results = append(pkg().Results, r)
						pending = nil
						continue
					}
				}
				pkg().Printed = append(pkg().Printed, rest)
			}
			continue
		}
		if strings.TrimSpace(line) == "" && len(pkg().Printed) == 0 {
			continue
		}
		pkg().Printed = append(pkg().Printed, line)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	// Drop a trailing package that printed nothing (the tail after the last ok line).
	kept := out.Packages[:0]
	for _, p := range out.Packages {
		for len(p.Printed) > 0 && strings.TrimSpace(p.Printed[len(p.Printed)-1]) == "" {
			p.Printed = p.Printed[:len(p.Printed)-1]
		}
		if p.Path != "" || len(p.Results) > 0 || len(p.Printed) > 0 {
			kept = append(kept, p)
		}
	}
	out.Packages = kept
	return out, nil
}

// metrics splits " 123 ns/op  4.5 MB/s" into pairs; ok is false unless every value is
// a number followed by a unit.
func metrics(s string) ([]Metric, bool) {
	f := strings.Fields(s)
	if len(f) == 0 || len(f)%2 != 0 {
		return nil, false
	}
	ms := make([]Metric, 0, len(f)/2)
	for i := 0; i < len(f); i += 2 {
		if !numberRE.MatchString(f[i]) || numberRE.MatchString(f[i+1]) {
			return nil, false
		}
		ms = append(ms, Metric{Value: f[i], Unit: f[i+1]})
	}
	return ms, true
}
