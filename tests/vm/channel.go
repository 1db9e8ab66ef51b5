package vm

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The result channel (guest ttyS1) carries the scenario's output and frames that /init
// writes at the start of a line:
//
//	@@PVT@@ <nonce> INIT <uptime>
//	@@PVT@@ <nonce> SETUP <uptime>
//	@@PVT@@ <nonce> END <rc> <stage> <uptime>
//
// A line is a frame only if it carries this boot's nonce, which the scenario never sees;
// anything else, including forged frames with a wrong nonce, is output.
const framePrefix = "@@PVT@@ "

// Caps on what is kept from a guest, so a runaway guest cannot exhaust the host.
const (
	maxOutput    = 8 << 20
	maxConsole   = 4 << 20
	maxLineBytes = 64 << 10
)

// frameKind is the type of a result-channel frame.
type frameKind int

const (
	frameInit frameKind = iota + 1
	frameSetup
	frameEnd
)

// frame is one parsed result-channel frame.
type frame struct {
	kind   frameKind
	rc     int
	stage  string
	uptime time.Duration
}

// parseFrame parses line as a frame of this boot; ok is false for ordinary output.
func parseFrame(line, nonce string) (frame, bool) {
	rest, ok := strings.CutPrefix(line, framePrefix+nonce+" ")
	if !ok || nonce == "" {
		return frame{}, false
	}
	f := strings.Fields(rest)
	if len(f) == 0 {
		return frame{}, false
	}
	var fr frame
	var up string
	switch {
	case f[0] == "INIT" && len(f) == 2:
		fr.kind, up = frameInit, f[1]
	case f[0] == "SETUP" && len(f) == 2:
		fr.kind, up = frameSetup, f[1]
	case f[0] == "END" && len(f) == 4:
		rc, err := strconv.Atoi(f[1])
		if err != nil || rc < 0 || rc > 255 {
			return frame{}, false
		}
		fr.kind, fr.rc, fr.stage, up = frameEnd, rc, f[2], f[3]
	default:
		return frame{}, false
	}
	secs, err := strconv.ParseFloat(up, 64)
	if err != nil || !(secs >= 0 && secs <= 1e7) { // also rejects NaN
		return frame{}, false
	}
	fr.uptime = time.Duration(secs * float64(time.Second))
	return fr, true
}

// capBuffer keeps at most max bytes; when full it drops the oldest half (and says so).
type capBuffer struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	max     int
	dropped int
}

func (c *capBuffer) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.buf.Write(p)
	if c.buf.Len() > c.max {
		drop := c.buf.Len() - c.max/2
		c.dropped += drop
		c.buf.Next(drop)
	}
	return len(p), nil
}

func (c *capBuffer) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dropped > 0 {
		return "[... " + strconv.Itoa(c.dropped) + " bytes dropped ...]\n" + c.buf.String()
	}
	return c.buf.String()
}

// readLines calls fn for each line of r (without "\n" and "\r"), splitting overlong lines
// into pieces of maxLineBytes, until r ends.
func readLines(r io.Reader, fn func(line string)) error {
	br := bufio.NewReaderSize(r, maxLineBytes)
	for {
		b, err := br.ReadSlice('\n')
		if len(b) > 0 {
			fn(strings.TrimRight(string(b), "\r\n"))
		}
		switch {
		case err == nil, errors.Is(err, bufio.ErrBufferFull):
		case errors.Is(err, io.EOF):
			return nil
		default:
			return err
		}
	}
}
