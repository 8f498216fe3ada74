#!/usr/bin/env bash
# A what-if family in ../shared/traces' layout for one workload of tools/record_field.py, on a GPU
# machine: WORKLOAD__default__0M (uncapped, recorded from the first allocation: the input), then the
# same workload under a cap of FRACTION (default 0.6) of that run's peak reserved, under each of the
# five settings (default, expandable, rpd4, msplit128, gc06): WORKLOAD__CONF__CAPM. fidelity.py
# (../shared/tools) scores allocsim's what-if answers against them.
#     bash tools/record_family.sh WORKLOAD OUT_DIR [FRACTION]
set -u
w=$1; out=$2; frac=${3:-0.6}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 150 python3 tools/record_field.py "$w" "$out/${w}__default__0M" --from-start || exit 1
cap=$(python3 -c "import json; m=json.load(open('$out/${w}__default__0M.json')); print(int(m['max_memory_reserved'] * $frac) >> 20)")
echo "cap ${cap} MiB"
declare -A conf=([default]="" [expandable]="expandable_segments:True" [rpd4]="roundup_power2_divisions:4"
                 [msplit128]="max_split_size_mb:128" [gc06]="garbage_collection_threshold:0.6")
for c in default expandable rpd4 msplit128 gc06; do
  timeout 150 python3 tools/record_field.py "$w" "$out/${w}__${c}__${cap}M" --from-start --cap-mib "$cap" --conf "${conf[$c]}"
  echo "-- ${w}__${c}__${cap}M rc=$?"
done
