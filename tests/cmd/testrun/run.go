package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// group is one `go test -json` command and its name in the report.
type group struct {
	name string
	args []string
}

// options steer what the reporter prints and where it keeps the logs.
type options struct {
	dir       string // where the commands run and go.mod is ("" for the current directory)
	logDir    string // relative to dir unless absolute
	heartbeat time.Duration
	idle      time.Duration // a running test silent this long stops its command (0: never)
	verbose   bool
	head      int             // lines kept from the start of a failed test's output
	tail      int             // lines kept from its end
	tests     map[string]bool // groups whose tests are reported as they run
}

// line is one line a command printed: on standard output (a JSON event, normally) or on
// standard error; exit marks the end of the command.
type line struct {
	group  string
	text   string
	stderr bool
	exit   *exitInfo
}

type exitInfo struct {
	code int
	err  error
}

// run starts the groups' commands, reports their events on stdout until all have
// exited and prints the summary. It returns whether everything passed; the error is for
// what keeps it from running at all.
func run(groups []group, opts options, stdout io.Writer) (bool, error) {
	logDir := opts.logDir
	if !filepath.IsAbs(logDir) {
		logDir = filepath.Join(opts.dir, logDir)
	}
	logs, err := newLogs(logDir)
	if err != nil {
		return false, err
	}
	defer logs.close()
	rep := newReporter(io.MultiWriter(stdout, logs.console), logs, opts, time.Now())

	// Ctrl-C reaches the commands (they are in our process group) and they end
	// their runs; we keep reading so that the summary says what ran.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)

	lines := make(chan line, 256)
	procs := map[string]*os.Process{}
	for _, g := range groups {
		rep.header(g)
		p, err := start(g, opts.dir, lines)
		if err != nil {
			rep.commandFailed(g.name, fmt.Sprintf("did not start: %v", err))
			continue
		}
		procs[g.name] = p
		rep.running++
	}

	var tick <-chan time.Time
	if every := tickEvery(opts.heartbeat, opts.idle); every > 0 {
		t := time.NewTicker(every)
		defer t.Stop()
		tick = t.C
	}
	for rep.running > 0 {
		select {
		case l := <-lines:
			rep.line(l, time.Now())
		case now := <-tick:
			rep.heartbeat(now)
			for _, g := range rep.idleGroups(now) {
				if p := procs[g]; p != nil {
					stopGroup(p, 10*time.Second)
				}
			}
		case s := <-sigs:
			rep.interrupted(s, time.Now())
			// Each command is a process group of its own: pass the signal on.
			for _, p := range procs {
				_ = syscall.Kill(-p.Pid, s.(syscall.Signal))
			}
		}
	}
	return rep.summary(time.Now()), nil
}

// tickEvery is how often the heartbeat and the idle check look whether they are due (0:
// neither is on).
func tickEvery(heartbeat, idle time.Duration) time.Duration {
	d := heartbeat
	if d <= 0 || (idle > 0 && idle < d) {
		d = idle
	}
	if d <= 0 {
		return 0
	}
	if d /= 5; d > time.Second {
		return d
	}
	return time.Second
}

// stopGroup ends a command's process group: SIGQUIT first, so that a Go test binary
// prints its goroutines' stacks, then SIGKILL after grace.
func stopGroup(p *os.Process, grace time.Duration) {
	_ = syscall.Kill(-p.Pid, syscall.SIGQUIT)
	go func() {
		time.Sleep(grace)
		_ = syscall.Kill(-p.Pid, syscall.SIGKILL)
	}()
}

// start runs g's command, in a process group of its own, and sends its output, line by
// line, then its exit, to lines.
func start(g group, dir string, lines chan<- line) (*os.Process, error) {
	cmd := exec.Command(g.args[0], g.args[1:]...)
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan struct{}, 2)
	pump := func(r io.Reader, isErr bool) {
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 64<<20)
		for sc.Scan() {
			lines <- line{group: g.name, text: sc.Text(), stderr: isErr}
		}
		if err := sc.Err(); err != nil {
			lines <- line{group: g.name, text: "testrun: reading the output: " + err.Error(), stderr: true}
			_, _ = io.Copy(io.Discard, r)
		}
		done <- struct{}{}
	}
	go pump(stdout, false)
	go pump(stderr, true)
	go func() {
		<-done
		<-done
		err := cmd.Wait()
		info := &exitInfo{}
		var ee *exec.ExitError
		switch {
		case err == nil:
		case errors.As(err, &ee):
			info.code = ee.ExitCode()
			if info.code < 0 {
				info.err = err // killed by a signal
			}
		default:
			info.code, info.err = -1, err
		}
		lines <- line{group: g.name, exit: info}
	}()
	return cmd.Process, nil
}

// commandLine is the command as printed in the header.
func commandLine(args []string) string {
	return strings.Join(args, " ")
}
