#!/usr/bin/env bash
# The bench across sites: write concurrently into the source topic of every
# site's Kafka, wait until every site's global topic holds all of it, then
# run `kdsync audit` over the three clusters (agreement, loss, duplicates,
# per-origin order, latency).  Run on the host, after `vagrant up`.
# Usage: infra/vagrant/bench.sh [EVENTS_PER_SITE] [RATE_PER_SITE] [OUT_DIR]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
N="${1:-5000}"
RATE="${2:-500}"
OUT="${3:-$ROOT/results/vagrant}"
NET="${KDSYNC_NET:-192.168.56}"
SITES=(dc1 dc2 dc3)
declare -A IPS=([dc1]="$NET.11" [dc2]="$NET.12" [dc3]="$NET.13")
KAFKA=/opt/kafka/bin
[[ "$N" =~ ^[0-9]+$ && "$RATE" =~ ^[0-9]+$ ]] || { echo "usage: bench.sh [EVENTS_PER_SITE] [RATE_PER_SITE] [OUT_DIR]" >&2; exit 2; }
cd "$HERE"

end_offset() {  # site topic -> summed end offset of all partitions
    vagrant ssh "$1" -c "$KAFKA/kafka-get-offsets.sh --bootstrap-server ${IPS[$1]}:9092 --topic $2 2>/dev/null" 2>/dev/null \
        | awk -F: '{s += $3} END {print s + 0}'
}

declare -A BASE
for s in "${SITES[@]}"; do BASE[$s]="$(end_offset "$s" test-global)"; done
echo "writing $N events at $RATE/s into each of ${SITES[*]} concurrently"
pids=()
for s in "${SITES[@]}"; do
    vagrant ssh "$s" -c "$KAFKA/kafka-producer-perf-test.sh --topic test --num-records $N --record-size 200 \
        --throughput $RATE --producer-props bootstrap.servers=${IPS[$s]}:9092 acks=all" >"/tmp/kdsync-bench-$s.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
want=$((N * ${#SITES[@]}))
deadline=$(( $(date +%s) + 600 ))
for s in "${SITES[@]}"; do
    while :; do
        have=$(( $(end_offset "$s" test-global) - BASE[$s] ))
        [ "$have" -ge "$want" ] && break
        [ "$(date +%s)" -lt "$deadline" ] || { echo "$s: only $have of $want events in test-global after 600 s" >&2; exit 1; }
        sleep 2
    done
    echo "$s: test-global has all $want new events"
done
clusters=()
for s in "${SITES[@]}"; do clusters+=(--cluster "$s=${IPS[$s]}:9092"); done
mkdir -p "$OUT"
"$ROOT/.venv/bin/kdsync" audit "${clusters[@]}" --topic test --out "$OUT"
echo "audit report in $OUT"
