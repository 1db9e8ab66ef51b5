package main

import (
	"fmt"
	"io"
	"strings"
)

// lines keeps a bounded excerpt of a test's output: its first head lines and its last
// tail lines, and how many lines there were in all.
type lines struct {
	head, tail []string
	maxHead    int
	maxTail    int
	next       int // where the next tail line goes once tail is full
	total      int
	partial    string // a line not yet ended by a newline
}

func newLines(head, tail int) *lines {
	return &lines{maxHead: head, maxTail: tail}
}

// write adds output, which may hold several lines or part of one.
func (b *lines) write(s string) {
	s = b.partial + s
	b.partial = ""
	for s != "" {
		i := strings.IndexByte(s, '\n')
		if i < 0 {
			b.partial = s
			return
		}
		b.add(s[:i])
		s = s[i+1:]
	}
}

func (b *lines) add(l string) {
	b.total++
	if len(b.head) < b.maxHead {
		b.head = append(b.head, l)
		return
	}
	if b.maxTail <= 0 {
		return
	}
	if len(b.tail) < b.maxTail {
		b.tail = append(b.tail, l)
		return
	}
	b.tail[b.next] = l
	b.next = (b.next + 1) % b.maxTail
}

// flush ends a partial last line.
func (b *lines) flush() {
	if b.partial != "" {
		p := b.partial
		b.partial = ""
		b.add(p)
	}
}

// dump writes the excerpt, each line after prefix, with a note where lines were left
// out that names the file holding all of them.
func (b *lines) dump(w io.Writer, prefix, whole string) {
	b.flush()
	for _, l := range b.head {
		fmt.Fprintf(w, "%s%s\n", prefix, l)
	}
	if left := b.total - len(b.head) - len(b.tail); left > 0 {
		fmt.Fprintf(w, "%s... %d lines left out (all in %s) ...\n", prefix, left, whole)
	}
	for i := range b.tail {
		fmt.Fprintf(w, "%s%s\n", prefix, b.tail[(b.next+i)%len(b.tail)])
	}
}
