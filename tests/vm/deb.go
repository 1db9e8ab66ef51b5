package vm

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
)

// errStopExtract, returned by an extract filter, ends the extraction early (successfully).
var errStopExtract = errors.New("stop extraction")

// debFilter decides per archive member (clean relative path, e.g. "usr/bin/ls") whether to
// extract it; it may return errStopExtract to stop reading the archive.
type debFilter func(name string, hdr *tar.Header) (bool, error)

// extractDeb unpacks a .deb's data archive into root (like dpkg-deb -x, but with a filter)
// and returns the relative paths of the members it extracted. dpkg-deb does the
// decompression; the tar stream is read here so that paths are checked and members can be
// chosen.
func extractDeb(ctx context.Context, deb, root string, filter debFilter) ([]string, error) {
	cmd := exec.CommandContext(ctx, "dpkg-deb", "--fsys-tarfile", deb)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("dpkg-deb %s: %w", filepath.Base(deb), err)
	}
	names, xerr := extractTar(pipe, root, filter)
	if errors.Is(xerr, errStopExtract) {
		xerr = nil
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return names, nil
	}
	// Drain so that dpkg-deb is not killed by SIGPIPE on trailing padding.
	_, _ = io.Copy(io.Discard, pipe)
	werr := cmd.Wait()
	if xerr != nil {
		return nil, fmt.Errorf("unpack %s: %w", filepath.Base(deb), xerr)
	}
	if werr != nil {
		return nil, fmt.Errorf("dpkg-deb %s: %w: %s", filepath.Base(deb), werr, lastLines(stderr.String(), 5))
	}
	return names, nil
}

// extractTar unpacks a tar stream below root. Members are cleaned and must stay inside
// root; directories, regular files, symlinks and hard links are supported, devices are
// skipped.
func extractTar(r io.Reader, root string, filter debFilter) ([]string, error) {
	tr := tar.NewReader(r)
	var names []string
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return names, nil
		}
		if err != nil {
			return names, err
		}
		name, ok := cleanMember(hdr.Name)
		if !ok {
			return names, fmt.Errorf("unsafe archive member %q", hdr.Name)
		}
		if name == "" {
			continue
		}
		if filter != nil {
			want, err := filter(name, hdr)
			if err != nil {
				return names, err
			}
			if !want {
				continue
			}
		}
		dst := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return names, err
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return names, err
			}
		case tar.TypeReg:
			if err := writeMember(dst, tr, os.FileMode(hdr.Mode)&0o7777); err != nil {
				return names, err
			}
		case tar.TypeSymlink:
			os.Remove(dst)
			if err := os.Symlink(hdr.Linkname, dst); err != nil {
				return names, err
			}
		case tar.TypeLink:
			target, ok := cleanMember(hdr.Linkname)
			if !ok || target == "" {
				return names, fmt.Errorf("unsafe hard link %q -> %q", hdr.Name, hdr.Linkname)
			}
			os.Remove(dst)
			if err := os.Link(filepath.Join(root, target), dst); err != nil {
				return names, err
			}
		default:
			continue
		}
		names = append(names, name)
	}
}

func writeMember(dst string, r io.Reader, mode os.FileMode) error {
	os.Remove(dst)
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode|0o200)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// cleanMember turns "./usr/bin/x" into "usr/bin/x"; ok is false for paths that would
// leave the extraction root.
func cleanMember(name string) (string, bool) {
	for _, part := range strings.Split(name, "/") {
		if part == ".." {
			return "", false
		}
	}
	c := strings.TrimPrefix(path.Clean("/"+name), "/")
	return c, true
}

// resolveIn resolves a path inside an unpacked tree, following symlinks (absolute ones
// relative to root) without ever leaving root. It returns the host path of the final
// target.
func resolveIn(root, rel string) (string, error) {
	cur := ""
	parts := strings.Split(strings.TrimPrefix(path.Clean("/"+rel), "/"), "/")
	for hops := 0; len(parts) > 0; {
		p := parts[0]
		parts = parts[1:]
		if p == "" || p == "." {
			continue
		}
		if p == ".." {
			cur = path.Dir(cur)
			if cur == "." || cur == "/" {
				cur = ""
			}
			continue
		}
		next := path.Join(cur, p)
		fi, err := os.Lstat(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			cur = next
			continue
		}
		if hops++; hops > 40 {
			return "", fmt.Errorf("%s: too many symlinks", rel)
		}
		target, err := os.Readlink(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(target, "/") {
			cur = ""
		}
		parts = append(strings.Split(strings.Trim(target, "/"), "/"), parts...)
	}
	return filepath.Join(root, cur), nil
}
