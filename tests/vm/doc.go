// Package vm is the nested-VM test bed: it builds a cached guest image (QEMU 11 from
// Debian trixie-backports run through its own loader, a Debian bookworm 6.1 kernel booted
// as a PVH vmlinux, vmw_pvrdma.ko built from Debian's linux-source, and an initramfs with
// busybox and rdma-core) and launches QEMU guests on private networks (a network
// namespace with a bridge and one tap per NIC).
//
// The library has no build tag so that `go build ./...` and `go vet ./...` cover it; tests
// that boot guests carry the build tag `vm`. A typical VM test:
//
//	img, err := vm.EnsureImage(ctx, t.Logf)
//	net, err := vm.NewNetwork(t, vm.NetworkConfig{HostAddr: "10.77.0.254/24"})
//	a, err := vm.Start(ctx, t, img, net, vm.Config{Name: "a",
//		NICs: []vm.NIC{{Model: "vmxnet3", Addr: "05.0", IP: "10.77.0.1/24"}},
//		Scenario: "ibv_devices"})
//	res, err := a.Wait(ctx)     // err: no result (timeout, crash, QEMU error)
//	err = res.Err()             // non-nil if the scenario exited non-zero; has the output
//
// Everything a test creates (QEMU processes, taps, bridges, namespaces, run directories) is
// removed by t.Cleanup, and also when the process gets SIGINT or SIGTERM. Namespaces and
// run directories left behind by crashed runs are swept on the next run.
//
// The guest side: /init mounts the pseudo file systems, loads vmxnet3 and the requested
// modules, configures each NIC by MAC, runs the scenario with busybox sh and reports its
// output and exit status on a second serial port (ttyS1), framed with a per-boot nonce
// so that nothing the scenario prints can be taken for the result. The kernel console
// (ttyS0) and the result channel are both copied into the test log.
//
// A guest with Config.Root boots a host directory (a Debian root with systemd) as its root
// file system over virtio-9p: /init sets it up as usual, switches to the root's systemd,
// and a unit it leaves in /run/systemd/system runs the scenario and reports the same way
// (guest/root-run.sh). A packaged systemd unit can then be tested with kernel RDMA devices.
package vm
