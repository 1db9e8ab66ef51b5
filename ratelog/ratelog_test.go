package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// recorder is a slog handler that keeps every record.
type recorder struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.recs = append(r.recs, rec)
	r.mu.Unlock()
	return nil
}
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *recorder) WithGroup(string) slog.Handler      { return r }

func attr(rec slog.Record, key string) (slog.Value, bool) {
	var v slog.Value
	found := false
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v, found = a.Value, true
			return false
		}
		return true
	})
	return v, found
}

type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time      { return c.t }
func (c *fakeClock) add(d time.Duration) { c.t = c.t.Add(d) }
func newFake() *fakeClock                { return &fakeClock{t: time.Unix(1e9, 0)} }
func (r *recorder) n() int               { r.mu.Lock(); defer r.mu.Unlock(); return len(r.recs) }
func (r *recorder) last() slog.Record    { r.mu.Lock(); defer r.mu.Unlock(); return r.recs[len(r.recs)-1] }

// TestLimiterOneLinePerKeyPerInterval: a flood of one key writes one line
// per interval, the next carrying the count of those dropped; other keys
// are independent; Flush reports what is still pending.
func TestLimiterOneLinePerKeyPerInterval(t *testing.T) {
	rec, clk := &recorder{}, newFake()
	l := NewClock(slog.New(rec), time.Second, clk.now)
	for range 1000 {
		l.Warn("a", "flood", "x", 1)
		clk.add(time.Millisecond / 2)
	}
	require.Equal(t, 1, rec.n(), "half a second of flood")
	require.True(t, l.Info("b", "other key"))
	require.Equal(t, 2, rec.n())
	clk.add(600 * time.Millisecond)
	require.True(t, l.Warn("a", "flood", "x", 2))
	require.Equal(t, 3, rec.n())
	v, ok := attr(rec.last(), "suppressed")
	require.True(t, ok)
	require.Equal(t, uint64(999), v.Uint64())
	require.False(t, l.Warn("a", "flood"))
	require.Equal(t, uint64(1), l.Suppressed())
	l.Flush()
	require.Equal(t, 4, rec.n())
	v, _ = attr(rec.last(), "suppressed")
	require.Equal(t, uint64(1), v.Uint64())
	require.Zero(t, l.Suppressed())
}

// TestLimiterBoundsKeys: keys beyond maxKeys share one overflow key, so
// the limiter's memory and output stay bounded whatever keys it gets.
func TestLimiterBoundsKeys(t *testing.T) {
	rec, clk := &recorder{}, newFake()
	l := NewClock(slog.New(rec), time.Second, clk.now)
	for i := range 10 * maxKeys {
		l.Warn(string(rune('A'+i)), "many keys")
	}
	require.Equal(t, maxKeys+1, rec.n())
	l.mu.Lock()
	require.LessOrEqual(t, len(l.keys), maxKeys+1)
	l.mu.Unlock()
}

// TestLimiterDisabledLevel: records below the handler's level cost
// nothing and are not counted.
func TestLimiterDisabledLevel(t *testing.T) {
	l := New(slog.New(slog.NewTextHandler(discard{}, &slog.HandlerOptions{Level: slog.LevelInfo})), 0)
	require.False(t, l.Debug("k", "debug"))
	require.Zero(t, l.Suppressed())
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// TestBucket: a burst, then the refill rate.
func TestBucket(t *testing.T) {
	clk := newFake()
	b := NewBucketClock(2, 5, clk.now)
	n := 0
	for range 100 {
		if b.Allow() {
			n++
		}
	}
	require.Equal(t, 5, n)
	clk.add(time.Second)
	n = 0
	for range 100 {
		if b.Allow() {
			n++
		}
	}
	require.Equal(t, 2, n)
	clk.add(time.Hour)
	n = 0
	for range 100 {
		if b.Allow() {
			n++
		}
	}
	require.Equal(t, 5, n, "refill caps at the burst")
}
