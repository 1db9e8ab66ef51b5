package e2e

import (
	"fmt"
	"os"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The outcome of one test in Python unittest's verbose report.
const (
	utPass    = "ok"
	utFail    = "FAIL"
	utError   = "ERROR"
	utSkip    = "skipped"
	utXFail   = "expected failure"
	utXPass   = "unexpected success"
	utUnknown = ""
)

// utResult is one test's line of a verbose unittest run.
type utResult struct {
	ID      string // as unittest names it: tests.test_qp.QPTest.test_query_rc_qp
	Outcome string // utPass, utFail, ...
	Reason  string // the skip reason
	Detail  string // the traceback of a failure or error
}

// utRun is a parsed `python3 -m unittest -v` (or run_tests.py -v) report.
type utRun struct {
	Tests map[string]*utResult
	IDs   []string // in the order they ran
	Ran   int
	// Summary counts from the last line (FAILED (failures=, errors=, skipped=) or OK).
	Failures, Errors, Skipped int
}

var (
	// A test's header line: "test_x (tests.test_y.Class.test_x)", then either " ... "
	// and its outcome on the same line or its docstring's first line on the next.
	utHeaderRE  = regexp.MustCompile(`(?m)^(\w+) \(([\w.]+)\)`)
	utOutcomeRE = regexp.MustCompile(`(?m)(?:^|\.\.\. )(ok|FAIL|ERROR|expected failure|unexpected success|skipped (?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"))$`)
	utRanRE     = regexp.MustCompile(`(?m)^Ran (\d+) tests? in [\d.]+s$`)
	utSummaryRE = regexp.MustCompile(`(?m)^(OK|FAILED)(?: \(([^)]*)\))?$`)
	utDetailRE  = regexp.MustCompile(`(?m)^={70}\n(ERROR|FAIL): \w+ \(([\w.]+)\)\n(?:.*\n)??-{70}\n`)
	utSepRE     = regexp.MustCompile(`(?m)^(?:={70}|-{70})$`)
)

// parseUnittest parses a verbose unittest report. It fails unless every test it counts
// has an outcome and the counts match the report's own summary.
func parseUnittest(out string) (*utRun, error) {
	r := &utRun{Tests: map[string]*utResult{}}
	m := utRanRE.FindAllStringSubmatchIndex(out, -1)
	if len(m) != 1 {
		return nil, fmt.Errorf("unittest report: %d 'Ran N tests' lines, want 1", len(m))
	}
	r.Ran, _ = strconv.Atoi(out[m[0][2]:m[0][3]])
	tail := out[m[0][1]:]
	s := utSummaryRE.FindStringSubmatch(tail)
	if s == nil {
		return nil, fmt.Errorf("unittest report: no OK/FAILED summary after 'Ran %d tests'", r.Ran)
	}
	for _, kv := range strings.Split(s[2], ", ") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		n, _ := strconv.Atoi(v)
		switch k {
		case "failures":
			r.Failures = n
		case "errors":
			r.Errors = n
		case "skipped":
			r.Skipped = n
		}
	}
	// The per-test lines end where the first failure's report (or the summary) starts.
	body := out[:m[0][0]]
	if sep := utSepRE.FindStringIndex(body); sep != nil {
		body, out = body[:sep[0]], body[sep[0]:]
	} else {
		out = ""
	}
	hs := utHeaderRE.FindAllStringSubmatchIndex(body, -1)
	for i, h := range hs {
		end := len(body)
		if i+1 < len(hs) {
			end = hs[i+1][0]
		}
		id := body[h[4]:h[5]]
		seg := body[h[1]:end]
		res := &utResult{ID: id}
		if dots := strings.Index(seg, " ... "); dots >= 0 {
			if o := utOutcomeRE.FindStringSubmatch(seg[dots:]); o != nil {
				res.Outcome = o[1]
				if rest, ok := strings.CutPrefix(o[1], "skipped "); ok {
					res.Outcome, res.Reason = utSkip, unquotePy(rest)
				}
			}
		}
		if res.Outcome == utUnknown {
			return nil, fmt.Errorf("unittest report: no outcome for %s in %q", id, seg)
		}
		if _, dup := r.Tests[id]; dup {
			return nil, fmt.Errorf("unittest report: %s twice", id)
		}
		r.Tests[id] = res
		r.IDs = append(r.IDs, id)
	}
	// Failure and error reports: "=====\nERROR: name (id)\n[docstring\n]-----\ntraceback".
	ds := utDetailRE.FindAllStringSubmatchIndex(out, -1)
	for i, d := range ds {
		end := len(out)
		if i+1 < len(ds) {
			end = ds[i+1][0]
		}
		if t := r.Tests[out[d[4]:d[5]]]; t != nil {
			t.Detail = strings.TrimRight(strings.TrimSuffix(strings.TrimRight(out[d[1]:end], "\n"), strings.Repeat("-", 70)), "\n")
		}
	}
	c := r.count()
	if len(r.IDs) != r.Ran || c[utFail] != r.Failures || c[utError] != r.Errors || c[utSkip] != r.Skipped {
		return nil, fmt.Errorf("unittest report: parsed %d tests (%d failures, %d errors, %d skipped), the summary says %d (%d, %d, %d)",
			len(r.IDs), c[utFail], c[utError], c[utSkip], r.Ran, r.Failures, r.Errors, r.Skipped)
	}
	return r, nil
}

