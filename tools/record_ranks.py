#!/usr/bin/env python3
"""Record one memory snapshot per rank of a small data-parallel training job, for `allocsim compare`
over ranks and `allocsim phases`. Run with torchrun on a machine with N GPUs:

    torchrun --nproc_per_node 2 tools/record_ranks.py OUT_DIR [--steps 12] [--spike-rank 1] [--spike-step 6]

or, on a machine with one GPU, both ranks sharing it through gloo:

    torchrun --nproc_per_node 2 tools/record_ranks.py OUT_DIR --backend gloo --one-gpu

Each rank trains the same small HF Llama (4 layers, hidden 512) with DDP and AdamW at batch 8, sequence
length 512, with `record_function` regions `forward`/`backward`/`optimizer`; at `--spike-step` the rank
`--spike-rank` gets a batch 4x as long (the step whose peak hides under the global maximum, on one rank).
History is recorded with `_record_memory_history(max_entries=10**7)` (Python stacks); each rank writes
OUT_DIR/rank{r}.pickle.gz (what `_dump_snapshot` writes, gzip'd) and OUT_DIR/rank{r}.json: the settings,
`step_peaks` (`max_memory_allocated()` after each step, with `reset_peak_memory_stats()` at each step's
start), `global_peak_allocated`, the sequence lengths, the wall-clock time (`time.time()`) of each step's
start, and the final `memory_stats()`.

What it settles: that `allocsim compare OUT_DIR` names the spiking rank and step, that every rank's
iteration peaks equal its `step_peaks`, and how far apart the ranks' trace clocks are (`time_us`).
Needs torch (2.11 was used), transformers, and N GPUs.
"""
import argparse
import gzip
import json
import os
import shutil
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--spike-rank", type=int, default=1)
    ap.add_argument("--spike-step", type=int, default=6)
    ap.add_argument("--backend", default="nccl", help="nccl (one GPU per rank) or gloo")
    ap.add_argument("--one-gpu", action="store_true",
                    help="every rank on GPU 0 (with --backend gloo; NCCL refuses two ranks on one device). Each "
                         "rank is still its own process with its own caching allocator and snapshot")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    local = 0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    os.makedirs(args.out, exist_ok=True)

    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=10**7)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = DDP(LlamaForCausalLM(cfg).cuda(), device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seqs = [512] * args.steps
    if rank == args.spike_rank and 0 <= args.spike_step < args.steps:
        seqs[args.spike_step] = 2048
    step_peaks, step_start = [], []
    for step, s in enumerate(seqs):
        torch.cuda.reset_peak_memory_stats()
        step_start.append(time.time())
        x = torch.randint(0, 32000, (8, s), device="cuda")
        with torch.autograd.profiler.record_function("forward"):
            out = model(input_ids=x, labels=x)
        with torch.autograd.profiler.record_function("backward"):
            out.loss.backward()
        del out
        with torch.autograd.profiler.record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_peaks.append(torch.cuda.max_memory_allocated())

    raw = os.path.join(args.out, f"rank{rank}.pickle")
    torch.cuda.memory._dump_snapshot(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    meta = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "device": local,
        "backend": args.backend,
        "torch": torch.__version__,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "device_total_memory": torch.cuda.get_device_properties(local).total_memory,
        "seq_lens": seqs,
        "step_peaks": step_peaks,
        "global_peak_allocated": max(step_peaks),
        "step_start_time": step_start,
        "memory_stats": {k: int(v) for k, v in torch.cuda.memory_stats().items()},
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
