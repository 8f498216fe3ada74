#!/usr/bin/env bash
# Record the field-like workloads of tools/record_field.py on a GPU machine with torch, from the repository root:
#
#   OUT=out GROUP=oom bash tools/record_field.sh
#
# GROUP picks the runs (one or more, space-separated): `oom` (device full, neighbour moving, fraction caps, C++ stacks, Llama), `pools`
# (MemPool, shared graph pools), `compile` (torch.compile reduce-overhead),
# `capture` (graph capture by batch size: input and checks for graph capture cost predictions), `random` (MemPools used at random, four seeds), `heldout2` (a second
# MemPool serving pattern), `heldout` (pool and compile variants kept apart to check the pool model on runs it was not built from), `stacks`
# (C++ frames, the default stacks="all"). Each run is a fresh process with a
# time limit; results land in $OUT as res.tar.part-* (15 MB pieces: cat them and untar) and log.txt.
set -u
OUT=${OUT:-out}
GROUP=${GROUP:-oom}
LIMIT=${LIMIT:-150}
mkdir -p "$OUT/res"
exec > >(tee "$OUT/log.txt") 2>&1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
ES=expandable_segments:True
DEADLINE=${DEADLINE:-520}  # seconds after which remaining runs are skipped (results still packed)
run() {  # name workload flags...
  local name=$1; shift
  if (( $(date +%s) - t0 > DEADLINE )); then echo "-- $name skipped (deadline)"; return; fi
  local s=$(date +%s)
  PYTHONUNBUFFERED=1 timeout "$LIMIT" python3 tools/record_field.py "$1" "$OUT/res/$name" "${@:2}"
  echo "-- $name rc=$? $(( $(date +%s) - s )) s"
}
for G in $GROUP; do
case $G in
oom)
  run devfull_frag__default frag --leave-mib 2200
  run devfull_frag__expandable frag --leave-mib 2200 --conf $ES
  run devfull_train__default train --leave-mib 4096
  run devfull_train__expandable train --leave-mib 4096 --conf $ES
  run devfull_findbatch__default findbatch --leave-mib 5120 --defaults
  run devfull_findbatch__expandable findbatch --leave-mib 5120 --conf $ES
  run neighbour__default neighbour --leave-mib 6144
  run neighbour__expandable neighbour --leave-mib 6144 --conf $ES
  run fraccap_findbatch__default findbatch --cap-mib 5120
  run fraccap_findbatch__expandable findbatch --cap-mib 5120 --conf $ES
  run fraccap_train__gc06msplit128 train --cap-mib 4096 --conf garbage_collection_threshold:0.6,max_split_size_mb:128
  run tiny_stacks_all__default tiny --defaults
  run tiny_annotations__default tiny --defaults --annotations
  run llama_train__default llama --stacks python
  run llama_train_stacks_all__default llama --defaults
  run llama_oom__default llama_oom --cap-mib 6144 --defaults
  ;;
pools)
  run mempool__default mempool
  run mempool__expandable mempool --conf $ES
  run mempool_nested__default mempool_nested
  run mempool_nested__expandable mempool_nested --conf $ES
  run mempool_oom__default mempool_oom --cap-mib 600
  run graphs__default graphs
  run graphs__expandable graphs --conf $ES
  ;;
compile)
  run compile_infer__default compile_infer --compile-context
  run compile_infer__expandable compile_infer --conf $ES --compile-context
  run compile_train__default compile_train --compile-context
  run compile_train__expandable compile_train --conf $ES --compile-context
  ;;
heldout)
  run mempool_serving__default mempool_serving
  run mempool_serving__expandable mempool_serving --conf $ES
  run graph_batches__default graph_batches
  run graph_batches__expandable graph_batches --conf $ES
  run compile_infer2__default compile_infer2 --compile-context
  run compile_infer2__expandable compile_infer2 --conf $ES --compile-context
  ;;
capture)
  BATCHES=256,128,64,32,16,8,4,2,1 run capture_a__default graph_capture
  BATCHES=512,384,256,192,128,96,64,48,32,24,16,8,4,2,1 run capture_b__default graph_capture
  BATCHES=64,32,16,8 run capture_c__default graph_capture
  BATCHES=256,128,64,32,16,8,4,2,1 run capture_a__expandable graph_capture --conf $ES
  BATCHES=512,384,256,192,128,96,64,48,32,24,16,8,4,2,1 run capture_b__expandable graph_capture --conf $ES
  ;;
random)
  for seed in 1 2 3 4; do
    SEED=$seed run mempool_random${seed}__default mempool_random
    SEED=$seed run mempool_random${seed}__expandable mempool_random --conf $ES
  done
  ;;
heldout2)
  run mempool_serving2__default mempool_serving2
  run mempool_serving2__expandable mempool_serving2 --conf $ES
  ;;
stacks)
  run tiny_stacks_all__default tiny --defaults
  ;;
esac
done
echo "== done in $(( $(date +%s) - t0 )) s"
ls -la "$OUT/res"
tar -cf - -C "$OUT" res | split -b 15000000 - "$OUT/res.tar.part-"
rm -rf "$OUT/res"
ls -la "$OUT"
