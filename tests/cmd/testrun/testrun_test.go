package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fixture runs testrun on the module in testdata/fixture with the groups given and
// returns the console output, whether it passed and the log directory.
func fixture(t *testing.T, opts options, groups ...string) (string, bool, string) {
	t.Helper()
	var gs runFlags
	for _, g := range groups {
		require.NoError(t, gs.Set(g))
	}
	dir, err := filepath.Abs(filepath.Join("testdata", "fixture"))
	require.NoError(t, err)
	logDir := t.TempDir()
	opts.dir, opts.logDir = dir, logDir
	if opts.head == 0 && opts.tail == 0 {
		opts.head, opts.tail = 5, 5
	}
	var out bytes.Buffer
	ok, err := run(gs, opts, &out)
	require.NoError(t, err)
	console, err := os.ReadFile(filepath.Join(logDir, "testrun.log"))
	require.NoError(t, err)
	require.Equal(t, out.String(), string(console), "testrun.log holds what the console showed")
	return out.String(), ok, logDir
}

// before asserts that a line matching first comes before one matching second.
func before(t *testing.T, out, first, second string) {
	t.Helper()
	a := regexp.MustCompile(first).FindStringIndex(out)
	b := regexp.MustCompile(second).FindStringIndex(out)
	require.NotNil(t, a, "%q not in:\n%s", first, out)
	require.NotNil(t, b, "%q not in:\n%s", second, out)
	require.Less(t, a[0], b[0], "%q should come before %q in:\n%s", first, second, out)
}

func lastLines(out string, n int) []string {
	ls := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return ls
}

// TestPassingRun: the tests of the groups named by -tests are reported as they start
// and finish (a skip with its reason), the package with its counts, and the run closes
// with PASS.
func TestPassingRun(t *testing.T) {
	out, ok, logDir := fixture(t, options{tests: map[string]bool{"vm": true}},
		"vm=go test -json -count=1 ./pass/", "unit=go test -json -count=1 ./notests/")
	require.True(t, ok, out)
	before(t, out, `(?m)^ +\d+:\d\d vm +start pass$`, `(?m)^ +\d+:\d\d vm +run +pass TestA$`)
	before(t, out, `(?m)vm +run +pass TestA$`, `(?m)vm +pass +pass TestA \(\d+\.\ds\)$`)
	require.Regexp(t, `(?m)vm +skip +pass TestB \(\d+\.\ds\): pass_test.go:7: no such device here$`, out)
	require.Regexp(t, `(?m)vm +ok +pass \(\d+\.\ds: 4 passed, 1 skipped\)$`, out)
	require.NotContains(t, out, "pass TestC/one", "subtests are not reported unless they fail")
	require.NotRegexp(t, `(?m)^ +\d+:\d\d unit`, out, "a package without tests is not reported")
	closing := lastLines(out, 2)
	require.Regexp(t, `^== done in \d+s: 1 package; whole output in `, closing[0])
	require.Equal(t, "PASS: 4 passed, 0 failed, 1 skipped", closing[1])

	log, err := os.ReadFile(filepath.Join(logDir, "pass.log"))
	require.NoError(t, err)
	require.Contains(t, string(log), "=== RUN   TestA\n    pass_test.go:5: a says hello\n--- PASS: TestA")
	require.FileExists(t, filepath.Join(logDir, "vm.json"))
	require.FileExists(t, filepath.Join(logDir, "unit.json"))
}

// TestFailingRun: failures of every kind are reported as they happen and in the
// summary with their output (an excerpt when long), the closing lines name every failed
// test and package, and the run fails.
func TestFailingRun(t *testing.T) {
	out, ok, logDir := fixture(t, options{},
		"unit=go test -json -count=1 -timeout 3s ./fail/ ./hang/ ./broken/ ./crash/")
	require.False(t, ok, out)

	// As they happen.
	before(t, out, `(?m)unit +FAIL +fail TestFails/broken \(`, `(?m)unit +FAIL +fail \(\d+\.\ds: 2 passed, 3 failed\)$`)
	require.Regexp(t, `(?m)unit +FAIL +broken \[build failed: example.com/fixture/broken \[example.com/fixture/broken.test\]\]$`, out)
	require.NotContains(t, out, "run   fail TestOK", "the unit group's passing tests are not reported one by one")

	summary := out[strings.Index(out, "\n== packages by time:"):]
	// The failed tests' output.
	require.Contains(t, summary, "=== FAIL unit: fail TestFails (")
	require.Contains(t, summary, "    fail_test.go:9: boom: the value was 7\n--- FAIL: TestFails/broken")
	require.Contains(t, summary, "=== FAIL unit: fail TestLong (")
	require.Regexp(t, `\.\.\. 993 lines left out \(all in .*/fail\.log\) \.\.\.\n.*line 997\n.*line 998\n.*line 999\n.*long failure\n--- FAIL: TestLong`, summary)
	// A test cut short by the timeout, with the panic that ended it.
	require.Regexp(t, `=== FAIL unit: hang TestHang\n +did not finish: its test binary ended .*\n=== RUN   TestHang\npanic: test timed out after 3s`, summary)
	// The compiler's message.
	require.Regexp(t, `=== FAIL unit: broken\n +build failed: .*\n.*\nbroken/broken_test.go:6:\d+: cannot use "not a number"`, summary)
	// A binary that failed after its tests passed.
	require.Regexp(t, `=== FAIL unit: crash \(\d+\.\ds\)\n +the test binary failed outside any test\n(.*\n)*TestMain: cleanup failed`, summary)

	closing := lastLines(out, 8)
	require.Regexp(t, `^== done in \d+s: 4 packages \(4 failed\); whole output in `, closing[0])
	require.Equal(t, []string{
		"FAIL fail TestFails/broken (0.0s)",
		"FAIL fail TestFails (0.0s)",
		"FAIL fail TestLong (0.0s)",
		"FAIL broken [build failed]",
		"FAIL crash (0.0s)",
		"FAIL hang TestHang (did not finish)",
		"FAIL: 3 passed, 4 failed, 0 skipped",
	}, regexpAll(closing[1:], `\(\d+\.\ds\)`, "(0.0s)"))

	b, err := os.ReadFile(filepath.Join(logDir, "broken.log"))
	require.NoError(t, err)
	require.Contains(t, string(b), `cannot use "not a number"`, "the build output is in the package's log")
}

