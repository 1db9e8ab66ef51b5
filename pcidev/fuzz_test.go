package pcidev_test

import (
	"testing"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
)

// FuzzAccesses applies arbitrary config-space and BAR accesses (as the
// server passes them on: inside the region, any size and alignment) and
// interrupt requests to a PVRDMA-shaped function. Nothing may panic, and
// the read-only parts of the config space must not change.
//
// Input, repeated: u8 op | u8 region | u16 offset | u8 length | data.
func FuzzAccesses(f *testing.F) {
	f.Add([]byte{1, 7, 4, 0, 2, 0x06, 0x01, 1, 7, 0x42, 0, 2, 0x02, 0xc0, 0, 0, 0, 0x20, 4, 2, 0, 0, 0})
	f.Add([]byte{1, 7, 0x10, 0, 4, 0xff, 0xff, 0xff, 0xff, 1, 7, 0x18, 0, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{1, 0, 0xfc, 0x1f, 8, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0xfc, 0x1f, 16, 3, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		regs := &regFile{}
		fn := newFn(t, pvrdmaLike(regs))
		sizes := fn.Describe().Regions
		before := rd(t, fn, cfgRegion, 0, 256)
		for len(data) >= 5 {
			op, region := data[0], uint32(data[1]%9)
			off := uint64(data[2]) | uint64(data[3])<<8
			n := int(data[4]%64) + 1
			data = data[5:]
			if uint64(off)+uint64(n) > sizes[region].Size {
				continue // the server refuses these before the device sees them
			}
			switch op % 4 {
			case 0:
				p := make([]byte, n)
				if err := fn.ReadRegion(region, off, p); err != nil {
					t.Fatalf("read region %d %#x+%d: %v", region, off, n, err)
				}
			case 1:
				p := make([]byte, n)
				copy(p, data)
				data = data[min(n, len(data)):]
				if err := fn.WriteRegion(region, off, p); err != nil {
					t.Fatalf("write region %d %#x+%d: %v", region, off, n, err)
				}
			case 2:
				_ = fn.TriggerMSIX(int(off % 5))
			case 3:
				_ = fn.Reset(vfiouser.ResetClient)
			}
		}
		after := rd(t, fn, cfgRegion, 0, 256)
		for _, ro := range [][2]int{{0, 4}, {8, 4}, {0x2c, 4}, {0x34, 1}, {0x3d, 1}, {0x40, 2}, {0x44, 8}} {
			if string(before[ro[0]:ro[0]+ro[1]]) != string(after[ro[0]:ro[0]+ro[1]]) {
				t.Fatalf("read-only config bytes %#x+%d changed: % x -> % x", ro[0], ro[1], before[ro[0]:ro[0]+ro[1]], after[ro[0]:ro[0]+ro[1]])
			}
		}
		if after[0x10]&0xf != 0 || after[0x18]&0xf != 0x4 || le.Uint16(after[6:])&pcidev.StatusCapList == 0 {
			t.Fatalf("BAR type bits or status changed: % x", after[0x10:0x1c])
		}
	})
}
