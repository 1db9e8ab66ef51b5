package pcidev_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
)

// TestStateRoundTrip: what the client wrote (command register, BAR
// addresses, MSI-X control and table) survives SaveState/RestoreState into
// a new function, and read-only bits stay the new function's own.
func TestStateRoundTrip(t *testing.T) {
	var regs regFile
	cfg := pvrdmaLike(&regs)
	changes := 0
	cfg.StateChanged = func() { changes++ }
	a := newFn(t, cfg)
	wr32(t, a, cfgRegion, 0x10, 0xfebf0000) // BAR0
	wr32(t, a, cfgRegion, 0x14, 0xfebf4000) // BAR1
	wr(t, a, cfgRegion, 0x04, 0x06, 0x01)   // memory, bus master, SERR
	msixCtl := uint64(0x42)
	for off := uint64(0x40); off < 0x100; off += 4 {
		if rd32(t, a, cfgRegion, off)&0xff == 0x11 {
			msixCtl = off + 2
			break
		}
	}
	wr(t, a, cfgRegion, msixCtl, 0x02, 0x80) // enable
	wr32(t, a, 0, 16+8, 0x4021)              // vector 1 data
	assert.Positive(t, changes, "StateChanged runs after client writes")
	saved := a.SaveState()

	b := newFn(t, pvrdmaLike(&regs))
	require.NoError(t, b.RestoreState(saved))
	assert.Equal(t, rd(t, a, cfgRegion, 0, 256), rd(t, b, cfgRegion, 0, 256))
	assert.True(t, b.BusMaster())
	assert.True(t, b.MemoryEnabled())
	assert.Equal(t, uint32(0x4021), rd32(t, b, 0, 16+8))
	assert.Equal(t, saved, b.SaveState())

	// Read-only bits are never taken from a state: a forged vendor ID
	// and BAR size bits are ignored.
	forged := append([]byte(nil), saved...)
	forged[16] = 0xee
	forged[16+0x10] = 0xff
	c := newFn(t, pvrdmaLike(&regs))
	require.NoError(t, c.RestoreState(forged))
	assert.Equal(t, uint32(0x15ad), rd32(t, c, cfgRegion, 0)&0xffff)
	assert.Equal(t, uint32(0xfebf0000), rd32(t, c, cfgRegion, 0x10))

	// A state of another layout or version is refused.
	for name, bad := range map[string][]byte{
		"empty":     nil,
		"short":     saved[:20],
		"magic":     append([]byte{1}, saved[1:]...),
		"version":   append(append(append([]byte(nil), saved[:4]...), 9, 0), saved[6:]...),
		"truncated": saved[:len(saved)-1],
		"longer":    append(append([]byte(nil), saved...), 0),
	} {
		assert.ErrorIs(t, c.RestoreState(bad), pcidev.ErrState, name)
	}
	noMSIX := pvrdmaLike(&regs)
	noMSIX.MSIX = nil
	assert.ErrorIs(t, newFn(t, noMSIX).RestoreState(saved), pcidev.ErrState)
}

// FuzzRestoreState: any bytes are refused or taken, never a panic, and a
// state taken saves back to a state that is taken again identically.
func FuzzRestoreState(f *testing.F) {
	var regs regFile
	fn, err := pcidev.New(nil, pvrdmaLike(&regs))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(fn.SaveState())
	f.Fuzz(func(t *testing.T, b []byte) {
		fn, err := pcidev.New(nil, pvrdmaLike(&regs))
		require.NoError(t, err)
		if fn.RestoreState(b) != nil {
			return
		}
		s := fn.SaveState()
		fn2, _ := pcidev.New(nil, pvrdmaLike(&regs))
		require.NoError(t, fn2.RestoreState(s))
		require.True(t, bytes.Equal(s, fn2.SaveState()))
	})
}
