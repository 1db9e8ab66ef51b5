package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// utExpect is a failure a document expects: the test, and patterns for its cause's
// source line and exception ("*" any text).
type utExpect struct {
	ID          string
	Line, Raise *regexp.Regexp
	Why         string
}

func (e utExpect) matches(id string, c utCause) bool {
	return e.ID == id && e.Line.MatchString(c.Line) && e.Raise.MatchString(c.Raise)
}

// utExpectSet is a list of expected failures.
type utExpectSet []utExpect

// match returns the expectation that the test's failure with cause c meets, or nil.
func (s utExpectSet) match(id string, c utCause) *utExpect {
	for i := range s {
		if s[i].matches(id, c) {
			return &s[i]
		}
	}
	return nil
}

// has reports whether the set lists the test.
func (s utExpectSet) has(id string) bool {
	for _, e := range s {
		if e.ID == id {
			return true
		}
	}
	return false
}

// expectedFailures are the failures testdata/pyverbs-failures.md expects.
type expectedFailures struct {
	OursOnly utExpectSet // the stock stack's own: over our device only
	Shared   utExpectSet // over both devices
}

// The sections of the document, and its table rows: test | fails at | raises | why.
const (
	oursOnlySection = "## Over our device only"
	sharedSection   = "## Over both devices"
)

var expectRowRE = regexp.MustCompile("^\\| `([^`]+)` \\| `([^`]+)` \\| `([^`]+)` \\| (.+) \\|$")

// readExpectedFailures reads the tables of expected failures: every row of a
// section's table must be well formed, and the stock stack's own must list some.
func readExpectedFailures(file string) (*expectedFailures, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pattern := func(s string) *regexp.Regexp {
		return regexp.MustCompile("^" + strings.ReplaceAll(regexp.QuoteMeta(s), `\*`, ".*") + "$")
	}
	ef := &expectedFailures{}
	var into *utExpectSet
	seen := map[string]bool{}
	for n, l := range strings.Split(string(b), "\n") {
		switch {
		case strings.HasPrefix(l, oursOnlySection):
			into, seen[oursOnlySection] = &ef.OursOnly, true
		case strings.HasPrefix(l, sharedSection):
			into, seen[sharedSection] = &ef.Shared, true
		case strings.HasPrefix(l, "#"):
			into = nil
		case into != nil && strings.HasPrefix(l, "| `"):
			m := expectRowRE.FindStringSubmatch(l)
			if m == nil {
				return nil, fmt.Errorf("%s:%d: not a row | `test` | `fails at` | `raises` | why |", file, n+1)
			}
			if ef.OursOnly.has(m[1]) || ef.Shared.has(m[1]) {
				return nil, fmt.Errorf("%s:%d: %s listed twice", file, n+1, m[1])
			}
			*into = append(*into, utExpect{ID: m[1], Line: pattern(m[2]), Raise: pattern(m[3]), Why: m[4]})
		}
	}
	for _, sec := range []string{oursOnlySection, sharedSection} {
		if !seen[sec] {
			return nil, fmt.Errorf("%s: no section %q", file, sec)
		}
	}
	if len(ef.OursOnly) == 0 {
		return nil, fmt.Errorf("%s: no failure of the stock stack's own", file)
	}
	return ef, nil
}

// expectRow is the row of testdata/pyverbs-failures.md that would expect the failure,
// its reason left to write.
func expectRow(id string, c utCause) string {
	return fmt.Sprintf("| `%s` | `%s` | `%s` | WHY |", id, c.Line, c.Raise)
}

// checkPyverbsFailures compares the two runs' failures and errors test by test with
// those testdata/pyverbs-failures.md expects, by test and cause: one over our device
// only must be the stock stack's own (the document's first table), one over both
// devices must be in its second table with the same cause over each. It logs every
// failure over either device with its cause, and fails for a listed failure of the
// stock stack that no longer fails over our device alone.
func checkPyverbsFailures(t testing.TB, ours, rxe *utRun) {
	t.Helper()
	exp, err := readExpectedFailures("testdata/pyverbs-failures.md")
	require.NoError(t, err)
	for _, id := range ours.IDs {
		o, x := ours.Tests[id], rxe.Tests[id]
		switch {
		case !o.failed() && !x.failed():
		case !o.failed():
			t.Logf("failed over rxe only: %s %s at %s", id, x.Outcome, x.cause())
		case x.failed():
			oc, xc := o.cause(), x.cause()
			t.Logf("failed over both: %s: ours %s at %s; rxe %s at %s", id, o.Outcome, oc, x.Outcome, xc)
			e := exp.Shared.match(id, oc)
			switch {
			case e == nil:
				t.Errorf("%s fails over both devices, for a cause testdata/pyverbs-failures.md does not list:\n"+
					"over ours: %s at %s\nover rxe:  %s at %s\nits row, once the reason is known: %s\n%s",
					id, o.Outcome, oc, x.Outcome, xc, expectRow(id, oc), o.Detail)
			case !e.matches(id, xc):
				t.Errorf("%s fails over both devices, but over rxe for another cause than the one listed:\n"+
					"over ours: %s at %s\nover rxe:  %s at %s\n%s", id, o.Outcome, oc, x.Outcome, xc, x.Detail)
			}
		default:
			oc := o.cause()
			if e := exp.OursOnly.match(id, oc); e != nil {
				t.Logf("stock stack: %s %s at %s (%s)", id, o.Outcome, oc, e.Why)
				continue
			}
			t.Errorf("%s: %s over our device at %s, %s over rxe:\n%s", id, o.Outcome, oc, x.Outcome, o.Detail)
		}
	}
	for _, e := range exp.OursOnly {
		o, x := ours.Tests[e.ID], rxe.Tests[e.ID]
		switch {
		case o == nil:
			t.Errorf("%s is listed as the stock stack's own failure, but the suite has no such test", e.ID)
		case !o.failed():
			t.Errorf("%s is listed as the stock stack's own failure, but it was %s over our device", e.ID, o.Outcome)
		case x.failed():
			t.Errorf("%s is listed as the stock stack's own failure, but it fails over rxe too (at %s)", e.ID, x.cause())
		}
	}
	for _, e := range exp.Shared {
		if o, x := ours.Tests[e.ID], rxe.Tests[e.ID]; o == nil || !o.failed() || !x.failed() {
			t.Logf("%s is listed as failing over both devices, but it did not in this run (ours %s, rxe %s)", e.ID, outcome(o), outcome(x))
		}
	}
}