func regexpAll(ls []string, re, with string) []string {
	r := regexp.MustCompile(re)
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = r.ReplaceAllString(l, with)
	}
	return out
}

// TestCommandFails: a command that exits non-zero without a failed test fails the
// run, and the closing lines say so; so does a package that is not there, and a command
// that does not start.
func TestCommandFails(t *testing.T) {
	out, ok, logDir := fixture(t, options{}, "unit=go test -json -count=1 ./pass/", "other=sh say-and-fail.sh")
	require.False(t, ok, out)
	require.Regexp(t, `(?m)^ +\d+:\d\d other +saying this$`, out, "a line that is not an event is shown as it comes")
	require.Regexp(t, `(?m)^FAIL other: the command exited with status 1 and no test failed`, out)
	require.Equal(t, "FAIL: 4 passed, 0 failed, 1 skipped", lastLines(out, 1)[0], "no test failed, the run did")
	b, err := os.ReadFile(filepath.Join(logDir, "other.out"))
	require.NoError(t, err)
	require.Equal(t, "saying this\n", string(b))

	out, ok, _ = fixture(t, options{}, "unit=go test -json -count=1 ./nosuchpackage/")
	require.False(t, ok, out)
	require.Regexp(t, `(?m)^FAIL \./nosuchpackage \[build failed\]$`, out)
	require.Contains(t, out, "nosuchpackage: directory not found")

	out, ok, _ = fixture(t, options{}, "unit=/nonexistent/go test -json")
	require.False(t, ok, out)
	require.Regexp(t, `(?m)^FAIL unit: did not start: `, out)
}

// TestHeartbeat: when nothing was printed for the heartbeat's time, a line says which
// packages and tests are running and for how long; no more often than that.
func TestHeartbeat(t *testing.T) {
	logDir := t.TempDir()
	l, err := newLogs(logDir)
	require.NoError(t, err)
	defer l.close()
	var out bytes.Buffer
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	r := newReporter(&out, l, options{logDir: logDir, heartbeat: 30 * time.Second, head: 5, tail: 5,
		tests: map[string]bool{"vm": true}}, t0)
	r.header(group{name: "unit", args: []string{"go", "test"}})
	r.header(group{name: "vm", args: []string{"go", "test"}})
	r.running = 2
	out.Reset()

	r.heartbeat(t0.Add(31 * time.Second))
	require.Equal(t, "  0:31      ...   running: unit building; vm building\n", out.String())
	out.Reset()

	r.event("vm", event{Action: "start", Package: "example.com/p"}, t0.Add(40*time.Second))
	r.event("vm", event{Action: "run", Package: "example.com/p", Test: "TestSlow"}, t0.Add(41*time.Second))
	r.event("unit", event{Action: "start", Package: "example.com/u"}, t0.Add(42*time.Second))
	r.event("unit", event{Action: "output", Package: "example.com/u", Output: "setting up\n"}, t0.Add(42*time.Second))
	out.Reset()
	r.heartbeat(t0.Add(60 * time.Second))
	require.Empty(t, out.String(), "not due: a line was printed 19s ago")
	r.heartbeat(t0.Add(72 * time.Second))
	require.Equal(t, "  1:12      ...   running: unit example.com/u 30s; vm example.com/p TestSlow 31s\n", out.String())
	out.Reset()
	r.heartbeat(t0.Add(80 * time.Second))
	require.Empty(t, out.String())
	r.heartbeat(t0.Add(103 * time.Second))
	require.Contains(t, out.String(), "vm example.com/p TestSlow 1m02s")
	out.Reset()

	// A parallel test waiting for its turn is not running: it is counted apart, and
	// its time starts when it goes on.
	r.event("vm", event{Action: "run", Package: "example.com/p", Test: "TestPar"}, t0.Add(110*time.Second))
	r.event("vm", event{Action: "pause", Package: "example.com/p", Test: "TestPar"}, t0.Add(110*time.Second))
	r.heartbeat(t0.Add(150 * time.Second))
	require.Contains(t, out.String(), "vm example.com/p TestSlow 1m49s, example.com/p 1 paused (t.Parallel)\n")
	out.Reset()
	r.event("vm", event{Action: "pass", Package: "example.com/p", Test: "TestSlow", Elapsed: 110}, t0.Add(151*time.Second))
	r.event("vm", event{Action: "cont", Package: "example.com/p", Test: "TestPar"}, t0.Add(151*time.Second))
	r.heartbeat(t0.Add(190 * time.Second))
	require.Contains(t, out.String(), "vm example.com/p TestPar 39s\n")
}

