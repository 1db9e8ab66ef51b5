package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// event is one line of `go test -json` (see `go doc test2json`), or of the build events
// it interleaves (`go help buildjson`: ImportPath, Action build-output or build-fail).
type event struct {
	Time        time.Time
	Action      string
	Package     string
	Test        string
	Elapsed     float64
	Output      string
	FailedBuild string
	ImportPath  string
}

// pkg is one package's test binary as the reporter follows it.
type pkg struct {
	group, path, short string
	start              time.Time // when its start event arrived
	announced          bool      // its start line is printed
	noTests            bool
	done               bool
	result             string // ok, FAIL, or "" for no tests
	elapsed            float64
	passed             int
	failed             int
	skipped            int
	tests              map[string]*test
	running            []*test // top-level tests not finished, in start order
	out                *lines  // output outside any test
	failures           int     // failure records for this package
}

// test is a test or subtest.
type test struct {
	name    string
	start   time.Time // when it started, or continued after a pause
	done    bool
	paused  bool      // a parallel test waiting for the serial ones (t.Parallel)
	lastOut time.Time // when it (or a subtest) last printed, started or continued
	out     *lines    // top-level tests only: their output and their subtests'
	last    string    // its last output line, for a skip's reason
}

// failure is what the summary prints about one failed test or package.
type failure struct {
	p       *pkg
	name    string  // test name; "" for the package itself
	elapsed float64 // seconds; < 0 when not known
	note    string
	out     *lines
}

// reporter turns the groups' events into progress lines and the summary. All its
// methods run on one goroutine.
type reporter struct {
	out       io.Writer
	logs      *logs
	opts      options
	begin     time.Time
	lastPrint time.Time
	module    string
	width     int // of the group column

	running  int // commands still running
	order    []string
	pkgs     map[string]*pkg // by group and import path
	pkgList  []*pkg
	builds   map[string]*lines // build output by ImportPath
	failures []failure
	failed   []string // every failed test's line for the closing list
	problems []string // commands that failed without a failed test
	exits    map[string]*exitInfo
	idled    map[string]bool // groups stopped as hung
	stopped  bool            // interrupted
}

func newReporter(out io.Writer, l *logs, opts options, begin time.Time) *reporter {
	return &reporter{
		out: out, logs: l, opts: opts, begin: begin, lastPrint: begin,
		module: modulePath(filepath.Join(opts.dir, "go.mod")),
		pkgs:   map[string]*pkg{}, builds: map[string]*lines{}, exits: map[string]*exitInfo{},
		idled: map[string]bool{},
	}
}