// outcome is a test's outcome, or "absent".
func outcome(t *utResult) string {
	if t == nil {
		return "absent"
	}
	return t.Outcome
}

// stockQueryFailure is the traceback test_query_rc_qp ends with over our device
// (rdma-core 44's tests/test_qp.py: verify_qp_attrs, the caps reported as zero).
const stockQueryFailure = `Traceback (most recent call last):
  File "/root/rdma-tests/test_qp.py", line 283, in test_query_rc_qp
    self.query_qp_common_test(e.IBV_QPT_RC)
  File "/root/rdma-tests/test_qp.py", line 267, in query_qp_common_test
    self.verify_qp_attrs(caps, e.IBV_QPS_RESET, qp_init_attr, qp_attr)
  File "/root/rdma-tests/test_qp.py", line 241, in verify_qp_attrs
    self.assertLessEqual(orig_cap.max_recv_wr, init_attr.cap.max_recv_wr)
AssertionError: 1743 not less than or equal to 0`

// stockCapsFailure is the traceback the illegal-caps tests end with over our device.
const stockCapsFailure = `Traceback (most recent call last):
  File "/root/rdma-tests/test_qp.py", line 200, in test_create_raw_qp_ex_with_illegal_caps_max_send_wr
    with self.assertRaises(PyverbsRDMAError) as ex:
AssertionError: PyverbsRDMAError not raised`

// tbRecorder is a testing.TB that records what a check reports.
type tbRecorder struct {
	testing.TB
	errors, logs []string
}

