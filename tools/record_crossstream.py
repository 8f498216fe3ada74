#!/usr/bin/env python3
"""Record a real trace where cross-stream frees are still pending when a malloc runs out of room
under a memory fraction, so the allocator's own retry (release_cached_blocks ->
synchronize_and_free_events) completes them: the trace then shows their free_completed entries
right before the malloc's segment_free/segment_alloc/alloc entries, exactly like frees that
process_events completed at the start of a malloc. Also records ordinary process_events
completions (after a synchronize) for contrast.

    python3 tools/record_crossstream.py OUT_PREFIX [PYTORCH_CUDA_ALLOC_CONF]

writes OUT_PREFIX.pickle.gz and OUT_PREFIX.json (cap, fraction, memory_stats, log), in the shape of
../shared/traces. Needs torch and a GPU.
"""
import gzip, json, os, pickle, sys

conf = sys.argv[2] if len(sys.argv) > 2 else ""
if conf:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
import torch

MiB = 1 << 20
total = torch.cuda.get_device_properties(0).total_memory
cap = 320 * MiB
fraction = cap / total
torch.cuda.set_per_process_memory_fraction(fraction)
torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=10**7)
side = torch.cuda.Stream()
log = []
keep = []

def used_on_side(t, cycles):
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        t.add_(1)
    t.record_stream(side)

for rnd in range(6):
    # Tensors used on the side stream and freed while it is still busy: pending frees.
    pend = [torch.empty((24 + 4 * rnd) * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    for t in pend:
        used_on_side(t, 200_000_000)
    small = [torch.empty(256 * 1024, dtype=torch.uint8, device="cuda") for _ in range(4)]
    keep.append(torch.empty(8 * MiB, dtype=torch.uint8, device="cuda"))
    del pend
    # Needs more than the cap allows while the pending blocks are still held: the retry's
    # synchronize completes them, their segments are released, and the retry succeeds (or OOMs).
    try:
        big = torch.empty((180 + 10 * rnd) * MiB, dtype=torch.uint8, device="cuda")
        del big
    except torch.OutOfMemoryError as e:
        log.append({"round": rnd, "exception": str(e)})
    # Ordinary completions: a short side-stream use, a synchronize, then the next malloc's
    # process_events completes them and reuses the block.
    t = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    used_on_side(t, 1000)
    del t
    torch.cuda.synchronize()
    u = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    del u, small
    if rnd % 3 == 2:
        keep.pop(0)

# A pending block the size of the next request, with no room under the cap for a second one: the
# allocator cannot reuse the pending block (its event has not completed), runs out of room, and
# its retry's synchronize completes the block, releases its segment and allocates a new one.
keep.clear()
torch.cuda.empty_cache()
filler = torch.empty(150 * MiB, dtype=torch.uint8, device="cuda")
for rnd in range(3):
    x = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    used_on_side(x, 400_000_000)
    del x
    y = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    del y
    torch.cuda.synchronize()
del filler

torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
prefix = sys.argv[1]
with gzip.open(prefix + ".pickle.gz", "wb") as f:
    pickle.dump(snap, f, protocol=4)
meta = {
    "workload": "crossstream_oom",
    "PYTORCH_CUDA_ALLOC_CONF": conf,
    "cap_bytes": cap,
    "fraction": fraction,
    "device_total_memory": total,
    "torch": torch.__version__,
    "memory_stats": torch.cuda.memory_stats(),
    "log": log,
    "trace_entries": len(snap["device_traces"][0]),
}
json.dump(meta, open(prefix + ".json", "w"), indent=1)
print(json.dumps({"entries": meta["trace_entries"], "ooms": len(log), "retries": meta["memory_stats"]["num_alloc_retries"], "syncs": meta["memory_stats"]["num_sync_all_streams"]}))