// modulePath reads the module path from a go.mod file ("" if there is none), so that
// packages are printed by their path inside the module.
func modulePath(gomod string) string {
	b, err := os.ReadFile(gomod)
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`)
		}
	}
	return ""
}

func (r *reporter) shortName(path string) string {
	if r.module == "" {
		return path
	}
	if path == r.module {
		return "."
	}
	if s, ok := strings.CutPrefix(path, r.module+"/"); ok {
		return s
	}
	return path
}

// clock formats the time since the run began as m:ss.
func clock(d time.Duration) string {
	s := int(d.Round(time.Second) / time.Second)
	return fmt.Sprintf("%3d:%02d", s/60, s%60)
}

func seconds(s float64) string { return fmt.Sprintf("%.1fs", s) }

// short formats a running time: 40s, 3m05s.
func short(d time.Duration) string {
	s := int(d.Round(time.Second) / time.Second)
	if s < 60 {
		return fmt.Sprintf("%ds", s)
	}
	return fmt.Sprintf("%dm%02ds", s/60, s%60)
}

// printf prints one progress line: the time since the start, the group, a verb, the text.
func (r *reporter) printf(now time.Time, group, verb, format string, args ...any) {
	fmt.Fprintf(r.out, "%s %-*s %-5s %s\n", clock(now.Sub(r.begin)), r.width, group, verb, fmt.Sprintf(format, args...))
	r.lastPrint = now
}

// header announces a group before its command starts.
func (r *reporter) header(g group) {
	r.order = append(r.order, g.name)
	if len(g.name) > r.width {
		r.width = len(g.name)
	}
	fmt.Fprintf(r.out, "testrun: %s: %s\n", g.name, commandLine(g.args))
	if len(r.order) == 1 {
		fmt.Fprintf(r.out, "testrun: each package's whole output goes to %s/<package>.log; progress below (m:ss since the start)\n", r.opts.logDir)
	}
}

// commandFailed records a command that failed outside its tests.
func (r *reporter) commandFailed(group, what string) {
	msg := fmt.Sprintf("%s: %s", group, what)
	r.problems = append(r.problems, msg)
	fmt.Fprintf(r.out, "testrun: %s\n", msg)
}

// line handles one line from a command.
func (r *reporter) line(l line, now time.Time) {
	switch {
	case l.exit != nil:
		r.exited(l.group, l.exit, now)
	case l.stderr:
		r.logs.write(l.group+".out", l.text+"\n")
		r.printf(now, l.group, "", "%s", l.text)
	default:
		var ev event
		if !strings.HasPrefix(l.text, "{") || json.Unmarshal([]byte(l.text), &ev) != nil {
			// Not an event: show it as it is.
			r.logs.write(l.group+".out", l.text+"\n")
			r.printf(now, l.group, "", "%s", l.text)
			return
		}
		r.logs.write(l.group+".json", l.text+"\n")
		r.event(l.group, ev, now)
	}
}

func (r *reporter) pkg(group, path string, now time.Time) *pkg {
	key := group + "\x00" + path
	p := r.pkgs[key]
	if p == nil {
		p = &pkg{group: group, path: path, short: r.shortName(path), start: now,
			tests: map[string]*test{}, out: newLines(r.opts.head, r.opts.tail)}
		r.pkgs[key] = p
		r.pkgList = append(r.pkgList, p)
	}
	return p
}

// event handles one JSON event of group.
func (r *reporter) event(group string, ev event, now time.Time) {
	switch ev.Action {
	case "build-output":
		if path, _, _ := strings.Cut(ev.ImportPath, " "); path != "" {
			r.logs.write(packageFile(r.shortName(path)), ev.Output)
		}
		b := r.builds[ev.ImportPath]
		if b == nil {
			b = newLines(r.opts.head, r.opts.tail)
			r.builds[ev.ImportPath] = b
		}
		b.write(ev.Output)
		return
	case "build-fail":
		return
	}
	if ev.Package == "" {
		return
	}
	p := r.pkg(group, ev.Package, now)
	switch ev.Action {
	case "start":
		p.start = now
	case "output":
		r.output(p, ev, now)
	case "run":
		r.announce(p, now)
		t := &test{name: ev.Test, start: now, lastOut: now}
		if root := p.tests[rootName(ev.Test)]; root != nil {
			root.lastOut = now
		}
		if !strings.Contains(ev.Test, "/") {
			t.out = newLines(r.opts.head, r.opts.tail)
			p.running = append(p.running, t)
			if r.opts.tests[group] {
				r.printf(now, group, "run", "%s %s", p.short, ev.Test)
			}
		}
		p.tests[ev.Test] = t
	case "pause", "cont":
		if t := p.tests[ev.Test]; t != nil {
			t.paused = ev.Action == "pause"
			t.start, t.lastOut = now, now
		}
	case "pass", "fail", "skip":
		if ev.Test == "" {
			r.packageDone(p, ev, now)
		} else {
			r.testDone(p, ev, now)
		}
	}
}

// announce prints a package's start line, once.
func (r *reporter) announce(p *pkg, now time.Time) {
	if !p.announced {
		p.announced = true
		r.printf(now, p.group, "start", "%s", p.short)
	}
}

func (r *reporter) output(p *pkg, ev event, now time.Time) {
	r.logs.write(packageFile(p.short), ev.Output)
	if r.opts.verbose {
		for _, l := range strings.Split(strings.TrimSuffix(ev.Output, "\n"), "\n") {
			r.printf(now, p.group, "", "%s: %s", p.short, l)
		}
	}
	if ev.Test == "" {
		if strings.Contains(ev.Output, "[no test files]") {
			p.noTests = true
		} else {
			r.announce(p, now)
		}
		p.out.write(ev.Output)
		return
	}
	t := p.tests[ev.Test]
	if t == nil { // output before its run event (not expected): keep it anyway
		t = &test{name: ev.Test, start: now}
		p.tests[ev.Test] = t
	}
	if l := strings.TrimSpace(ev.Output); l != "" && !strings.HasPrefix(l, "---") && !strings.HasPrefix(l, "===") {
		t.last = l
	}
	if root := p.tests[rootName(ev.Test)]; root != nil {
		root.lastOut = now
		if root.out != nil {
			root.out.write(ev.Output)
		}
	}
}

// rootName is the top-level test of a test or subtest name.
func rootName(name string) string {
	root, _, _ := strings.Cut(name, "/")
	return root
}

func (r *reporter) testDone(p *pkg, ev event, now time.Time) {
	t := p.tests[ev.Test]
	if t == nil {
		t = &test{name: ev.Test, start: now}
		p.tests[ev.Test] = t
	}
	t.done = true
	top := !strings.Contains(ev.Test, "/")
	if top {
		p.running = removeTest(p.running, t)
	}
	switch ev.Action {
	case "pass":
		p.passed++
		if top && r.opts.tests[p.group] {
			r.printf(now, p.group, "pass", "%s %s (%s)", p.short, ev.Test, seconds(ev.Elapsed))
		}
	case "skip":
		p.skipped++
		if top && r.opts.tests[p.group] {
			r.printf(now, p.group, "skip", "%s %s (%s): %s", p.short, ev.Test, seconds(ev.Elapsed), t.last)
		}
	case "fail":
		p.failed++
		r.printf(now, p.group, "FAIL", "%s %s (%s)", p.short, ev.Test, seconds(ev.Elapsed))
		r.failed = append(r.failed, fmt.Sprintf("FAIL %s %s (%s)", p.short, ev.Test, seconds(ev.Elapsed)))
		if top {
			r.addFailure(failure{p: p, name: ev.Test, elapsed: ev.Elapsed, out: t.out})
		}
	}
	if top && ev.Action != "fail" {
		t.out = nil // passed: its output is in the package's log
	}
}

func removeTest(ts []*test, t *test) []*test {
	for i, x := range ts {
		if x == t {
			return append(ts[:i], ts[i+1:]...)
		}
	}
	return ts
}

func (r *reporter) addFailure(f failure) {
	f.p.failures++
	r.failures = append(r.failures, f)
}

func (r *reporter) packageDone(p *pkg, ev event, now time.Time) {
	p.done = true
	p.elapsed = ev.Elapsed
	r.unfinished(p, "did not finish: its test binary ended (a timeout or a crash: see the output)")
	r.logs.closeFile(packageFile(p.short))
	switch {
	case ev.Action == "skip" && p.noTests:
		return
	case ev.Action == "fail" && ev.FailedBuild != "":
		p.result = "FAIL"
		f := failure{p: p, elapsed: -1, note: "build failed: " + ev.FailedBuild, out: r.builds[ev.FailedBuild]}
		if f.out == nil {
			f.out = p.out
		}
		r.addFailure(f)
		r.failed = append(r.failed, fmt.Sprintf("FAIL %s [build failed]", p.short))
		r.printf(now, p.group, "FAIL", "%s [build failed: %s]", p.short, ev.FailedBuild)
		return
	case ev.Action == "fail":
		p.result = "FAIL"
		if p.failures == 0 {
			r.addFailure(failure{p: p, elapsed: ev.Elapsed, note: "the test binary failed outside any test", out: p.out})
			r.failed = append(r.failed, fmt.Sprintf("FAIL %s (%s)", p.short, seconds(ev.Elapsed)))
		}
	default:
		p.result = "ok"
	}
	r.announce(p, now)
	r.printf(now, p.group, p.result, "%s (%s: %s)", p.short, seconds(ev.Elapsed), p.counts())
}

// unfinished records the tests of p that started and never finished as failed.
func (r *reporter) unfinished(p *pkg, why string) {
	for _, t := range p.running {
		p.failed++
		r.failed = append(r.failed, fmt.Sprintf("FAIL %s %s (did not finish)", p.short, t.name))
		r.addFailure(failure{p: p, name: t.name, elapsed: -1, note: why, out: t.out})
	}
	p.running = nil
}

func (p *pkg) counts() string {
	s := fmt.Sprintf("%d passed", p.passed)
	if p.failed > 0 {
		s += fmt.Sprintf(", %d failed", p.failed)
	}
	if p.skipped > 0 {
		s += fmt.Sprintf(", %d skipped", p.skipped)
	}
	return s
}

// exited handles the end of a group's command.
func (r *reporter) exited(group string, e *exitInfo, now time.Time) {
	r.running--
	r.exits[group] = e
	for _, p := range r.pkgList {
		if p.group == group && !p.done {
			p.done, p.result = true, "FAIL"
			p.elapsed = now.Sub(p.start).Seconds()
			r.unfinished(p, "did not finish: the go command ended first")
			r.printf(now, group, "FAIL", "%s: did not finish", p.short)
		}
	}
	failedTests := false
	for _, f := range r.failures {
		if f.p.group == group {
			failedTests = true
		}
	}
	switch {
	case e.err != nil:
		r.commandFailed(group, fmt.Sprintf("the command: %v", e.err))
	case e.code != 0 && !failedTests:
		r.commandFailed(group, fmt.Sprintf("the command exited with status %d and no test failed (see its output above, also in %s)",
			e.code, filepath.Join(r.opts.logDir, group+".out")))
	}
}

// heartbeat says what is running when nothing was printed for opts.heartbeat.
func (r *reporter) heartbeat(now time.Time) {
	if r.opts.heartbeat <= 0 || now.Sub(r.lastPrint) < r.opts.heartbeat || r.running == 0 {
		return
	}
	var parts []string
	for _, g := range r.order {
		var names []string
		for _, p := range r.pkgList {
			if p.group != g || p.done || !p.announced {
				continue
			}
			var running []*test
			paused := 0
			for _, t := range p.running {
				if t.paused {
					paused++
				} else {
					running = append(running, t)
				}
			}
			if len(running) == 0 {
				names = append(names, fmt.Sprintf("%s %s", p.short, short(now.Sub(p.start))))
			}
			for i, t := range running {
				if i == 3 {
					names = append(names, fmt.Sprintf("%s +%d more", p.short, len(running)-i))
					break
				}
				names = append(names, fmt.Sprintf("%s %s %s", p.short, t.name, short(now.Sub(t.start))))
			}
			if paused > 0 {
				names = append(names, fmt.Sprintf("%s %d paused (t.Parallel)", p.short, paused))
			}
		}
		if len(names) > 0 {
			parts = append(parts, g+" "+strings.Join(names, ", "))
		} else if _, ended := r.exits[g]; !ended {
			parts = append(parts, g+" building")
		}
	}
	r.printf(now, "", "...", "running: %s", strings.Join(parts, "; "))
}

// idleGroups returns the groups that have a running test silent for opts.idle, each
// once, and reports the test: its command is to be stopped.
func (r *reporter) idleGroups(now time.Time) []string {
	if r.opts.idle <= 0 {
		return nil
	}
	var out []string
	for _, p := range r.pkgList {
		if p.done || r.idled[p.group] {
			continue
		}
		for _, t := range p.running {
			if t.paused || now.Sub(t.lastOut) < r.opts.idle {
				continue
			}
			r.idled[p.group] = true
			msg := fmt.Sprintf("%s %s printed nothing for %s: taken as hung, stopping the %s command (SIGQUIT: its goroutines' stacks follow in the package's output)",
				p.short, t.name, short(now.Sub(t.lastOut)), p.group)
			r.printf(now, p.group, "IDLE", "%s", msg)
			r.problems = append(r.problems, msg)
			if t.out != nil {
				t.out.write(fmt.Sprintf("testrun: %s\n", msg))
			}
			out = append(out, p.group)
			break
		}
	}
	return out
}

// interrupted notes a signal; the commands end their runs and the summary follows.
func (r *reporter) interrupted(s os.Signal, now time.Time) {
	r.stopped = true
	r.printf(now, "", "...", "%v: waiting for the tests to stop", s)
}

// summary prints the packages by time, the failures' output and the closing lines; it
// returns whether everything passed.
func (r *reporter) summary(now time.Time) bool {
	var ran []*pkg
	tests := map[string]int{}
	for _, p := range r.pkgList {
		tests["passed"] += p.passed
		tests["failed"] += p.failed
		tests["skipped"] += p.skipped
		if !p.noTests || p.result == "FAIL" {
			ran = append(ran, p)
		}
	}
	sort.SliceStable(ran, func(i, j int) bool { return ran[i].elapsed > ran[j].elapsed })
	fmt.Fprintf(r.out, "\n== packages by time:\n")
	failedPkgs := 0
	for _, p := range ran {
		if p.result == "FAIL" {
			failedPkgs++
		}
		res := p.result
		if res == "" {
			res = "-"
		}
		fmt.Fprintf(r.out, "%9s  %-*s %-4s %s (%s)\n", seconds(p.elapsed), r.width, p.group, res, p.short, p.counts())
	}
	for _, f := range r.failures {
		title := f.p.short
		if f.name != "" {
			title += " " + f.name
		}
		if f.elapsed >= 0 {
			title += " (" + seconds(f.elapsed) + ")"
		}
		fmt.Fprintf(r.out, "\n=== FAIL %s: %s\n", f.p.group, title)
		if f.note != "" {
			fmt.Fprintf(r.out, "    %s\n", f.note)
		}
		if f.out != nil {
			f.out.dump(r.out, "", filepath.Join(r.opts.logDir, packageFile(f.p.short)))
		}
	}
	if r.logs.err != nil {
		r.problems = append(r.problems, fmt.Sprintf("writing the logs: %v", r.logs.err))
	}
	if r.stopped {
		r.problems = append(r.problems, "interrupted")
	}
	ok := len(r.failed) == 0 && len(r.problems) == 0
	fmt.Fprintf(r.out, "\n== done in %s: %s", short(now.Sub(r.begin)), plural(len(ran), "package"))
	if failedPkgs > 0 {
		fmt.Fprintf(r.out, " (%d failed)", failedPkgs)
	}
	fmt.Fprintf(r.out, "; whole output in %s/\n", r.opts.logDir)
	for _, l := range r.failed {
		fmt.Fprintln(r.out, l)
	}
	for _, p := range r.problems {
		fmt.Fprintf(r.out, "FAIL %s\n", p)
	}
	// The closing line in the plain form CI reads: "WORD: N passed, N failed, N skipped".
	verdict := "PASS"
	if !ok {
		verdict = "FAIL"
	}
	fmt.Fprintf(r.out, "%s: %d passed, %d failed, %d skipped\n", verdict, tests["passed"], tests["failed"], tests["skipped"])
	return ok
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}
