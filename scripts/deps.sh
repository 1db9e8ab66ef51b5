#!/bin/sh
# Installs the host packages the VM test bed needs (Debian 12 / bookworm packages only).
# Idempotent: when everything is present it neither updates the package lists nor
# downloads anything.
set -eu
# gcc-12/make/binutils build vmw_pvrdma.ko; libelf1 and libssl3 are what the unpacked
# linux-kbuild-6.1 tools link against; kmod gives depmod; xz-utils and dpkg unpack;
# libibverbs-dev builds the interop checker the soft transport's rxe tests run in a guest.
# debootstrap and systemd-container (systemd-nspawn) let the package test install the
# .deb in a clean bookworm root and start its unit under systemd.
# libvirt-daemon (libvirtd), its QEMU driver, libvirt-clients and libxml2-utils (virt-xml-validate) run
# the libvirt test: libvirtd in a private mount namespace, with the test bed's QEMU.
pkgs="ca-certificates gcc gcc-12 make libc6-dev binutils bc libelf1 libssl3 kmod xz-utils apt dpkg iproute2 libibverbs-dev debootstrap systemd-container libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients libxml2-utils"
missing=""
for p in $pkgs; do
	if ! dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
		missing="$missing $p"
	fi
done
if [ -n "$missing" ]; then
	echo "deps: installing$missing"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q --no-install-recommends $missing
fi
for t in /dev/net/tun; do
	[ -e "$t" ] || echo "deps: note: $t is missing" >&2
done
[ -e /dev/net/tun ] || { echo "deps: /dev/net/tun is required for the VM networks" >&2; exit 1; }
