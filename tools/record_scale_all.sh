#!/usr/bin/env bash
# The recordings behind docs/scale.md's "Exactness on recordings", in one run on a GPU machine
# (torch 2.11, transformers): tools/record_scale.py's plan (lm, cnn, infer, one) under the default
# settings and expandable_segments:True, and its search for the largest sequence length under a
# 12 GiB set_per_process_memory_fraction cap, in three concurrent streams (each recording is a fresh
# process; the search runs three values at a time from 768, the first past its prefix, each capped).
# Everything it writes is packed into OUT (default $OUT) as rec.tar split in 15 MiB parts, with each stream's log.
# FAMILY=WORKLOAD first records tools/record_family.sh's what-if family of that workload in the
# search's stream, before the search.
#     [FAMILY=ckpt] bash tools/record_scale_all.sh [OUT]
set -u
out="${1:-$OUT}"
rec=/tmp/rec
rm -rf "$rec"; mkdir -p "$rec"/{lm,cnn,infer,one,search,family}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
# A smoke run first: a script that breaks says so in seconds, not after the whole plan.
timeout 120 python3 tools/record_scale.py run lm_seq "$rec/smoke" --prefix 128,256 --big 512 || { echo "smoke run failed"; exit 1; }
budget=${BUDGET_S:-480}
( timeout "$budget" python3 tools/record_scale.py plan "$rec/lm" --group lm ) > "$rec/lm.log" 2>&1 &
( for g in cnn infer one; do timeout "$budget" python3 tools/record_scale.py plan "$rec/$g" --group "$g"; done ) > "$rec/cnn_infer_one.log" 2>&1 &
( [ -z "${FAMILY:-}" ] || { timeout 200 bash tools/record_family.sh "$FAMILY" "$rec/family"; }; timeout "$budget" python3 tools/record_scale.py search "$rec/search" --workload lm_seq --cap-mib 12288 --step 128 --start 768 --jobs 3 --max 8192 ) > "$rec/search.log" 2>&1 &
wait
cp "$rec"/*.log "$out/" 2>/dev/null
tar -C "$rec" -cf /tmp/rec.tar .
split -b 15M -d /tmp/rec.tar "$out/rec.tar."
ls -la "$out"
