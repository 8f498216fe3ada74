#!/usr/bin/env python3
"""The real-PyTorch oracle: replay a trace's requests through the real CUDA caching allocator.

    python3 tools/torch_replay.py TRACE -o PRODUCED.pickle[.gz] [--conf STR] [--capacity BYTES]
                                  [--empty-cache-from SIM.json | --empty-cache-at 3,17,...]
    python3 tools/torch_replay.py --compare PRODUCED.pickle[.gz] SIM.json

TRACE is a snapshot (`.pickle`, `.pickle.gz`, read with Python's pickle) or an allocsim JSON Lines trace
(`.jsonl`). Runs where torch and a GPU exist (the device tool's H200: `python3` there holds torch 2.11).

What is replayed, in trace order (allocsim's replay semantics, `crates/replay/src/program.rs`):
  * every `alloc` and `oom` entry is a request: `torch.empty(size, dtype=uint8)` on its stream (stream 0
    is the default stream; every other raw `cudaStream_t` gets its own `torch.cuda.Stream()`). A request
    that runs out of memory (`torch.cuda.OutOfMemoryError`) is skipped and its later free ignored.
  * a `free_requested` followed right away by its `free_completed`: the tensor is dropped.
  * a `free_requested` whose `free_completed` comes later (a cross-stream free, `record_stream`): the
    tensor is recorded on a side stream that is kept busy (`torch.cuda._sleep`), dropped, and the side
    stream is synchronized where the trace shows the `free_completed`, so the block returns at the next
    malloc. This depends on GPU timing and is APPROXIMATE (the sleep must outlast the gap).
  * `empty_cache()` calls are not in a trace: they come from allocsim, which infers them
    (`allocsim replay TRACE [--config C] --json` → `empty_cache_calls`, request ordinals). Each is applied
    at the trace position of the first run of `segment_free`/`segment_unmap` entries that comes after
    request ordinal-1 and before request ordinal (where the recorded run released its segments).
  * segment entries are outputs, not inputs: they are not replayed.
PYTORCH_CUDA_ALLOC_CONF is set from --conf before torch is imported; --capacity BYTES becomes
`set_per_process_memory_fraction(f)` with `int(f * total) == BYTES` exactly. History is recorded
(`_record_memory_history(enabled="all", context=None, stacks="python")`) from before the first
request, tensors still alive at the end stay alive, and `torch.cuda.memory._snapshot()` is pickled
(protocol 4, gzip for `.gz`) to PRODUCED. The produced snapshot is a real recording: `allocsim validate
PRODUCED --capacity BYTES` must be exact.

--compare PRODUCED SIM.json: compares the segment events of a real run with allocsim's prediction
(`allocsim replay TRACE --config C [--capacity B] --addresses-from PRODUCED --json`): (request, action,
size, address) in order, the first OOM request, peak reserved. Exit status 1 if they differ.
"""
import argparse
import gzip
import json
import os
import pickle
import sys
import time

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


def load_trace(path):
    """(device 0's trace entries as dicts, final segments as dicts) from a pickle or a .jsonl trace."""
    if path.endswith(".jsonl"):
        entries, segments = [], []
        with open(path) as f:
            for i, line in enumerate(f):
                line = line.strip()
                if not line:
                    continue
                o = json.loads(line)
                if i == 0 and o.get("format") == "allocsim-trace":
                    continue
                if "segment" in o:
                    segments.append(o["segment"])
                elif o.get("device", 0) == 0:
                    entries.append(o)
        return entries, segments
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces") or [[]]
    return traces[0], [s for s in snap.get("segments", []) if s.get("device", 0) == 0]


def release_runs(entries):
    """[(trace index of the run's first entry, request ordinal before which it lies)]."""
    runs, req, i = [], 0, 0
    while i < len(entries):
        a = entries[i]["action"]
        if a in ("alloc", "oom"):
            req += 1
        elif a in ("segment_free", "segment_unmap"):
            runs.append((i, req))
            while i + 1 < len(entries) and entries[i + 1]["action"] in ("segment_free", "segment_unmap"):
                i += 1
        i += 1
    return runs


def fraction_for(capacity, total):
    """A float f with int(f * total) == capacity (what setMemoryFraction computes in C++)."""
    import math

    f = capacity / total
    for _ in range(64):
        got = int(f * total)
        if got == capacity:
            return f
        f = math.nextafter(f, math.inf if got < capacity else -math.inf)
    raise SystemExit(f"no fraction gives exactly {capacity} bytes of {total}")


