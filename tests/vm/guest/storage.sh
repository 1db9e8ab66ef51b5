# Helpers for the kernel's RDMA storage consumers (vm.LayerStorage), busybox sh; sourced
# after lib.sh. A target guest serves a RAM disk (brd) over NVMe-oF (nvmet-rdma), SRP
# (ib_srpt), iSER (LIO's iSCSI target with ib_isert) or a tmpfs over NFSv4.2/RDMA
# (nfsd); an initiator guest connects, writes, reads back. Everything is set up through
# configfs, sysfs, /dev/nvme-fabrics and /proc/fs/nfsd as the kernel documents them, plus
# nfs-utils for NFS and open-iscsi's iscsid and iscsiadm for the iSER initiator.

# pvt_configfs: mount configfs (/init does only if the module was loaded before it).
pvt_configfs() {
	modprobe configfs || return 1
	grep -q ' /sys/kernel/config ' /proc/mounts || mount -t configfs configfs /sys/kernel/config
}

# pvt_ramdisks N MIB: N RAM disks /dev/ram0.. of MIB MiB each.
pvt_ramdisks() {
	modprobe brd rd_nr="$1" rd_size=$(($2 * 1024)) max_part=0 || return 1
	[ -b /dev/ram$(($1 - 1)) ] || { echo "pvt: no /dev/ram$(($1 - 1))"; return 1; }
}

# pvt_sum FILE [MIB]: the digest of FILE's first MIB MiB (all of it without MIB), read
# with O_DIRECT (a block device's data, not the page cache). MD5: busybox's fastest digest
# under TCG (5 times SHA-256's speed); the check is against corruption, not an adversary.
pvt_sum() {
	if [ -n "$2" ]; then
		dd if="$1" bs=1M count="$2" iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1
	else
		dd if="$1" bs=1M iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1
	fi
}

# --- NVMe over Fabrics -------------------------------------------------------------

# pvt_nvmet_target ADDR PORT NQN DEV: export block device DEV as namespace 1 of
# subsystem NQN (any host) on an RDMA port at ADDR:PORT.
pvt_nvmet_target() {
	pvt_configfs && modprobe nvmet_rdma || return 1
	_c=/sys/kernel/config/nvmet
	mkdir "$_c/subsystems/$3" || return 1
	echo 1 >"$_c/subsystems/$3/attr_allow_any_host" || return 1
	mkdir "$_c/subsystems/$3/namespaces/1" || return 1
	echo -n "$4" >"$_c/subsystems/$3/namespaces/1/device_path" || return 1
	echo 1 >"$_c/subsystems/$3/namespaces/1/enable" || return 1
	mkdir "$_c/ports/1" || return 1
	echo rdma >"$_c/ports/1/addr_trtype" || return 1
	echo ipv4 >"$_c/ports/1/addr_adrfam" || return 1
	echo "$1" >"$_c/ports/1/addr_traddr" || return 1
	echo "$2" >"$_c/ports/1/addr_trsvcid" || return 1
	ln -s "$_c/subsystems/$3" "$_c/ports/1/subsystems/$3" || return 1
}

# pvt_nvmet_remove NQN: undo pvt_nvmet_target.
pvt_nvmet_remove() {
	_c=/sys/kernel/config/nvmet
	rm -f "$_c/ports/1/subsystems/$1"
	rmdir "$_c/ports/1" 2>/dev/null
	echo 0 >"$_c/subsystems/$1/namespaces/1/enable" 2>/dev/null
	rmdir "$_c/subsystems/$1/namespaces/1" "$_c/subsystems/$1" 2>/dev/null
	true
}

# pvt_nvme_connect ADDR PORT NQN [OPTS]: connect to an NVMe-oF/RDMA subsystem through
# /dev/nvme-fabrics (OPTS: more options of the connect string, e.g.
# reconnect_delay=1), wait for its namespace's block device and print its path.
pvt_nvme_connect() {
	modprobe nvme_rdma || return 1
	_o="transport=rdma,traddr=$1,trsvcid=$2,nqn=$3${4:+,$4}"
	exec 5<>/dev/nvme-fabrics || return 1
	if ! echo "$_o" >&5; then
		exec 5>&-
		echo "pvt: nvme connect $_o failed" >&2
		return 1
	fi
	read -r _r <&5
	exec 5>&-
	echo "pvt: nvme connected: $_r" >&2 # instance=N,cntlid=M
	# The guest's only controller; with native multipath its disk is the subsystem's
	# head, nvmeXn1.
	_t=0
	while [ $_t -lt 100 ]; do
		for _d in /sys/block/nvme*n1; do
			[ -b /dev/"${_d##*/}" ] && { echo /dev/"${_d##*/}"; return 0; }
		done
		sleep 0.1
		_t=$((_t + 1))
	done
	echo "pvt: no NVMe namespace block device" >&2
	return 1
}

