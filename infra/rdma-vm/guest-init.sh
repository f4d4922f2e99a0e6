#!/bin/sh
# Runs inside the test guest (started by /sbin/kdsync-vm-boot, output goes to
# /mnt/out/guest.log).  Brings up eth0 and a soft-RoCE device rxe0 on it, then
# runs the in-VM tests (tests/rdma) with the guest's python3 and Debian's
# python3-pyverbs.  Results land in /mnt/out: junit.xml, results.json (written
# by the tests), vm-info.txt, and exit_code (pytest's exit status).
set -u
OUT=/mnt/out
SRC=/mnt/src
echo "== kdsync rdma guest: $(uname -r), $(nproc) cpu(s), up $(cut -d' ' -f1 /proc/uptime)s"
# No udev in the guest: load the NIC driver ourselves (the initramfs only
# carries what finds the root disk).
modprobe virtio_net 2>/dev/null || true
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 100 ]; do
    i=$((i + 1)); sleep 0.1
done
ip link set lo up
# Jumbo frames, as a RoCE deployment would use: rxe's RoCE MTU follows the
# netdev (1500 -> 1024, 9000 -> 4096), and under emulation rxe is bound by
# packets per second, so this is 4-5x the RDMA throughput.  All test traffic
# stays inside the guest, so qemu's user network never sees these frames.
ip link set eth0 mtu 9000
ip link set eth0 up
# qemu user networking: the guest is always 10.0.2.15/24, gateway 10.0.2.2.
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2 2>/dev/null || true
modprobe rdma_rxe || { echo "modprobe rdma_rxe failed"; echo 97 >"$OUT/exit_code"; exit 97; }
modprobe rdma_ucm 2>/dev/null || true
rdma link add rxe0 type rxe netdev eth0 || { echo "rdma link add failed"; echo 98 >"$OUT/exit_code"; exit 98; }
# Wait for the port to become ACTIVE (it is immediate with eth0 up, but poll).
i=0
while [ $i -lt 50 ]; do
    rdma link show rxe0/1 2>/dev/null | grep -q ACTIVE && break
    i=$((i + 1)); sleep 0.1
done
{
    echo "kernel: $(uname -r)"
    echo "cpus: $(nproc)"
    rdma link show
    ibv_devices
    ls /sys/class/infiniband/rxe0/ports/1/gids/ >/dev/null 2>&1 && echo "gid0: $(cat /sys/class/infiniband/rxe0/ports/1/gids/0)"
    echo "rxe0 active_mtu: $(cat /sys/class/infiniband/rxe0/ports/1/active_mtu 2>/dev/null || ibv_devinfo -d rxe0 | awk '/active_mtu/ {print $2}')"
    python3 -c 'import sys, pyverbs; print("python", sys.version.split()[0], "pyverbs", getattr(pyverbs, "__version__", "?"))'
} >"$OUT/vm-info.txt" 2>&1
cat "$OUT/vm-info.txt"
# shellcheck disable=SC3045  # dash supports -l; root has CAP_IPC_LOCK anyway
ulimit -l unlimited 2>/dev/null || true
cd /tmp || exit 1
# the project's virtualenv (shared with the source) gives the guest confluent-kafka and the Tansu binary
export KDSYNC_IN_VM=1 KDSYNC_VM_OUT="$OUT" KDSYNC_RDMA_ADDR=10.0.2.15 PYTHONPATH="$SRC:$SRC/.venv/lib/python3.11/site-packages" PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
if [ -f "$OUT/cmd" ]; then
    echo "== custom command: $(cat "$OUT/cmd")"
    sh "$OUT/cmd"
    rc=$?
else
    python3 -m pytest -p no:cacheprovider -o addopts="" -o cache_dir=/tmp/.pytest_cache --rootdir="$SRC" \
        -v --junitxml="$OUT/junit.xml" "$SRC/tests/rdma"
    rc=$?
fi
echo "== tests exit $rc"
echo "$rc" >"$OUT/exit_code"
sync
exit 0