// count returns the number of tests per outcome.
func (r *utRun) count() map[string]int {
	c := map[string]int{}
	for _, t := range r.Tests {
		c[t.Outcome]++
	}
	return c
}

// failed reports whether the test failed or raised an error (or unexpectedly passed).
func (t *utResult) failed() bool {
	return t != nil && (t.Outcome == utFail || t.Outcome == utError || t.Outcome == utXPass)
}

// String is the counts line the VM test prints per device.
func (r *utRun) String() string {
	c := r.count()
	return fmt.Sprintf("tests=%d pass=%d fail=%d error=%d skip=%d", r.Ran, c[utPass]+c[utXFail], c[utFail], c[utError]+c[utXPass], c[utSkip])
}

// skipReasons returns, per skip reason, the tests skipped with it (sorted).
func (r *utRun) skipReasons() map[string][]string {
	m := map[string][]string{}
	for _, id := range r.IDs {
		if t := r.Tests[id]; t.Outcome == utSkip {
			m[t.Reason] = append(m[t.Reason], id)
		}
	}
	for _, ids := range m {
		sort.Strings(ids)
	}
	return m
}

// skipSet is the skip reasons a document explains: patterns in which "*" stands
// for any text and "DEV" for the device's name.
type skipSet []*regexp.Regexp

func (s skipSet) match(reason string) bool {
	for _, re := range s {
		if re.MatchString(reason) {
			return true
		}
	}
	return false
}

// skipClasses reads the skip reasons a markdown document explains: the first
// backquoted text of each table row ("| `reason` | ...").
func skipClasses(path, dev string) (skipSet, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var s skipSet
	for _, m := range regexp.MustCompile("(?m)^\\| `([^`]+)`").FindAllStringSubmatch(string(b), -1) {
		p := strings.ReplaceAll(regexp.QuoteMeta(m[1]), `\*`, ".*")
		s = append(s, regexp.MustCompile("^"+strings.ReplaceAll(p, "DEV", regexp.QuoteMeta(dev))+"$"))
	}
	if len(s) == 0 {
		return nil, fmt.Errorf("%s explains no skip reason", path)
	}
	return s, nil
}

// utCause is where a failure or error came from, as its traceback shows it: the
// innermost frame that shows a source line (its file's base name and that line,
// trimmed) and the first line of the exception it ends with. Of chained exceptions
// ("During handling of the above exception ..."), the last.
type utCause struct {
	File, Line, Raise string
}

