// Command benchreport runs the project's benchmarks and writes docs/BENCHMARKS.md from
// their own output, so that no figure is ever copied into the documentation by hand.
//
//	go run ./tests/benchreport [-sections all|NAME,...] [-report docs/BENCHMARKS.md] [-raw out/bench]
//	go run ./tests/benchreport -from out/bench -sections NAME   # re-render from a kept run
//	go run ./tests/benchreport -placeholders -sections NAME     # mark sections not generated
//
// `make bench-report` runs it (BENCH_SECTIONS selects sections). Each section is one
// `go test -bench` command (sections.go); the tool records the date, the commit, the
// machine and the load average before and after it, runs the command with its output
// going both to the terminal and to <raw>/<section>.txt, parses the results and the
// lines the benchmarks printed (parse.go), and replaces that section of the report,
// keeping the others as they were. A section whose command fails is left as it was.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// modulePath is the module whose package paths the report shortens.
const modulePath = "github.com/pvrdma-backend/pvrdma-backend"

func main() {
	list := flag.String("sections", "all", "sections to run: all, or names separated by commas ("+sectionNames()+")")
	report := flag.String("report", "docs/BENCHMARKS.md", "the report to update")
	raw := flag.String("raw", "out/bench", "directory for each section's raw output (<section>.txt) and run record (<section>.json)")
	benchtime := flag.String("benchtime", "", "override -benchtime of the time-based sections (device, wire), e.g. 100ms for a quick check")
	from := flag.String("from", "", "render the sections from the raw output and run records in this directory instead of running them")
	placeholders := flag.Bool("placeholders", false, "mark the sections as not generated (no run)")
	flag.Parse()
	if err := run(*list, *report, *raw, *benchtime, *from, *placeholders, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run(list, reportPath, raw, benchtime, from string, placeholders bool, stdout, stderr io.Writer) error {
	secs, err := selectSections(list)
	if err != nil {
		return err
	}
	text, err := os.ReadFile(reportPath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	rep := parseReport(string(text))
	var failed []string
	for _, s := range secs {
		var md string
		var err error
		switch {
		case placeholders:
			md = renderPlaceholder(s)
		case from != "":
			md, err = fromRaw(s, from)
		default:
			md, err = runSection(s, reportPath, raw, benchtime, stdout, stderr)
		}
		if err != nil {
			fmt.Fprintf(stderr, "benchreport: section %s: %v (the report keeps its previous text)\n", s.Name, err)
			failed = append(failed, s.Name)
			continue
		}
		rep.Sections[s.Name] = md
		// Written after each section, so that a long run that stops keeps what it did.
		if err := writeFile(reportPath, rep.render()); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "benchreport: section %s written to %s\n", s.Name, reportPath)
	}
	if len(failed) > 0 {
		return fmt.Errorf("sections not updated: %s", strings.Join(failed, ", "))
	}
	return nil
}

// runSection runs a section's command, keeps its raw output and run record in raw, and
// renders the section.
func runSection(s Section, reportPath, raw, benchtime string, stdout, stderr io.Writer) (string, error) {
	if err := os.MkdirAll(raw, 0o755); err != nil {
		return "", err
	}
	args := s.withBenchtime(benchtime)
	cmd := exec.Command("go", append([]string{"test"}, args...)...)
	rec := Run{
		Section: s.Name,
		Command: commandLine(args),
		Date:    time.Now(),
		Commit:  commit(reportPath),
		Machine: readMachine(),
	}
	rawPath := filepath.Join(raw, s.Name+".txt")
	f, err := os.Create(rawPath)
	if err != nil {
		return "", err
	}
	defer f.Close()
	fmt.Fprintf(stderr, "benchreport: section %s: %s\n", s.Name, rec.Command)
	cmd.Stdout = io.MultiWriter(f, stdout)
	cmd.Stderr = io.MultiWriter(f, stderr)
	rec.Before = readLoad()
	start := time.Now()
	runErr := cmd.Run()
	rec.Duration = time.Since(start)
	rec.After = readLoad()
	if runErr != nil {
		rec.ExitErr = runErr.Error()
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return "", err
	}
	if err := writeFile(filepath.Join(raw, s.Name+".json"), string(b)+"\n"); err != nil {
		return "", err
	}
	if runErr != nil {
		return "", fmt.Errorf("%s: %w (output in %s)", rec.Command, runErr, rawPath)
	}
	return render(s, rec, rawPath)
}

// fromRaw renders a section from a kept run.
func fromRaw(s Section, dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, s.Name+".json"))
	if err != nil {
		return "", fmt.Errorf("no run record: %w", err)
	}
	var rec Run
	if err := json.Unmarshal(b, &rec); err != nil {
		return "", fmt.Errorf("run record: %w", err)
	}
	if rec.ExitErr != "" {
		return "", fmt.Errorf("that run failed: %s", rec.ExitErr)
	}
	return render(s, rec, filepath.Join(dir, s.Name+".txt"))
}

func render(s Section, rec Run, rawPath string) (string, error) {
	f, err := os.Open(rawPath)
	if err != nil {
		return "", err
	}
	defer f.Close()
	out, err := Parse(f)
	if err != nil {
		return "", fmt.Errorf("parse %s: %w", rawPath, err)
	}
	if out.Failed {
		return "", fmt.Errorf("the output reports a failure (see %s)", rawPath)
	}
	n := 0
	for _, p := range out.Packages {
		n += len(p.Results)
	}
	if n == 0 {
		return "", fmt.Errorf("no benchmark results in %s", rawPath)
	}
	return renderSection(s, rec, out, rawPath), nil
}

// commandLine is the command as a shell would take it: the environment variables that
// change what the benchmarks do (PVRDMA_*, GOMAXPROCS, GOFLAGS), then go test.
func commandLine(args []string) string {
	return commandLineEnv(os.Environ(), args)
}

// commandLineEnv is commandLine with the environment environ.
func commandLineEnv(environ, args []string) string {
	var env []string
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "PVRDMA_") || k == "GOMAXPROCS" || k == "GOFLAGS" || k == "HOSTILE_LOG" {
			env = append(env, envAssign(k, v))
		}
	}
	return strings.Join(append(env, shellJoin(append([]string{"go", "test"}, args...))), " ")
}

// envAssign is an assignment a shell takes as one before a command:
// NAME=VALUE with only the value quoted (a quoted 'NAME=VALUE' is a
// command name to the shell, not an assignment).
func envAssign(name, value string) string {
	return name + "=" + shellQuote(value)
}

// shellJoin quotes each word that needs it.
func shellJoin(words []string) string {
	q := make([]string, len(words))
	for i, w := range words {
		q[i] = shellQuote(w)
	}
	return strings.Join(q, " ")
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_=,./:+@", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// writeFile replaces path atomically.
func writeFile(path, text string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
