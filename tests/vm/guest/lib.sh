# Helpers for test-bed scenarios (busybox sh); sourced before every scenario.

# Real programs (iproute2 ip, pciutils lspci) instead of the busybox applets.
[ -r /usr/lib/pvt/overrides.sh ] && . /usr/lib/pvt/overrides.sh

# pvt_retry N CMD...: run CMD; while it fails because its peer is not listening yet
# ("Couldn't connect", "Connection refused", "Unable to init the socket connection", "No
# route to host" (its NIC not up yet, so ARP is not answered: seen with ucx_perftest), or
# for rdma_cm tools a CM reject with reason 8, invalid service ID, which rping prints as
# "error 8" and ucmatose as "error: 8", or a SIDR request that found no listener), retry
# up to N times, one second apart. Any other failure is returned at once. The command's
# output is printed once, from the last attempt.
pvt_retry() {
	_n=$1
	shift
	_i=0
	while :; do
		# (in an if, so that the scenario's set -e does not end the shell)
		if "$@" >/tmp/pvt_retry.out 2>&1; then _rc=0; else _rc=$?; fi
		if [ $_rc -eq 0 ] || [ $_i -ge "$_n" ] ||
			! grep -qiE "couldn't connect|connection refused|unable to init the socket connection|no route to host|failed to connect|RDMA_CM_EVENT_REJECTED, error:? 8|RDMA_CM_EVENT_UNREACHABLE" /tmp/pvt_retry.out; then
			cat /tmp/pvt_retry.out
			return $_rc
		fi
		_i=$((_i + 1))
		sleep 1
	done
}

# pvt_rxe DEV [NAME]: load soft-RoCE and create an rxe device on netdev DEV. crc32_generic
# is not a declared dependency of rdma_rxe but rxe fails without it.
pvt_rxe() {
	modprobe crc32_generic && modprobe rdma_rxe || return 1
	rdma link add "${2:-rxe0}" type rxe netdev "$1" || return 1
	_t=0
	while [ ! -e /sys/class/infiniband/"${2:-rxe0}"/ports/1/gids/1 ] && [ $_t -lt 50 ]; do
		sleep 0.1
		_t=$((_t + 1))
	done
}

# pvt_gid_index IBDEV IPV4: print the index of IBDEV's RoCE v2 GID for IPV4
# (::ffff:a.b.c.d), waiting up to 10 s for it to appear.
pvt_gid_index() {
	_want=$(echo "$2" | awk -F. '{printf "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", $1, $2, $3, $4}')
	_t=0
	while [ $_t -lt 100 ]; do
		for _g in /sys/class/infiniband/"$1"/ports/1/gids/*; do
			_i=${_g##*/}
			if [ "$(cat "$_g" 2>/dev/null)" = "$_want" ] &&
				[ "$(cat /sys/class/infiniband/"$1"/ports/1/gid_attrs/types/"$_i" 2>/dev/null)" = "RoCE v2" ]; then
				echo "$_i"
				return 0
			fi
		done
		sleep 0.1
		_t=$((_t + 1))
	done
	echo "pvt: no RoCE v2 GID for $2 on $1" >&2
	return 1
}

# pvt_send HOST PORT SECS MSG: deliver the line MSG to HOST's pvt_recv on PORT, retrying
# until it listens, for at most SECS seconds.
pvt_send() {
	_h=$1 _p=$2 _s=$3
	shift 3
	_end=$(($(cut -d. -f1 /proc/uptime) + _s))
	while ! echo "$*" | nc -w 2 "$_h" "$_p" 2>/dev/null; do
		[ "$(cut -d. -f1 /proc/uptime)" -lt "$_end" ] || { echo "pvt: no pvt_recv on $_h:$_p for '$*' within ${_s}s" >&2; return 1; }
		sleep 0.3
	done
}

# pvt_recv PORT SECS TAG: wait at most SECS seconds for a line "TAG [REST]" sent by a
# peer's pvt_send to PORT, and print REST. Lines with another tag (a peer's stale
# message) are dropped.
pvt_recv() {
	_p=$1 _end=$(($(cut -d. -f1 /proc/uptime) + $2)) _tag=$3
	while :; do
		_left=$((_end - $(cut -d. -f1 /proc/uptime)))
		[ $_left -gt 0 ] || { echo "pvt: no '$_tag' on port $_p within $2s" >&2; return 1; }
		_m=$(timeout $_left nc -l -p "$_p" </dev/null 2>/dev/null) || true
		case "$_m" in
		"$_tag") return 0 ;;
		"$_tag "*)
			echo "${_m#"$_tag" }"
			return 0
			;;
		esac
	done
}