func (r *tbRecorder) Helper() {}
func (r *tbRecorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
func (r *tbRecorder) Logf(format string, args ...any) {
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
}
func (r *tbRecorder) FailNow() { panic("FailNow") }

// TestPyverbsFailureTable: testdata/pyverbs-failures.md's rows match the stock stack's
// failures by test and cause; the same test failing for another cause, or a failure
// both devices share that is not listed, fails TestPyverbsSuite's check, and a listed
// failure that stopped failing over our device alone does too.
func TestPyverbsFailureTable(t *testing.T) {
	exp, err := readExpectedFailures("testdata/pyverbs-failures.md")
	require.NoError(t, err)
	require.Len(t, exp.OursOnly, 4)
	const (
		rcQuery = "tests.test_qp.QPTest.test_query_rc_qp"
		udQuery = "tests.test_qp.QPTest.test_query_ud_qp"
		sendWR  = "tests.test_qp.QPTest.test_create_raw_qp_ex_with_illegal_caps_max_send_wr"
		recvWR  = "tests.test_qp.QPTest.test_create_raw_qp_ex_with_illegal_caps_max_recv_wr"
		other   = "tests.test_mr.MRTest.test_reg_mr_bad_flags"
	)
	fail := func(detail string) *utResult { return &utResult{Outcome: utFail, Detail: detail} }
	pass := func() *utResult { return &utResult{Outcome: utPass} }
	stock := func() map[string]*utResult {
		return map[string]*utResult{rcQuery: fail(stockQueryFailure), udQuery: fail(strings.ReplaceAll(stockQueryFailure, "rc_qp", "ud_qp")),
			sendWR: fail(stockCapsFailure), recvWR: fail(strings.ReplaceAll(stockCapsFailure, "send_wr", "recv_wr")), other: pass()}
	}
	passing := func() map[string]*utResult {
		return map[string]*utResult{rcQuery: pass(), udQuery: pass(), sendWR: pass(), recvWR: pass(), other: pass()}
	}
	check := func(ours, rxe map[string]*utResult) *tbRecorder {
		ids := []string{rcQuery, udQuery, sendWR, recvWR, other}
		var rec tbRecorder
		checkPyverbsFailures(&rec, &utRun{Tests: ours, IDs: ids}, &utRun{Tests: rxe, IDs: ids})
		return &rec
	}

	rec := check(stock(), passing())
	assert.Empty(t, rec.errors, "the stock stack's four, each for its cause")
	assert.Len(t, rec.logs, 4)
	assert.Contains(t, rec.logs[0], "stock stack: "+rcQuery+" FAIL at test_qp.py: `self.assertLessEqual(orig_cap.max_recv_wr, init_attr.cap.max_recv_wr)`: AssertionError: 1743 not less than or equal to 0")

	ours := stock()
	ours[udQuery] = fail(strings.Replace(stockQueryFailure, "AssertionError: 1743 not less than or equal to 0", "AssertionError: 1 != 0", 1))
	rec = check(ours, passing())
	require.Len(t, rec.errors, 1, "another cause in a listed test")
	assert.Contains(t, rec.errors[0], udQuery+": FAIL over our device at test_qp.py: `self.assertLessEqual(orig_cap.max_recv_wr, init_attr.cap.max_recv_wr)`: AssertionError: 1 != 0, ok over rxe")

	ours = stock()
	ours[sendWR] = &utResult{Outcome: utError, Detail: `Traceback (most recent call last):
  File "/root/rdma-tests/test_qp.py", line 201, in test_create_raw_qp_ex_with_illegal_caps_max_send_wr
    self.create_qp_common_test(e.IBV_QPT_UD, e.IBV_QPS_RTS, False, True,
pyverbs.pyverbs_error.PyverbsRDMAError: Failed to modify QP state to RTS. Errno: 22, Invalid argument`}
	rec = check(ours, passing())
	require.Len(t, rec.errors, 1, "an error where a failure is listed")
	assert.Contains(t, rec.errors[0], sendWR+": ERROR over our device")

	ours, rxe := stock(), passing()
	otherFail := `Traceback (most recent call last):
  File "/root/rdma-tests/test_mr.py", line 99, in test_reg_mr_bad_flags
    self.assertEqual(ex.exception.error_code, errno.EINVAL)
AssertionError: 95 != 22`
	ours[other], rxe[other] = fail(otherFail), fail(otherFail)
	rec = check(ours, rxe)
	require.Len(t, rec.errors, 1, "a failure shared with rxe that is not listed")
	assert.Contains(t, rec.errors[0], "its row, once the reason is known: | `"+other+"` | `self.assertEqual(ex.exception.error_code, errno.EINVAL)` | `AssertionError: 95 != 22` | WHY |")
	assert.Contains(t, strings.Join(rec.logs, "\n"), "failed over both: "+other+": ours FAIL at test_mr.py:")

	exp.Shared = append(exp.Shared, utExpect{ID: other, Line: regexp.MustCompile(".*"), Raise: regexp.MustCompile("^AssertionError: 95 != 22$")})
	assert.NotNil(t, exp.Shared.match(other, ours[other].cause()))
	assert.Nil(t, exp.Shared.match(other, utCause{Line: "x", Raise: "AssertionError: 1 != 22"}))

	rxe = passing()
	rxe[other] = fail(otherFail)
	rec = check(stock(), rxe)
	assert.Empty(t, rec.errors, "a failure over rxe only")
	assert.Contains(t, strings.Join(rec.logs, "\n"), "failed over rxe only: "+other+" FAIL at test_mr.py")

	ours, rxe = stock(), passing()
	ours[recvWR] = pass()
	rxe[rcQuery] = fail(stockQueryFailure)
	delete(ours, udQuery)
	rec = check(ours, rxe)
	errs := strings.Join(rec.errors, "\n")
	assert.Contains(t, errs, recvWR+" is listed as the stock stack's own failure, but it was ok over our device")
	assert.Contains(t, errs, rcQuery+" is listed as the stock stack's own failure, but it fails over rxe too")
	assert.Contains(t, errs, udQuery+" is listed as the stock stack's own failure, but the suite has no such test")
}

// TestReadExpectedFailures: a malformed row or a missing section is refused.
func TestReadExpectedFailures(t *testing.T) {
	b, err := os.ReadFile("testdata/pyverbs-failures.md")
	require.NoError(t, err)
	dir := t.TempDir()
	for name, doc := range map[string]string{
		"no section":        strings.Replace(string(b), sharedSection, "## Elsewhere", 1),
		"not a row":         strings.Replace(string(b), "| `AssertionError: PyverbsRDMAError not raised` |", "| AssertionError |", 1),
		"listed twice":      string(b) + "| `tests.test_qp.QPTest.test_query_ud_qp` | `x` | `y` | z |\n",
		"no failure of the": strings.Replace(string(b), "| `tests.test_qp", "| x `tests.test_qp", -1),
	} {
		f := filepath.Join(dir, "doc.md")
		require.NoError(t, os.WriteFile(f, []byte(doc), 0o644))
		_, err := readExpectedFailures(f)
		assert.ErrorContains(t, err, name)
	}
}
