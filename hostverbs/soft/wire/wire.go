// Package wire holds the ways the soft transport's packets travel: the
// Wire interface the fabric sends and receives RoCE datagrams through, and
// its implementations: UDPWire (IP mode: UDP sockets with segmentation
// offload, the default), KernelWire (IP mode: raw sockets, one packet per
// slot of each system call), PacketWire (L2 mode: Ethernet frames on a bridge, RoCE v1
// and v2, 802.1Q tags) and MemNet (an in-memory network with seeded
// impairments, for tests).
package wire

import (
	"context"
	"errors"
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Wire carries RoCE v2 datagrams between a Fabric and the network. The
// kernel implementations (NewUDPWire, NewKernelWire) send and receive UDP
// 4791 through the host's IP stack; MemNet connects fabrics in memory with
// injectable loss, reordering and duplication for deterministic tests.
type Wire interface {
	// Transmit sends the datagrams, in order, and returns how many were
	// accepted. A datagram the network refuses (too large for the path,
	// no route) is skipped and reported through the error; Transmit does
	// not retain the slices, but may rewrite an IPv4 datagram's ID with
	// its header checksum and ICRC (UDPWire sends the IDs Linux assigns).
	Transmit(pkts []Datagram) (int, error)
	// Queues is the number of independent receive queues (sockets); the
	// fabric runs one receive goroutine per queue.
	Queues() int
	// Receive blocks until at least one datagram arrives on queue and
	// returns how many it got, k: datagram i is out[i] (i < k), a whole IP
	// datagram, which is either bufs[i] (each a buffer of MaxDatagram
	// bytes that the caller owns) cut to its length, or a view of the
	// wire's own memory (UDPWire hands packets on where the kernel put
	// them). Both stay valid until the queue's next Receive or TryReceive.
	// It returns an error once the wire is closed or ctx is done. Each
	// queue has at most one caller at a time.
	Receive(ctx context.Context, queue int, bufs, out [][]byte) (int, error)
	// Close releases the wire and unblocks Receive.
	Close() error
}

// PollingWire is implemented by wires that can check a queue without
// blocking: the receive loop drains what is already there before it
// sends the ACKs its work produced.
type PollingWire interface {
	// TryReceive is Receive that returns 0 at once if nothing is queued.
	TryReceive(queue int, bufs, out [][]byte) (int, error)
}

// CountingWire is implemented by wires that keep statistics of their own
// (system calls, coalescing, drops before a datagram exists); the fabric
// reports them with its counters.
type CountingWire interface {
	// Counters adds the wire's statistics to m.
	Counters(m map[string]uint64)
}

// ICRCCheckingWire is implemented by wires that check the ICRC of every
// datagram themselves (they must, to rebuild headers the kernel did not
// deliver): Receive returns only datagrams whose ICRC checked, and counts
// the others as "drop_bad_icrc" in its Counters, so the fabric does not
// compute it a second time.
type ICRCCheckingWire interface {
	// ChecksICRC reports that the wire checks every datagram's ICRC.
	ChecksICRC() bool
}

// LinkWire is implemented by wires that carry Ethernet frames: the
// fabric hands a captured datagram only to the device whose MAC the frame
// was addressed to, and such a wire carries RoCE v1 as well as v2.
type LinkWire interface {
	// Frame describes the frame that carried datagram i of the batch the
	// last Receive (or TryReceive) on queue returned.
	Frame(queue, i int) FrameInfo
}

// FrameInfo is what a link wire knows of a received frame beyond its
// datagram.
type FrameInfo struct {
	// DstMAC is the frame's destination MAC.
	DstMAC [6]byte
	// RoCEv1 is set for an Ethertype 0x8915 frame: the datagram is a
	// GRH-framed RoCE v1 packet, not an IP datagram.
	RoCEv1 bool
}

// Datagram is one outgoing RoCE packet.
type Datagram struct {
	// Packet is an IPv4 or IPv6 datagram carrying UDP port 4791, ICRC
	// included; for RoCE v1, the GRH-framed packet.
	Packet []byte
	// RoCEv1 marks a RoCE v1 packet, which only link wires carry (in an
	// Ethertype 0x8915 frame).
	RoCEv1 bool
	// SrcMAC and DstMAC are the link addresses of the sending device and
	// of the AV's destination, for wires that build Ethernet frames; IP
	// wires ignore them.
	SrcMAC, DstMAC [6]byte
}

// BatchSize is the most datagrams one Receive returns or one Transmit
// system call carries: the wires size their scratch to it.
const BatchSize = 64

// ErrOversize is what a Wire returns for a datagram larger than the path
// allows (EMSGSIZE).
var ErrOversize = errors.New("datagram exceeds the path MTU")

// MaxDatagram bounds every datagram a Fabric sends or accepts: a 4096-byte
// path MTU plus the largest header set.
const MaxDatagram = 4096 + 128

// waitError is the error of a failed wait for a receive socket (the wire
// named name): ErrClosed once the wire's closed channel is, else err.
func waitError(name string, closed <-chan struct{}, err error) error {
	select {
	case <-closed:
		return fmt.Errorf("%s: %w", name, hostverbs.ErrClosed)
	default:
	}
	return fmt.Errorf("%s: receive: %w", name, err)
}
