#!/bin/sh
# /init of the pvrdma-backend test-bed guests (busybox sh). Sets the guest up from
# /etc/pvt/config, runs /pvt/scenario and reports on the result channel (ttyS1):
#   @@PVT@@ <nonce> INIT <uptime>
#   ...scenario stdout and stderr...
#   @@PVT@@ <nonce> SETUP <uptime>       (after modules and NICs)
#   @@PVT@@ <nonce> END <rc> <stage> <uptime>
# then powers off. The nonce is read from the config and removed before the scenario
# runs, so the scenario cannot forge the frame.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
umask 022
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs tmpfs /run
[ -d /sys/kernel/config ] && mount -t configfs configfs /sys/kernel/config 2>/dev/null

. /etc/pvt/config
. /usr/lib/pvt/lib.sh
nonce=$PVT_NONCE
rm -f /etc/pvt/config
unset PVT_NONCE

res=/dev/ttyS1
stty -F $res raw -echo 2>/dev/null
exec 3>$res
mark() { echo "@@PVT@@ $nonce $* $(cut -d' ' -f1 /proc/uptime)" >&3; }
finish() {
	printf '\n' >&3
	mark END "$1" "$2"
	# Closing the last descriptor of the tty waits until the UART has sent everything.
	exec 3>&-
	sync
	poweroff -f
	sleep 10
}
mark INIT
dmesg -n 1 2>/dev/null

setup() {
	hostname "$PVT_HOSTNAME"
	ip link set lo up
	for m in $PVT_PRELOAD $PVT_MODULES; do
		modprobe "$m" || { echo "pvt: modprobe $m failed"; return 1; }
	done
	# NICs: "mac=ip/prefix" (ip may be "-" for none), matched by MAC.
	for nic in $PVT_NICS; do
		mac=${nic%%=*}
		addr=${nic#*=}
		dev=""
		tries=0
		while [ -z "$dev" ] && [ $tries -lt 50 ]; do
			for d in /sys/class/net/*; do
				[ "$(cat "$d/address" 2>/dev/null)" = "$mac" ] && dev=${d##*/}
			done
			[ -n "$dev" ] || { tries=$((tries + 1)); sleep 0.1; }
		done
		[ -n "$dev" ] || { echo "pvt: no interface with MAC $mac"; ls /sys/class/net; return 1; }
		ip link set "$dev" up || return 1
		if [ "$addr" != "-" ]; then
			ip addr add "$addr" dev "$dev" || return 1
		fi
	done
	return 0
}

if ! setup >&3 2>&1; then
	finish 125 setup
fi
mark SETUP
cd /root
sh /pvt/scenario >&3 2>&1 </dev/null
finish $? scenario
