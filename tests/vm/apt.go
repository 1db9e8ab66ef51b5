package vm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// aptRoot is a private apt state (sources, lists, archives, an empty dpkg status) under the
// cache. It downloads .debs of another suite without touching the host's apt or dpkg
// state, so trixie packages are never installed on the bookworm host.
type aptRoot struct {
	dir     string
	sources []string // sources.list lines
	logf    func(string, ...any)
}

// Package is one exact Debian package (name, version, architecture).
type Package struct {
	Name    string `json:"name"`
	Version string `json:"version"`
	Arch    string `json:"arch"`
}

func (p Package) String() string { return p.Name + "=" + p.Version + ":" + p.Arch }

// debFile is the file name apt gives the package in its archives directory.
func (p Package) debFile() string {
	return p.Name + "_" + strings.ReplaceAll(p.Version, ":", "%3a") + "_" + p.Arch + ".deb"
}

func (a *aptRoot) archives() string { return filepath.Join(a.dir, "cache", "archives") }
func (a *aptRoot) lists() string    { return filepath.Join(a.dir, "lists") }

func (a *aptRoot) prepare() error {
	for _, d := range []string{
		filepath.Join(a.lists(), "partial"),
		filepath.Join(a.archives(), "partial"),
		filepath.Join(a.dir, "etc"),
	} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	status := filepath.Join(a.dir, "status")
	if _, err := os.Stat(status); err != nil {
		if err := os.WriteFile(status, nil, 0o644); err != nil {
			return err
		}
	}
	src := strings.Join(a.sources, "\n") + "\n"
	return os.WriteFile(filepath.Join(a.dir, "etc", "sources.list"), []byte(src), 0o644)
}

func (a *aptRoot) opts() []string {
	return []string{
		"-o", "Dir::Etc::sourcelist=" + filepath.Join(a.dir, "etc", "sources.list"),
		"-o", "Dir::Etc::sourceparts=-",
		"-o", "Dir::State::Lists=" + a.lists(),
		"-o", "Dir::State::status=" + filepath.Join(a.dir, "status"),
		"-o", "Dir::Cache=" + filepath.Join(a.dir, "cache"),
		"-o", "APT::Install-Recommends=0",
		"-o", "APT::Install-Suggests=0",
		"-o", "APT::Sandbox::User=root",
		// Debian mirrors may serve frozen snapshots whose Release files have expired.
		"-o", "Acquire::Check-Valid-Until=false",
		"-o", "Acquire::Languages=none",
		"-o", "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false",
		"-o", "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false",
		"-o", "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false",
		"-o", "Acquire::Retries=3",
		"-o", "Debug::NoLocking=1",
	}
}

func (a *aptRoot) run(ctx context.Context, dir, tool string, args ...string) ([]byte, error) {
	full := append(a.opts(), args...)
	cmd := exec.CommandContext(ctx, tool, full...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", tool, strings.Join(args, " "), err, lastLines(stderr.String(), 10))
	}
	return out, nil
}

// hasLists reports whether the package indices have been fetched before.
func (a *aptRoot) hasLists() bool {
	m, _ := filepath.Glob(filepath.Join(a.lists(), "*_Packages*"))
	return len(m) > 0
}

// update fetches the package indices (the only step besides downloads that uses the
// network).
func (a *aptRoot) update(ctx context.Context) error {
	if err := a.prepare(); err != nil {
		return fmt.Errorf("apt root %s: %w", a.dir, err)
	}
	a.logf("apt-get update (%s)", filepath.Base(a.dir))
	_, err := a.run(ctx, a.dir, "apt-get", "-q", "update")
	return err
}

// resolve returns the exact packages apt would download for `install pkgs` into an empty
// system, from the cached indices (no network).
func (a *aptRoot) resolve(ctx context.Context, pkgs []string) ([]Package, error) {
	out, err := a.run(ctx, a.dir, "apt-get", append([]string{"-s", "install"}, pkgs...)...)
	if err != nil {
		return nil, err
	}
	res, err := parseAptSimulation(out)
	if err != nil {
		return nil, fmt.Errorf("resolve %v: %w", pkgs, err)
	}
	return res, nil
}

