#!/usr/bin/env bash
# PyTorch's allocator tests (test/test_cuda.py, a trimmed copy in .ptsrc/test/ — not committed: it
# is PyTorch's code) and tools/record_test_cuda.py's scenarios, recorded in one run on a GPU
# machine, one test at a time (several of them size their allocations by the device's free
# memory), packed into OUT (default $OUT) as tc.tar (split into tc.tar.00, tc.tar.01, ... of
# 15 MiB when larger: `cat tc.tar.* > tc.tar`).
#     bash tools/record_test_cuda_all.sh [OUT]
# Needs .ptsrc/ and .whl/ (the expecttest wheel, and ninja's as a fallback) carried along.
# Environment: BUDGET_S (seconds for all the tests, default 420), SCENARIOS_S (default 120),
# JOB_TIMEOUT_S (one test under one settings, default 150), SKIP_TESTS, SKIP_SCENARIOS.
set -u
out="${1:-$OUT}"
rec=/tmp/tc
rm -rf "$rec"; mkdir -p "$rec"/tests "$rec"/scenarios
export PYTHONUNBUFFERED=1
# torch's test helpers import expecttest, which the machine lacks: carried as a wheel in .whl/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# load_inline (TestMemPool's dummy allocator) runs `ninja`: the image's own if it has one, else
# the wheel's (pip --target puts its binary in /tmp/site/bin)
[ -d /tmp/site/bin ] && export PATH="$PATH:/tmp/site/bin"
# one build folder for all the test processes, so each source of the extension is built once
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions MAX_JOBS="${MAX_JOBS:-$(nproc)}"
mkdir -p "$TORCH_EXTENSIONS_DIR"
{
  echo "== toolchain"
  for t in c++ g++ gcc nvcc ninja; do printf '%s: ' "$t"; command -v "$t" || echo "not found"; done
  ninja --version 2>&1 | head -1
  python3 -c 'import sys, torch, numpy, expecttest; from torch.utils import cpp_extension as c; print(sys.version.split()[0], torch.__version__, torch.version.git_version, "cuda", torch.version.cuda, "CUDA_HOME", c.CUDA_HOME, "numpy", numpy.__version__)' 2>&1
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1
} | tee "$rec/env.log"
if ! (cd .ptsrc/test && python3 -c "import test_cuda") > /tmp/imp.log 2>&1; then
  cp /tmp/imp.log "$rec/import.log"; tail -20 /tmp/imp.log
  tar -C "$rec" -cf "$out/tc.tar" .; exit 1
fi
# The same list as tools/record_test_cuda.py's DEFAULT_TESTS, each in the class test_cuda.py
# defines it in. The five TestMemPool tests after test_mempool_multithread load_inline a dummy
# allocator (C++ compiler, ninja, CUDA headers): the three with check_vars=True first, then the two
# with check_vars=False, so that each source is compiled once.
tests=(TestCuda.test_out_of_memory_retry TestCuda.test_set_per_process_memory_fraction
  TestCuda.test_record_stream TestCuda.test_caching_allocator_record_stream_oom
  TestCudaMallocAsync.test_max_split_expandable TestCudaMallocAsync.test_garbage_collect_expandable
  TestCudaMallocAsync.test_allocator_settings TestCudaMallocAsync.test_notifies_oom
  TestMemPool.test_mempool_no_split TestMemPool.test_mempool_empty_cache
  TestMemPool.test_mempool_multithread
  TestMemPool.test_mempool_empty_cache_inactive TestMemPool.test_mempool_with_allocator
  TestMemPool.test_tensor_delete_after_allocator_delete
  TestMemPool.test_mempool_expandable TestMemPool.test_deleted_mempool_not_used_on_oom)
budget=${BUDGET_S:-420}
jt=${JOB_TIMEOUT_S:-150}
[ -n "${SKIP_TESTS:-}" ] || timeout "$budget" python3 tools/record_test_cuda.py --pytorch-src .ptsrc "$rec/tests" \
  --job-timeout "$jt" --tests "${tests[@]}" 2>&1 | tee "$rec/tests.log"
[ -n "${SKIP_SCENARIOS:-}" ] || timeout "${SCENARIOS_S:-120}" python3 tools/record_test_cuda.py --scenarios "$rec/scenarios" \
  --job-timeout "$jt" 2>&1 | tee "$rec/scenarios.log"
tar -C "$rec" -cf "$out/tc.tar" .
# what comes back from the device machine: files of at most 16 MiB each, 8 files, 64 MiB in all
if [ "$(stat -c %s "$out/tc.tar")" -gt $((15 << 20)) ]; then
  split -b 15m -d "$out/tc.tar" "$out/tc.tar." && rm "$out/tc.tar"
fi
ls -la "$out"