// TestLinesExcerpt: the excerpt keeps the first and last lines, joins partial writes
// and counts what it left out.
func TestLinesExcerpt(t *testing.T) {
	b := newLines(2, 3)
	b.write("a\nb")
	b.write("c\nd\n")
	for _, s := range []string{"e\n", "f\n", "g\n", "h"} {
		b.write(s)
	}
	var out bytes.Buffer
	b.dump(&out, "> ", "x.log")
	require.Equal(t, "> a\n> bc\n> ... 2 lines left out (all in x.log) ...\n> f\n> g\n> h\n", out.String())

	short := newLines(2, 3)
	short.write("only\n")
	out.Reset()
	short.dump(&out, "", "x.log")
	require.Equal(t, "only\n", out.String())
}

// TestRunFlag: -run takes NAME=COMMAND and refuses a group given twice.
func TestRunFlag(t *testing.T) {
	var r runFlags
	require.NoError(t, r.Set("unit=go test -json ./a/ ./b/"))
	require.Equal(t, []string{"go", "test", "-json", "./a/", "./b/"}, r[0].args)
	require.Error(t, r.Set("unit=go test"))
	require.Error(t, r.Set("nocommand="))
	require.Error(t, r.Set("go test"))
}

// TestIdleStopsCommand: a running test that prints nothing for -idle is taken as hung:
// its command is stopped at once (with its goroutines' stacks), the test is reported as
// failed, and the run ends long before the test's own timeout.
func TestIdleStopsCommand(t *testing.T) {
	out, ok, logDir := fixture(t, options{idle: 3 * time.Second, tests: map[string]bool{"vm": true}},
		"vm=go test -json -count=1 -timeout 10m ./silent/")
	require.False(t, ok, out)
	require.Regexp(t, `(?m)vm +IDLE +silent TestSilent printed nothing for \d+s: taken as hung, stopping the vm command`, out)
	require.Contains(t, out, "FAIL silent TestSilent (did not finish)")
	require.Regexp(t, `(?m)^FAIL: 0 passed, 1 failed`, lastLines(out, 1)[0])
	log, err := os.ReadFile(filepath.Join(logDir, "silent.log"))
	require.NoError(t, err)
	require.Contains(t, string(log), "SIGQUIT", "the test binary printed its stacks")
	require.Contains(t, string(log), "silent_test.go", "the stacks show where the test waited")
}

// TestIdleCheck: only a running, unpaused test's silence counts, from its last output
// (a subtest's included), and a group is stopped once.
func TestIdleCheck(t *testing.T) {
	logDir := t.TempDir()
	l, err := newLogs(logDir)
	require.NoError(t, err)
	defer l.close()
	var out bytes.Buffer
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	r := newReporter(&out, l, options{logDir: logDir, idle: 5 * time.Minute, head: 5, tail: 5}, t0)
	r.header(group{name: "vm", args: []string{"go", "test"}})
	r.running = 1
	r.event("vm", event{Action: "run", Package: "example.com/p", Test: "TestA"}, t0)
	r.event("vm", event{Action: "run", Package: "example.com/p", Test: "TestA/sub"}, t0.Add(time.Minute))
	r.event("vm", event{Action: "output", Package: "example.com/p", Test: "TestA/sub", Output: "guest: hello\n"}, t0.Add(2*time.Minute))
	r.event("vm", event{Action: "run", Package: "example.com/p", Test: "TestPar"}, t0)
	r.event("vm", event{Action: "pause", Package: "example.com/p", Test: "TestPar"}, t0)
	require.Empty(t, r.idleGroups(t0.Add(6*time.Minute)), "TestA printed 4m ago; TestPar is paused")
	require.Equal(t, []string{"vm"}, r.idleGroups(t0.Add(7*time.Minute+time.Second)))
	require.Contains(t, out.String(), "example.com/p TestA printed nothing for 5m01s")
	require.Empty(t, r.idleGroups(t0.Add(20*time.Minute)), "stopped once")
}
