package vfiouser

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Holding a server: for a hand-over to another process, every connection
// stops taking messages at a message boundary. A connection waiting for its
// next message is woken (a read deadline in the past; with whole-message
// reads nothing is consumed), one in the middle of a message finishes it
// and answers it first. The client's next requests wait in the socket,
// where the next process (or this one, after Release) reads them.

// holdGate is the server's hold state.
type holdGate struct {
	mu      sync.Mutex
	held    bool
	release chan struct{} // closed by Release
	parked  map[*conn]bool
	changed chan struct{} // signalled when a connection parks
}

// Hold stops every connection at its next message boundary and returns
// once all are parked (connections that arrive meanwhile park at once), or
// with ctx's error, still holding. Release undoes it.
func (s *Server) Hold(ctx context.Context) error {
	g := &s.gate
	g.mu.Lock()
	if !g.held {
		g.held = true
		g.release = make(chan struct{})
		g.parked = map[*conn]bool{}
		g.changed = make(chan struct{}, 1)
	}
	g.mu.Unlock()
	for {
		s.mu.Lock()
		conns := make([]*conn, 0, len(s.conns))
		for c := range s.conns {
			conns = append(conns, c)
		}
		s.mu.Unlock()
		g.mu.Lock()
		waiting := 0
		for _, c := range conns {
			if !g.parked[c] {
				waiting++
				_ = c.t.setReadDeadline(time.Now()) // wake it if it waits for a message
			}
		}
		ch := g.changed
		g.mu.Unlock()
		if waiting == 0 {
			return nil
		}
		select {
		case <-ch:
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			return fmt.Errorf("vfio-user: %d connections still busy: %w", waiting, ctx.Err())
		}
	}
}

// Release lets held connections take messages again.
func (s *Server) Release() {
	g := &s.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held {
		g.held = false
		close(g.release)
		g.parked = nil
	}
}

// park blocks the connection while the server is held, unless it is in
// the middle of a message (which it finishes first). woken says the last
// read ended at a deadline: one Hold set, to be cleared if the hold is
// over or the connection must finish a message. It returns false when the
// connection must end.
func (c *conn) park(g *holdGate, woken bool) bool {
	g.mu.Lock()
	held := g.held
	g.mu.Unlock()
	partial := false
	if held {
		<-c.tok // the reader is the token holder's
		partial = c.rd.w != c.rd.r
		c.tok <- struct{}{}
	}
	g.mu.Lock()
	if !g.held || partial {
		g.mu.Unlock()
		if woken {
			_ = c.t.setReadDeadline(time.Time{})
		}
		return true
	}
	rel := g.release
	g.parked[c] = true
	select {
	case g.changed <- struct{}{}:
	default:
	}
	g.mu.Unlock()
	select {
	case <-rel:
	case <-c.closed:
		return false
	}
	_ = c.t.setReadDeadline(time.Time{})
	return true
}
