package vm

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"
)

// The initramfs is an uncompressed "newc" cpio archive (the SVR4 format without CRC,
// magic 070701), the format the kernel unpacks (Documentation/driver-api/early-userspace/
// buffer-format.rst). Each member is a 110-byte ASCII header of 13 eight-digit hex fields,
// the NUL-terminated name padded to a multiple of 4, then the data padded to 4.
const (
	cpioMagic     = "070701"
	cpioHeaderLen = 110
	cpioTrailer   = "TRAILER!!!"
)

// File type bits of the cpio mode field (same as st_mode).
const (
	modeDir     = 0o040000
	modeRegular = 0o100000
	modeSymlink = 0o120000
	modeCharDev = 0o020000
	modeTypeMsk = 0o170000
)

// cpioWriter writes a newc archive. Names are written without a leading slash; every
// member gets its own inode number and nlink 1, so the kernel never treats members as
// hard links even when several archives are concatenated.
type cpioWriter struct {
	w      *bufio.Writer
	ino    uint32
	dirs   map[string]bool
	err    error
	closed bool
}

func newCPIOWriter(w io.Writer) *cpioWriter {
	return &cpioWriter{w: bufio.NewWriterSize(w, 1<<16), ino: 1, dirs: map[string]bool{"": true}}
}

// cpioName normalises a member name: no leading slash, cleaned, and "" for the root.
func cpioName(name string) string {
	c := strings.TrimPrefix(path.Clean("/"+name), "/")
	if c == "." {
		return ""
	}
	return c
}

// header writes one member header and its name.
func (c *cpioWriter) header(name string, mode uint32, size int, rdevMajor, rdevMinor uint32) {
	if c.err != nil {
		return
	}
	if c.closed {
		c.err = errors.New("cpio: write after close")
		return
	}
	nlink := uint32(1)
	if mode&modeTypeMsk == modeDir {
		nlink = 2
	}
	fields := []uint32{c.ino, mode, 0, 0, nlink, 0, uint32(size), 0, 0, rdevMajor, rdevMinor, uint32(len(name) + 1), 0}
	c.ino++
	var b strings.Builder
	b.Grow(cpioHeaderLen + len(name) + 4)
	b.WriteString(cpioMagic)
	for _, f := range fields {
		fmt.Fprintf(&b, "%08x", f)
	}
	b.WriteString(name)
	b.WriteByte(0)
	for n := cpioHeaderLen + len(name) + 1; n%4 != 0; n++ {
		b.WriteByte(0)
	}
	_, c.err = c.w.WriteString(b.String())
}

func (c *cpioWriter) pad(n int) {
	if c.err != nil {
		return
	}
	if r := n % 4; r != 0 {
		_, c.err = c.w.Write(make([]byte, 4-r))
	}
}

// mkdirAll writes directory members for every missing parent of name, and name itself.
func (c *cpioWriter) mkdirAll(name string, perm uint32) {
	name = cpioName(name)
	if c.dirs[name] {
		return
	}
	c.mkdirAll(path.Dir(name), 0o755) // "." for top-level names, which is the root
	c.dirs[name] = true
	c.header(name, modeDir|perm&0o7777, 0, 0, 0)
}

func (c *cpioWriter) parents(name string) {
	if d := path.Dir(name); d != "." && d != "" {
		c.mkdirAll(d, 0o755)
	}
}

// file writes a regular file with the given content.
func (c *cpioWriter) file(name string, perm uint32, data []byte) error {
	name = cpioName(name)
	c.parents(name)
	c.header(name, modeRegular|perm&0o7777, len(data), 0, 0)
	if c.err == nil {
		_, c.err = c.w.Write(data)
	}
	c.pad(len(data))
	return c.err
}

// copyFile writes a regular file whose content comes from a host file.
func (c *cpioWriter) copyFile(name string, perm uint32, hostPath string) error {
	data, err := os.ReadFile(hostPath)
	if err != nil {
		return err
	}
	return c.file(name, perm, data)
}

// symlink writes a symbolic link.
func (c *cpioWriter) symlink(name, target string) error {
	name = cpioName(name)
	c.parents(name)
	c.header(name, modeSymlink|0o777, len(target), 0, 0)
	if c.err == nil {
		_, c.err = c.w.WriteString(target)
	}
	c.pad(len(target))
	return c.err
}

// charDev writes a character device node.
func (c *cpioWriter) charDev(name string, perm, major, minor uint32) error {
	name = cpioName(name)
	c.parents(name)
	c.header(name, modeCharDev|perm&0o7777, 0, major, minor)
	return c.err
}

// close writes the trailer and flushes.
func (c *cpioWriter) close() error {
	if c.closed {
		return c.err
	}
	c.header(cpioTrailer, 0, 0, 0, 0)
	c.closed = true
	if c.err == nil {
		c.err = c.w.Flush()
	}
	return c.err
}

// cpioEntry is one member as read back by readCPIO (tests and inspection).
type cpioEntry struct {
	Name  string
	Mode  uint32
	Data  []byte
	Major uint32
	Minor uint32
}

// readCPIO parses a (possibly concatenated) newc archive. It validates every header and
// length and never allocates more than the input holds.
func readCPIO(b []byte) ([]cpioEntry, error) {
	var out []cpioEntry
	off := 0
	for off < len(b) {
		// Archives may be followed by zero padding.
		if b[off] == 0 {
			off++
			continue
		}
		if len(b)-off < cpioHeaderLen {
			return out, fmt.Errorf("cpio: short header at %d", off)
		}
		h := b[off : off+cpioHeaderLen]
		if string(h[:6]) != cpioMagic {
			return out, fmt.Errorf("cpio: bad magic %q at %d", h[:6], off)
		}
		var f [13]uint32
		for i := range f {
			var v uint32
			if _, err := fmt.Sscanf(string(h[6+8*i:14+8*i]), "%08x", &v); err != nil {
				return out, fmt.Errorf("cpio: bad field %d at %d: %w", i, off, err)
			}
			f[i] = v
		}
		mode, size, rmaj, rmin, nameLen := f[1], int(f[6]), f[9], f[10], int(f[11])
		if nameLen < 1 || nameLen > 4096 {
			return out, fmt.Errorf("cpio: bad name length %d at %d", nameLen, off)
		}
		nameEnd := off + cpioHeaderLen + nameLen
		if nameEnd > len(b) {
			return out, fmt.Errorf("cpio: truncated name at %d", off)
		}
		name := string(b[off+cpioHeaderLen : nameEnd-1])
		dataOff := align4(nameEnd)
		if size < 0 || dataOff > len(b) || size > len(b)-dataOff {
			return out, fmt.Errorf("cpio: truncated data of %q", name)
		}
		off = align4(dataOff + size)
		if name == cpioTrailer {
			continue
		}
		out = append(out, cpioEntry{Name: name, Mode: mode, Data: b[dataOff : dataOff+size], Major: rmaj, Minor: rmin})
	}
	return out, nil
}

func align4(n int) int { return (n + 3) &^ 3 }

// sortedKeys returns the keys of m in order (for reproducible archives).
func sortedKeys[K ~string, V any](m map[K]V) []K {
	keys := make([]K, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
