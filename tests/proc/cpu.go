package proc

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTick is the unit of /proc/PID/stat's CPU times (USER_HZ, 100 on
// every Linux architecture this runs on).
const clockTick = 10 * time.Millisecond

// TreeCPU returns the CPU time (user and system) the process pid and its
// live descendants have used so far: a daemon that supervises a worker
// is measured with its worker. A descendant that exits between two calls
// takes its time with it, so measure over windows where the tree is
// stable.
func TreeCPU(pid int) (time.Duration, error) {
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		return 0, err
	}
	parent := map[int]int{}
	cpu := map[int]time.Duration{}
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // exited since the glob
		}
		id, ppid, t, err := parseStat(string(b))
		if err != nil {
			return 0, fmt.Errorf("%s: %w", p, err)
		}
		parent[id], cpu[id] = ppid, t
	}
	if _, ok := cpu[pid]; !ok {
		return 0, fmt.Errorf("process %d: not running", pid)
	}
	var total time.Duration
	for id, t := range cpu {
		for a := id; a > 1; a = parent[a] {
			if a == pid {
				total += t
				break
			}
		}
	}
	return total, nil
}

// parseStat reads a /proc/PID/stat line's PID, parent PID and user plus
// system time. The command name (field 2) is in parentheses and may hold
// spaces and parentheses: the fields after it follow the last ')'.
func parseStat(s string) (pid, ppid int, cpu time.Duration, err error) {
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 1 || end < open {
		return 0, 0, 0, fmt.Errorf("malformed stat %q", s)
	}
	if pid, err = strconv.Atoi(strings.TrimSpace(s[:open])); err != nil {
		return 0, 0, 0, fmt.Errorf("pid: %w", err)
	}
	// After the name: state(3) ppid(4) ... utime(14) stime(15).
	f := strings.Fields(s[end+1:])
	if len(f) < 13 {
		return 0, 0, 0, fmt.Errorf("stat has %d fields after the name", len(f))
	}
	if ppid, err = strconv.Atoi(f[1]); err != nil {
		return 0, 0, 0, fmt.Errorf("ppid: %w", err)
	}
	var ticks int64
	for _, v := range f[11:13] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, 0, 0, fmt.Errorf("cpu time: %w", err)
		}
		ticks += n
	}
	return pid, ppid, time.Duration(ticks) * clockTick, nil
}
