package vm

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path"
	"sort"
)

// libDirs are the directories the guest's dynamic loader searches (Debian multiarch
// layout), relative to the unpacked root.
var libDirs = []string{
	"lib/x86_64-linux-gnu",
	"usr/lib/x86_64-linux-gnu",
	"lib64",
	"usr/lib64",
	"lib",
	"usr/lib",
}

// isELF reports whether the host file starts with the ELF magic.
func isELF(hostPath string) bool {
	f, err := os.Open(hostPath)
	if err != nil {
		return false
	}
	defer f.Close()
	var magic [4]byte
	_, err = f.ReadAt(magic[:], 0)
	return err == nil && string(magic[:]) == elf.ELFMAG
}

// elfClosure computes the shared-library closure of the given ELF files (paths relative
// to root): it follows PT_INTERP and DT_NEEDED, resolving each name in libDirs of the
// unpacked tree. It returns a map from guest library path (e.g.
// "usr/lib/x86_64-linux-gnu/libc.so.6") to the host file holding its content, with
// symlinks resolved. A NEEDED name that cannot be found is an error: the image would not
// run, so it must be fixed at build time.
func elfClosure(root string, roots []string) (map[string]string, error) {
	libs := map[string]string{}
	seen := map[string]bool{}
	queue := append([]string(nil), roots...)
	for len(queue) > 0 {
		rel := queue[0]
		queue = queue[1:]
		if seen[rel] {
			continue
		}
		seen[rel] = true
		host, err := resolveIn(root, rel)
		if err != nil {
			return nil, fmt.Errorf("resolve %s: %w", rel, err)
		}
		needed, interp, err := elfNeeds(host)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", rel, err)
		}
		if interp != "" {
			ihost, err := resolveIn(root, interp)
			if err != nil {
				return nil, fmt.Errorf("%s: interpreter %s: %w", rel, interp, err)
			}
			libs[stripSlash(interp)] = ihost
		}
		for _, name := range needed {
			found := ""
			for _, dir := range libDirs {
				cand := path.Join(dir, name)
				if h, err := resolveIn(root, cand); err == nil {
					if st, err := os.Stat(h); err == nil && st.Mode().IsRegular() {
						found = cand
						libs[multiarchPath(name)] = h
						break
					}
				}
			}
			if found == "" {
				return nil, fmt.Errorf("%s needs %s, which no unpacked package provides", rel, name)
			}
			queue = append(queue, found)
		}
	}
	return libs, nil
}

// multiarchPath is where the initramfs keeps every shared library.
func multiarchPath(soname string) string { return path.Join("usr/lib/x86_64-linux-gnu", soname) }

func stripSlash(p string) string {
	for len(p) > 0 && p[0] == '/' {
		p = p[1:]
	}
	return p
}

// elfNeeds returns an ELF file's DT_NEEDED entries and its PT_INTERP, if any.
func elfNeeds(hostPath string) (needed []string, interp string, err error) {
	f, err := elf.Open(hostPath)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				return nil, "", fmt.Errorf("read PT_INTERP: %w", err)
			}
			for len(b) > 0 && b[len(b)-1] == 0 {
				b = b[:len(b)-1]
			}
			interp = string(b)
		}
	}
	needed, err = f.ImportedLibraries()
	if err != nil && !errors.Is(err, elf.ErrNoSymbols) {
		return nil, "", err
	}
	sort.Strings(needed)
	return needed, interp, nil
}