# pvt_nvme_disconnect: delete every NVMe controller.
pvt_nvme_disconnect() {
	for _c in /sys/class/nvme/nvme*; do
		[ -e "$_c/delete_controller" ] && echo 1 >"$_c/delete_controller"
	done
	true
}

# --- NFS over RDMA ------------------------------------------------------------------

# pvt_nfsd_rdma DIR CLIENTS MIB [PORT]: export DIR (a tmpfs of MIB MiB made there) as the
# NFSv4 root (fsid=0) to CLIENTS (e.g. 10.77.0.0/24) and start nfsd (NFSv4.x only,
# grace and lease 10 s) with an RDMA listener on PORT (default 20049) beside TCP 2049.
# The export is "insecure": an RDMA peer's source port is rdma_cm's, not a reserved one.
pvt_nfsd_rdma() {
	modprobe nfsd && modprobe rpcrdma || return 1
	mkdir -p "$1" /var/lib/nfs/v4recovery /proc/fs/nfsd
	mount -t tmpfs -o size="$3"m tmpfs "$1" || return 1
	mount -t nfsd nfsd /proc/fs/nfsd || return 1
	echo "$1 $2(rw,fsid=0,insecure,no_root_squash,no_subtree_check,sync)" >/etc/exports
	exportfs -ra || return 1
	# NFSv4 only: mountd serves the kernel's export caches, no MOUNT protocol, so no
	# rpcbind.
	rpc.mountd -N 2 -N 3 || return 1
	rpc.nfsd -N 3 -V 4.2 -G 10 -L 10 4 || return 1
	echo "rdma ${4:-20049}" >/proc/fs/nfsd/portlist || return 1
	echo "pvt: nfsd listens on: $(tr '\n' ' ' </proc/fs/nfsd/portlist)" >&2
}

# pvt_nfsd_stop DIR: stop nfsd and mountd and undo pvt_nfsd_rdma DIR.
pvt_nfsd_stop() {
	rpc.nfsd 0
	exportfs -ua
	killall rpc.mountd
	umount /proc/fs/nfsd
	umount "$1"
	true
}

# pvt_nfs_mount SERVER DIR [PORT] [OPTS]: mount SERVER's NFSv4 root on DIR over RDMA
# (NFSv4.2, port PORT, default 20049; OPTS: more mount options).
pvt_nfs_mount() {
	modprobe nfsv4 && modprobe rpcrdma || return 1
	mkdir -p "$2"
	mount.nfs "$1:/" "$2" -n -o "rdma,port=${3:-20049},vers=4.2${4:+,$4}"
}

# --- SRP ----------------------------------------------------------------------------

