// Command testrun runs `go test -json` commands side by side and reports while they run:
// each package as it starts and finishes, each test of the groups named by -tests as it
// starts and finishes, every failure as it happens, all with the time since the run
// began, and a line saying what is still running when nothing else was printed for a
// while. At the end it prints the packages by time, the failed tests' output, and closing
// lines with the counts and the failed tests' names; it exits 1 if any test or package
// failed or any command exited non-zero.
//
// Each package's full output (what `go test -v` prints) goes to LOGDIR/<package>.log, each
// command's JSON events to LOGDIR/<group>.json and the other lines it printed (standard
// error's included, shown on the console as they come) to LOGDIR/<group>.out, and
// everything printed on the console to LOGDIR/testrun.log. A command that prints no JSON
// (a build step run beside the tests) is shown line by line the same way.
//
// A test that prints nothing for -idle (its subtests and the guests it logs included) is
// taken as hung: its command is stopped at once (SIGQUIT, so that the test binary prints
// every goroutine's stack, then SIGKILL), its tests are reported as failed, and the run
// goes on with the other commands. No run sits idle longer than that.
//
//	testrun [-logdir DIR] [-tests GROUP,...] [-heartbeat 30s] [-idle 5m] [-v] \
//		-run 'unit=go test -json ./a/ ./b/' -run 'vm=go test -json -tags vm -p 2 ./c/'
//
// `make test` runs it with the unit packages and the VM packages as two groups.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"time"
)

// runFlags collects repeated -run NAME=COMMAND flags.
type runFlags []group

func (r *runFlags) String() string { return fmt.Sprint(*r) }

func (r *runFlags) Set(s string) error {
	name, cmd, ok := strings.Cut(s, "=")
	args := strings.Fields(cmd)
	if !ok || name == "" || len(args) == 0 {
		return fmt.Errorf("-run %q: want NAME=COMMAND [ARGS]", s)
	}
	for _, g := range *r {
		if g.name == name {
			return fmt.Errorf("-run: group %q given twice", name)
		}
	}
	*r = append(*r, group{name: name, args: args})
	return nil
}

func main() {
	var groups runFlags
	flag.Var(&groups, "run", "a group to run: NAME=COMMAND ARGS... (a `go test -json` command; repeatable)")
	logDir := flag.String("logdir", "test-logs", "directory for the full output (emptied first)")
	tests := flag.String("tests", "", "comma-separated groups whose tests are reported as they start and finish (the others: packages and failures)")
	heartbeat := flag.Duration("heartbeat", 30*time.Second, "say what is running when nothing was printed for this long (0: never)")
	idle := flag.Duration("idle", 5*time.Minute, "stop a command when one of its tests printed nothing for this long (0: never)")
	verbose := flag.Bool("v", false, "also print every line of the tests' output, prefixed with its package")
	headLines := flag.Int("head", 50, "lines printed from the start of a failed test's output")
	tailLines := flag.Int("tail", 250, "lines printed from the end of a failed test's output")
	flag.Parse()
	if len(groups) == 0 || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: testrun [flags] -run NAME=COMMAND... (see -help)")
		os.Exit(2)
	}
	opts := options{
		logDir:    *logDir,
		heartbeat: *heartbeat,
		idle:      *idle,
		verbose:   *verbose,
		head:      *headLines,
		tail:      *tailLines,
		tests:     map[string]bool{},
	}
	for _, g := range strings.Split(*tests, ",") {
		if g = strings.TrimSpace(g); g != "" {
			opts.tests[g] = true
		}
	}
	ok, err := run(groups, opts, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testrun:", err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}
