#!/usr/bin/env bash
# kdsync as a systemd service: a venv that sees Debian's pyverbs
# (--system-site-packages), the project installed from /kdsync, a generated
# config, and the group secret.
# Usage: kdsync.sh NAME PRIVATE_IP ROLE PEERS PROTOCOL TRANSPORT SECRET
set -euo pipefail
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
NAME="${1:?usage: kdsync.sh NAME IP ROLE PEERS PROTOCOL TRANSPORT SECRET}"
IP="${2:?missing PRIVATE_IP}"
ROLE="${3:?missing ROLE}"
PEERS="${4:?missing PEERS}"
PROTOCOL="${5:-derecho}"
TRANSPORT="${6:-auto}"
SECRET="${7:?missing SECRET}"
HERE="$(cd "$(dirname "$0")" && pwd)"

if [ ! -x /opt/kdsync/venv/bin/python ]; then
    python3 -m venv --system-site-packages /opt/kdsync/venv
fi
/opt/kdsync/venv/bin/pip install -q --upgrade pip
/opt/kdsync/venv/bin/pip install -q /kdsync

install -d -m 0750 /etc/kdsync /var/lib/kdsync
umask 077
printf '%s\n' "$SECRET" >/etc/kdsync/secret
bash "$HERE/gen-config.sh" "$NAME" "$IP" "$ROLE" "$PEERS" "$PROTOCOL" "$TRANSPORT" /etc/kdsync/secret >/etc/kdsync/kdsync.toml
umask 022

AFTER="network-online.target kdsync-rxe.service"
[ "$ROLE" = "member" ] && AFTER="$AFTER kafka.service"
cat >/etc/systemd/system/kdsync.service <<UNIT
[Unit]
Description=kdsync member ${NAME} (${ROLE})
After=${AFTER}
Wants=${AFTER}

[Service]
ExecStart=/opt/kdsync/venv/bin/kdsync run --config /etc/kdsync/kdsync.toml
Restart=on-failure
RestartSec=2
# RDMA registers (pins) its buffers.
LimitMEMLOCK=infinity

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable kdsync.service
systemctl restart kdsync.service
log "kdsync ${NAME} started; journalctl -u kdsync -f"
