#!/usr/bin/env bash
# Run the RDMA tests for real: build (or reuse) the Debian guest image, boot it
# under qemu (software emulation, TCG), load soft-RoCE (rdma_rxe) in the guest
# and run tests/rdma there.  The project is shared read-only over virtfs/9p;
# results come back through a second, writable 9p share.
#
# Usage: infra/rdma-vm/run-tests.sh [OUT_DIR]      (default build/rdma-vm)
#        infra/rdma-vm/run-tests.sh --budget        prints the suite's qemu limit in seconds, and exits
# Env:   KDSYNC_VM_SUITE    which in-VM tests (tests/rdma): "ci" (default: every behaviour once, what
#                           make test and make test-rdma run), "bench" (the RDMA/TCP measurements of
#                           make bench: transport round trips and throughput, four kdsync run groups),
#                           "stress" (KDSYNC_STRESS_STARTS member starts, default 300: make test-rdma-stress;
#                           KDSYNC_STRESS_KIND "transport" (default) or "member": tests/rdma/test_start_stress.py),
#                           "all" (ci and bench)
#        KDSYNC_VM_TIMEOUT  seconds before qemu is killed (default: the suite's budget, below: it scales
#                           with the work, the stress suite's with its starts)
#        KDSYNC_VM_CMD      a shell command to run in the guest instead of pytest
#        KDSYNC_VM_CACHE    image cache directory (see build-image.sh)
#        KDSYNC_VM_KERNEL_ARGS  extra kernel arguments (default "quiet"; "" shows boot messages)
# Exit:  0 tests passed, 1 tests failed, the guest did not finish or the
#        project has no virtualenv (make install: the guest imports from it),
#        3 skipped: the environment cannot run the VM (reason on stderr,
#        also written to OUT_DIR/skip_reason).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROJECT="$(cd "$HERE/../.." && pwd)"
SUITE="${KDSYNC_VM_SUITE:-ci}"
STARTS="${KDSYNC_STRESS_STARTS:-300}"
KIND="${KDSYNC_STRESS_KIND:-transport}"

# The qemu limit of each suite: the guest's boot and set-up (~25-40 s under
# TCG) plus the suite's work, with room for a box busy with other jobs (2-3x
# what the runs took: ci 222-322 s in all, stress 4.6 s a start; docs/rdma.md,
# "The VM tests").  ci's was 600 s until a CI box overran it in the suite's
# second test (the emulated guest slows far more than the host on a busy box).
budget() {
    case "$SUITE" in
        ci) echo 900 ;;
        bench) echo 1200 ;;
        all) echo 1500 ;;
        stress) if [ "$KIND" = member ]; then echo $(( 300 + STARTS * 30 )); else echo $(( 240 + STARTS * 5 )); fi ;;
        *) echo "unknown KDSYNC_VM_SUITE '$SUITE' (ci, bench, stress, all)" >&2; exit 2 ;;
    esac
}
if [ "${1:-}" = "--budget" ]; then
    budget
    exit 0
fi
OUT="${1:-$PROJECT/build/rdma-vm}"
TIMEOUT="${KDSYNC_VM_TIMEOUT:-$(budget)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -rf "$OUT"/{junit.xml,results.json,guest.log,console.log,exit_code,vm-info.txt,skip_reason,cmd,run.json,suite,stress_starts,stress_kind,guest_budget,artifacts,stress-crashes}
echo "$SUITE" >"$OUT/suite"
echo "$STARTS" >"$OUT/stress_starts"
echo "$KIND" >"$OUT/stress_kind"
# the guest keeps its artifacts (logs, cores) at this point, before qemu is killed
echo $(( TIMEOUT > 150 ? TIMEOUT - 75 : TIMEOUT / 2 )) >"$OUT/guest_budget"

skip() {
    echo "skipped: $*" >&2
    echo "$*" >"$OUT/skip_reason"
    exit 3
}
log() { echo "[rdma-vm] $*" >&2; }

# the guest imports confluent-kafka (and runs Tansu) from the project's own
# virtualenv over the read-only share (guest-init.sh): without it every test
# module fails to import after the VM's boot
SITE="$PROJECT/.venv/lib/python3.11/site-packages"
if [ ! -d "$SITE/confluent_kafka" ]; then
    echo "run-tests.sh: the guest needs the project's virtualenv: $SITE has no confluent_kafka (run: make install)" >&2
    exit 1
fi

if ! command -v qemu-system-x86_64 >/dev/null; then
    [ "$(id -u)" = 0 ] || skip "qemu-system-x86_64 is not installed and we are not root to apt-get install it"
    log "installing qemu-system-x86 debootstrap e2fsprogs"
    apt-get update -q >&2 || skip "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        qemu-system-x86 debootstrap e2fsprogs >&2 || skip "cannot apt-get install qemu-system-x86"
fi

t0=$(date +%s)
set +e
IMAGE="$(bash "$HERE/build-image.sh" | tail -n 1)"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 3 ]; then
    skip "guest image could not be built (see messages above)"
elif [ "$rc" != 0 ] || [ ! -f "$IMAGE/disk.img" ]; then
    echo "guest image build failed (exit $rc)" >&2
    exit 1
