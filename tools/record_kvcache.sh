#!/usr/bin/env bash
# Record the kvcache workload of tools/record_field.py (LLM serving with a growing K/V cache) as the
# reference traces in ../shared/traces were recorded: history from before the first allocation,
# stacks="python", under each allocator config, uncapped and under a fraction cap, on a GPU machine
# with torch, from the repository root:
#
#   OUT=out bash tools/record_kvcache.sh
#
# A short calibration run sets KV_TOKENS (unless given) so that a trace holds about $ENTRIES entries (default
# 665000); the uncapped default run's peak reserved memory sets the cap (CAP_RATIO of it, default 0.6, in MiB).
# FLAGS adds flags to every run (`--defaults`: stacks="all", as `_record_memory_history()` records
# by default). Results land in $OUT/kvcache.tar (kvcache__<config>__<cap>M.pickle.gz and the .json
# beside each: one file, as the device tool returns a few files at most) and $OUT/log.txt.
set -u
OUT=${OUT:-out}
ENTRIES=${ENTRIES:-665000}
DEADLINE=${DEADLINE:-500}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
run() {  # name flags...
  local name=$1; shift
  if (( $(date +%s) - t0 > DEADLINE )); then echo "-- $name skipped (deadline)"; return; fi
  local s=$(date +%s)
  PYTHONUNBUFFERED=1 KV_TOKENS=$KV_TOKENS timeout 240 python3 tools/record_field.py kvcache "$OUT/$name" --from-start --max-entries 50000000 ${FLAGS:-} "$@"
  echo "-- $name rc=$? $(( $(date +%s) - s )) s"
}
if [ -z "${KV_TOKENS:-}" ]; then
  KV_TOKENS=200 run calibrate
  per=$(field "$OUT/calibrate.json" "sum(d['trace_entries']) / 200")
  KV_TOKENS=$(python3 -c "print(int($ENTRIES / $per))")
  rm -f "$OUT"/calibrate.*
  echo "entries per token $per -> KV_TOKENS=$KV_TOKENS"
fi
run kvcache__default__0M
peak=$(field "$OUT/kvcache__default__0M.json" "d['max_memory_reserved']")
cap=$(python3 -c "print(int($peak * ${CAP_RATIO:-0.6}) >> 20)")
echo "peak reserved $peak -> cap ${cap} MiB"
ES=expandable_segments:True
run kvcache__default__${cap}M --cap-mib "$cap"
run kvcache__expandable__${cap}M --cap-mib "$cap" --conf $ES
run kvcache__msplit128__${cap}M --cap-mib "$cap" --conf max_split_size_mb:128
run kvcache__rpd4__${cap}M --cap-mib "$cap" --conf roundup_power2_divisions:4
run kvcache__gc06__${cap}M --cap-mib "$cap" --conf garbage_collection_threshold:0.6
run kvcache__expandable__0M --conf $ES
(cd "$OUT" && tar cf kvcache.tar kvcache__* && rm -f kvcache__*)
echo "total $(( $(date +%s) - t0 )) s"
