package vm

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// Parsers for the output of the RDMA tools the guests run, for baselines and
// comparisons. They accept the whole output of a run (banners, addresses, warnings) and
// find the result lines.

// ErrNoResult means the output holds no result lines of the expected form.
var ErrNoResult = errors.New("no result in tool output")

// PingPong is the result of ibv_{rc,uc,ud,srq}_pingpong.
type PingPong struct {
	Bytes       int64   // bytes moved in total
	Iters       int64   // iterations
	Seconds     float64 // elapsed time
	Mbps        float64 // megabits per second, as printed
	UsecPerIter float64 // microseconds per iteration, as printed
}

var (
	ppBytesRE = regexp.MustCompile(`(?m)^\s*(\d+) bytes in ([0-9.]+) seconds = ([0-9.]+) Mbit/sec\s*$`)
	ppItersRE = regexp.MustCompile(`(?m)^\s*(\d+) iters in ([0-9.]+) seconds = ([0-9.]+) usec/iter\s*$`)
)

// ParsePingPong parses the two result lines of an ibv_*_pingpong run:
//
//	4096000 bytes in 0.20 seconds = 162.07 Mbit/sec
//	1000 iters in 0.20 seconds = 202.18 usec/iter
func ParsePingPong(out string) (PingPong, error) {
	b := ppBytesRE.FindStringSubmatch(out)
	it := ppItersRE.FindStringSubmatch(out)
	if b == nil || it == nil {
		return PingPong{}, fmt.Errorf("pingpong: %w", ErrNoResult)
	}
	var p PingPong
	var err error
	parse := func(dst *float64, s string) {
		if err == nil {
			*dst, err = strconv.ParseFloat(s, 64)
		}
	}
	if p.Bytes, err = strconv.ParseInt(b[1], 10, 64); err != nil {
		return PingPong{}, fmt.Errorf("pingpong bytes: %w", err)
	}
	if p.Iters, err = strconv.ParseInt(it[1], 10, 64); err != nil {
		return PingPong{}, fmt.Errorf("pingpong iters: %w", err)
	}
	parse(&p.Seconds, b[2])
	parse(&p.Mbps, b[3])
	parse(&p.UsecPerIter, it[3])
	if err != nil {
		return PingPong{}, fmt.Errorf("pingpong: %w", err)
	}
	return p, nil
}

// BW is one result row of a perftest bandwidth test (ib_send_bw, ib_write_bw,
// ib_read_bw, ib_atomic_bw).
type BW struct {
	Bytes       int64
	Iterations  int64
	PeakMBps    float64 // MB/s (converted from Gb/s with --report_gbits)
	AvgMBps     float64
	MsgRateMpps float64
}

// Lat is one result row of a perftest latency test (ib_send_lat, ib_write_lat,
// ib_read_lat, ib_atomic_lat), in microseconds.
type Lat struct {
	Bytes      int64
	Iterations int64
	Min, Max   float64
	Typical    float64
	Avg, Stdev float64
	P99, P999  float64
}

// perftestColRE finds the column names of a perftest result header, e.g. "#bytes",
// "BW peak[MB/sec]", "t_typical[usec]", "99% percentile[usec]".
var perftestColRE = regexp.MustCompile(`#[a-z_]+|[A-Za-z0-9_.%]+(?: [a-z]+)?\[[^\]]+\]`)

// perftestTable returns the rows of the table whose header has all the required
// columns, as column name -> value string.
func perftestTable(out string, required ...string) ([]map[string]string, error) {
	lines := strings.Split(out, "\n")
	for i, line := range lines {
		if !strings.Contains(line, "#bytes") {
			continue
		}
		cols := perftestColRE.FindAllString(line, -1)
		ok := true
		for _, r := range required {
			if !containsPrefix(cols, r) {
				ok = false
			}
		}
		if !ok {
			continue
		}
		var rows []map[string]string
		for _, row := range lines[i+1:] {
			f := strings.Fields(row)
			if len(f) == 0 || f[0][0] < '0' || f[0][0] > '9' {
				break
			}
			if len(f) < len(cols) {
				return nil, fmt.Errorf("perftest row %q has %d fields, header %d", row, len(f), len(cols))
			}
			m := map[string]string{}
			for j, c := range cols {
				m[c] = f[j]
			}
			rows = append(rows, m)
		}
		if len(rows) == 0 {
			return nil, fmt.Errorf("perftest: header without rows: %w", ErrNoResult)
		}
		return rows, nil
	}
	return nil, fmt.Errorf("perftest: %w", ErrNoResult)
}

