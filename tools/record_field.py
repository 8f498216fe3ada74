#!/usr/bin/env python3
"""Record real allocator snapshots of the kinds of jobs users bring: out of memory because another process
holds the GPU, capped with a memory fraction, MemPool and CUDA-graph private pools, torch.compile's CUDA-graph
trees, a small HF Llama trained with AdamW, history recorded with C++ stacks.

    python3 tools/record_field.py WORKLOAD OUT_PREFIX [--conf STR] [--cap-mib N] [--leave-mib N]
                                  [--stacks python|all|none] [--defaults] [--max-entries N]

writes OUT_PREFIX.pickle.gz (the bytes `torch.cuda.memory._dump_snapshot` writes, gzip'd) and OUT_PREFIX.json:
the settings, the allowed maximum (`cap_bytes`, `fraction`), the device's total memory, the neighbour process's
holdings and `cudaMemGetInfo` readings, the real `memory_stats()` at the end, every OOM message as PyTorch
printed it (with the step and region it happened in) and per-step peaks where the workload measures them.

`--leave-mib N` starts a second process (this script, `--neighbour`) that takes all of the GPU's free memory
but N MiB, as the job's own CUDA context sees it; workloads can move that target mid-run. `--cap-mib N` sets
`torch.cuda.set_per_process_memory_fraction(N MiB / total)`. `--defaults` records with
`_record_memory_history()`'s own defaults (stacks="all", context="all", no entry limit), as most users do.
Needs torch (2.11 was used) and a GPU.
"""
import argparse
import random
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------- the neighbour process
def neighbour_main():
    """Holds GPU memory on command: `leave N` frees what it holds and takes all free memory but N bytes."""
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch

    torch.zeros(1, device="cuda")
    held = []
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        if parts[0] == "leave":
            target = int(parts[1])
            held.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            n = (free - target) // (2 * MiB) * (2 * MiB)
            if n > 0:
                held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            free2, _ = torch.cuda.mem_get_info()
            print(f"ok {max(n, 0)} {free2}", flush=True)


