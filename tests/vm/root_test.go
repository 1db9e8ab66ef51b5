package vm

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// fakeRoot makes a merged-/usr root with an /sbin/init symlink, as debootstrap does.
func fakeRoot(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for _, d := range []string{"usr/lib", "usr/sbin", "etc"} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, d), 0o755))
	}
	require.NoError(t, os.Symlink("usr/lib", filepath.Join(root, "lib")))
	require.NoError(t, os.Symlink("usr/sbin", filepath.Join(root, "sbin")))
	require.NoError(t, os.Symlink("/lib/systemd/systemd", filepath.Join(root, "usr/sbin/init")))
	return root
}

// TestInstallRoot: the kernel's modules and the test's files land inside the root,
// through its own relative symlinks, and a symlink out of the root is refused.
func TestInstallRoot(t *testing.T) {
	cache := t.TempDir()
	img := &Image{Kernel: filepath.Join(cache, "kernel", "k1", "vmlinux"), KernelABI: "6.1.0-1-amd64"}
	mods := img.modulesDir()
	require.NoError(t, os.MkdirAll(filepath.Join(mods, "kernel/fs/9p"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(mods, "kernel/fs/9p/9p.ko"), []byte("ko"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(mods, "modules.dep"), []byte("dep"), 0o600))
	host := filepath.Join(t.TempDir(), "helper")
	require.NoError(t, os.WriteFile(host, []byte("#!/bin/sh\n"), 0o750))

	root := fakeRoot(t)
	cfg := Config{Name: "r1", Root: root,
		Files:     map[string][]byte{"/etc/x/y.conf": []byte("y")},
		HostFiles: map[string]string{"/usr/bin/helper": host}}
	require.NoError(t, cfg.validateRoot(nil))
	require.NoError(t, installRoot(img, &cfg))
	b, err := os.ReadFile(filepath.Join(root, "usr/lib/modules/6.1.0-1-amd64/kernel/fs/9p/9p.ko"))
	require.NoError(t, err, "lib/modules resolves to usr/lib/modules inside the root")
	require.Equal(t, "ko", string(b))
	st, err := os.Stat(filepath.Join(root, "usr/lib/modules/6.1.0-1-amd64/modules.dep"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o644), st.Mode().Perm())
	st, err = os.Stat(filepath.Join(root, "etc/x/y.conf"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), st.Mode().Perm(), "Files are mode 0755")
	st, err = os.Stat(filepath.Join(root, "usr/bin/helper"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o750), st.Mode().Perm(), "HostFiles keep their mode")

	// A symlink that leaves the root is not followed.
	outside := t.TempDir()
	require.NoError(t, os.Symlink(outside, filepath.Join(root, "escape")))
	cfg.Files = map[string][]byte{"/escape/x": []byte("x")}
	cfg.HostFiles = nil
	require.Error(t, installRoot(img, &cfg))
	_, err = os.Stat(filepath.Join(outside, "x"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestValidateRoot(t *testing.T) {
	img := &Image{Modules: append(DefaultModules(), rootModules...)}
	root := fakeRoot(t)
	require.NoError(t, (&Config{Name: "a", Root: root}).validate(img))
	require.ErrorContains(t, (&Config{Name: "a", Root: "rel/root"}).validate(img), "absolute")
	require.ErrorContains(t, (&Config{Name: "a", Root: t.TempDir()}).validate(img), "no /sbin/init")
	require.ErrorContains(t, (&Config{Name: "a", Root: root}).validate(&Image{Modules: DefaultModules()}), "module virtio_pci")
	require.ErrorContains(t, (&Config{Name: "a", Root: root, Launch: func(Boot) (*exec.Cmd, error) { return nil, nil }}).validate(img), "Launch")
}
