#!/usr/bin/env bash
# Build (or reuse) the soft-RoCE test guest: a Debian bookworm root made with
# debootstrap, packed into an ext4 image with `mkfs.ext4 -d` (no loop mount),
# plus the kernel and initrd to boot it with qemu -kernel/-initrd.
#
# The result is cached under $KDSYNC_VM_CACHE (default
# ${XDG_CACHE_HOME:-~/.cache}/kdsync-rdma-vm/<key>), keyed on the package list,
# the kernel pin, the mirror and the boot stub, so a rerun only boots.
#
# Prints the image directory on stdout (last line).  Exit codes: 0 ok,
# 3 the environment cannot build it (reason on stderr, prefixed "skipped:").
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Kernel pin: the ABI package linux-image-amd64 6.1.176-1 (bookworm 12.13)
# depends on.  Override both together if the mirror moves on.
KERNEL_PKG="${KDSYNC_VM_KERNEL_PKG:-linux-image-6.1.0-50-amd64}"
KERNEL_VERSION="${KDSYNC_VM_KERNEL_VERSION:-6.1.176-1}"
SUITE=bookworm
IMAGE_SIZE="${KDSYNC_VM_IMAGE_SIZE:-1800M}"
# Bump when the image recipe below changes (part of the cache key).
RECIPE=2

skip() { echo "skipped: $*" >&2; exit 3; }
log() { echo "[build-image] $*" >&2; }

mirror() {
    # The Debian mirror apt already uses on this host (deb822 or one-line form).
    local m=""
    if [ -n "${KDSYNC_VM_MIRROR:-}" ]; then echo "$KDSYNC_VM_MIRROR"; return; fi
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        m=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
        m=$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
    fi
    echo "${m:-http://deb.debian.org/debian}"
}

MIRROR="$(mirror)"
mapfile -t PKGS < <(grep -v '^\s*#' "$HERE/packages.txt" | sed '/^\s*$/d')
KEY=$( { printf '%s\n' "$RECIPE" "$SUITE" "$MIRROR" "$KERNEL_PKG=$KERNEL_VERSION" "$IMAGE_SIZE" "${PKGS[@]}"; cat "$HERE/guest-boot.sh"; } | sha256sum | cut -c1-16)
CACHE_ROOT="${KDSYNC_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kdsync-rdma-vm}"
DEST="$CACHE_ROOT/$KEY"

if [ -f "$DEST/ready" ]; then
    log "cached image $DEST"
    echo "$DEST"
    exit 0
fi

[ "$(id -u)" = 0 ] || skip "building the guest image needs root (debootstrap); run as root or prebuild $DEST"

need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -q >&2 || skip "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2 \
        || skip "cannot install ${need[*]} with apt-get"
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache (two test runs may start together); the
# second one finds the image ready once it gets the lock.
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [ -f "$DEST/ready" ]; then
    log "image built meanwhile: $DEST"
    echo "$DEST"
    exit 0
fi
WORK="$(mktemp -d "$CACHE_ROOT/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
ROOT="$WORK/root"
INCLUDE="$KERNEL_PKG,$(IFS=,; echo "${PKGS[*]}")"
log "debootstrap $SUITE from $MIRROR (kernel $KERNEL_PKG $KERNEL_VERSION)"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
    tail -20 "$WORK/debootstrap.log" >&2
    skip "debootstrap failed (log above)"
}
# shellcheck disable=SC2016  # dpkg-query format, not a shell expansion
got=$(chroot "$ROOT" dpkg-query -W -f '${Version}' "$KERNEL_PKG" 2>/dev/null || true)
if [ "$got" != "$KERNEL_VERSION" ]; then
    log "kernel pin mismatch: mirror served $KERNEL_PKG '$got', pinned '$KERNEL_VERSION'"
    skip "pinned kernel $KERNEL_PKG=$KERNEL_VERSION not served by $MIRROR; set KDSYNC_VM_KERNEL_PKG/KDSYNC_VM_KERNEL_VERSION"
fi
install -m 0755 "$HERE/guest-boot.sh" "$ROOT/sbin/kdsync-vm-boot"
# A small initramfs with just what finds the root disk: under emulation,
# unpacking and probing the default one ("most" modules) costs ~20 s a boot.
printf 'MODULES=list\nCOMPRESS=gzip\n' >"$ROOT/etc/initramfs-tools/conf.d/kdsync-vm"
printf 'virtio_pci\nvirtio_blk\next4\n' >"$ROOT/etc/initramfs-tools/modules"
chroot "$ROOT" update-initramfs -u -k all >>"$WORK/debootstrap.log" 2>&1 || skip "update-initramfs failed in the guest root"
echo kdsync-vm >"$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n10.0.2.15 kdsync-vm\n' >"$ROOT/etc/hosts"
# Versions actually installed, for the results file.
# shellcheck disable=SC2016
chroot "$ROOT" dpkg-query -W -f '${Package} ${Version}\n' >"$WORK/packages.lock"
# Drop what the tests never need (apt lists and caches) to keep the image small.
rm -rf "$ROOT/var/cache/apt/archives"/*.deb "$ROOT/var/lib/apt/lists"/*
mkdir -p "$WORK/out"
cp "$ROOT"/boot/vmlinuz-* "$WORK/out/vmlinuz"
cp "$ROOT"/boot/initrd.img-* "$WORK/out/initrd.img"
mkfs.ext4 -q -L kdsync-vm -d "$ROOT" "$WORK/out/disk.img" "$IMAGE_SIZE" >&2
cp "$WORK/packages.lock" "$WORK/debootstrap.log" "$WORK/out/"
rm -rf "$DEST"
mv "$WORK/out" "$DEST"
touch "$DEST/ready"
# Images of older recipes/pins are dead weight (~2 GB each): drop them.
find "$CACHE_ROOT" -mindepth 1 -maxdepth 1 -type d ! -name "$KEY" ! -name 'build.*' -exec rm -rf {} +
log "built $DEST"
echo "$DEST"
