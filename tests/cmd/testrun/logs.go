package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// logs are the files of one run under the log directory: testrun.log (the console),
// one .log per package (its output as `go test -v` prints it), and per group its JSON
// events (.json) and the other lines it printed, standard error's included (.out).
type logs struct {
	dir     string
	console *os.File
	files   map[string]*os.File
	err     error // the first write error, reported once in the summary
}

// newLogs empties dir (only the files a run writes there) and opens the console log.
func newLogs(dir string) (*logs, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("log directory: %w", err)
	}
	for _, pat := range []string{"*.log", "*.json", "*.out", "*.stderr"} {
		old, _ := filepath.Glob(filepath.Join(dir, pat))
		for _, f := range old {
			if err := os.Remove(f); err != nil {
				return nil, fmt.Errorf("log directory: %w", err)
			}
		}
	}
	l := &logs{dir: dir, files: map[string]*os.File{}}
	f, err := os.Create(filepath.Join(dir, "testrun.log"))
	if err != nil {
		return nil, fmt.Errorf("log directory: %w", err)
	}
	l.console = f
	return l, nil
}

// packageFile is the name of a package's log: its path inside the module with the
// slashes turned into dots ("tests.e2e.log"); the module's root package is "root.log".
func packageFile(short string) string {
	if short == "" || short == "." {
		return "root.log"
	}
	return strings.ReplaceAll(short, "/", ".") + ".log"
}

// write appends s to the named file of the log directory, opening it on first use.
func (l *logs) write(name, s string) {
	f, ok := l.files[name]
	if !ok {
		var err error
		f, err = os.OpenFile(filepath.Join(l.dir, name), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			l.fail(err)
			f = nil
		}
		l.files[name] = f
	}
	if f == nil {
		return
	}
	if _, err := io.WriteString(f, s); err != nil {
		l.fail(err)
	}
}

// closeFile closes a file that is not expected to be written again (a finished
// package's log); a later write opens it again.
func (l *logs) closeFile(name string) {
	if f := l.files[name]; f != nil {
		if err := f.Close(); err != nil {
			l.fail(err)
		}
	}
	delete(l.files, name)
}

func (l *logs) fail(err error) {
	if l.err == nil {
		l.err = err
	}
}

func (l *logs) close() {
	for name := range l.files {
		l.closeFile(name)
	}
	_ = l.console.Close()
}