# pvt_srpt_target IBDEV SELF DEV [PORT]: export block device DEV as LUN 0 through
# ib_srpt on IBDEV's port 1, listening for rdma_cm logins on PORT (default 5555). Prints
# the target's service GUID (the initiator's id_ext and ioc_guid). The ACL is SELF, the
# target's own address: 6.1's ib_srpt names an rdma_cm login's session after its cm_id's
# route.addr.src_addr, which on the passive side is the local address ("Rejected login
# for initiator <target's address>" otherwise).
pvt_srpt_target() {
	pvt_configfs && modprobe target_core_iblock && modprobe ib_srpt || return 1
	_c=/sys/kernel/config/target
	mkdir -p "$_c/core/iblock_0/srp0" || return 1
	echo "udev_path=$3" >"$_c/core/iblock_0/srp0/control" || return 1
	echo 1 >"$_c/core/iblock_0/srp0/enable" || return 1
	mkdir -p "$_c/srpt" || return 1
	echo "${4:-5555}" >"$_c/srpt/discovery_auth/rdma_cm_port" || return 1
	# The target port is named by the interface ID of the port's GID 0.
	_g=$(cat /sys/class/infiniband/"$1"/ports/1/gids/0) || return 1
	_w=${_g#fe80:0000:0000:0000:}
	_t="$_c/srpt/$_w/$_w"
	mkdir -p "$_t/lun/lun_0" || return 1
	# configfs resolves a link's target from the working directory: absolute paths.
	ln -s "$_c/core/iblock_0/srp0" "$_t/lun/lun_0/srp0" || return 1
	mkdir -p "$_t/acls/$2/lun_0" || return 1
	ln -s "$_t/lun/lun_0" "$_t/acls/$2/lun_0/lun_0" || return 1
	echo 1 >"$_t/enable" || return 1
	cat /sys/module/ib_srpt/parameters/srpt_service_guid
}

# pvt_srpt_remove: undo pvt_srpt_target.
pvt_srpt_remove() {
	_c=/sys/kernel/config/target
	for _t in "$_c"/srpt/*/*/enable; do
		[ -e "$_t" ] || continue
		_t=${_t%/enable}
		echo 0 >"$_t/enable"
		rm -f "$_t"/acls/*/lun_0/lun_0 "$_t/lun/lun_0/srp0"
		rmdir "$_t"/acls/*/lun_0 "$_t"/acls/* "$_t/lun/lun_0" "$_t" "${_t%/*}"
	done
	rmdir "$_c/core/iblock_0/srp0" "$_c/core/iblock_0"
	true
}

# pvt_srp_login IBDEV SELF TARGET GUID [PORT] [OPTS]: log in over rdma_cm from SELF to
# the SRP target at TARGET:PORT (default 5555) whose service GUID is GUID, wait for its
# LUN's SCSI disk and print its path.
pvt_srp_login() {
	modprobe ib_srp && modprobe sd_mod || return 1
	_p=/sys/class/infiniband_srp/srp-"$1"-1
	_t=0
	while [ ! -e "$_p/add_target" ] && [ $_t -lt 50 ]; do
		sleep 0.1
		_t=$((_t + 1))
	done
	[ -e "$_p/add_target" ] || { echo "pvt: no $_p: ib_srp did not take $1" >&2; return 1; }
	_g=$(cat /sys/class/infiniband/"$1"/ports/1/gids/0 | tr -d :) || return 1
	echo "id_ext=$4,ioc_guid=$4,initiator_ext=$(echo "$_g" | cut -c1-16),src=$2,dest=$3:${5:-5555}${6:+,$6}" >"$_p/add_target" || return 1
	_t=0
	while [ $_t -lt 100 ]; do
		for _d in /sys/class/scsi_host/host*/device/target*/*/block/sd*; do
			[ -e "$_d" ] && [ -b /dev/"${_d##*/}" ] && { echo /dev/"${_d##*/}"; return 0; }
		done
		sleep 0.1
		_t=$((_t + 1))
	done
	echo "pvt: the SRP target's LUN has no SCSI disk" >&2
	return 1
}

# pvt_srp_logout: log out of every SRP target.
pvt_srp_logout() {
	for _r in /sys/class/srp_remote_ports/*; do
		[ -e "$_r/delete" ] && echo 1 >"$_r/delete"
	done
	true
}

# pvt_isert_target SELF DEV: export block device DEV as LUN 0 of LIO's iSCSI target
# $PVT_ISER_IQN, with an iSER portal on SELF:3260 (ib_isert), open to any initiator
# (generated node ACLs, no authentication).
PVT_ISER_IQN=iqn.2026-11.test.pvt:iser
pvt_isert_target() {
	pvt_configfs && modprobe target_core_iblock && modprobe crc32c_generic && modprobe ib_isert || return 1
	_c=/sys/kernel/config/target
	mkdir -p "$_c/core/iblock_1/iser0" || return 1
	echo "udev_path=$2" >"$_c/core/iblock_1/iser0/control" || return 1
	echo 1 >"$_c/core/iblock_1/iser0/enable" || return 1
	_t="$_c/iscsi/$PVT_ISER_IQN/tpgt_1"
	mkdir -p "$_t/lun/lun_0" || return 1
	ln -s "$_c/core/iblock_1/iser0" "$_t/lun/lun_0/iser0" || return 1
	mkdir -p "$_t/np/$1:3260" || return 1
	echo 1 >"$_t/np/$1:3260/iser" || return 1
	for _a in authentication=0 generate_node_acls=1 cache_dynamic_acls=1 demo_mode_write_protect=0; do
		echo "${_a#*=}" >"$_t/attrib/${_a%=*}" || return 1
	done
	echo 1 >"$_t/enable" || return 1
	echo "pvt: iSER portal $1:3260 iser=$(cat "$_t/np/$1:3260/iser")" >&2
}

# pvt_isert_remove: undo pvt_isert_target.
pvt_isert_remove() {
	_c=/sys/kernel/config/target
	_t="$_c/iscsi/$PVT_ISER_IQN/tpgt_1"
	if [ -d "$_t" ]; then
		echo 0 >"$_t/enable"
		rm -f "$_t/lun/lun_0/iser0"
		rmdir "$_t/lun/lun_0"
		for _n in "$_t"/np/*; do
			[ -d "$_n" ] || continue
			echo 0 >"$_n/iser"
			rmdir "$_n"
		done
		rmdir "$_t" "${_t%/*}"
	fi
	rmdir "$_c/core/iblock_1/iser0" "$_c/core/iblock_1"
	true
}

# pvt_iser_login TARGET: start iscsid, log in to TARGET:3260's $PVT_ISER_IQN through
# open-iscsi's iser iface (ib_iser), wait for its LUN's SCSI disk and print its path.
pvt_iser_login() {
	modprobe crc32c_generic && modprobe ib_iser && modprobe sd_mod || return 1
	mkdir -p /etc/iscsi /var/lib/iscsi /run/lock/iscsi || return 1
	echo "InitiatorName=iqn.2026-11.test.pvt:host" >/etc/iscsi/initiatorname.iscsi
	[ -e /etc/iscsi/iscsid.conf ] || : >/etc/iscsi/iscsid.conf
	if ! pidof iscsid >/dev/null; then
		setsid iscsid -f -d 1 >/tmp/iscsid.log 2>&1 &
		sleep 1
	fi
	iscsiadm -m node -o new -T "$PVT_ISER_IQN" -p "$1:3260" -I iser >&2 || return 1
	iscsiadm -m node -T "$PVT_ISER_IQN" -p "$1:3260" -I iser -o update -n node.session.initial_login_retry_max -v 2 >&2
	if ! timeout 120 iscsiadm -m node -T "$PVT_ISER_IQN" -p "$1:3260" -I iser --login >&2; then
		echo "pvt: iSER login failed; iscsid said:" >&2
		tail -40 /tmp/iscsid.log >&2
		dmesg | tail -30 >&2
		return 1
	fi
	_t=0
	while [ $_t -lt 100 ]; do
		for _d in /sys/class/iscsi_session/session*/device/target*/*/block/sd*; do
			[ -e "$_d" ] && [ -b /dev/"${_d##*/}" ] && { echo /dev/"${_d##*/}"; return 0; }
		done
		sleep 0.1
		_t=$((_t + 1))
	done
	echo "pvt: the iSER target's LUN has no SCSI disk" >&2
	return 1
}

# pvt_iser_logout TARGET: log out of TARGET's $PVT_ISER_IQN, forget it, stop iscsid.
pvt_iser_logout() {
	iscsiadm -m node -T "$PVT_ISER_IQN" -p "$1:3260" -I iser --logout
	iscsiadm -m node -o delete -T "$PVT_ISER_IQN" -p "$1:3260" -I iser >/dev/null 2>&1
	_p=$(pidof iscsid) && kill $_p
	grep -i 'err\|fail' /tmp/iscsid.log | tail -5
	true
}

# --- One consumer run between two guests ---------------------------------------------
# The target guest runs pvt_storage_target, the initiator pvt_storage_host, with the same
# KIND (nvme, nfs or srp); they keep in step with pvt_send/pvt_recv (target on port
# 7001, initiator on 7002), every message tagged with KIND. The initiator prints
# sum_written= (the digest of its data) and sum_read= (of what it read back with O_DIRECT
# after the last pass), the target sum_target= (of its RAM disk read directly, or the
# exported file, after the initiator's last write): all three must be equal. Each side
# prints the kernel log of its run (dmesg -c) after "--- dmesg".

# pvt_storage_target KIND IBDEV SELF PEER MIB [SECS]: serve MIB MiB over KIND to PEER and
# check what it wrote; SECS is how long the initiator keeps writing.
pvt_storage_target() {
	_k=$1 _dev=$2 _self=$3 _peer=$4 _mib=$5 _secs=${6:-0}
	_rc=0
	[ -b /dev/ram1 ] || pvt_ramdisks 2 "$_mib" || _rc=1
	_info=""
	if [ $_rc = 0 ]; then
		case $_k in
		nvme) pvt_nvmet_target "$_self" 4420 pvt-nvme /dev/ram0 || _rc=1 ;;
		nfs) pvt_nfsd_rdma /export "$_peer"/32 $((_mib + 16)) || _rc=1 ;;
		srp) _info=$(pvt_srpt_target "$_dev" "$_self" /dev/ram1) || _rc=1 ;;
		iser) pvt_isert_target "$_self" /dev/ram1 || _rc=1 ;;
		*) echo "pvt: no consumer $_k"; _rc=1 ;;
		esac
	fi
	if [ $_rc != 0 ]; then
		pvt_send "$_peer" 7002 120 "$_k-ready fail"
	else
		pvt_send "$_peer" 7002 120 "$_k-ready ok $_info" || _rc=1
	fi
	if _w=$(pvt_recv 7001 $((_secs + 600)) "$_k-written") && [ "$_w" = ok ] && [ $_rc = 0 ]; then
		case $_k in
		nvme) echo "sum_target=$(pvt_sum /dev/ram0 "$_mib")" ;;
		# tmpfs has no O_DIRECT (6.1): the server's own view of the file.
		nfs) echo "sum_target=$(md5sum /export/data | cut -d' ' -f1)" ;;
		srp | iser) echo "sum_target=$(pvt_sum /dev/ram1 "$_mib")" ;;
		esac
	else
		echo "pvt: the initiator wrote nothing"
		_rc=1
	fi
	pvt_recv 7001 300 "$_k-done" || _rc=1
	case $_k in
	nvme) pvt_nvmet_remove pvt-nvme ;;
	nfs) pvt_nfsd_stop /export ;;
	srp) pvt_srpt_remove ;;
	iser) pvt_isert_remove ;;
	esac
	echo "--- dmesg"
	dmesg -c
	return $_rc
}

