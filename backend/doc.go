// Package backend is the pvrdma-backend daemon: it owns the fabrics, serves
// one vfio-user socket per VM, creates a PVRDMA device for each connected
// VM on its fabric, manages GIDs on the host (netlink), talks to QEMU over
// QMP, and exports metrics.
package backend
