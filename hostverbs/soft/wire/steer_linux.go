//go:build linux

package wire

// Spreading the UDP wire's receiving over several sockets: the port 4791
// sockets of a family form one SO_REUSEPORT group, and a classic BPF
// program attached to the group (SO_ATTACH_REUSEPORT_CBPF) picks the
// socket of each datagram from its destination address and BTH
// destination QP, so that every packet for one QP (requests, ACKs, CNPs)
// queues on one socket and is handled, in order, by one of the fabric's
// receive goroutines.

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
	"golang.org/x/sys/unix"
)

// maxQueuesPerFamily bounds UDPWireConfig.QueuesPerFamily.
const maxQueuesPerFamily = 64

// steerProgram returns the classic BPF program that picks, among the n
// sockets of a family's reuseport group, the one a datagram queues on:
//
//	index = (the destination address's last 32 bits + the BTH's destination QP) mod n
//
// For a UDP socket the kernel runs it with the packet's data starting at
// the UDP payload, the BTH (run_bpf_filter in net/core/sock_reuseport.c
// pulls the UDP header; a GRO super-packet starts with its first
// segment's); the address is read through the network header
// (SKF_NET_OFF). A datagram too short for the loads makes the program
// return 0, the first socket. The index is always below n; should the
// group hold fewer sockets (one closed), the kernel picks by its own hash
// for indices past the end.
func steerProgram(v6 bool, n int) []unix.SockFilter {
	dst := uint32(16) // IPv4 destination address
	if v6 {
		dst = 24 + 12 // the IPv6 destination's last 32 bits
	}
	const skfNetOff = 0xfff00000 // SKF_NET_OFF (-0x100000) as the 32-bit offset the loads take
	return []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: skfNetOff + dst},
		{Code: unix.BPF_MISC | unix.BPF_TAX},
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 4}, // BTH bytes 4..7: reserved, destination QP
		{Code: unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, K: 0x00ffffff},
		{Code: unix.BPF_ALU | unix.BPF_ADD | unix.BPF_X},
		{Code: unix.BPF_ALU | unix.BPF_MOD | unix.BPF_K, K: uint32(n)},
		{Code: unix.BPF_RET | unix.BPF_A},
	}
}

// attachSteering sets steerProgram for n sockets on the reuseport group
// of fd, replacing the group's program (a predecessor's, for another n).
func attachSteering(fd int, v6 bool, n int) error {
	prog := steerProgram(v6, n)
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_REUSEPORT_CBPF, &fp); err != nil {
		return fmt.Errorf("udp wire: steering program for %d udp %d sockets: %w", n, roce.UDPPort, err)
	}
	return nil
}

// reusesPort reports whether fd has SO_REUSEPORT set: a socket bound
// without it (a version of the wire with one socket per family) cannot
// be joined by others.
func reusesPort(fd int) bool {
	v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT)
	return err == nil && v != 0
}
