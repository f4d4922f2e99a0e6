#!/usr/bin/env bash
# Helpers shared by the provisioning scripts (sourced, not run).

log() { echo "[kdsync-provision] $*"; }

# The interface that carries IPv4 address $1 (the private network).
iface_of() {
    ip -o -4 addr show | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'
}

apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    if [ ! -f /var/lib/apt/periodic/kdsync-updated ]; then
        apt-get update -q
        mkdir -p /var/lib/apt/periodic && touch /var/lib/apt/periodic/kdsync-updated
    fi
    apt-get install -y -q --no-install-recommends "$@"
}
