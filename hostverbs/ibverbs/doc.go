// Package ibverbs is the hostverbs provider that relays a VM's verbs to a
// host RDMA device (a RoCE HCA, or a kernel Soft-RoCE link) through
// rdma-core's libibverbs, loaded at run time: the daemon links no RDMA
// library, starts on hosts without rdma-core, and New reports what to
// install when the library, the device or its port is missing.
//
// Objects (PDs, MRs, CQs, QPs, SRQs, AHs) are host objects: QPNs, lkeys and
// rkeys are the host's, so the addresses and keys guests exchange are used
// verbatim by remote peers. An MR registers the guest's own pages at the
// guest's IOVA: the pages are mapped again, next to each other, from the
// guest RAM's memory file (a contiguous host alias), and the alias is
// registered with ibv_reg_mr_iova2. Payload never passes through the
// daemon. Completions arrive on a completion channel per device, waited for
// with poll(2): nothing spins while the device is idle.
package ibverbs
