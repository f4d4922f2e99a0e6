#!/usr/bin/env bash
# kdsync as a systemd service: a venv that sees Debian's pyverbs
# (--system-site-packages), the project installed from /kdsync, a generated
# config, the group secret, and the unit from packaging/systemd/.
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
ROOT="$(cd "$HERE/../../.." && pwd)"  # the project (/kdsync in the VMs)

if [ ! -x /opt/kdsync/venv/bin/python ]; then
    python3 -m venv --system-site-packages /opt/kdsync/venv
fi
/opt/kdsync/venv/bin/pip install -q --upgrade pip
/opt/kdsync/venv/bin/pip install -q /kdsync

# The service runs as user kdsync; its state directory (/var/lib/kdsync) is made by systemd (StateDirectory).
id -u kdsync >/dev/null 2>&1 || useradd --system --home-dir /var/lib/kdsync --shell /usr/sbin/nologin kdsync
install -d -m 0750 -o root -g kdsync /etc/kdsync
umask 027
printf '%s\n' "$SECRET" >/etc/kdsync/secret
bash "$HERE/gen-config.sh" "$NAME" "$IP" "$ROLE" "$PEERS" "$PROTOCOL" "$TRANSPORT" /etc/kdsync/secret >/etc/kdsync/kdsync.toml
chgrp kdsync /etc/kdsync/secret /etc/kdsync/kdsync.toml
umask 022

# The unit is the packaged one (one source of truth); the testbed only adds its ordering.
install -m 0644 "$ROOT/packaging/systemd/kdsync.service" /etc/systemd/system/kdsync.service
AFTER="network-online.target kdsync-rxe.service"
[ "$ROLE" = "member" ] && AFTER="$AFTER kafka.service"
install -d /etc/systemd/system/kdsync.service.d
cat >/etc/systemd/system/kdsync.service.d/testbed.conf <<UNIT
[Unit]
Description=kdsync member ${NAME} (${ROLE})
After=${AFTER}
Wants=${AFTER}
UNIT
systemctl daemon-reload
systemctl enable kdsync.service
systemctl restart kdsync.service
log "kdsync ${NAME} started; journalctl -u kdsync -f"
