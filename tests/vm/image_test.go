package vm

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseAptSimulation(t *testing.T) {
	out := []byte(`NOTE: This is only a simulation!
Reading package lists...
Inst gcc-14-base (14.2.0-19 Debian:13.7/stable [amd64])
Inst libc6 (2.41-12+deb13u4 Debian:13.7/stable [amd64]) []
Inst libaudit-common (1:4.0.2-2+deb13u1 Debian:13.7/stable [all])
Inst qemu-system-x86 [1:7.2] (1:11.1.3+ds-1~bpo13+1 Debian Backports:stable-backports [amd64])
Conf libc6 (2.41-12+deb13u4 Debian:13.7/stable [amd64])
`)
	pkgs, err := parseAptSimulation(out)
	require.NoError(t, err)
	require.Equal(t, []Package{
		{Name: "gcc-14-base", Version: "14.2.0-19", Arch: "amd64"},
		{Name: "libaudit-common", Version: "1:4.0.2-2+deb13u1", Arch: "all"},
		{Name: "libc6", Version: "2.41-12+deb13u4", Arch: "amd64"},
		{Name: "qemu-system-x86", Version: "1:11.1.3+ds-1~bpo13+1", Arch: "amd64"},
	}, pkgs)
	require.Equal(t, "libaudit-common_1%3a4.0.2-2+deb13u1_all.deb", pkgs[1].debFile())

	_, err = parseAptSimulation([]byte("Inst broken line\n"))
	require.Error(t, err)
	_, err = parseAptSimulation([]byte("nothing\n"))
	require.Error(t, err)
}

func TestComponentKey(t *testing.T) {
	a := newComponent("/c", "qemu", "r1", []string{"a=1:amd64", "b=2:all"})
	b := newComponent("/c", "qemu", "r1", []string{"a=1:amd64", "b=2:all"})
	c := newComponent("/c", "qemu", "r1", []string{"a=1:amd64", "b=3:all"})
	d := newComponent("/c", "qemu", "r2", []string{"a=1:amd64", "b=2:all"})
	require.Equal(t, a, b)
	require.NotEqual(t, a.key, c.key, "a version change changes the key")
	require.NotEqual(t, a.key, d.key, "a recipe change changes the key")
	require.Equal(t, filepath.Join("/c", "qemu", a.key), a.dir)
}

func TestComponentBuildIsAtomic(t *testing.T) {
	dir := t.TempDir()
	c := newComponent(dir, "kernel", "r", nil)
	err := c.build(func(tmp string) error {
		require.NoError(t, os.WriteFile(filepath.Join(tmp, "half"), []byte("x"), 0o644))
		return os.ErrInvalid
	})
	require.Error(t, err)
	require.False(t, c.exists(), "a failed build leaves nothing")
	ents, _ := os.ReadDir(filepath.Join(dir, "kernel"))
	require.Empty(t, ents, "and no temporary directory")

	require.NoError(t, c.build(func(tmp string) error {
		return os.WriteFile(filepath.Join(tmp, "vmlinux"), []byte("x"), 0o644)
	}))
	require.True(t, c.exists())
	require.FileExists(t, filepath.Join(c.dir, "vmlinux"))
}

func TestDefaultCacheDir(t *testing.T) {
	t.Setenv(EnvCacheDir, "")
	t.Setenv("XDG_CACHE_HOME", "")
	require.Equal(t, "/var/cache/pvrdma-backend", DefaultCacheDir())
	t.Setenv("XDG_CACHE_HOME", "/x")
	require.Equal(t, "/x/pvrdma-backend", DefaultCacheDir())
	t.Setenv(EnvCacheDir, "/y")
	require.Equal(t, "/y", DefaultCacheDir())
}

func TestCleanMemberAndResolveIn(t *testing.T) {
	for in, want := range map[string]string{"./usr/bin/x": "usr/bin/x", "./": "", "usr//lib/": "usr/lib"} {
		got, ok := cleanMember(in)
		require.True(t, ok, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"../etc/passwd", "./usr/../../x", "a/.."} {
		_, ok := cleanMember(bad)
		require.False(t, ok, bad)
	}

	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/lib/x86_64-linux-gnu"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "usr/lib/x86_64-linux-gnu/libfoo.so.1.2"), nil, 0o644))
	require.NoError(t, os.Symlink("libfoo.so.1.2", filepath.Join(root, "usr/lib/x86_64-linux-gnu/libfoo.so.1")))
	require.NoError(t, os.Symlink("usr/lib", filepath.Join(root, "lib")))
	require.NoError(t, os.Symlink("/usr/lib/x86_64-linux-gnu/libfoo.so.1", filepath.Join(root, "abs")))
	require.NoError(t, os.Symlink("../../../../../../etc/passwd", filepath.Join(root, "escape")))
	for _, rel := range []string{"lib/x86_64-linux-gnu/libfoo.so.1", "abs"} {
		got, err := resolveIn(root, rel)
		require.NoError(t, err, rel)
		require.Equal(t, filepath.Join(root, "usr/lib/x86_64-linux-gnu/libfoo.so.1.2"), got, rel)
	}
	got, err := resolveIn(root, "escape")
	if err == nil {
		require.Equal(t, filepath.Join(root, "etc/passwd"), got, "a symlink cannot leave the root")
	}
}

func TestUsrMerged(t *testing.T) {
	for in, want := range map[string]string{
		"bin/busybox": "usr/bin/busybox", "/sbin/ip": "usr/sbin/ip", "lib64/ld-linux-x86-64.so.2": "usr/lib64/ld-linux-x86-64.so.2",
		"lib/modules/x/y.ko": "usr/lib/modules/x/y.ko", "usr/bin/ls": "usr/bin/ls", "etc/hosts": "etc/hosts",
		"/var/run/x": "run/x", "library/x": "library/x",
	} {
		require.Equal(t, want, usrMerged(in), in)
	}
}

func TestConfigValidate(t *testing.T) {
	img := &Image{Modules: []string{"ib_core", "ib_uverbs", "vmw_pvrdma", "rdma_rxe"}}
	ok := Config{Name: "a1", NICs: []NIC{{Addr: "05.0", MAC: "52:54:00:77:00:01", IP: "10.77.0.1/24"}},
		Files: map[string][]byte{"/usr/bin/helper": nil}}
	require.NoError(t, ok.validate(img))
	for name, c := range map[string]Config{
		"name":      {Name: "A b"},
		"mem":       {Name: "a", MemMiB: 64},
		"module":    {Name: "a", Modules: []string{"nope"}},
		"badmodule": {Name: "a", Modules: []string{"x;reboot"}},
		"model":     {Name: "a", NICs: []NIC{{Model: "e1000"}}},
		"addr":      {Name: "a", NICs: []NIC{{Addr: "5"}}},
		"mac":       {Name: "a", NICs: []NIC{{MAC: "52:54:00"}}},
		"dupmac":    {Name: "a", NICs: []NIC{{MAC: "52:54:00:00:00:01"}, {MAC: "52:54:00:00:00:01"}}},
		"ip":        {Name: "a", NICs: []NIC{{IP: "10.77.0.1"}}},
		"relpath":   {Name: "a", Files: map[string][]byte{"usr/bin/x": nil}},
		"init":      {Name: "a", Files: map[string][]byte{"/init": nil}},
		"dotdot":    {Name: "a", HostFiles: map[string]string{"/usr/../init": "/bin/true"}},
		"pvt":       {Name: "a", Files: map[string][]byte{"/etc/pvt/config": nil}},
	} {
		require.Error(t, c.validate(img), name)
	}
}
