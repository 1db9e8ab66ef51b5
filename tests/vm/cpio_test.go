package vm

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCPIOWriterRoundTrip(t *testing.T) {
	var b bytes.Buffer
	w := newCPIOWriter(&b)
	require.NoError(t, w.file("/usr/bin/tool", 0o755, []byte("hello")))
	require.NoError(t, w.symlink("bin", "usr/bin"))
	require.NoError(t, w.charDev("dev/console", 0o600, 5, 1))
	require.NoError(t, w.file("etc/empty", 0o644, nil))
	require.NoError(t, w.close())
	require.Zero(t, b.Len()%4, "members are 4-byte aligned")

	ents, err := readCPIO(b.Bytes())
	require.NoError(t, err)
	var names []string
	byName := map[string]cpioEntry{}
	for _, e := range ents {
		names = append(names, e.Name)
		byName[e.Name] = e
	}
	// Parents come before children, each once; the root is never written.
	require.Equal(t, []string{"usr", "usr/bin", "usr/bin/tool", "bin", "dev", "dev/console", "etc", "etc/empty"}, names)
	require.Equal(t, uint32(modeRegular|0o755), byName["usr/bin/tool"].Mode)
	require.Equal(t, "hello", string(byName["usr/bin/tool"].Data))
	require.Equal(t, uint32(modeSymlink|0o777), byName["bin"].Mode)
	require.Equal(t, "usr/bin", string(byName["bin"].Data))
	require.Equal(t, uint32(modeCharDev|0o600), byName["dev/console"].Mode)
	require.Equal(t, [2]uint32{5, 1}, [2]uint32{byName["dev/console"].Major, byName["dev/console"].Minor})
	require.Equal(t, uint32(modeDir|0o755), byName["usr"].Mode)

	// The header of the first member, field by field (newc: magic + 13 x %08x).
	h := b.String()[:cpioHeaderLen]
	require.Equal(t, "070701", h[:6])
	require.Equal(t, fmt.Sprintf("%08x", modeDir|0o755), h[14:22], "mode")
	require.Equal(t, fmt.Sprintf("%08x", len("usr")+1), h[94:102], "namesize counts the NUL")
	require.Contains(t, b.String(), cpioTrailer+"\x00", "trailer")
}

func TestCPIOConcatenated(t *testing.T) {
	var b bytes.Buffer
	for i := 0; i < 2; i++ {
		w := newCPIOWriter(&b)
		require.NoError(t, w.file("f", 0o644, []byte{byte('a' + i)}))
		require.NoError(t, w.close())
	}
	ents, err := readCPIO(b.Bytes())
	require.NoError(t, err)
	var data []string
	for _, e := range ents {
		if e.Name == "f" {
			data = append(data, string(e.Data))
		}
	}
	require.Equal(t, []string{"a", "b"}, data, "later archives override earlier ones in order")
}

func TestCPIOWriteAfterClose(t *testing.T) {
	w := newCPIOWriter(&bytes.Buffer{})
	require.NoError(t, w.close())
	require.Error(t, w.file("x", 0o644, nil))
}

func TestReadCPIORejectsGarbage(t *testing.T) {
	var b bytes.Buffer
	w := newCPIOWriter(&b)
	require.NoError(t, w.file("x", 0o644, []byte("data")))
	require.NoError(t, w.close())
	good := b.Bytes()
	for _, bad := range [][]byte{
		good[:50],                             // short header
		append([]byte("070702"), good[6:]...), // bad magic
		good[:cpioHeaderLen+3],                // truncated name
	} {
		_, err := readCPIO(bad)
		require.Error(t, err)
	}
	huge := append([]byte(nil), good...)
	copy(huge[6+8*6:], "7fffffff") // file size beyond the input
	_, err := readCPIO(huge)
	require.Error(t, err)
}

func FuzzReadCPIO(f *testing.F) {
	var b bytes.Buffer
	w := newCPIOWriter(&b)
	_ = w.file("usr/bin/x", 0o755, []byte("abc"))
	_ = w.symlink("bin", "usr/bin")
	_ = w.close()
	f.Add(b.Bytes())
	f.Fuzz(func(t *testing.T, data []byte) {
		ents, err := readCPIO(data)
		if err != nil {
			return
		}
		// What parses must survive a rewrite.
		var out bytes.Buffer
		w := newCPIOWriter(&out)
		for _, e := range ents {
			if e.Mode&modeTypeMsk == modeRegular {
				_ = w.file(e.Name, e.Mode, e.Data)
			}
		}
		if err := w.close(); err != nil {
			t.Fatal(err)
		}
		if _, err := readCPIO(out.Bytes()); err != nil {
			t.Fatalf("rewritten archive does not parse: %v", err)
		}
	})
}