fi
t1=$(date +%s)

if [ -n "${KDSYNC_VM_CMD:-}" ]; then
    printf '%s\n' "$KDSYNC_VM_CMD" >"$OUT/cmd"
fi

# TCG: the host's /dev/kvm is a nested paravirtual KVM that cannot boot a stock
# kernel, and CI hosts may have no KVM at all; emulation is slower but certain.
log "booting guest (TCG, suite $SUITE, timeout ${TIMEOUT}s), console in $OUT/console.log"
qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -m 2048 -smp 2 \
    -kernel "$IMAGE/vmlinuz" -initrd "$IMAGE/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 init=/sbin/kdsync-vm-boot net.ifnames=0 panic=-1 ${KDSYNC_VM_KERNEL_ARGS-quiet}" \
    -drive "file=$IMAGE/disk.img,format=raw,if=virtio" -snapshot \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
    -virtfs "local,path=$PROJECT,mount_tag=src,security_model=none,readonly=on" \
    -virtfs "local,path=$OUT,mount_tag=out,security_model=none" \
    -nographic -no-reboot -monitor none -serial "file:$OUT/console.log" &
QEMU_PID=$!
# Kill only the qemu we started, if this script is interrupted.
trap 'kill "$QEMU_PID" 2>/dev/null || true' EXIT INT TERM
deadline=$(( $(date +%s) + TIMEOUT ))
while kill -0 "$QEMU_PID" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
        log "timeout after ${TIMEOUT}s: killing qemu pid $QEMU_PID"
        kill "$QEMU_PID" 2>/dev/null || true
        sleep 2
        kill -9 "$QEMU_PID" 2>/dev/null || true
        break
    fi
    sleep 1
done
wait "$QEMU_PID" 2>/dev/null || true
trap - EXIT INT TERM
t2=$(date +%s)
# the commit the guest ran (with "+changes" when the work tree differs from it): make bench names it
COMMIT="$(git -C "$PROJECT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ "$COMMIT" != unknown ] && ! git -C "$PROJECT" diff --quiet HEAD -- kdsync tests/rdma 2>/dev/null; then
    COMMIT="$COMMIT+changes"
fi
printf '{"image": "%s", "image_seconds": %d, "vm_seconds": %d, "commit": "%s", "suite": "%s", "timeout": %d}\n' \
    "$IMAGE" $((t1 - t0)) $((t2 - t1)) "$COMMIT" "$SUITE" "$TIMEOUT" >"$OUT/run.json"
log "image $((t1 - t0))s, vm $((t2 - t1))s"

if [ ! -f "$OUT/exit_code" ]; then
    if ! grep -q 'kdsync-vm' "$OUT/console.log" 2>/dev/null && [ ! -f "$OUT/guest.log" ]; then
        tail -30 "$OUT/console.log" >&2 2>/dev/null || true
        skip "the guest did not boot under qemu within ${TIMEOUT}s (console tail above)"
    fi
    echo "guest did not finish the $SUITE suite within ${TIMEOUT}s; see $OUT/guest.log" >&2
    tail -30 "$OUT/guest.log" >&2 2>/dev/null || true
    exit 1
fi
code="$(cat "$OUT/exit_code")"
tail -40 "$OUT/guest.log" >&2 || true
[ "$code" = 0 ] || { echo "in-VM tests failed (exit $code); see $OUT/guest.log and $OUT/artifacts/ (member logs, cores, gdb stacks)" >&2; exit 1; }
log "in-VM tests passed"
if command -v python3 >/dev/null && [ -f "$OUT/results.json" ]; then
    python3 - "$OUT/results.json" <<'PY' >&2 || true
import json, sys
r = json.load(open(sys.argv[1]))
p = r.get("perf", {})
for kind in ("rdma", "tcp") if p else ():
    k = p.get(kind, {})
    print(f"[rdma-vm] {kind}: RTT p50 {k.get('rtt_us_p50')} us, p99 {k.get('rtt_us_p99')} us, "
          f"{k.get('throughput_msgs_s')} msg/s of {k.get('msg_bytes_throughput')} B")
if p:
    print(f"[rdma-vm] RDMA/TCP: RTT p50 ratio {p.get('rtt_p50_rdma_over_tcp')}, throughput ratio {p.get('throughput_rdma_over_tcp')}")
g = r.get("group_rdma")
if g:
    print(f"[rdma-vm] 3-member {g.get('protocol')} group over RDMA: {g.get('events')} events agreed in {g.get('deliver_all_s')} s")
st = r.get("stress")
if st:
    print(f"[rdma-vm] stress: {st.get('starts')} member starts, {st.get('native_crashes')} native crashes, "
          f"{st.get('other_failures')} other failures in {st.get('seconds')} s")
m = r.get("member")
if m:
    print(f"[rdma-vm] kdsync run members rdma/tcp: p50 {m.get('p50_ms_ratio_rdma_over_tcp')}, "
          f"p99 {m.get('p99_ms_ratio_rdma_over_tcp')}, CPU/event {m.get('cpu_us_per_event_ratio_rdma_over_tcp')}")
PY
fi
