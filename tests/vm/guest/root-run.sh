#!/bin/sh
# Scenario runner of a guest booted on its own root (vm.Config.Root): the root's systemd
# starts it (pvt-scenario.service) once multi-user.target is reached. It reports on the
# result channel (ttyS1) as /init does for other guests, the scenario's output then
#   @@PVT@@ <nonce> END <rc> scenario <uptime>
# and powers off. /init left the nonce in /run/pvt/nonce; it is removed before the
# scenario runs, so the scenario cannot forge the frame.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
# The result channel is a tty: no colours, hyperlinks or pager from systemd's tools.
export TERM=dumb SYSTEMD_COLORS=0 SYSTEMD_URLIFY=0 SYSTEMD_PAGER=cat
umask 022
. /run/pvt/nonce
nonce=$PVT_NONCE
rm -f /run/pvt/nonce
unset PVT_NONCE

res=/dev/ttyS1
stty -F $res raw -echo 2>/dev/null
exec 3>$res
cd /root
sh /run/pvt/scenario >&3 2>&1 </dev/null
rc=$?
printf '\n' >&3
echo "@@PVT@@ $nonce END $rc scenario $(cut -d' ' -f1 /proc/uptime)" >&3
# Closing the last descriptor of the tty waits until the UART has sent everything.
exec 3>&-
sync
systemctl --force --force poweroff || echo o >/proc/sysrq-trigger
sleep 10