def replay(args):
    entries, segments = load_trace(args.trace)
    private = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    if private:
        raise SystemExit(f"{args.trace}: {len(private)} private-pool segments (CUDA graphs / MemPools): not replayable here")
    if args.empty_cache_from:
        with open(args.empty_cache_from) as f:
            ec_ordinals = json.load(f).get("empty_cache_calls", [])
    else:
        ec_ordinals = [int(x) for x in args.empty_cache_at.split(",") if x] if args.empty_cache_at else []
    runs = release_runs(entries)
    ec_at = set()
    for k in ec_ordinals:
        pos = next((i for i, r in runs if r == k and i not in ec_at), None)
        if pos is None:
            raise SystemExit(f"empty_cache() before request {k}: no release run in the trace lies there")
        ec_at.add(pos)

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.conf
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    total = torch.cuda.get_device_properties(dev).total_memory
    if args.capacity:
        torch.cuda.set_per_process_memory_fraction(fraction_for(args.capacity, total), dev)
    streams = {0: torch.cuda.default_stream(dev)}

    def stream(raw):
        if raw not in streams:
            streams[raw] = torch.cuda.Stream(dev)
        return streams[raw]

    side = torch.cuda.Stream(dev)  # keeps deferred frees pending
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=50_000_000)
    live, pending = {}, {}  # addr in the trace -> tensor; addr -> True (deferred free in flight)
    ooms, req, t0 = [], 0, time.time()
    n_deferred = 0
    for i, e in enumerate(entries):
        a = e["action"]
        if i in ec_at:
            torch.cuda.empty_cache()
        if a in ("alloc", "oom"):
            with torch.cuda.stream(stream(e.get("stream", 0))):
                try:
                    t = torch.empty(e["size"], dtype=torch.uint8, device=dev)
                except torch.cuda.OutOfMemoryError:
                    t = None
                    ooms.append(req)
            if t is not None and a == "alloc":
                live[e["addr"]] = t
            elif t is not None:
                live[("oom", req)] = t  # an OOM in the trace that fits here: stays allocated
            req += 1
        elif a == "free_requested":
            t = live.pop(e["addr"], None)
            if t is None:
                continue
            nxt = entries[i + 1] if i + 1 < len(entries) else None
            if nxt is not None and nxt["action"] == "free_completed" and nxt["addr"] == e["addr"]:
                del t
            else:
                side.wait_stream(stream(e.get("stream", 0)))
                with torch.cuda.stream(side):
                    torch.cuda._sleep(args.sleep_cycles)
                t.record_stream(side)
                del t
                pending[e["addr"]] = True
                n_deferred += 1
        elif a == "free_completed":
            if pending.pop(e["addr"], None):
                side.synchronize()
    torch.cuda.synchronize()
    wall = time.time() - t0
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    opener = gzip.open if args.output.endswith(".gz") else open
    with opener(args.output, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    stats = torch.cuda.memory_stats(dev)
    meta = {
        "trace": args.trace,
        "PYTORCH_CUDA_ALLOC_CONF": args.conf,
        "capacity": args.capacity,
        "device_total_memory": total,
        "device_name": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "requests": req,
        "ooms": ooms,
        "empty_cache_at_requests": sorted(ec_ordinals),
        "deferred_frees": n_deferred,
        "max_memory_reserved": torch.cuda.max_memory_reserved(dev),
        "num_device_alloc": stats.get("num_device_alloc"),
        "num_device_free": stats.get("num_device_free"),
        "wall_s": round(wall, 3),
    }
    with open(args.output.replace(".pickle", "").replace(".gz", "") + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta))
    del live


def segment_events(entries):
    out, req = [], 0
    for e in entries:
        a = e["action"]
        if a in SEGMENT_ACTIONS:
            out.append((req, a, e["size"], e["addr"]))
        elif a in ("alloc", "oom"):
            req += 1
    return out


def compare(produced, sim_json):
    entries, _ = load_trace(produced)
    real = segment_events(entries)
    real_ooms = []
    req = 0
    for e in entries:
        if e["action"] == "oom":
            real_ooms.append(req)
        if e["action"] in ("alloc", "oom"):
            req += 1
    with open(sim_json) as f:
        sim = json.load(f)
    pred = [(e["request"], e["action"], e["size"], e["addr"]) for e in sim["segment_events"]]
    pred_ooms = [o["request"] for o in sim.get("ooms", [])]
    first = next((i for i, (x, y) in enumerate(zip(real, pred)) if x != y), None)
    if first is None and len(real) != len(pred):
        first = min(len(real), len(pred))
    peak_real = 0
    cur = 0
    for _, a, size, _ in real:
        cur += size if a in ("segment_alloc", "segment_map") else -size
        peak_real = max(peak_real, cur)
    peak_pred = sim["stats"].get("reserved_bytes.all.peak")
    ok = first is None and real_ooms == pred_ooms and peak_real == peak_pred
    print(json.dumps({
        "produced": produced,
        "segment_events": {"real": len(real), "predicted": len(pred), "first_difference": first,
                           "at": [real[first] if first is not None and first < len(real) else None,
                                  pred[first] if first is not None and first < len(pred) else None]},
        "ooms": {"real": real_ooms, "predicted": pred_ooms},
        "peak_reserved": {"real": peak_real, "predicted": peak_pred},
        "exact": ok,
    }))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("-o", "--output")
    ap.add_argument("--conf", default="", help="PYTORCH_CUDA_ALLOC_CONF")
    ap.add_argument("--capacity", type=int, help="allowed maximum in bytes (set_per_process_memory_fraction)")
    ap.add_argument("--empty-cache-from", help="allocsim replay --json output: its empty_cache_calls")
    ap.add_argument("--empty-cache-at", help="comma-separated request ordinals")
    ap.add_argument("--sleep-cycles", type=int, default=200_000_000, help="side-stream sleep holding a deferred free")
    ap.add_argument("--compare", nargs=2, metavar=("PRODUCED", "SIM_JSON"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.trace or not args.output:
        ap.error("TRACE and -o are required")
    replay(args)


if __name__ == "__main__":
    main()
