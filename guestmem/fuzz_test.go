package guestmem

import (
	"testing"
)

// FuzzAccess drives ReadAt/WriteAt/PageList with arbitrary addresses and
// lengths against a memory with holes: nothing may panic, and a successful
// access must lie inside mapped memory.
func FuzzAccess(f *testing.F) {
	f.Add(uint64(0x1000), uint64(16), uint64(0x1ff0), uint64(0x20), uint8(0))
	f.Add(^uint64(0), uint64(2), uint64(0), uint64(0), uint8(1))
	f.Add(uint64(0x2ff8), uint64(0x10), uint64(0x7ff8), uint64(0x1010), uint8(2))
	f.Fuzz(func(t *testing.T, gpa, n, iova, length uint64, op uint8) {
		m := New()
		_ = m.Add(Bytes(0x1000, make([]byte, 0x2000), ProtRead|ProtWrite))
		_ = m.Add(Bytes(0x8000, make([]byte, 0x1000), ProtRead))
		n %= 0x10000
		buf := make([]byte, n)
		var err error
		switch op % 4 {
		case 0:
			err = m.ReadAt(buf, GPA(gpa))
		case 1:
			err = m.WriteAt(buf, GPA(gpa))
		case 2:
			_, err = m.FetchAddUint64(GPA(gpa), n)
		case 3:
			pages := make([]GPA, min(n/8, 64))
			for i := range pages {
				pages[i] = GPA((gpa + uint64(i)*0x1000) &^ 0xfff)
			}
			pl, perr := NewPageList(iova, length%0x40000, pages)
			if perr == nil {
				err = pl.ReadAt(m, buf, iova)
			}
		}
		if err == nil && op%4 < 2 && n > 0 {
			end := gpa + n
			inA := gpa >= 0x1000 && end <= 0x3000 && end > gpa
			inB := op%4 == 0 && gpa >= 0x8000 && end <= 0x9000 && end > gpa
			if !inA && !inB {
				t.Fatalf("access %#x+%#x op %d succeeded outside mapped memory", gpa, n, op%4)
			}
		}
	})
}
