package vfiouser

import (
	"encoding/binary"
	"fmt"
)

// Wire format of every vfio-user message (vfio-user spec, "Header"): a
// 16-byte header in host byte order (little-endian here) followed by a
// command-specific payload.
//
//	 0      2        4             8         12          16
//	+------+--------+-------------+---------+-----------+----------
//	|msg id|command | message size|  flags  |   error   | payload
//	+------+--------+-------------+---------+-----------+----------
//
// Message size counts the whole message including the header. Flags bits
// 0-3 are the type (0 command, 1 reply), bit 4 No_reply, bit 5 Error. Error
// replies carry the header only, with an errno in the error field.

// HeaderSize is the size of the message header.
const HeaderSize = 16

const (
	hdrOffID      = 0
	hdrOffCommand = 2
	hdrOffSize    = 4
	hdrOffFlags   = 8
	hdrOffError   = 12
)

// Command is a vfio-user command code (vfio-user spec, "Commands").
type Command uint16

// Commands of protocol version 0.0.
const (
	CmdVersion             Command = 1
	CmdDMAMap              Command = 2
	CmdDMAUnmap            Command = 3
	CmdDeviceGetInfo       Command = 4
	CmdDeviceGetRegionInfo Command = 5
	CmdGetRegionIOFDs      Command = 6
	CmdDeviceGetIRQInfo    Command = 7
	CmdDeviceSetIRQs       Command = 8
	CmdRegionRead          Command = 9
	CmdRegionWrite         Command = 10
	CmdDMARead             Command = 11 // server -> client
	CmdDMAWrite            Command = 12 // server -> client
	CmdDeviceReset         Command = 13
	CmdRegionWriteMulti    Command = 15
	CmdDeviceFeature       Command = 16
	CmdMigDataRead         Command = 17
	CmdMigDataWrite        Command = 18
)

var commandNames = [...]string{
	CmdVersion:             "VERSION",
	CmdDMAMap:              "DMA_MAP",
	CmdDMAUnmap:            "DMA_UNMAP",
	CmdDeviceGetInfo:       "DEVICE_GET_INFO",
	CmdDeviceGetRegionInfo: "DEVICE_GET_REGION_INFO",
	CmdGetRegionIOFDs:      "DEVICE_GET_REGION_IO_FDS",
	CmdDeviceGetIRQInfo:    "DEVICE_GET_IRQ_INFO",
	CmdDeviceSetIRQs:       "DEVICE_SET_IRQS",
	CmdRegionRead:          "REGION_READ",
	CmdRegionWrite:         "REGION_WRITE",
	CmdDMARead:             "DMA_READ",
	CmdDMAWrite:            "DMA_WRITE",
	CmdDeviceReset:         "DEVICE_RESET",
	CmdRegionWriteMulti:    "REGION_WRITE_MULTI",
	CmdDeviceFeature:       "DEVICE_FEATURE",
	CmdMigDataRead:         "MIG_DATA_READ",
	CmdMigDataWrite:        "MIG_DATA_WRITE",
}

func (c Command) String() string {
	if int(c) < len(commandNames) && commandNames[c] != "" {
		return commandNames[c]
	}
	return fmt.Sprintf("Command(%d)", uint16(c))
}

// Header flags.
const (
	// FlagTypeMask selects the message type bits.
	FlagTypeMask uint32 = 0xf
	// FlagCommand is the type of a command message.
	FlagCommand uint32 = 0x0
	// FlagReply is the type of a reply message.
	FlagReply uint32 = 0x1
	// FlagNoReply on a command asks for no reply (a posted write).
	FlagNoReply uint32 = 0x10
	// FlagError on a reply marks a failed command; Error holds the errno.
	FlagError uint32 = 0x20

	knownFlags = FlagTypeMask | FlagNoReply | FlagError
)

// Header is a decoded message header.
type Header struct {
	ID      uint16
	Command Command
	Size    uint32 // whole message, header included
	Flags   uint32
	Error   uint32 // errno, meaningful in replies with FlagError
}

// DecodeHeader decodes the first HeaderSize bytes of b, which must be at
// least that long.
func DecodeHeader(b []byte) Header {
	_ = b[HeaderSize-1]
	return Header{
		ID:      binary.LittleEndian.Uint16(b[hdrOffID:]),
		Command: Command(binary.LittleEndian.Uint16(b[hdrOffCommand:])),
		Size:    binary.LittleEndian.Uint32(b[hdrOffSize:]),
		Flags:   binary.LittleEndian.Uint32(b[hdrOffFlags:]),
		Error:   binary.LittleEndian.Uint32(b[hdrOffError:]),
	}
}

// Encode writes h into the first HeaderSize bytes of b.
func (h Header) Encode(b []byte) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint16(b[hdrOffID:], h.ID)
	binary.LittleEndian.PutUint16(b[hdrOffCommand:], uint16(h.Command))
	binary.LittleEndian.PutUint32(b[hdrOffSize:], h.Size)
	binary.LittleEndian.PutUint32(b[hdrOffFlags:], h.Flags)
	binary.LittleEndian.PutUint32(b[hdrOffError:], h.Error)
}

// Type returns the message type bits.
func (h Header) Type() uint32 { return h.Flags & FlagTypeMask }

// IsReply reports whether h is a reply.
func (h Header) IsReply() bool { return h.Type() == FlagReply }

// NoReply reports whether a command asks for no reply.
func (h Header) NoReply() bool { return h.Flags&FlagNoReply != 0 }

func (h Header) String() string {
	kind := "cmd"
	if h.IsReply() {
		kind = "reply"
	}
	return fmt.Sprintf("%s %s id=%d size=%d flags=%#x err=%d", kind, h.Command, h.ID, h.Size, h.Flags, h.Error)
}

// PCI region indexes (VFIO's VFIO_PCI_*_REGION_INDEX).
const (
	RegionBAR0   = 0
	RegionBAR5   = 5
	RegionROM    = 6
	RegionConfig = 7
	RegionVGA    = 8
	// NumPCIRegions is the number of standard PCI regions.
	NumPCIRegions = 9
)

// IRQIndex is a VFIO PCI interrupt type (VFIO_PCI_*_IRQ_INDEX).
type IRQIndex uint32

// PCI interrupt indexes.
const (
	IRQINTx IRQIndex = 0
	IRQMSI  IRQIndex = 1
	IRQMSIX IRQIndex = 2
	IRQErr  IRQIndex = 3
	IRQReq  IRQIndex = 4
	// NumPCIIRQs is the number of standard PCI interrupt indexes.
	NumPCIIRQs = 5
)

func (i IRQIndex) String() string {
	switch i {
	case IRQINTx:
		return "INTx"
	case IRQMSI:
		return "MSI"
	case IRQMSIX:
		return "MSI-X"
	case IRQErr:
		return "ERR"
	case IRQReq:
		return "REQ"
	}
	return fmt.Sprintf("IRQIndex(%d)", uint32(i))
}