# pvt_storage_host KIND IBDEV SELF PEER MIB [SECS] [OPTS]: connect to PEER's KIND target,
# write MIB MiB of random data with O_DIRECT and read it back, pass after pass for SECS
# seconds (at least once); OPTS are more options for the connection (nvme: the connect
# string's, nfs: mount's, srp: add_target's). With PVT_STORAGE_WORK=pvt_bench it
# measures instead (pvt_bench).
pvt_storage_host() {
	_k=$1 _dev=$2 _self=$3 _peer=$4 _mib=$5 _secs=${6:-0} _opts=$7
	_rc=0
	_r=$(pvt_recv 7002 300 "$_k-ready") || _rc=1
	case "$_r" in
	ok*) _info=${_r#ok} _info=${_info# } ;;
	*) echo "pvt: the target is not ready: $_r"; _rc=1 ;;
	esac
	_path=""
	if [ $_rc = 0 ]; then
		case $_k in
		nvme) _path=$(pvt_nvme_connect "$_peer" 4420 pvt-nvme "$_opts") || _rc=1 ;;
		nfs) pvt_nfs_mount "$_peer" /mnt/nfs 20049 "$_opts" && _path=/mnt/nfs/data || _rc=1 ;;
		srp) _path=$(pvt_srp_login "$_dev" "$_self" "$_peer" "$_info" 5555 "$_opts") || _rc=1 ;;
		iser) _path=$(pvt_iser_login "$_peer") || _rc=1 ;;
		esac
	fi
	[ $_rc = 0 ] && echo "pvt: $_k device $_path"
	if [ $_rc = 0 ]; then
		${PVT_STORAGE_WORK:-pvt_io} "$_path" "$_mib" "$_secs" || _rc=1
	fi
	if [ $_rc = 0 ]; then
		pvt_send "$_peer" 7001 120 "$_k-written ok" || _rc=1
	else
		pvt_send "$_peer" 7001 120 "$_k-written fail"
	fi
	case $_k in
	nvme) pvt_nvme_disconnect ;;
	nfs)
		# The RDMA transport's counters: connect_count (the 3rd number) above 1 is a
		# reconnect.
		grep 'xprt:' /proc/self/mountstats | sed 's/^[[:space:]]*/pvt: /'
		umount /mnt/nfs 2>/dev/null
		;;
	srp) pvt_srp_logout ;;
	iser) pvt_iser_logout "$_peer" ;;
	esac
	pvt_send "$_peer" 7001 120 "$_k-done" || _rc=1
	echo "--- dmesg"
	dmesg -c
	return $_rc
}

