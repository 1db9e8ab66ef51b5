// Package vdev is the PVRDMA device model: the PCI function that the stock
// Linux vmw_pvrdma driver and rdma-core's vmw_pvrdma provider drive,
// emulated over a hostverbs.Device.
//
// It covers the BAR1 register file, the device shared region (DSR) and the
// capabilities written into it, the command channel (all 21 commands,
// driven by a table keyed by command code), the UAR doorbells of BAR2, the
// async-event and CQ-notification rings with their MSI-X vectors, and the
// translation of guest work requests (read from guest rings with
// package ringbuf) into hostverbs work requests and of hostverbs work
// completions into CQEs in guest CQ rings. The binary layouts it reads
// and writes (registers, DSR, commands, WQEs, CQEs, ring entries) are
// package vdev/abi's, which holds the codecs only; what a field may hold
// and what the device does with it are decided here.
//
// Everything the guest writes is untrusted: ring indices, page
// directories, handles, keys, SGEs and every command field are validated
// and a bad one gets an error status (ERR register and response header, or
// an error CQE that consumes the WQE's slot), never a panic, an
// out-of-bounds access or an unbounded allocation. Resource counts are
// bounded by per-VM Limits, and the capabilities reported to the guest are
// the truth: the provider's limits, ours, and the ABI's, whichever is
// smallest.
//
// The guest's send and receive rings are the durable record of the work
// outstanding (workQueue): the device reads and posts a WQE by moving a
// posted cursor of its own, and moves cons_head in guest memory past a WQE
// only when it completes, before its CQE is visible; the provider gets
// WRIDs that name ring indices, translated back to the guest's wr_id on
// completion. A daemon that dies therefore leaves in guest memory every
// WQE posted and not completed, and a device rebuilt over the running
// guest (SetAdoptRings, KickQueues) resumes from there: completions are
// written at most once, work is executed at least once. Shared receive
// queues complete out of order and keep releasing at post.
//
// Crash survival: the device journals every change of state the guest
// made (Config.Journal, journal.go), compacts it on demand (Checkpoint)
// and is rebuilt from it by a restarted daemon for the same, still running
// guest (Restore, restore.go): same handles, QPNs and keys, rings adopted
// where the guest memory has them. Restore reads as its stages: read the
// journal (restore_journal.go), replay its records (restore_replay.go; the
// command handlers' side in restore_hooks.go), settle the result.
//
// Planned hand-over (handover.go, handover_srq.go): with the guest's
// doorbells and commands stopped, a daemon waits for SendsDrained,
// journals the receives the SRQs' providers hold and the transport state
// of the connected RC QPs (SaveTransports) and execs its successor, whose
// Restore posts those receives again and gives the new provider QPs that
// state back: those QPs, on an SRQ or not, keep their connections instead
// of going to ERR. ResumeTransports, or the guest's next BAR write,
// abandons a hand-over.
//
// Concurrency: BAR accesses (ReadBAR/WriteBAR) of one device arrive in
// order from one goroutine, are serialised by the device and run
// synchronously (a doorbell drains the ring and posts to the provider
// before the write returns). Completions and async events arrive from
// provider goroutines; each CQ ring and the two device rings have their own
// lock, so completions never wait for commands.
package vdev