// aptInstRE matches `apt-get -s` lines such as
// "Inst libc6 (2.41-12+deb13u4 Debian:13.7/stable [amd64]) []" or, for an upgrade,
// "Inst libc6 [2.36-9] (2.41-12 Debian:13.7/stable [amd64])".
var aptInstRE = regexp.MustCompile(`^Inst (\S+) (?:\[[^\]]*\] )?\((\S+) [^()]*\[([a-z0-9]+)\]\)`)

// parseAptSimulation extracts the packages of the "Inst" lines of `apt-get -s install`.
func parseAptSimulation(out []byte) ([]Package, error) {
	var res []Package
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "Inst ") {
			continue
		}
		m := aptInstRE.FindStringSubmatch(line)
		if m == nil {
			return nil, fmt.Errorf("unexpected apt line %q", line)
		}
		res = append(res, Package{Name: m[1], Version: m[2], Arch: m[3]})
	}
	if len(res) == 0 {
		return nil, errors.New("apt resolved no packages")
	}
	sort.Slice(res, func(i, j int) bool { return res[i].Name < res[j].Name })
	return res, nil
}

// fetch downloads the given exact packages (no dependency resolution) into the archives
// directory, skipping the ones already there, and returns their paths.
func (a *aptRoot) fetch(ctx context.Context, pkgs []Package) ([]string, error) {
	var missing []string
	paths := make([]string, len(pkgs))
	for i, p := range pkgs {
		paths[i] = filepath.Join(a.archives(), p.debFile())
		if _, err := os.Stat(paths[i]); err != nil {
			missing = append(missing, p.Name+"="+p.Version)
		}
	}
	if len(missing) > 0 {
		a.logf("downloading %d packages (%s)", len(missing), filepath.Base(a.dir))
		if err := a.download(ctx, missing); err != nil {
			return nil, err
		}
	}
	for _, p := range paths {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("apt download left no %s", filepath.Base(p))
		}
	}
	return paths, nil
}

// download runs apt-get download for name=version pins. When a pinned version is not in
// the indices it fetches them once more (they may be older than the lock); if the mirror
// still does not serve it, the error names every pin it lacks and the command that moves
// the pins.
func (a *aptRoot) download(ctx context.Context, pins []string) error {
	_, err := a.run(ctx, a.archives(), "apt-get", append([]string{"-q", "download"}, pins...)...)
	if err == nil {
		return nil
	}
	unserved, cerr := a.unserved(ctx, pins)
	if cerr != nil || len(unserved) == 0 {
		return err
	}
	a.logf("%d pinned packages are not in the cached indices (%s): fetching them again", len(unserved), filepath.Base(a.dir))
	if uerr := a.update(ctx); uerr != nil {
		return fmt.Errorf("%w (and updating the indices failed: %v)", err, uerr)
	}
	if _, err = a.run(ctx, a.archives(), "apt-get", append([]string{"-q", "download"}, pins...)...); err == nil {
		return nil
	}
	if unserved, cerr = a.unserved(ctx, pins); cerr == nil && len(unserved) > 0 {
		return fmt.Errorf("the mirror (%s) no longer serves %d package versions the test bed lock pins: %s; %s",
			strings.Join(a.sources, "; "), len(unserved), strings.Join(unserved, " "), updateHint)
	}
	return err
}

// unserved returns the name=version pins whose version the indices do not have.
func (a *aptRoot) unserved(ctx context.Context, pins []string) ([]string, error) {
	var out []string
	for _, pin := range pins {
		name, version, _ := strings.Cut(pin, "=")
		vs, err := a.candidates(ctx, name)
		if err != nil {
			return nil, err
		}
		if !contains(vs, version) {
			out = append(out, pin)
		}
	}
	return out, nil
}

// candidates returns the versions of pkg in the indices, newest first.
func (a *aptRoot) candidates(ctx context.Context, pkg string) ([]string, error) {
	out, err := a.run(ctx, a.dir, "apt-cache", "madison", pkg)
	if err != nil {
		return nil, err
	}
	var vs []string
	seen := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(line, "|")
		if len(f) < 3 || strings.TrimSpace(f[0]) != pkg {
			continue
		}
		v := strings.TrimSpace(f[1])
		if !seen[v] {
			seen[v] = true
			vs = append(vs, v)
		}
	}
	return vs, nil
}

// names returns the package names that start with prefix.
func (a *aptRoot) names(ctx context.Context, prefix string) ([]string, error) {
	out, err := a.run(ctx, a.dir, "apt-cache", "pkgnames", prefix)
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(out)), nil
}

// lastLines returns at most n trailing lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
