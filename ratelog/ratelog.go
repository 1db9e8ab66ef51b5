// Package ratelog bounds the log lines that untrusted parties (guests,
// QEMU, network peers) can make the daemon write: a Limiter lets one
// record per key through per interval and folds the rest into a
// "suppressed" count carried by the key's next record (or by Flush).
//
// A Limiter belongs to whatever it limits (a device, a VM session, a
// fabric); there is no package-level state.
package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// DefaultInterval is the interval Limiters use when given 0: one line per
// key every 10 seconds at most.
const DefaultInterval = 10 * time.Second

// maxKeys bounds the keys a Limiter tracks. Keys are chosen by the code
// (message kinds, not guest-supplied values), so this is a safety net:
// beyond it, records share one overflow key.
const maxKeys = 128

// overflowKey collects records once maxKeys keys are tracked.
const overflowKey = "\x00overflow"

// Limiter lets at most one log record per key per interval through.
// It is safe for concurrent use. The zero value is not usable; call New.
type Limiter struct {
	log   *slog.Logger
	every time.Duration
	now   func() time.Time

	mu   sync.Mutex
	keys map[string]*entry
}

type entry struct {
	last       time.Time
	suppressed uint64
	level      slog.Level
	msg        string
}

// New returns a Limiter that writes to log (slog.Default() if nil), one
// record per key per every (DefaultInterval if 0).
func New(log *slog.Logger, every time.Duration) *Limiter {
	return NewClock(log, every, time.Now)
}

// NewClock is New with a clock, for tests.
func NewClock(log *slog.Logger, every time.Duration, now func() time.Time) *Limiter {
	if log == nil {
		log = slog.Default()
	}
	if every <= 0 {
		every = DefaultInterval
	}
	return &Limiter{log: log, every: every, now: now, keys: map[string]*entry{}}
}

// Logger returns the logger the Limiter writes to.
func (l *Limiter) Logger() *slog.Logger { return l.log }

// Log writes msg with args at level unless a record of key was written
// less than the interval ago; then it only counts it. A written record
// carries "suppressed"=N when N records of its key were dropped since the
// previous one. It reports whether the record was written.
func (l *Limiter) Log(ctx context.Context, level slog.Level, key, msg string, args ...any) bool {
	if !l.log.Enabled(ctx, level) {
		return false
	}
	now := l.now()
	l.mu.Lock()
	e := l.keys[key]
	if e == nil {
		if len(l.keys) >= maxKeys {
			l.evictLocked(now)
		}
		if len(l.keys) >= maxKeys {
			key = overflowKey
			e = l.keys[key]
		}
		if e == nil {
			e = &entry{} // zero last: always written
			l.keys[key] = e
		}
	}
	if now.Sub(e.last) < l.every {
		e.suppressed++
		e.level, e.msg = level, msg
		l.mu.Unlock()
		return false
	}
	n := e.suppressed
	e.last, e.suppressed, e.level, e.msg = now, 0, level, msg
	l.mu.Unlock()
	if n > 0 {
		args = append(args, slog.Uint64("suppressed", n))
	}
	l.log.Log(ctx, level, msg, args...)
	return true
}

// evictLocked forgets keys whose interval has passed with nothing
// suppressed (keys with a pending count are kept until written).
func (l *Limiter) evictLocked(now time.Time) {
	for k, e := range l.keys {
		if now.Sub(e.last) >= l.every && e.suppressed == 0 {
			delete(l.keys, k)
		}
	}
}

// Debug logs at debug level under key.
func (l *Limiter) Debug(key, msg string, args ...any) bool {
	return l.Log(context.Background(), slog.LevelDebug, key, msg, args...)
}

// Info logs at info level under key.
func (l *Limiter) Info(key, msg string, args ...any) bool {
	return l.Log(context.Background(), slog.LevelInfo, key, msg, args...)
}

// Warn logs at warn level under key.
func (l *Limiter) Warn(key, msg string, args ...any) bool {
	return l.Log(context.Background(), slog.LevelWarn, key, msg, args...)
}

// Error logs at error level under key.
func (l *Limiter) Error(key, msg string, args ...any) bool {
	return l.Log(context.Background(), slog.LevelError, key, msg, args...)
}

// Flush writes one line per key that has suppressed records (with the
// last suppressed message and the count) and forgets all keys. Owners call
// it when they close, so no count is lost.
func (l *Limiter) Flush() {
	l.mu.Lock()
	type pending struct {
		key string
		e   entry
	}
	var out []pending
	for k, e := range l.keys {
		if e.suppressed > 0 {
			out = append(out, pending{k, *e})
		}
	}
	l.keys = map[string]*entry{}
	l.mu.Unlock()
	for _, p := range out {
		l.log.Log(context.Background(), p.e.level, p.e.msg, slog.String("key", p.key), slog.Uint64("suppressed", p.e.suppressed))
	}
}

// Suppressed returns the records dropped and not yet reported, all keys.
func (l *Limiter) Suppressed() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var n uint64
	for _, e := range l.keys {
		n += e.suppressed
	}
	return n
}
