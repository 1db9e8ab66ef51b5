package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Machine is where a section ran, read from the host when the section starts.
type Machine struct {
	CPU      string `json:"cpu"`
	Cores    int    `json:"cores"`
	MemKiB   uint64 `json:"mem_kib"`
	Kernel   string `json:"kernel"`
	Go       string `json:"go"`
	Hostname string `json:"hostname,omitempty"`
}

// readMachine describes this host.
func readMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), Go: goVersion()}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		_ = f.Close()
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemTotal:" {
				m.MemKiB, _ = strconv.ParseUint(f[1], 10, 64)
			}
		}
	}
	var uts unix.Utsname
	if unix.Uname(&uts) == nil {
		m.Kernel = unix.ByteSliceToString(uts.Release[:])
	}
	return m
}

// String is the machine in one line.
func (m Machine) String() string {
	cpu := m.CPU
	if cpu == "" {
		cpu = "unknown CPU"
	}
	return fmt.Sprintf("%s, %d cores (online CPUs), %.1f GiB memory, Linux %s, %s",
		cpu, m.Cores, float64(m.MemKiB)/(1<<20), m.Kernel, m.Go)
}

func goVersion() string {
	out, err := exec.Command("go", "env", "GOVERSION").Output()
	if err != nil {
		return runtime.Version()
	}
	return strings.TrimSpace(string(out))
}

// Load is the kernel's load averages (1, 5 and 15 minutes), as /proc/loadavg has them.
type Load [3]string

// readLoad reads /proc/loadavg.
func readLoad() Load {
	var l Load
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return Load{"?", "?", "?"}
	}
	f := strings.Fields(string(b))
	for i := 0; i < 3 && i < len(f); i++ {
		l[i] = f[i]
	}
	return l
}

func (l Load) String() string { return strings.Join(l[:], " ") }

// Busy reports whether the 1-minute load was at or above 0.5: another job was using
// the machine, and the section's figures are not quiet ones.
func (l Load) Busy() bool {
	v, err := strconv.ParseFloat(l[0], 64)
	return err != nil || v >= 0.5
}

// commit is the work tree's commit, with a note if it has local changes (other than to
// the report itself, which a run of several sections rewrites as it goes).
func commit(report string) string {
	out, err := exec.Command("git", "rev-parse", "--short=12", "HEAD").Output()
	if err != nil {
		return "unknown (not a git work tree)"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)"+report).Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
		c += " with uncommitted changes"
	}
	return c
}
