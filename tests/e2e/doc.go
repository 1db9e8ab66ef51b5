// Package e2e holds the end-to-end tests of pvrdma-backend: stock Linux
// guests (vmw_pvrdma driver, rdma-core tools) in QEMU 11 talking to the
// daemon over vfio-user (build tag vm). The helpers here start a daemon in
// process and guests wired to it.
package e2e
