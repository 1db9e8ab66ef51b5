// Package abi holds the guest-visible binary layouts of the PVRDMA device,
// as the stock Linux vmw_pvrdma driver and rdma-core's libvmw_pvrdma
// provider use them: the BAR1 registers and their values, the device shared
// region (DSR) and the capabilities written into it, every command request
// and response, the verbs attribute structures they carry, the send and
// receive WQEs, the CQEs and the entries of the async-event and
// CQ-notification rings, the UAR doorbell bits, and the constants the ABI
// defines (device versions, command codes, interrupt vectors, MR and
// capability flags).
//
// It is codecs only, with no behaviour: one Go struct per C structure of
// the Linux headers drivers/infiniband/hw/vmw_pvrdma/pvrdma_dev_api.h,
// pvrdma_verbs.h, pvrdma_ring.h and include/uapi/rdma/vmw_pvrdma-abi.h,
// each with Decode and Encode over a little-endian byte slice of exactly
// its exported size. Field offsets are constants next to each struct
// (unexported, except the few that code outside needs), pinned by
// abi_test.go against the offsets of the C headers. Decode and Encode
// index the slice up front (b[Size-1]) and never read or write outside it;
// callers pass slices of at least the struct's size. Nothing here
// validates a value: what a field may hold, and what the device does with
// it, is package vdev's; the test bed's fake guest driver (tests/hostile)
// speaks the same layouts from the guest's side.
//
// The package imports nothing of the device and nothing but the standard
// library.
package abi
