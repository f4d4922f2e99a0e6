#!/bin/sh
# Runs inside the test guest (started by /sbin/kdsync-vm-boot, output goes to
# /mnt/out/guest.log).  Brings up eth0 and a soft-RoCE device rxe0 on it, then
# runs the in-VM tests (tests/rdma) with the guest's python3 and Debian's
# python3-pyverbs.  Results land in /mnt/out: junit.xml, results.json (written
# by the tests), vm-info.txt, and exit_code (pytest's exit status).
# Which tests: /mnt/out/suite (written by run-tests.sh): "ci" (the default:
# every behaviour once), "bench" (the RDMA/TCP measurements of make bench),
# "stress" (member starts, KDSYNC_STRESS_STARTS from /mnt/out/stress_starts).
# Native crashes: core files are kept (ulimit -c, core_pattern below); when
# the tests fail, the members' logs, faulthandler's stacks, the cores and
# gdb's backtrace of each core go to /mnt/out/artifacts.
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
# Keep a core of any process that crashes (a member's SIGSEGV): every test's
# processes inherit this limit, and the kernel writes the core here.
mkdir -p /tmp/cores
# shellcheck disable=SC3045
ulimit -c unlimited 2>/dev/null || true
echo '/tmp/cores/core.%e.%p.%t' >/proc/sys/kernel/core_pattern 2>/dev/null || true
echo 0 >/proc/sys/kernel/core_uses_pid 2>/dev/null || true
# What a failure leaves for the reader: every member's log (its last lines
# hold faulthandler's stack of every thread after a native crash), the cores
# and gdb's stack of every thread in each.
keep_artifacts() {
    A="$OUT/artifacts"
    mkdir -p "$A"
    if [ -d /tmp/kdsync-tests ]; then
        (cd /tmp/kdsync-tests && find . -name '*.log' -size -20M -print | tar -cf - -T - 2>/dev/null) | tar -xf - -C "$A" 2>/dev/null
    fi
    n=0
    for c in /tmp/cores/core.*; do
        [ -f "$c" ] || continue
        n=$((n + 1))
        exe=python3
        echo "== core $c"
        GDB=$(command -v gdb-minimal || command -v gdb)
        if [ -n "$GDB" ]; then
            "$GDB" -batch -nx -ex 'info sharedlibrary' -ex 'thread apply all bt' "$(command -v $exe)" "$c" \
                >"$A/$(basename "$c").gdb.txt" 2>&1
            grep -A25 '^Thread 1 ' "$A/$(basename "$c").gdb.txt" | head -40
        fi
        # the first three cores themselves (a few hundred MB each at most)
        [ $n -le 3 ] && cp "$c" "$A/"
    done
    echo "== kept $(find "$A" -type f | wc -l) file(s) in artifacts/ ($n core(s))"
}
# A suite that overruns its budget is killed with qemu: keep what it left a
# little before that (run-tests.sh writes the guest's share of the budget).
if [ -f "$OUT/guest_budget" ]; then
    (sleep "$(cat "$OUT/guest_budget")"; echo "== budget spent: keeping artifacts"; keep_artifacts) &
    WATCHDOG=$!
else
    WATCHDOG=
fi
cd /tmp || exit 1
# the project's virtualenv (shared with the source) gives the guest confluent-kafka and the Tansu binary
export KDSYNC_IN_VM=1 KDSYNC_VM_OUT="$OUT" KDSYNC_RDMA_ADDR=10.0.2.15 PYTHONPATH="$SRC:$SRC/.venv/lib/python3.11/site-packages" PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
if [ -f "$OUT/cmd" ]; then
    echo "== custom command: $(cat "$OUT/cmd")"
    sh "$OUT/cmd"
    rc=$?
else
    SUITE="$(cat "$OUT/suite" 2>/dev/null || echo ci)"
    EXTRA=
    case "$SUITE" in
        ci) MARK="not bench and not stress" ;;
        bench) MARK="bench" ;;
        stress) MARK="stress"; EXTRA="-s"; KDSYNC_STRESS_STARTS="$(cat "$OUT/stress_starts" 2>/dev/null || echo 300)"
                KDSYNC_STRESS_KIND="$(cat "$OUT/stress_kind" 2>/dev/null || echo transport)"
                export KDSYNC_STRESS_STARTS KDSYNC_STRESS_KIND ;;
        all) MARK="not stress" ;;
        *) echo "unknown suite $SUITE"; echo 96 >"$OUT/exit_code"; exit 96 ;;
    esac
    echo "== suite $SUITE (-m \"$MARK\" ${EXTRA:-})"
    python3 -m pytest -p no:cacheprovider -o addopts="" -o cache_dir=/tmp/.pytest_cache --rootdir="$SRC" \
        --basetemp=/tmp/kdsync-tests --durations=0 -m "$MARK" ${EXTRA:-} \
        -v --junitxml="$OUT/junit.xml" "$SRC/tests/rdma"
    rc=$?
fi
echo "== tests exit $rc"
kill "$WATCHDOG" 2>/dev/null
cores=$(find /tmp/cores -type f 2>/dev/null | wc -l)
if [ "$rc" != 0 ] || [ "$cores" != 0 ]; then
    keep_artifacts
fi
echo "$rc" >"$OUT/exit_code"
sync
exit 0
