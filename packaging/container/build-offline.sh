#!/usr/bin/env bash
# Build the kdsync image where no container registry can be reached: a
# stand-in for python:3.11-slim-bookworm is made from Debian's own packages
# (debootstrap: Debian bookworm, python3 3.11, pip, venv), imported into podman,
# and the Containerfile is built on it with PYTHON_IMAGE pointing there.
# Needs root, podman, debootstrap and access to a Debian mirror and to PyPI.
# Usage: packaging/container/build-offline.sh [TAG]   (default localhost/kdsync:dev)
set -euo pipefail
TAG="${1:-localhost/kdsync:dev}"
BASE="localhost/kdsync-python-base:3.11-bookworm"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if ! podman image exists "$BASE"; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
        bookworm "$work/rootfs" "$MIRROR"
    # what the official python image offers: `python`, and pip allowed to install system-wide
    ln -sf python3 "$work/rootfs/usr/bin/python"
    rm -f "$work"/rootfs/usr/lib/python3.*/EXTERNALLY-MANAGED
    # trust what the build host trusts (a site's TLS-intercepting proxy CA, for one)
    cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
    tar -C "$work/rootfs" -c . | podman import --change 'CMD ["python3"]' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$BASE"
fi
# --network host: the build stage fetches the pinned wheels from PyPI.  --isolation chroot: RUN steps
# without an OCI runtime (crun refuses hosts with hybrid cgroups v1/v2, as found on this build machine).
podman build --isolation chroot --network host --build-arg "PYTHON_IMAGE=$BASE" -f "$ROOT/packaging/container/Containerfile" \
    -t "$TAG" "$ROOT"