class Neighbour:
    def __init__(self):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        self.p = subprocess.Popen([sys.executable, __file__, "--neighbour"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert self.p.stdout.readline().strip() == "ready"
        self.history = []

    def leave(self, nbytes, torch):
        torch.cuda.synchronize()
        t0 = time.time()
        self.p.stdin.write(f"leave {nbytes}\n")
        self.p.stdin.flush()
        ok, held, free = self.p.stdout.readline().split()
        assert ok == "ok"
        mine_free, total = torch.cuda.mem_get_info()
        self.history.append({"time_us": int(t0 * 1e6), "leave": nbytes, "neighbour_holds": int(held),
                             "neighbour_saw_free": int(free), "job_saw_free": mine_free,
                             "job_reserved": torch.cuda.memory_reserved()})

    def close(self):
        with contextlib.suppress(Exception):
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)
        if self.p.poll() is None:
            self.p.kill()


# ---------------------------------------------------------------- the context workloads get
class Ctx:
    def __init__(self, torch, args, neighbour):
        self.torch = torch
        self.args = args
        self.neighbour = neighbour
        self.log = []
        self.extra = {}
        self.region = "setup"
        self.step = None

    def leave(self, mib):
        self.neighbour.leave(mib * MiB, self.torch)

    def oom(self, e, **kw):
        free, total = self.torch.cuda.mem_get_info()
        self.log.append({"oom": str(e), "step": self.step, "region": self.region, "time_us": int(time.time() * 1e6),
                         "mem_get_info_after": [free, total], **kw})

    @contextlib.contextmanager
    def in_region(self, name):
        old = self.region
        self.region = name
        with self.torch.autograd.profiler.record_function(name):
            yield
        self.region = old


# ---------------------------------------------------------------- models
def lm(torch, vocab=16000, d=768, layers=6, heads=12):
    nn = torch.nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(d, vocab)

        def forward(self, x):
            return self.head(self.enc(self.emb(x)))

    return LM().cuda()


def lm_step(ctx, model, opt, batch, seq, vocab=16000):
    torch = ctx.torch
    x = torch.randint(0, vocab, (batch, seq), device="cuda")
    with ctx.in_region("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), x.view(-1))
    with ctx.in_region("backward"):
        loss.backward()
    with ctx.in_region("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss)


def find_batch(ctx, start, seq, steps_at_fit=2):
    """Halve the batch on every OOM until a step fits (what batch-size finders do), then train a little."""
    torch = ctx.torch
    model = lm(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b = start
    ctx.step = 0
    while b >= 1:
        try:
            for _ in range(steps_at_fit):
                lm_step(ctx, model, opt, b, seq)
                ctx.step += 1
            ctx.extra["fitting_batch"] = b
            break
        except torch.OutOfMemoryError as e:
            ctx.oom(e, batch=b)
            opt.zero_grad(set_to_none=True)
            b //= 2
    return model, opt


# ---------------------------------------------------------------- workloads
def w_frag(ctx):
    """300 x 6 MiB (three per 20 MiB segment), two of every three freed, then large requests that cannot use
    the holes; each OOM caught, then smaller ones that fit."""
    torch = ctx.torch
    ts = [torch.empty(6 * MiB, dtype=torch.uint8, device="cuda") for _ in range(300)]
    keep = [t for i, t in enumerate(ts) if i % 3 == 0]
    del ts
    big = []
    for sz in [256, 512, 1024, 64, 2048, 128, 32, 768, 16, 384]:
        ctx.step = sz
        try:
            big.append(torch.empty(sz * MiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            ctx.oom(e, request_mib=sz)
    del big
    # Free the rest and try once more: the cached segments are released by the retry.
    keep = keep[: len(keep) // 2]
    for sz in [1024, 1536]:
        try:
            x = torch.empty(sz * MiB, dtype=torch.uint8, device="cuda")
            del x
        except torch.OutOfMemoryError as e:
            ctx.oom(e, request_mib=sz)


def w_train(ctx):
    """A transformer LM: two steps at batch 8, then batches that grow until the first OOM, which ends the job
    (the OOM snapshot a user brings)."""
    torch = ctx.torch
    model = lm(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx.step = 0
    try:
        for b in [8, 8, 16, 32, 64, 128, 256]:
            lm_step(ctx, model, opt, b, 512)
            ctx.step += 1
    except torch.OutOfMemoryError as e:
        ctx.oom(e, batch=b)


def w_findbatch(ctx):
    find_batch(ctx, 256, 512)


def w_neighbour(ctx):
    """The neighbour's usage moves between phases; each phase trains a few steps, OOMs caught."""
    torch = ctx.torch
    model = lm(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx.step = 0
    # (free MiB the neighbour leaves, batches): the job keeps what it has cached, so a phase with little left
    # free runs out of memory only when the job needs more than its cache plus that.
    for leave, batches in [(6144, [8, 16]), (512, [16, 32, 8]), (3072, [32, 24]), (256, [16, 24, 8]), (8192, [32, 16])]:
        ctx.leave(leave)
        for b in batches:
            try:
                lm_step(ctx, model, opt, b, 512)
            except torch.OutOfMemoryError as e:
                ctx.oom(e, batch=b, leave_mib=leave)
                opt.zero_grad(set_to_none=True)
            ctx.step += 1


def w_tiny(ctx):
    """A tiny MLP, 3 steps with record_function regions: small enough for a test fixture."""
    torch = ctx.torch
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        ctx.step = step
        x = torch.randn(64 * (step + 1), 256, device="cuda")
        with ctx.in_region("forward"):
            loss = model(x).square().mean()
        with ctx.in_region("backward"):
            loss.backward()
        with ctx.in_region("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)


def llama(torch, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda()


def llama_steps(ctx, seqs, batch=8):
    import random

    torch = ctx.torch
    model = llama(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx.extra["step_peaks"] = []
    ctx.extra["seq_lens"] = seqs
    pre = torch.cuda.max_memory_allocated()
    ctx.extra["peak_before_training"] = pre
    for step, s in enumerate(seqs):
        ctx.step = step
        torch.cuda.reset_peak_memory_stats()
        x = torch.randint(0, 32000, (batch, s), device="cuda")
        try:
            with ctx.in_region("forward"):
                out = model(input_ids=x, labels=x)
            with ctx.in_region("backward"):
                out.loss.backward()
            del out
            with ctx.in_region("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError as e:
            ctx.oom(e, seq=s)
            out = None
            opt.zero_grad(set_to_none=True)
        ctx.extra["step_peaks"].append(torch.cuda.max_memory_allocated())
    ctx.extra["global_peak_allocated"] = max([pre] + ctx.extra["step_peaks"])


def w_llama(ctx):
    import random

    rng = random.Random(0)
    llama_steps(ctx, [rng.choice([128, 256, 384, 512, 768, 1024]) for _ in range(16)])


def w_llama_oom(ctx):
    import random

    rng = random.Random(1)
    seqs = [rng.choice([128, 256, 384, 512]) for _ in range(16)]
    seqs[9] = 4096  # one long batch: runs out of memory under the cap
    llama_steps(ctx, seqs)


def w_mempool(ctx):
    """Buffers allocated inside short-lived MemPools (use_mem_pool), eager work outside; pools dropped mid-run
    followed by empty_cache(), others kept alive across it."""
    torch = ctx.torch
    keep_pools = []
    live = []
    for rnd in range(8):
        ctx.step = rnd
        eager = [torch.randn(256 * 1024 * (1 + rnd % 3), device="cuda") for _ in range(4)]
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            bufs = [torch.empty((3 + 5 * rnd) * MiB, dtype=torch.uint8, device="cuda"),
                    torch.empty(100_000 * (rnd + 1), dtype=torch.uint8, device="cuda"),
                    torch.empty(24 * MiB, dtype=torch.uint8, device="cuda")]
        y = torch.empty((7 + rnd) * MiB, dtype=torch.uint8, device="cuda")
        for b in bufs:
            b.fill_(1)
        if rnd % 3 == 0:
            # drop the pool with its tensors, then empty the cache: its segments go back
            del bufs, pool
            torch.cuda.empty_cache()
        elif rnd % 3 == 1:
            # keep the pool alive, free its tensors: its cached segments survive empty_cache
            del bufs
            keep_pools.append(pool)
            torch.cuda.empty_cache()
        else:
            # the pool object dies while its tensors are alive; they are freed later
            live.append(bufs)
            del pool
        del eager, y
    live.clear()
    torch.cuda.empty_cache()
    keep_pools.clear()
    torch.cuda.empty_cache()


def w_mempool_nested(ctx):
    """Nested pools, a pool used from two streams, a pool reused after empty_cache."""
    torch = ctx.torch
    side = torch.cuda.Stream()
    outer = torch.cuda.MemPool()
    inner = torch.cuda.MemPool()
    a = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.use_mem_pool(outer):
        b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        with torch.cuda.use_mem_pool(inner):
            c = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
            d = torch.empty(4000, dtype=torch.uint8, device="cuda")
        e = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            f = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")
            g = torch.empty(50_000, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    h = torch.empty(9 * MiB, dtype=torch.uint8, device="cuda")
    del b, d, f
    torch.cuda.empty_cache()
    with torch.cuda.use_mem_pool(outer):
        b2 = torch.empty(7 * MiB, dtype=torch.uint8, device="cuda")  # reuses the pool's cached block
        with torch.cuda.stream(side):
            f2 = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del c, e, g, b2, f2, h, a
    del inner
    torch.cuda.empty_cache()
    with torch.cuda.use_mem_pool(outer):
        z = [torch.empty(s * MiB, dtype=torch.uint8, device="cuda") for s in (1, 2, 25, 3)]
    del z
    del outer
    torch.cuda.empty_cache()


def w_mempool_oom(ctx):
    """Under a fraction cap: a use_on_oom pool serves a request the default pool cannot; a no_split pool."""
    torch = ctx.torch
    spare = torch.cuda.MemPool(use_on_oom=True)
    with torch.cuda.use_mem_pool(spare):
        s = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
    del s
    ns = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(ns):
        n1 = torch.empty(MiB + 1, dtype=torch.uint8, device="cuda")
        n2 = torch.empty(1000, dtype=torch.uint8, device="cuda")
    held = []
    for i in range(12):
        ctx.step = i
        try:
            held.append(torch.empty(90 * MiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            ctx.oom(e, request_mib=90)
    del held, n1, n2
    torch.cuda.empty_cache()


def w_graphs(ctx):
    """Two CUDA graphs captured into one shared pool, replayed with eager work between, then dropped."""
    torch = ctx.torch
    m1 = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    m2 = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024)).cuda()
    x = torch.randn(512, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            m2(m1(x))
    torch.cuda.current_stream().wait_stream(s)
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool):
        y1 = m1(x)
    with torch.cuda.graph(g2, pool=pool):
        y2 = m2(y1)
    for i in range(10):
        ctx.step = i
        x.copy_(torch.randn(512, 1024, device="cuda"))
        g1.replay()
        g2.replay()
        z = [torch.empty((i + 1) * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
        del z
    torch.cuda.synchronize()
    del g1, g2, y1, y2
    torch.cuda.empty_cache()
    w = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
    del w


def mlp(torch, d=1024):
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d),
                               torch.nn.LayerNorm(d)).cuda()


def w_compile_infer(ctx):
    """torch.compile(mode="reduce-overhead") inference at several batch sizes (CUDA-graph trees re-record per
    shape), eager work between."""
    torch = ctx.torch
    model = mlp(torch).eval()
    cm = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for i, bs in enumerate([64, 64, 64, 128, 128, 128, 64, 256, 256, 256, 128, 64]):
            ctx.step = i
            out = cm(torch.randn(bs, 1024, device="cuda")).clone()
            eager = torch.empty((i % 4 + 1) * 3 * MiB, dtype=torch.uint8, device="cuda")
            del out, eager


def w_compile_train(ctx):
    """torch.compile(mode="reduce-overhead") training with AdamW at several batch sizes."""
    torch = ctx.torch
    model = mlp(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cm = torch.compile(model, mode="reduce-overhead")
    for i, bs in enumerate([64, 64, 64, 128, 128, 128, 64, 64]):
        ctx.step = i
        torch.compiler.cudagraph_mark_step_begin()
        loss = cm(torch.randn(bs, 1024, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def w_mempool_serving(ctx):
    """vLLM-like: weights in one MemPool kept for the run, a KV cache in a second pool that is dropped and
    re-created ("sleep mode"), activations outside, a pool used from a side stream."""
    torch = ctx.torch
    rng = random.Random(7)
    side = torch.cuda.Stream()
    wpool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(wpool):
        weights = [torch.empty(rng.choice([3, 9, 17, 33]) * MiB + rng.randrange(0, 4096), dtype=torch.uint8,
                               device="cuda") for _ in range(10)]
    for rnd in range(5):
        ctx.step = rnd
        kv = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(kv):
            blocks = [torch.empty((20 + 6 * rnd) * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
            small = [torch.empty(rng.randrange(512, 900_000), dtype=torch.uint8, device="cuda") for _ in range(5)]
        for i in range(6):
            act = [torch.empty(rng.randrange(1, 40) * 100_000, dtype=torch.uint8, device="cuda") for _ in range(4)]
            with torch.cuda.stream(side):
                with torch.cuda.use_mem_pool(kv):
                    extra = torch.empty(rng.randrange(1, 6) * MiB, dtype=torch.uint8, device="cuda")
                extra.fill_(0)
            side.synchronize()
            del act, extra
        del blocks[1], small[::2]
        if rnd % 2 == 0:
            del blocks, small, kv
            torch.cuda.empty_cache()
        else:
            del blocks, small
            torch.cuda.empty_cache()
            del kv
    del weights
    torch.cuda.empty_cache()
    del wpool
    torch.cuda.empty_cache()


def w_graph_batches(ctx):
    """Serving-engine style: CUDA graphs captured for several batch sizes (largest first) into one shared
    pool, replayed, then a second model's graphs into a fresh pool; eager work between."""
    torch = ctx.torch
    model = torch.nn.Sequential(torch.nn.Linear(1024, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 1024)).cuda()
    pool = torch.cuda.graph_pool_handle()
    s = torch.cuda.Stream()
    graphs = {}
    for bs in (256, 128, 64, 32, 8):
        x = torch.randn(bs, 1024, device="cuda")
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = model(x)
        graphs[bs] = (g, x, y)
    for i in range(8):
        ctx.step = i
        for bs in (8, 64, 256):
            graphs[bs][0].replay()
        tmp = torch.empty((i % 3 + 1) * 5 * MiB, dtype=torch.uint8, device="cuda")
        del tmp
    torch.cuda.synchronize()
    del graphs, g, x, y
    torch.cuda.empty_cache()
    m2 = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU()).cuda()
    g2 = torch.cuda.CUDAGraph()
    x2 = torch.randn(96, 2048, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m2(x2)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g2):
        y2 = m2(x2)
    for _ in range(3):
        g2.replay()
    torch.cuda.synchronize()
    del g2, y2
    torch.cuda.empty_cache()


def w_compile_infer2(ctx):
    """torch.compile(mode="reduce-overhead") of a deeper model, another batch-size sequence, eager work that
    stays alive across calls."""
    torch = ctx.torch
    model = torch.nn.Sequential(mlp(torch, 768), mlp(torch, 768)).eval()
    cm = torch.compile(model, mode="reduce-overhead")
    keep = []
    with torch.no_grad():
        for i, bs in enumerate([32, 32, 96, 96, 96, 32, 200, 200, 200, 96, 32, 32]):
            ctx.step = i
            out = cm(torch.randn(bs, 768, device="cuda")).clone()
            keep.append(out)
            if len(keep) > 3:
                keep.pop(0)
            tmp = torch.empty((i % 5 + 1) * 2 * MiB, dtype=torch.uint8, device="cuda")
            del tmp


def w_graph_capture(ctx):
    """CUDA-graph capture cost by batch size, as serving engines capture: a decoder-like model (weights
    eager), a warm-up per batch size on a side stream, then one graph per batch size (largest first) into
    one shared pool (`graph_pool_handle()`), replayed. The batch sizes come from $BATCHES (comma-separated,
    default 256,128,64,32,16,8,4,2,1). `extra` holds the memory readings after the weights, after each
    capture and at the end."""
    torch = ctx.torch
    batches = [int(b) for b in os.environ.get("BATCHES", "256,128,64,32,16,8,4,2,1").split(",")]
    d = 1024
    layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 4), torch.nn.Linear(d, 8000)).cuda().eval()
    seq = 16
    reading = lambda: {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}
    ctx.extra["batches"] = batches
    ctx.extra["after_weights"] = reading()
    pool = torch.cuda.graph_pool_handle()
    s = torch.cuda.Stream()
    graphs = {}
    captures = []
    with torch.no_grad():
        for bs in batches:
            ctx.step = bs
            x = torch.randn(bs, seq, d, device="cuda")
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    model(x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                y = model(x)
            graphs[bs] = (g, x, y)
            captures.append({"batch": bs, **reading()})
        ctx.extra["captures"] = captures
        for i in range(4):
            for bs in batches[::2]:
                graphs[bs][0].replay()
    torch.cuda.synchronize()
    ctx.extra["end"] = reading()


def w_mempool_serving2(ctx):
    """A second MemPool serving pattern: a pool kept alive across `empty_cache()`, a pool allocated from
    from two streams in turn, pools dropped in another order than created, eager work throughout."""
    torch = ctx.torch
    rng = random.Random(23)
    side = torch.cuda.Stream()
    keep = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(keep):
        w = [torch.empty(rng.choice([2, 5, 11, 24]) * MiB + rng.randrange(0, 9000), dtype=torch.uint8, device="cuda")
             for _ in range(8)]
    pools = []
    live = []
    for rnd in range(6):
        ctx.step = rnd
        p = torch.cuda.MemPool()
        pools.append(p)
        with torch.cuda.use_mem_pool(p):
            a = [torch.empty(rng.randrange(1, 30) * MiB // 2, dtype=torch.uint8, device="cuda") for _ in range(3)]
            b = [torch.empty(rng.randrange(512, 1_000_000), dtype=torch.uint8, device="cuda") for _ in range(4)]
        with torch.cuda.stream(side):
            with torch.cuda.use_mem_pool(p):
                c = torch.empty(rng.randrange(1, 12) * MiB, dtype=torch.uint8, device="cuda")
                c2 = torch.empty(rng.randrange(512, 400_000), dtype=torch.uint8, device="cuda")
            c.fill_(1)
        side.synchronize()
        eager = [torch.empty(rng.randrange(1, 50) * 70_000, dtype=torch.uint8, device="cuda") for _ in range(5)]
        live.append((a[0], b[1]))
        del a, b, c, c2, eager[1::2]
        if rnd % 3 == 2:
            torch.cuda.empty_cache()
        if len(pools) > 2:
            old = pools.pop(1)
            live.pop(1)
            del old
        del eager
    del w
    torch.cuda.empty_cache()
    live.clear()
    pools.clear()
    torch.cuda.empty_cache()
    del keep
    torch.cuda.empty_cache()


def w_mempool_random(ctx):
    """MemPools used at random ($SEED): 60 steps, each creating a pool, allocating in a live pool (default
    or side stream, small or large), allocating outside, freeing tensors, dropping a pool (some of its
    tensors may live on) or calling `empty_cache()`. A check of the pool inference on patterns it was not
    built from."""
    torch = ctx.torch
    rng = random.Random(int(os.environ.get("SEED", "1")))
    side = torch.cuda.Stream()
    pools, tensors = [], []
    for step in range(60):
        ctx.step = step
        op = rng.random()
        if op < 0.15 or not pools:
            pools.append(torch.cuda.MemPool())
        elif op < 0.45:
            p = rng.choice(pools)
            size = rng.choice([rng.randrange(512, 1_000_000), rng.randrange(1, 40) * MiB // 2])
            if rng.random() < 0.3:
                with torch.cuda.stream(side):
                    with torch.cuda.use_mem_pool(p):
                        t = torch.empty(size, dtype=torch.uint8, device="cuda")
                    t.fill_(0)
                side.synchronize()
            else:
                with torch.cuda.use_mem_pool(p):
                    t = torch.empty(size, dtype=torch.uint8, device="cuda")
            tensors.append(t)
        elif op < 0.7:
            tensors.append(torch.empty(rng.choice([rng.randrange(512, 1_000_000), rng.randrange(1, 30) * MiB // 3]),
                                       dtype=torch.uint8, device="cuda"))
        elif op < 0.85 and tensors:
            for _ in range(rng.randrange(1, 4)):
                if tensors:
                    tensors.pop(rng.randrange(len(tensors)))
        elif op < 0.95:
            if len(pools) > 1:
                pools.pop(rng.randrange(len(pools)))
        else:
            torch.cuda.empty_cache()
    tensors.clear()
    torch.cuda.empty_cache()
    pools.clear()
    torch.cuda.empty_cache()


def w_ckpt(ctx):
    """Activation checkpointing (each layer recomputed in backward, torch.utils.checkpoint with
    use_reentrant=False) and fused AdamW: the LM of `train` at batch 16, sequence lengths that grow
    in a fixed order until the first OOM, which ends the job. The same requests in the same order up
    to the first OOM under every setting, so capped runs of it are what-if ground truth
    (tools/record_family.sh)."""
    torch = ctx.torch
    from torch.utils.checkpoint import checkpoint

    model = lm(torch)
    layers = list(model.enc.layers)

    def forward(x):
        h = model.emb(x)
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False)
        if model.enc.norm is not None:
            h = model.enc.norm(h)
        return model.head(h)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ctx.step = 0
    seqs = [256, 512, 384, 1024, 768, 2048, 1536, 3072, 4096, 6144, 8192]
    reserved = []  # memory_reserved() after each step (peaks are not reset: memory_stats() is compared whole)
    try:
        for seq in seqs:
            x = torch.randint(0, 16000, (16, seq), device="cuda")
            with ctx.in_region("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
                logits = forward(x)
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 16000), x.view(-1))
            del logits
            with ctx.in_region("backward"):
                loss.backward()
            del loss
            with ctx.in_region("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            reserved.append(torch.cuda.memory_reserved())
            ctx.step += 1
    except torch.OutOfMemoryError as e:
        ctx.oom(e, seq=seq)
    ctx.extra["seqs"] = seqs
    ctx.extra["reserved_after_step"] = reserved


def w_kvcache(ctx):
    """LLM serving (the shape of `allocsim synth --workload kvcache`, on real kernels): a bf16 decoder of 8
    layers (d=2048, 16 heads) with a K/V cache per request and layer, grown by re-allocation every 16 tokens
    (a larger tensor, the old one copied and freed). Requests arrive with prompts of 32..1536 tokens
    (prefill in one pass), generate 16..384 tokens one at a time, and finish; up to 12 are active. On an
    OOM the request that hit it is evicted (its cache freed) and the job goes on. $KV_TOKENS decode tokens
    in all (default 2500), $SEED the arrivals."""
    torch = ctx.torch
    F = torch.nn.functional
    rng = random.Random(int(os.environ.get("SEED", "0")))
    total_tokens = int(os.environ.get("KV_TOKENS", "2500"))
    L, H, Dh, vocab = 8, 16, 128, 32000
    d = H * Dh
    dt = torch.bfloat16
    with ctx.in_region("weights"):
        emb = torch.randn(vocab, d, dtype=dt, device="cuda") * 0.02
        layers = [{"qkv": torch.randn(d, 3 * d, dtype=dt, device="cuda") * 0.02,
                   "o": torch.randn(d, d, dtype=dt, device="cuda") * 0.02,
                   "up": torch.randn(d, 4 * d, dtype=dt, device="cuda") * 0.02,
                   "down": torch.randn(4 * d, d, dtype=dt, device="cuda") * 0.02} for _ in range(L)]
    grow = 16

    def block(x, w, n, req, start):
        # x: (n, d). The cache of this layer gets the n new keys and values at start..start+n.
        qkv = x @ w["qkv"]
        q, k, v = qkv.view(n, 3, H, Dh).permute(1, 2, 0, 3).unbind(0)  # each (H, n, Dh)
        li = w["i"]
        kc, vc = req["k"][li], req["v"][li]
        need = start + n
        if kc is None or kc.shape[1] < need:
            cap = (need + grow - 1) // grow * grow
            nk = torch.empty(H, cap, Dh, dtype=dt, device="cuda")
            nv = torch.empty(H, cap, Dh, dtype=dt, device="cuda")
            if kc is not None:
                nk[:, :start] = kc[:, :start]
                nv[:, :start] = vc[:, :start]
            req["k"][li], req["v"][li] = nk, nv
            kc, vc = nk, nv
            del nk, nv
        kc[:, start:need] = k
        vc[:, start:need] = v
        a = F.scaled_dot_product_attention(q, kc[:, :need], vc[:, :need], is_causal=(n > 1))
        x = x + a.transpose(0, 1).reshape(n, d) @ w["o"]
        x = x + F.gelu(x @ w["up"]) @ w["down"]
        return x

    for i, w in enumerate(layers):
        w["i"] = i
    active, done, rid = [], 0, 0
    ctx.step = 0

    def evict(req, e):
        ctx.oom(e, request=req["id"], tokens=req["len"])
        req["k"] = req["v"] = None
        active.remove(req)

    while done < total_tokens:
        ctx.step += 1
        while len(active) < 12 and rng.random() < 0.5:
            rid += 1
            req = {"id": rid, "len": 0, "left": rng.randrange(16, 385), "k": [None] * L, "v": [None] * L}
            n = rng.randrange(32, 1537)
            try:
                with ctx.in_region("prefill"):
                    x = emb[torch.randint(0, vocab, (n,), device="cuda")]
                    for w in layers:
                        x = block(x, w, n, req, 0)
                    del x
                req["len"] = n
                active.append(req)
            except torch.OutOfMemoryError as e:
                active.append(req)
                evict(req, e)
        for req in list(active):
            try:
                with ctx.in_region("decode"):
                    x = emb[torch.randint(0, vocab, (1,), device="cuda")]
                    for w in layers:
                        x = block(x, w, 1, req, req["len"])
                    del x
            except torch.OutOfMemoryError as e:
                evict(req, e)
                continue
            req["len"] += 1
            req["left"] -= 1
            done += 1
            if req["left"] == 0:
                req["k"] = req["v"] = None
                active.remove(req)
    active.clear()


WORKLOADS = {
    "frag": w_frag,
    "train": w_train,
    "findbatch": w_findbatch,
    "neighbour": w_neighbour,
    "tiny": w_tiny,
    "llama": w_llama,
    "llama_oom": w_llama_oom,
    "mempool": w_mempool,
    "mempool_nested": w_mempool_nested,
    "mempool_oom": w_mempool_oom,
    "graphs": w_graphs,
    "compile_infer": w_compile_infer,
    "compile_train": w_compile_train,
    "mempool_serving": w_mempool_serving,
    "graph_batches": w_graph_batches,
    "compile_infer2": w_compile_infer2,
    "graph_capture": w_graph_capture,
    "mempool_serving2": w_mempool_serving2,
    "mempool_random": w_mempool_random,
    "kvcache": w_kvcache,
    "ckpt": w_ckpt,
}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--neighbour":
        return neighbour_main()
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("out")
    ap.add_argument("--conf", default="")
    ap.add_argument("--cap-mib", type=int)
    ap.add_argument("--leave-mib", type=int)
    ap.add_argument("--stacks", default="python")
    ap.add_argument("--defaults", action="store_true")
    ap.add_argument("--max-entries", type=int, default=10**7)
    ap.add_argument("--from-start", action="store_true",
                    help="start recording before the first allocation (no warm-up tensor): a complete trace")
    ap.add_argument("--compile-context", action="store_true", help="record_memory_history(compile_context=True)")
    ap.add_argument("--annotations", action="store_true", help="record_memory_history(global_record_annotations=True)")
    args = ap.parse_args()
    if args.conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.conf
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch

    t0 = time.time()
    if args.from_start:
        torch.cuda.init()
    else:
        torch.zeros(1, device="cuda")
    free0, total = torch.cuda.mem_get_info()
    neighbour = None
    fraction = None
    if args.cap_mib:
        fraction = args.cap_mib * MiB / total
        torch.cuda.set_per_process_memory_fraction(fraction)
    kw = {}
    if args.compile_context:
        kw["compile_context"] = True
    if args.annotations:
        kw["global_record_annotations"] = True
    if args.defaults:
        history = {"call": "_record_memory_history()", **kw}
        torch.cuda.memory._record_memory_history(**kw)
    elif args.stacks == "none":
        history = {"enabled": "all", "context": None, "max_entries": args.max_entries, **kw}
        torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=args.max_entries, **kw)
    else:
        history = {"enabled": "all", "context": "all", "stacks": args.stacks, "max_entries": args.max_entries, **kw}
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=args.stacks,
                                                 max_entries=args.max_entries, **kw)
    neighbour = Neighbour() if args.leave_mib is not None else None
    ctx = Ctx(torch, args, neighbour)
    if neighbour:
        ctx.leave(args.leave_mib)
    error = None
    try:
        WORKLOADS[args.workload](ctx)
    except Exception as e:  # a workload that breaks still leaves its snapshot
        error = traceback.format_exc()
        print(error, file=sys.stderr)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    raw = args.out + ".pickle"
    torch.cuda.memory._dump_snapshot(raw)
    with open(raw, "rb") as f, gzip.open(args.out + ".pickle.gz", "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)
    raw_size = os.path.getsize(raw)
    os.remove(raw)
    snap_entries = None
    with contextlib.suppress(Exception):
        snap_entries = [len(t) for t in torch.cuda.memory._snapshot()["device_traces"]]
    props = torch.cuda.get_device_properties(0)
    meta = {
        "workload": args.workload,
        "PYTORCH_CUDA_ALLOC_CONF": args.conf,
        "cap_bytes": int(fraction * total) if fraction else None,
        "fraction": fraction,
        "leave_bytes": args.leave_mib * MiB if args.leave_mib is not None else None,
        "neighbour": neighbour.history if neighbour else None,
        "device_total_memory": total,
        "device_name": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "history": history,
        "mem_get_info_start": [free0, total],
        "mem_get_info_end": [free1, total],
        "memory_stats": torch.cuda.memory_stats(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "log": ctx.log,
        "extra": ctx.extra,
        "error": error,
        "trace_entries": snap_entries,
        "pickle_bytes": raw_size,
        "wall_s": round(time.time() - t0, 2),
    }
    if neighbour:
        neighbour.close()
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({"out": os.path.basename(args.out), "entries": snap_entries, "ooms": len(ctx.log),
                      "num_ooms": meta["memory_stats"].get("num_ooms"), "error": bool(error),
                      "peak_reserved": meta["max_memory_reserved"], "wall_s": meta["wall_s"]}), flush=True)


if __name__ == "__main__":
    main()
