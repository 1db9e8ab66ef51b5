#!/bin/sh
# /init of the pvrdma-backend test-bed guests (busybox sh). Sets the guest up from
# /etc/pvt/config, runs /pvt/scenario and reports on the result channel (ttyS1):
#   @@PVT@@ <nonce> INIT <uptime>
#   ...scenario stdout and stderr...
#   @@PVT@@ <nonce> SETUP <uptime>       (after modules and NICs)
#   @@PVT@@ <nonce> END <rc> <stage> <uptime>
# then powers off. The nonce is read from the config and removed before the scenario
# runs, so the scenario cannot forge the frame.
# A guest with its own root (vm.Config.Root, PVT_ROOT set) instead mounts that root
# after SETUP and switches to its systemd, which runs the scenario from
# pvt-scenario.service (root-run.sh reports END and powers off).
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
# The console shows KERN_WARNING and more severe messages (an oops's trace among them):
# the harness fails a guest at the first kernel fault it reports there (an oops, a
# panic, a hung task).
dmesg -n 5 2>/dev/null

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
	[ -z "$PVT_ROOT" ] || prepare_root || return 1
	return 0
}

# prepare_root mounts the guest's root (shared over virtio-9p with mount tag $PVT_ROOT)
# on /newroot and puts what its systemd needs to run the scenario in /run, which moves
# there: the scenario, the helpers, the runner, its unit (wanted by multi-user.target)
# and the nonce.
prepare_root() {
	mkdir -p /newroot
	mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose "$PVT_ROOT" /newroot || {
		echo "pvt: mount the root (9p tag $PVT_ROOT) failed"
		return 1
	}
	[ -L /newroot/sbin/init ] || [ -e /newroot/sbin/init ] || { echo "pvt: the root has no /sbin/init"; return 1; }
	mkdir -p /run/pvt /run/systemd/system/multi-user.target.wants || return 1
	cp /pvt/scenario /usr/lib/pvt/lib.sh /usr/lib/pvt/root-run.sh /run/pvt/ || return 1
	cp /usr/lib/pvt/pvt-scenario.service /run/systemd/system/ || return 1
	ln -s ../pvt-scenario.service /run/systemd/system/multi-user.target.wants/pvt-scenario.service || return 1
	(umask 077 && echo "PVT_NONCE=$nonce" >/run/pvt/nonce) || return 1
	chmod 755 /run
}

# move_mounts moves /run and the pseudo file systems into the new root (/proc last:
# finish needs it).
move_mounts() {
	umount /tmp
	for m in /run /dev /sys /proc; do
		mount -o move $m /newroot$m || { echo "pvt: move $m to the new root failed"; return 1; }
	done
}

if ! setup >&3 2>&1; then
	finish 125 setup
fi
mark SETUP
if [ -n "$PVT_ROOT" ]; then
	move_mounts >&3 2>&1 || finish 125 setup
	exec 3>&-
	# switch_root frees the initramfs and execs the root's init, which stays PID 1.
	exec switch_root /newroot /sbin/init
fi
cd /root
sh /pvt/scenario >&3 2>&1 </dev/null
finish $? scenario
