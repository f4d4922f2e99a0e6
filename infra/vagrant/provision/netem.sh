#!/usr/bin/env bash
# Delays between sites with tc netem on the private interface: one prio band
# (with its own netem) per destination, selected by destination IP; all other
# traffic goes undelayed.  RoCE v2 is UDP/IP, so RDMA traffic is delayed too.
# Idempotent (replaces the root qdisc); run at every boot.
# Usage: netem.sh PRIVATE_IP "DEST_IP=MS,DEST_IP=MS,..." [JITTER_MS]
set -euo pipefail
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
IP="${1:?usage: netem.sh PRIVATE_IP DEST=MS,... [JITTER_MS]}"
SPEC="${2:-}"
JITTER="${3:-0}"

IFACE="$(iface_of "$IP")"
[ -n "$IFACE" ] || { echo "no interface carries $IP" >&2; exit 1; }
tc qdisc del dev "$IFACE" root 2>/dev/null || true
IFS=',' read -r -a ITEMS <<<"$SPEC"
[ "${#ITEMS[@]}" -gt 0 ] || { log "no delays for $IFACE"; exit 0; }
[ "${#ITEMS[@]}" -le 14 ] || { echo "at most 14 delayed destinations" >&2; exit 1; }
# Band 1 (class 1:1) is the default for everything; bands 2.. are delayed.
tc qdisc add dev "$IFACE" root handle 1: prio bands 16 priomap 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
band=2
for item in "${ITEMS[@]}"; do
    dest="${item%%=*}"
    ms="${item#*=}"
    [[ "$dest" =~ ^[0-9.]+$ && "$ms" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "bad delay item '$item' (want IP=MS)" >&2; exit 1; }
    if [ "$JITTER" != "0" ]; then
        tc qdisc add dev "$IFACE" parent "1:$band" handle "$((band * 10)):" netem delay "${ms}ms" "${JITTER}ms" distribution normal
    else
        tc qdisc add dev "$IFACE" parent "1:$band" handle "$((band * 10)):" netem delay "${ms}ms"
    fi
    tc filter add dev "$IFACE" protocol ip parent 1:0 prio 1 u32 match ip dst "$dest/32" flowid "1:$band"
    log "$IFACE -> $dest: +${ms}ms (jitter ${JITTER}ms)"
    band=$((band + 1))
done
