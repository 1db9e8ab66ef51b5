// Package packaging tests the Debian package (`make deb`) the way an operator meets
// it: installed with dpkg in a clean Debian root booted under systemd
// (systemd-nspawn), its service started, and the daemon answering `status`. The
// relay, which needs kernel RDMA devices the host lacks, is tested in a VM test-bed
// guest that boots such a root under systemd (vm.Config.Root) with kernel rxe.
// The tests carry the build tag vm: they need root, systemd-nspawn and debootstrap
// (scripts/deps.sh installs them), and the first run fetches a minimal bookworm
// root into the VM image cache.
package packaging