# pvt_io PATH MIB SECS: write MIB MiB of fresh random data to PATH with O_DIRECT and read
# it back with O_DIRECT, comparing, pass after pass (new data each pass) until SECS
# seconds have passed (at least once). Prints "pvt-io start" before the first write,
# each pass's times, passes, and sum_written and sum_read of the last pass.
pvt_io() {
	_end=$(($(cut -d. -f1 /proc/uptime) + $3))
	_n=0
	echo "pvt-io start"
	while :; do
		dd if=/dev/urandom of=/tmp/pvt-data bs=1M count="$2" 2>/dev/null || return 1
		_want=$(md5sum /tmp/pvt-data | cut -d' ' -f1)
		_t0=$(cut -d' ' -f1 /proc/uptime)
		timeout 600 dd if=/tmp/pvt-data of="$1" bs=1M oflag=direct conv=fsync 2>/tmp/pvt-dd.err ||
			{ echo "pvt: write pass $((_n + 1)) failed: $(cat /tmp/pvt-dd.err)"; return 1; }
		_t1=$(cut -d' ' -f1 /proc/uptime)
		_got=$(timeout 600 dd if="$1" bs=1M count="$2" iflag=direct 2>/tmp/pvt-dd.err | md5sum | cut -d' ' -f1)
		_t2=$(cut -d' ' -f1 /proc/uptime)
		_n=$((_n + 1))
		echo "pass $_n: write $(echo "$_t0 $_t1" | awk '{printf "%.2f", $2 - $1}') s, read and md5 $(echo "$_t1 $_t2" | awk '{printf "%.2f", $2 - $1}') s"
		if [ "$_got" != "$_want" ]; then
			echo "pvt: pass $_n read back $_got, wrote $_want: $(cat /tmp/pvt-dd.err)"
			echo "sum_written=$_want"
			echo "sum_read=$_got"
			return 1
		fi
		[ "$(cut -d. -f1 /proc/uptime)" -lt "$_end" ] || break
	done
	rm -f /tmp/pvt-data
	echo "passes=$_n"
	echo "sum_written=$_want"
	echo "sum_read=$_got"
}