func (c utCause) String() string {
	return fmt.Sprintf("%s: `%s`: %s", c.File, c.Line, c.Raise)
}

var (
	utFrameRE = regexp.MustCompile(`^  File "([^"]*)", line \d+, in `)
	utCaretRE = regexp.MustCompile(`^\s+[~^]+\s*$`)
)

// cause returns where the test's failure or error came from (zero if its report has
// no traceback).
func (t *utResult) cause() utCause {
	lines := strings.Split(t.Detail, "\n")
	start := -1
	for i, l := range lines {
		if l == "Traceback (most recent call last):" {
			start = i
		}
	}
	var c utCause
	if start < 0 {
		return c
	}
	i := start + 1
	for i < len(lines) {
		m := utFrameRE.FindStringSubmatch(lines[i])
		if m == nil {
			if strings.HasPrefix(lines[i], "  ") { // "  [Previous line repeated N more times]"
				i++
				continue
			}
			break
		}
		i++
		if i < len(lines) && strings.HasPrefix(lines[i], "    ") {
			c.File, c.Line = path.Base(m[1]), strings.TrimSpace(lines[i])
			i++
			for i < len(lines) && utCaretRE.MatchString(lines[i]) {
				i++
			}
		}
	}
	if i < len(lines) {
		c.Raise = strings.TrimSpace(lines[i])
	}
	return c
}

