// Package soft is a software RoCE transport implementing
// hostverbs.Provider: InfiniBand RC and UD transport (requester, responder
// and completer per QP, as in Linux rxe) carried as RoCE v2 in UDP port
// 4791, wire compatible with Linux Soft-RoCE and RoCE HCAs (tested against
// rxe), or as RoCE v1 (Ethertype 0x8915) for devices opened in that mode.
// DCQCN congestion control (dcqcn.go) marks packets ECN-capable, answers
// CE marks with CNPs and paces QPs that receive them.
//
// # Fabric
//
// A Fabric is the distributed switch of one host network: Open gives one
// hostverbs.Device per VM. Each device owns the GIDs its guest binds
// (SetGID), and has its own QPN space (QPN 1 is its GSI QP), key space
// (lkey == rkey, resolved in the target device) and limits. Packets are
// demultiplexed by destination GID to a device (frames a Wire captured in
// Ethernet also by the device's MAC), then by destination QPN.
//
// Traffic between devices of the same fabric never leaves the process: a
// message travels as one packet whose payload refers to the sender's guest
// memory, and the responder copies it straight into the receiver's (one
// copy between guest memories), through the same requester, responder and
// completer as on the wire, with the same semantics (PSNs, ACKs, RNR,
// errors). Everything else goes through the fabric's Wire (package wire):
//
//   - KernelWire: the host kernel's IP stack, in the network namespace the
//     wire is created in. It sends with raw IP sockets (header included, so
//     each packet carries its GID as source address, its QP pair's UDP
//     source port, its traffic class as TOS, DF and a non-zero IPv4 ID the
//     ICRC covers) and receives with BPF-filtered raw sockets, verifying
//     every ICRC, plus UDP 4791 sockets that drop all they get so the kernel
//     sends no ICMP port unreachable. The GIDs must be local addresses of
//     the host (the daemon adds bound GIDs to its fabric netdev). Needs
//     CAP_NET_RAW and port 4791 free in the namespace.
//   - PacketWire: Ethernet frames on a bridge (AF_PACKET), for VMs sharing
//     an L2 segment with other RoCE peers; RoCE v1 and v2, optionally in an
//     802.1Q VLAN with a priority.
//   - MemNet: an in-memory network with injectable loss, reordering and
//     duplication, for deterministic tests.
//
// In process, for tests or a single host:
//
//	f, err := soft.New(soft.Config{})
//	dev, err := f.Open(hostverbs.DeviceConfig{Name: "vm1", Memory: mem, MAC: mac, Events: onEvent})
//	err = dev.SetGID(0, hostverbs.GIDEntry{GID: hostverbs.GIDFromAddr(ip), Type: hostverbs.GIDTypeRoCEv2})
//
// Through the kernel in a network namespace (the wire's sockets live in the
// namespace of the thread that creates them; the fabric can then be used
// from anywhere):
//
//	var w *soft.KernelWire
//	err := inNetns(func() (err error) { w, err = wire.NewKernelWire(wire.KernelWireConfig{}); return })
//	f, err := soft.New(soft.Config{Wire: w, LinkMTU: 1500, DefaultTOS: 0})
//
// # Concurrency and completions
//
// PostSend starts transmission on the calling goroutine (a doorbell is a
// synchronous round trip: the first packets are on the wire, or delivered
// in process, before it returns). Receive processing runs on one goroutine
// per wire queue; what it sends (ACKs, READ responses, the rest of a
// window) goes through an ordered transmit ring that a transmit goroutine
// drains, so receiving and sending use two cores. Timers run on the
// fabric's Clock (RealClock, or ManualClock in tests). A completion is
// pushed to its CQ's CompletionHandler from whichever goroutine produced
// it, in order per queue; the *WorkCompletion is only valid during the
// call. Asynchronous events (COMM_EST, QP errors, SRQ limit, LAST_WQE
// reached, SQ drained) go to DeviceConfig.Events. Neither may call back
// into the provider.
//
// In-process delivery is synchronous: PostSend and Modify (into RTS) may
// run the destination device's responder and call its completion handler,
// and then this device's, before returning. A caller
// must therefore not hold, across PostSend, a lock that any device's
// completion handler or event callback takes.
//
// # Hand-over
//
// RC QPs implement hostverbs.TransportSaver (transport.go): once its sends
// have drained, a QP's transport state (PSNs, MSN, the responder's
// READ/atomic resources) is saved and the QP frozen (it drops what it
// receives, counted as drop_qp_handed_over), and another process restores
// the state into a QP created with the same QPN and brought to the same
// state, which goes on with the peer where the old one stopped: what was
// lost in between is recovered as any packet loss, at once thanks to a
// PSN sequence NAK the restored QP sends. DCQCN rate state is not carried:
// the QP restarts at line rate. SRQs implement hostverbs.SRQSaver: the
// receives no QP has taken are returned, oldest first, and the SRQ frozen
// (a request or datagram that needs one of its receives is dropped,
// counted as drop_srq_handed_over, rather than RNR NAKed), for the next
// process to post again.
//
// # Protocol
//
// RC: SEND (with immediate), RDMA WRITE (with immediate), RDMA READ (large
// reads requested a window at a time), ATOMIC CMP_SWAP and FETCH_ADD with
// a responder replay cache; ACK coalescing; go-back-N on PSN sequence NAKs,
// implied NAKs and local ACK timeouts with retry_cnt; RNR NAK with
// min_rnr_timer and rnr_retry (7: forever); duplicate requests answered
// without re-execution; NAK invalid request, remote access and remote
// operational errors mapped to completion statuses, the responder's QP
// going to ERR with the matching async event; ERR flushes with
// WR_FLUSH_ERR. UD and GSI: SEND with Q_Key check (a WR Q_Key with the high
// bit set means the QP's own), a 40-byte GRH ahead of the payload (20 zero
// bytes and the IPv4 header, or the IPv6 header). P_Key 0xFFFF. Path MTU
// 256 to 4096. Every inbound access is checked against key, PD, access
// flags and bounds; malformed or unexpected packets are dropped and counted
// (Fabric.Counters, and Counters on each device).
//
// Not implemented: UC and RD, memory windows and fast registration (SEND
// with invalidate is NAKed), inline data, alternate paths, SRQ resize,
// congestion control (ECN marks are neither set nor acted upon).
package soft
