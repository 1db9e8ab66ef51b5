package ratelog

import (
	"sync"
	"time"
)

// Bucket is a token bucket: Allow takes a token if one is left. Tokens
// refill at Rate per second up to Burst. Safe for concurrent use.
type Bucket struct {
	rate  float64
	burst float64
	now   func() time.Time

	mu     sync.Mutex
	tokens float64
	last   time.Time
}

// NewBucket returns a full bucket of burst tokens refilled at rate per
// second.
func NewBucket(rate float64, burst int) *Bucket { return NewBucketClock(rate, burst, time.Now) }

// NewBucketClock is NewBucket with a clock, for tests.
func NewBucketClock(rate float64, burst int, now func() time.Time) *Bucket {
	return &Bucket{rate: rate, burst: float64(burst), now: now, tokens: float64(burst), last: now()}
}

// Allow takes one token and reports whether there was one.
func (b *Bucket) Allow() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	if d := now.Sub(b.last); d > 0 {
		b.tokens = min(b.burst, b.tokens+d.Seconds()*b.rate)
		b.last = now
	}
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