// unquotePy undoes Python's repr of a str (single or double quotes, backslash escapes
// of the quote and backslash).
func unquotePy(s string) string {
	if len(s) >= 2 && (s[0] == '\'' || s[0] == '"') && s[len(s)-1] == s[0] {
		s = s[1 : len(s)-1]
	}
	return strings.NewReplacer(`\\`, `\`, `\'`, `'`, `\"`, `"`).Replace(s)
}

// TestParseUnittest parses a recorded run_tests.py -v report (rdma-core 44's suite on
// kernel rxe, shortened): per-test outcomes with and without docstrings, skip reasons
// in either quote style, a test's own output between its header and its outcome, and
// the traceback of the error; a report whose summary disagrees is refused.
func TestParseUnittest(t *testing.T) {
	b, err := os.ReadFile("testdata/unittest-verbose.txt")
	require.NoError(t, err)
	r, err := parseUnittest(string(b))
	require.NoError(t, err)
	assert.Equal(t, "tests=8 pass=3 fail=1 error=1 skip=3", r.String())
	assert.Equal(t, utPass, r.Tests["tests.test_addr.AHTest.test_create_ah"].Outcome)
	assert.Equal(t, utPass, r.Tests["tests.test_atomic.AtomicTest.test_atomic_cmp_and_swap"].Outcome, "output between header and outcome")
	rdmacm := r.Tests["tests.test_rdmacm.CMTestCase.test_rdmacm_async_read"]
	assert.Equal(t, utSkip, rdmacm.Outcome)
	assert.Equal(t, "Device rxe0 doesn't have net interface", rdmacm.Reason)
	assert.Equal(t, "Create XRCD is not supported", r.Tests["tests.test_atomic.AtomicTest.test_xrc_atomic_cmp_and_swap"].Reason)
	aw := r.Tests["tests.test_qpex.QpExTestCase.test_qp_ex_rc_atomic_write"]
	assert.True(t, aw.failed())
	assert.Contains(t, aw.Detail, "Completion status is local QP operation error")
	assert.NotContains(t, aw.Detail, "Ran 8 tests")
	q := r.Tests["tests.test_qp.QPTest.test_query_rc_qp"]
	assert.Equal(t, utFail, q.Outcome)
	assert.Contains(t, q.Detail, "AssertionError")
	assert.NotContains(t, q.Detail, "ERROR: test_qp_ex_rc_atomic_write")
	assert.Equal(t, map[string][]string{
		"Create XRCD is not supported":           {"tests.test_atomic.AtomicTest.test_xrc_atomic_cmp_and_swap"},
		"Device rxe0 doesn't have net interface": {"tests.test_rdmacm.CMTestCase.test_rdmacm_async_read"},
		"Extended CQ is not supported":           {"tests.test_tag_matching.TMTest.test_tm_no_tag"},
	}, r.skipReasons())

	_, err = parseUnittest(strings.Replace(string(b), "FAILED (failures=1, errors=1, skipped=3)", "FAILED (failures=1, errors=2, skipped=3)", 1))
	assert.ErrorContains(t, err, "the summary says")
	_, err = parseUnittest(strings.Replace(string(b), "Test ibv_create_ah. ... ok", "Test ibv_create_ah. ...", 1))
	assert.ErrorContains(t, err, "no outcome for tests.test_addr.AHTest.test_create_ah")
}

// TestPyverbsSkipTable: testdata/pyverbs-skips.md's reasons match the suite's skip
// messages as TestPyverbsSuite reads them (DEV is the device's name, * any text), and
// a reason it does not explain matches none of them.
func TestPyverbsSkipTable(t *testing.T) {
	s, err := skipClasses("testdata/pyverbs-skips.md", "rocep0s5f1")
	require.NoError(t, err)
	for _, reason := range []string{
		"Create Extended CQ is not supported",
		"Create UC QP without extended attrs is not supported",
		"Create player with RC_SEND is not supported",
		"Device rocep0s5f1 doesn't have net interface",
		"Rereg MR is not supported (Failed to rereg MR: IBV_REREG_MR_ERR_CMD. Errno: 95, Operation not supported)",
		"PCI device must be passed by the user",
	} {
		assert.True(t, s.match(reason), reason)
	}
	for _, reason := range []string{
		"Device rxe0 doesn't have net interface",
		"Create MW is not supported, and more",
		"Failed to register a MR",
	} {
		assert.False(t, s.match(reason), reason)
	}
}

// TestUnittestCause: a failure's cause is the innermost frame with a source line and
// the exception's first line, in the recorded report and in Python 3.11's forms
// (carets under the failing expression, frames without source, chained exceptions).
func TestUnittestCause(t *testing.T) {
	b, err := os.ReadFile("testdata/unittest-verbose.txt")
	require.NoError(t, err)
	r, err := parseUnittest(string(b))
	require.NoError(t, err)
	assert.Equal(t, utCause{"utils.py", "raise PyverbsRDMAError(f'Completion status is {wc_status_to_str(wcs[0].status)}')",
		"pyverbs.pyverbs_error.PyverbsRDMAError: Completion status is local QP operation error"},
		r.Tests["tests.test_qpex.QpExTestCase.test_qp_ex_rc_atomic_write"].cause())
	assert.Equal(t, utCause{"test_qp.py", "self.query_qp_common_test(e.IBV_QPT_RC)", "AssertionError: 0 != 16 : Wrong sq_sig_all"},
		r.Tests["tests.test_qp.QPTest.test_query_rc_qp"].cause())
	assert.Equal(t, utCause{}, r.Tests["tests.test_addr.AHTest.test_create_ah"].cause(), "no traceback")

	chained := (&utResult{Detail: `Traceback (most recent call last):
  File "/root/rdma-tests/utils.py", line 10, in first
    x = y[0]
        ~^^^
IndexError: list index out of range

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/root/rdma-tests/test_mr.py", line 20, in test_x
    self.create(size=0x1000)
  File "/root/rdma-tests/base.py", line 30, in create
    mr = MR(self.pd, size, access)
         ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "mr.pyx", line 88, in pyverbs.mr.MR.__init__
pyverbs.pyverbs_error.PyverbsRDMAError: Failed to register a MR. Errno: 22, Invalid argument
Extra line of the message`}).cause()
	assert.Equal(t, utCause{"base.py", "mr = MR(self.pd, size, access)",
		"pyverbs.pyverbs_error.PyverbsRDMAError: Failed to register a MR. Errno: 22, Invalid argument"}, chained)
}
