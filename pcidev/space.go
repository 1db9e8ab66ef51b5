package pcidev

import "encoding/binary"

// Type-0 configuration header (PCI Local Bus Spec 3.0, figure 6-1):
//
//	0x00 vendor ID      0x02 device ID
//	0x04 command        0x06 status
//	0x08 revision       0x09 class code (prog-if, subclass, class)
//	0x0c cache line     0x0d latency timer  0x0e header type  0x0f BIST
//	0x10..0x27 BAR0..BAR5
//	0x28 CardBus CIS    0x2c subsystem vendor ID  0x2e subsystem ID
//	0x30 expansion ROM  0x34 capabilities pointer
//	0x3c interrupt line 0x3d interrupt pin  0x3e min_gnt  0x3f max_lat
const (
	offVendorID    = 0x00
	offDeviceID    = 0x02
	offCommand     = 0x04
	offStatus      = 0x06
	offRevision    = 0x08
	offClassCode   = 0x09
	offCacheLine   = 0x0c
	offLatency     = 0x0d
	offHeaderType  = 0x0e
	offBAR0        = 0x10
	offSubVendorID = 0x2c
	offSubsystemID = 0x2e
	offROM         = 0x30
	offCapPtr      = 0x34
	offIntLine     = 0x3c
	offIntPin      = 0x3d
)

// Command register bits.
const (
	CommandIO           uint16 = 1 << 0
	CommandMemory       uint16 = 1 << 1
	CommandBusMaster    uint16 = 1 << 2
	CommandParity       uint16 = 1 << 6
	CommandSERR         uint16 = 1 << 8
	CommandINTxDisable  uint16 = 1 << 10
	commandWritableBits        = CommandIO | CommandMemory | CommandBusMaster | CommandParity | CommandSERR | CommandINTxDisable
)

// Status register bits.
const (
	StatusINTx    uint16 = 1 << 3
	StatusCapList uint16 = 1 << 4
	// Error bits, write-one-to-clear: master data parity error, signaled
	// and received target abort, received master abort, signaled system
	// error, detected parity error.
	statusRW1C uint16 = 0xf900
)

// BAR low bits.
const (
	barIO           = 0x1
	barMem64        = 0x4
	barPrefetchable = 0x8
)

// MSI-X capability (MSI-X ECN): ID, next, message control (table size - 1
// in bits 0-10, function mask bit 14, enable bit 15), table offset | BIR,
// PBA offset | BIR.
const (
	capIDMSIX      = 0x11
	msixCapSize    = 12
	msixCtrlEnable = 1 << 15
	msixCtrlMask   = 1 << 14
)

// configSpace holds the bytes of the configuration space with, per byte,
// the bits the guest may write and the bits it clears by writing ones.
// Accesses of any size and alignment inside the space go byte by byte
// through the masks, which makes BAR sizing, read-only IDs and RW1C status
// bits fall out of one rule.
type configSpace struct {
	size  int
	b     [extConfigSize]byte
	wmask [extConfigSize]byte
	w1c   [extConfigSize]byte
	init  [extConfigSize]byte
	// msix is the offset of the MSI-X capability, 0 without one.
	msix int
}

func (s *configSpace) put16(off int, v uint16) { binary.LittleEndian.PutUint16(s.b[off:], v) }
func (s *configSpace) put32(off int, v uint32) { binary.LittleEndian.PutUint32(s.b[off:], v) }
func (s *configSpace) u16(off int) uint16      { return binary.LittleEndian.Uint16(s.b[off:]) }

func (s *configSpace) mask16(off int, m uint16) { binary.LittleEndian.PutUint16(s.wmask[off:], m) }
func (s *configSpace) mask32(off int, m uint32) { binary.LittleEndian.PutUint32(s.wmask[off:], m) }

// buildSpace lays out the header and capability list for cfg (validated).
func buildSpace(cfg *Config) *configSpace {
	s := &configSpace{size: stdConfigSize}
	if cfg.ExtendedConfig {
		s.size = extConfigSize
	}
	s.put16(offVendorID, cfg.VendorID)
	s.put16(offDeviceID, cfg.DeviceID)
	s.mask16(offCommand, commandWritableBits)
	binary.LittleEndian.PutUint16(s.w1c[offStatus:], statusRW1C)
	s.b[offRevision] = cfg.Revision
	s.b[offClassCode] = byte(cfg.ClassCode)
	s.b[offClassCode+1] = byte(cfg.ClassCode >> 8)
	s.b[offClassCode+2] = byte(cfg.ClassCode >> 16)
	s.wmask[offCacheLine] = 0xff
	s.wmask[offLatency] = 0xff
	s.b[offHeaderType] = 0 // type 0, single function as far as we know (QEMU owns multifunction)
	for i := 0; i < 6; i++ {
		b := &cfg.BARs[i]
		off := offBAR0 + 4*i
		switch b.Type {
		case BARIO:
			s.put32(off, barIO)
			s.mask32(off, ^uint32(b.Size-1)&^0x3)
		case BARMem32, BARMem64:
			low := uint32(0)
			if b.Type == BARMem64 {
				low |= barMem64
			}
			if b.Prefetchable {
				low |= barPrefetchable
			}
			s.put32(off, low)
			s.mask32(off, uint32(^(b.Size-1))&^0xf)
			if b.Type == BARMem64 {
				s.mask32(off+4, uint32(^(b.Size-1)>>32))
				i++
			}
		}
	}
	s.put16(offSubVendorID, cfg.SubVendorID)
	s.put16(offSubsystemID, cfg.SubDeviceID)
	// No expansion ROM: the ROM BAR reads 0 and ignores writes, so sizing
	// finds nothing (QEMU probes it this way).
	s.wmask[offIntLine] = 0xff
	s.b[offIntPin] = cfg.IntPin

	// Capability list from 0x40, each entry dword aligned.
	next := capStart
	prev := offCapPtr
	link := func(at int) {
		s.b[prev] = byte(at)
		prev = at + 1
	}
	if x := cfg.MSIX; x != nil {
		at := next
		link(at)
		s.b[at] = capIDMSIX
		s.put16(at+2, uint16(x.Vectors-1))
		s.mask16(at+2, msixCtrlEnable|msixCtrlMask)
		s.put32(at+4, x.TableOffset|uint32(x.BAR))
		s.put32(at+8, x.PBAOffset|uint32(x.BAR))
		s.msix = at
		next += msixCapSize
	}
	for _, cp := range cfg.Capabilities {
		at := next
		link(at)
		s.b[at] = cp.ID
		copy(s.b[at+2:], cp.Data)
		copy(s.wmask[at+2:], cp.WriteMask)
		next += alignUp(2+len(cp.Data), 4)
	}
	if next != capStart {
		s.put16(offStatus, StatusCapList)
	}
	s.init = s.b
	return s
}

// read copies [off, off+len(p)) into p; the caller checked the range.
func (s *configSpace) read(off int, p []byte) { copy(p, s.b[off:off+len(p)]) }

// write applies p at off through the write and RW1C masks.
func (s *configSpace) write(off int, p []byte) {
	for i, v := range p {
		o := off + i
		cur := s.b[o]
		cur = cur&^s.wmask[o] | v&s.wmask[o]
		cur &^= v & s.w1c[o]
		s.b[o] = cur
	}
}

// reset returns every register to its power-on value.
func (s *configSpace) reset() { s.b = s.init }

// overlaps reports whether [off, off+n) touches [reg, reg+size).
func overlaps(off, n, reg, size int) bool { return off < reg+size && reg < off+n }
