#!/usr/bin/env bash
# GPU validation, run on a machine with an NVIDIA GPU, torch and python3, from the repository root:
#
#   BIN=target/gpu/allocsim GPU_TEST=target/gpu/gpu_test EXTRA=../shared/traces OUT=out bash tools/gpu_validation.sh
#
# BIN: an allocsim built with `--features cuda`. GPU_TEST (optional): the test binary of
# crates/cuda/tests/gpu.rs (`cargo test --release -p allocsim-cuda --no-run`). EXTRA (optional): a folder
# holding synthetic__default__8810M and transformer__default__21382M (.pickle.gz) from ../shared/traces.
# Results land in $OUT: log.txt (everything printed) and results.tar.gz (the JSON outputs, the produced
# snapshots and their metadata). PARTS (default 123) picks the parts: 1 `replay --backend cuda`,
# 2 the GPU test binary, 3 the real-PyTorch oracle. See docs/gpu-validation.md.
set -u
BIN=${BIN:-target/release/allocsim}
OUT=${OUT:-out}
EXTRA=${EXTRA:-../shared/traces}
PARTS=${PARTS:-123}
mkdir -p "$OUT/res"
exec > >(tee "$OUT/log.txt") 2>&1
t0=$(date +%s)
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
uname -r
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'total', torch.cuda.get_device_properties(0).total_memory)"

# trace path | allowed maximum in bytes (empty: none)
CASES=(
  "traces/unet512__default__0M.pickle.gz|"
  "traces/multistream__default__0M.pickle.gz|"
  "traces/frag__default__2048M.pickle.gz|2147483648"
  "traces/emptycache__default__0M.pickle.gz|"
  "$EXTRA/synthetic__default__8810M.pickle.gz|9237954560"
  "$EXTRA/transformer__default__21382M.pickle.gz|22420652032"
)
name() { basename "$1" .pickle.gz; }
tagof() { case "$1" in "") echo default ;; expandable_segments:True) echo expandable ;; *) echo "$1" | tr -c 'A-Za-z0-9\n' '_' ;; esac; }

[[ $PARTS == *1* ]] && echo "== 1. allocsim replay --backend cuda (every segment event checked against cuMemGetInfo)"
for c in "${CASES[@]}"; do
  [[ $PARTS == *1* ]] || break
  T=${c%%|*}; cap=${c##*|}; [[ -f $T ]] || { echo "missing $T: skipped"; continue; }
  a=(); [[ -n $cap ]] && a=(--capacity "$cap" --trace-capacity "$cap")
  for C in "" "expandable_segments:True"; do
    k=(); [[ -n $C ]] && k=(--config "$C")
    "$BIN" replay "$T" "${k[@]}" "${a[@]}" --backend cuda --json > "$OUT/res/cuda_$(name "$T")__$(tagof "$C").json"; rc=$?
    python3 - "$OUT/res/cuda_$(name "$T")__$(tagof "$C").json" "$rc" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); g = d["gpu"]
t = ", ".join(f"{x['kind']} {x['count']}x{x['mean_us']:.1f}us" for x in g["timings"])
print(f"{d['trace']} [{d['config'] or 'defaults'}] cap={d['capacity']} (device cap {g['device_cap']}, refused by it {g['cap_refusals']}): {g['events_checked']}/{g['segment_events']} events checked, "
      f"{len(g['mismatches'])} mismatches, {g['ooms']} OOMs, leaked {g['leaked_bytes']}, same as sim: {d['same_events_as_simulated']}, "
      f"wall {g['wall_s']:.3f}s, rc={sys.argv[2]}\n    {t}")
for m in g["mismatches"][:5]: print("    MISMATCH", m)
for e in g["driver_errors"][:5]: print("    DRIVER ERROR", e)
EOF
  done
done
[[ $PARTS == *1* ]] && "$BIN" replay traces/emptycache__default__0M.pickle.gz --config expandable_segments:True --backend cuda  # text form, once

if [[ -n ${GPU_TEST:-} && $PARTS == *2* ]]; then
  echo "== 2. crates/cuda/tests/gpu.rs on the GPU"
  "$GPU_TEST" --nocapture; echo "rc=$?"
fi

[[ $PARTS == *3* ]] && echo "== 3. real-PyTorch oracle: tools/torch_replay.py, then allocsim validate / replay --addresses-from"
ORACLE=(
  "traces/emptycache__default__0M.pickle.gz||"
  "traces/emptycache__default__0M.pickle.gz||expandable_segments:True"
  "traces/frag__default__2048M.pickle.gz|2147483648|"
  "traces/frag__default__2048M.pickle.gz|2147483648|expandable_segments:True"
  "traces/frag__default__2048M.pickle.gz|2147483648|roundup_power2_divisions:[256:4,512:2,>:1]"
  "traces/frag__default__2048M.pickle.gz|2147483648|expandable_segments:True,large_segment_size_mb:64"
  "traces/frag__default__2048M.pickle.gz|2147483648|max_split_size_mb:128,garbage_collection_threshold:0.6"
  "$EXTRA/synthetic__default__8810M.pickle.gz|9237954560|"
  "$EXTRA/synthetic__default__8810M.pickle.gz|9237954560|expandable_segments:True"
  "$EXTRA/transformer__default__21382M.pickle.gz|22420652032|"
  "$EXTRA/transformer__default__21382M.pickle.gz|22420652032|roundup_power2_divisions:4"
)
for c in "${ORACLE[@]}"; do
  [[ $PARTS == *3* ]] || break
  IFS='|' read -r T cap C <<< "$c"; [[ -f $T ]] || { echo "missing $T: skipped"; continue; }
  tag=$(name "$T")__$(tagof "$C")
  a=(); [[ -n $cap ]] && a=(--capacity "$cap" --trace-capacity "$cap")
  k=(); [[ -n $C ]] && k=(--config "$C")
  v=(); [[ -n $cap ]] && v=(--capacity "$cap")
  echo "-- $tag"
  # empty_cache() calls: inferred by allocsim under the trace's own settings, applied under C.
  "$BIN" replay "$T" "${k[@]}" "${a[@]}" --json > "$OUT/res/sim_$tag.json"
  PYTHONUNBUFFERED=1 python3 tools/torch_replay.py "$T" --conf "$C" "${v[@]}" \
    --empty-cache-from "$OUT/res/sim_$tag.json" -o "$OUT/res/real_$tag.pickle.gz"; echo "torch_replay rc=$?"
  "$BIN" validate "$OUT/res/real_$tag.pickle.gz" "${v[@]}"; echo "validate rc=$?"
  "$BIN" replay "$T" "${k[@]}" "${a[@]}" --addresses-from "$OUT/res/real_$tag.pickle.gz" --json > "$OUT/res/whatif_$tag.json"
  python3 tools/torch_replay.py --compare "$OUT/res/real_$tag.pickle.gz" "$OUT/res/whatif_$tag.json"; echo "compare rc=$?"
done
echo "== done in $(( $(date +%s) - t0 )) s"
rm -f "$OUT"/res/sim_*.json
tar -czf "$OUT/results.tar.gz" -C "$OUT" res
if (( $(stat -c %s "$OUT/results.tar.gz") > 15000000 )); then  # the device tool brings back files up to 16 MB
  tar -czf "$OUT/results.tar.gz" -C "$OUT" --exclude='*.pickle.gz' res
fi
rm -rf "$OUT/res"