func containsPrefix(list []string, prefix string) bool {
	for _, s := range list {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}

// column returns the value of the first column whose name starts with prefix, and that
// name (for its unit).
func column(row map[string]string, prefix string) (float64, string, error) {
	for name, v := range row {
		if strings.HasPrefix(name, prefix) {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, name, fmt.Errorf("column %s: %w", name, err)
			}
			return f, name, nil
		}
	}
	return 0, "", fmt.Errorf("no column %s", prefix)
}

// toMBps converts a bandwidth in the unit of its column name to MB/s.
func toMBps(v float64, name string) float64 {
	if strings.Contains(name, "Gb/sec") {
		return v * 1000 / 8
	}
	return v
}

// ParsePerftestBW parses the result table of a perftest bandwidth run (one row per
// message size; several with -a).
func ParsePerftestBW(out string) ([]BW, error) {
	rows, err := perftestTable(out, "#bytes", "#iterations", "BW peak", "BW average", "MsgRate")
	if err != nil {
		return nil, err
	}
	res := make([]BW, 0, len(rows))
	for _, r := range rows {
		var b BW
		var errs []error
		var bytes, iters, peak, avg float64
		var peakName, avgName string
		var e error
		bytes, _, e = column(r, "#bytes")
		errs = append(errs, e)
		iters, _, e = column(r, "#iterations")
		errs = append(errs, e)
		peak, peakName, e = column(r, "BW peak")
		errs = append(errs, e)
		avg, avgName, e = column(r, "BW average")
		errs = append(errs, e)
		b.MsgRateMpps, _, e = column(r, "MsgRate")
		errs = append(errs, e)
		if err := errors.Join(errs...); err != nil {
			return nil, fmt.Errorf("perftest bw: %w", err)
		}
		b.Bytes, b.Iterations = int64(bytes), int64(iters)
		b.PeakMBps, b.AvgMBps = toMBps(peak, peakName), toMBps(avg, avgName)
		res = append(res, b)
	}
	return res, nil
}

// ParsePerftestLat parses the result table of a perftest latency run.
func ParsePerftestLat(out string) ([]Lat, error) {
	rows, err := perftestTable(out, "#bytes", "#iterations", "t_typical", "t_avg")
	if err != nil {
		return nil, err
	}
	res := make([]Lat, 0, len(rows))
	for _, r := range rows {
		var l Lat
		var bytes, iters float64
		var errs []error
		get := func(dst *float64, prefix string, optional bool) {
			v, _, e := column(r, prefix)
			if e != nil && optional {
				return
			}
			*dst = v
			errs = append(errs, e)
		}
		get(&bytes, "#bytes", false)
		get(&iters, "#iterations", false)
		get(&l.Min, "t_min", false)
		get(&l.Max, "t_max", false)
		get(&l.Typical, "t_typical", false)
		get(&l.Avg, "t_avg", false)
		get(&l.Stdev, "t_stdev", true)
		get(&l.P99, "99%", true)
		get(&l.P999, "99.9%", true)
		if err := errors.Join(errs...); err != nil {
			return nil, fmt.Errorf("perftest lat: %w", err)
		}
		l.Bytes, l.Iterations = int64(bytes), int64(iters)
		res = append(res, l)
	}
	return res, nil
}

// Section returns the part of a scenario's output between a line "=== name" and the next
// line starting with "=== " (or the end). Scenarios print such markers to separate the
// output of the tools they run.
func Section(out, name string) string {
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		if strings.TrimSpace(l) != "=== "+name {
			continue
		}
		var sec []string
		for _, s := range lines[i+1:] {
			if strings.HasPrefix(s, "=== ") {
				break
			}
			sec = append(sec, s)
		}
		return strings.Join(sec, "\n")
	}
	return ""
}