# pvt_bench PATH MIB SECS: measure PATH (a block device of at least MIB MiB; its data is
# overwritten): sequential write and read of MIB MiB in 1 MiB requests with O_DIRECT
# (dd, timed: bytes, seconds), then 4 KiB random reads and writes at queue depth 1
# with O_DIRECT for SECS seconds each over the first MIB MiB (ioping's raw statistics:
# count, ns, iops, bytes/s, min, avg, max, mdev ns, ...). Each result is a line
# "bench NAME: ...".
pvt_bench() {
	pvt_bench_dd seq_write "$2" if=/dev/zero of="$1" bs=1M count="$2" oflag=direct conv=fsync || return 1
	pvt_bench_dd seq_read "$2" if="$1" of=/dev/null bs=1M count="$2" iflag=direct || return 1
	_r=$(ioping -B -D -i 0 -w "$3" -s 4k -S "$2"m "$1" 2>/tmp/pvt-bench.err) ||
		{ echo "pvt: bench rand_read failed: $_r $(cat /tmp/pvt-bench.err)"; return 1; }
	echo "bench rand_read: $_r"
	_r=$(ioping -B -D -WWW -i 0 -w "$3" -s 4k -S "$2"m "$1" 2>/tmp/pvt-bench.err) ||
		{ echo "pvt: bench rand_write failed: $_r $(cat /tmp/pvt-bench.err)"; return 1; }
	echo "bench rand_write: $_r"
}

# pvt_bench_dd NAME MIB DD-ARGS...: run dd (copying MIB MiB) and print "bench NAME:
# BYTES bytes (MIB MiB) copied, SECS seconds", timed with /proc/uptime (busybox's dd
# prints no time).
pvt_bench_dd() {
	_name=$1 _mib=$2
	shift 2
	_t0=$(cut -d' ' -f1 /proc/uptime)
	_r=$(dd "$@" 2>&1) || { echo "pvt: bench $_name failed: $_r"; return 1; }
	_t1=$(cut -d' ' -f1 /proc/uptime)
	echo "bench $_name: $((_mib * 1048576)) bytes ($_mib MiB) copied, $(echo "$_t0 $_t1" | awk '{printf "%.2f", $2 - $1}') seconds"
}
