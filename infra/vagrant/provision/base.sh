#!/usr/bin/env bash
# Every VM: RDMA userspace (rdma-core, pyverbs) and a soft-RoCE device rxe0 on
# the private interface, brought up at every boot by kdsync-rxe.service.
# Usage: base.sh PRIVATE_IP
set -euo pipefail
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
IP="${1:?usage: base.sh PRIVATE_IP}"

apt_install rdma-core ibverbs-providers ibverbs-utils rdmacm-utils python3-pyverbs \
    iproute2 kmod python3-venv python3-pip curl ca-certificates jq

IFACE="$(iface_of "$IP")"
[ -n "$IFACE" ] || { echo "no interface carries $IP" >&2; exit 1; }
log "soft-RoCE rxe0 on $IFACE ($IP)"

cat >/etc/systemd/system/kdsync-rxe.service <<UNIT
[Unit]
Description=soft-RoCE device rxe0 on $IFACE for kdsync
After=network-online.target
Wants=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/sbin/modprobe rdma_rxe
ExecStart=/bin/sh -c 'rdma link show rxe0/1 >/dev/null 2>&1 || rdma link add rxe0 type rxe netdev $IFACE'

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now kdsync-rxe.service
for _ in $(seq 50); do
    rdma link show rxe0/1 2>/dev/null | grep -q ACTIVE && break
    sleep 0.2
done
rdma link show rxe0/1
