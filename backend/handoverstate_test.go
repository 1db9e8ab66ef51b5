package backend

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestHandoverStateRoundTrip: the state a predecessor writes is read back
// whole, from a sealed memfd that nobody can change afterwards.
func TestHandoverStateRoundTrip(t *testing.T) {
	in := handoverState{VMs: map[string]handedVM{
		"a": {PCI: []byte{1, 2, 3}, Counters: map[string]uint64{"doorbells": 7}},
		"b": {},
	}}
	fd, err := writeHandoverState(in)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fd), "state")
	defer f.Close()
	_, err = unix.Write(fd, []byte("x"))
	require.ErrorIs(t, err, unix.EPERM, "the memfd is sealed against writes")
	out, err := readHandoverState(f)
	require.NoError(t, err)
	require.Equal(t, handoverStateVersion, out.Version)
	require.Equal(t, in.VMs, out.VMs)
}

// TestHandoverStateRefused: a state of another version, or one that does
// not parse, is refused (the successor then reads the VMs' files).
func TestHandoverStateRefused(t *testing.T) {
	for name, content := range map[string]string{
		"version": `{"version":2,"vms":{}}`,
		"garbage": `{"version":1,"vms":`,
		"empty":   ``,
	} {
		p := filepath.Join(t.TempDir(), name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		f, err := os.Open(p)
		require.NoError(t, err)
		_, err = readHandoverState(f)
		f.Close()
		require.Error(t, err, name)
	}
}

// FuzzReadHandoverState: whatever the memfd holds, reading it fails or
// gives a state of this version, never a panic.
func FuzzReadHandoverState(f *testing.F) {
	f.Add([]byte(`{"version":1,"vms":{"a":{"pci":"AQID","counters":{"doorbells":7}}}}`))
	f.Add([]byte(`{"version":1,"vms":null}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(t.TempDir(), "state")
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		fh, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer fh.Close()
		st, err := readHandoverState(fh)
		if err == nil && st.Version != handoverStateVersion {
			t.Fatalf("version %d accepted", st.Version)
		}
	})
}
