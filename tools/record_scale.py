#!/usr/bin/env python3
"""Record the ground truth for `allocsim scale`: training and inference steps at small shapes, then one
step at a larger shape, each run in a fresh process; and a real search for the largest shape under a
`set_per_process_memory_fraction` cap.

    python3 tools/record_scale.py run WORKLOAD OUT_PREFIX --prefix 128,256,… --big 2048
                                  [--conf STR] [--cap-mib N] [--stacks python|all] [--no-snapshot]
    python3 tools/record_scale.py plan OUT_DIR [--group lm|cnn|infer|one|all] [--dry-run]
    python3 tools/record_scale.py search OUT_DIR [--workload lm_seq] [--cap-mib 12288] [--step 128]
                                  [--max 8192] [--conf STR]

`run` is one recording, in this process: the history is turned on after the process's first CUDA
allocation (as tools/record_field.py does), the model is built, then each step of `--prefix` and
finally the `--big` one runs inside `record_function("PARAM=VALUE")` (what `allocsim.torch.step`
records; `allocsim scale --param PARAM` reads the values from these regions), with
`torch.cuda.reset_peak_memory_stats()` at its start and `max_memory_allocated()` /
`max_memory_reserved()` read after it. A step that runs out of memory is caught (its readings are
taken then) and the job goes on. It writes OUT_PREFIX.pickle.gz (the bytes `_dump_snapshot` writes,
gzip'd) and OUT_PREFIX.json: the settings, the cap, the device, `memory_stats()` at the end, every
OOM message as PyTorch printed it with its step, and `extra`: `param`, `values` (one per step, the
big one last), `step_peaks` (allocated) and `step_peaks_reserved`, `big_index`.

Workloads (`WORKLOAD`, PARAM in brackets):

* `lm_seq` [seq]: HF Llama (6 layers, hidden 768, vocab 32000), AdamW, batch 8, by sequence length.
  Past 3,072 indices (8 × 384) embedding backward takes its sort-based path with buffers of its
  own: the default prefix records 512 and 640 above it as well as 128–384 below.
* `lm_batch` [batch]: the same model at sequence length 256, by batch size (the default prefix
  again both sides of embedding backward's switch: 14 × 256 and 16 × 256 indices are past it).
* `cnn` [side]: a ResNet-style CNN (plain torch: conv, batch norm, ReLU, residual blocks; cuDNN
  picks its algorithms and workspaces by shape), SGD with momentum, batch 16, by image side.
* `infer` [batch]: the `lm_seq` model in eval mode under `no_grad`, one forward at sequence length
  512 per step, by batch size.

`plan` runs every recording of a group, each in a fresh process (`run` through `subprocess`), under
the default settings and under `expandable_segments:True`: for each workload, the prefix followed by
one step at 2×, 4× and 8× the largest prefix value (separate runs); group `one` is a prefix at a
single value (512, three steps) and one step at 2048: the single-recording case, whose error
`allocsim scale` states. It writes OUT_DIR/WORKLOAD__CONF__bigN.{pickle.gz,json} and OUT_DIR/plan.json.

`search` is the real search for the largest value under a cap: for every multiple of `--step` from
the step up to `--max` (stopping after four values in a row have run out of memory), a fresh process
runs the prefix and then one step at that value under `set_per_process_memory_fraction(cap / total)`,
and records whether it ran out of memory (`--no-snapshot`: no snapshot is kept for these). A last run
records the prefix alone under the cap, with its snapshot: what `allocsim scale PREFIX --param seq
--largest-under CAP --step STEP` learns from. It writes OUT_DIR/search__WORKLOAD__CONF__capN.json
(every value tried, ok or OOM, and the largest that ran; values that OOM below it are where the
answer is not monotone) and OUT_DIR/search__WORKLOAD__CONF__capN__prefix.{pickle.gz,json}.

`tools/scale_exactness.py --recordings OUT_DIR` then compares what `allocsim scale` predicts, learnt
from each run's prefix, with every reading. Needs torch (2.11 was used for traces/field) and a GPU;
`lm_*` and `infer` need transformers.
"""
import argparse
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

DEFAULT_PREFIX = {
    "lm_seq": [128, 256, 384, 512, 640, 128, 256, 384, 512, 640],
    "lm_batch": [2, 4, 8, 14, 16, 2, 4, 8, 14, 16],
    "cnn": [64, 96, 128, 160, 64, 96, 128, 160],
    "infer": [1, 2, 4, 8, 1, 2, 4, 8],
}
PARAM = {"lm_seq": "seq", "lm_batch": "batch", "cnn": "side", "infer": "batch"}
CONFS = {"default": "", "expandable": "expandable_segments:True"}


# ---------------------------------------------------------------- models
def llama(torch, layers=6):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=16384)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda()


def resnet(torch, width=64, blocks=(2, 2, 2, 2), classes=1000):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for k, n in enumerate(blocks):
        cout = width * 2 ** k
        for j in range(n):
            layers.append(Block(cin, cout, 2 if (j == 0 and k > 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    torch.manual_seed(0)
    return nn.Sequential(*layers).cuda()


# ---------------------------------------------------------------- steps
class Job:
    """Builds the workload's model once and runs one step at a value."""

    def __init__(self, torch, workload):
        self.torch = torch
        self.workload = workload
        if workload in ("lm_seq", "lm_batch", "infer"):
            self.model = llama(torch)
        elif workload == "cnn":
            self.model = resnet(torch)
        else:
            raise SystemExit(f"unknown workload {workload!r}")
        if workload == "infer":
            self.model.eval()
            self.opt = None
        elif workload == "cnn":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, v):
        torch = self.torch
        if self.workload == "lm_seq":
            x = torch.randint(0, 32000, (8, v), device="cuda")
            out = self.model(input_ids=x, labels=x)
            out.loss.backward()
            del out
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        elif self.workload == "lm_batch":
            x = torch.randint(0, 32000, (v, 256), device="cuda")
            out = self.model(input_ids=x, labels=x)
            out.loss.backward()
            del out
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        elif self.workload == "cnn":
            x = torch.randn(16, 3, v, v, device="cuda")
            y = torch.randint(0, 1000, (16,), device="cuda")
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            del loss
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:  # infer
            x = torch.randint(0, 32000, (v, 512), device="cuda")
            with torch.no_grad():
                out = self.model(input_ids=x)
            del out

    def recover(self):
        """After an OOM: what a job that catches it does before going on."""
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)


def run_main(args):
    if args.conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.conf
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch

    t0 = time.time()
    torch.zeros(1, device="cuda")
    free0, total = torch.cuda.mem_get_info()
    fraction = None
    if args.cap_mib:
        fraction = args.cap_mib * MiB / total
        torch.cuda.set_per_process_memory_fraction(fraction)
    history = None
    if not args.no_snapshot:
        history = {"enabled": "all", "context": "all", "stacks": args.stacks, "max_entries": args.max_entries}
        torch.cuda.memory._record_memory_history(**history)
    param = PARAM[args.workload]
    values = [int(v) for v in args.prefix.split(",")] if args.prefix else list(DEFAULT_PREFIX[args.workload])
    big_index = None
    if args.big and args.big != "none":
        big_index = len(values)
        values.append(int(args.big))
    log, peaks, peaks_reserved = [], [], []
    error = None
    job = None
    try:
        job = Job(torch, args.workload)
        for k, v in enumerate(values):
            torch.cuda.reset_peak_memory_stats()
            try:
                with torch.autograd.profiler.record_function(f"{param}={v}"):
                    job.step(v)
            except torch.OutOfMemoryError as e:
                free, _ = torch.cuda.mem_get_info()
                log.append({"oom": str(e), "step": k, param: v, "time_us": int(time.time() * 1e6), "mem_get_info_after": [free, total]})
                job.recover()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            peaks_reserved.append(torch.cuda.max_memory_reserved())
    except Exception:  # a workload that breaks still leaves what it recorded
        error = traceback.format_exc()
        print(error, file=sys.stderr)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    raw_size = None
    if not args.no_snapshot:
        raw = args.out + ".pickle"
        torch.cuda.memory._dump_snapshot(raw)
        with open(raw, "rb") as f, gzip.open(args.out + ".pickle.gz", "wb", compresslevel=6) as g:
            shutil.copyfileobj(f, g)
        raw_size = os.path.getsize(raw)
        os.remove(raw)
    props = torch.cuda.get_device_properties(0)
    meta = {
        "workload": args.workload,
        "PYTORCH_CUDA_ALLOC_CONF": args.conf,
        "cap_bytes": int(fraction * total) if fraction else None,
        "fraction": fraction,
        "device_total_memory": total,
        "device_name": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "history": history,
        "mem_get_info_start": [free0, total],
        "mem_get_info_end": [free1, total],
        "memory_stats": torch.cuda.memory_stats(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "log": log,
        "extra": {
            "param": param,
            "values": values,
            "big_index": big_index,
            "step_peaks": peaks,
            "step_peaks_reserved": peaks_reserved,
        },
        "error": error,
        "pickle_bytes": raw_size,
        "wall_s": round(time.time() - t0, 2),
    }
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({"out": os.path.basename(args.out), "steps": len(peaks), "ooms": len(log), "error": bool(error),
                      "big": values[-1] if big_index is not None else None,
                      "big_peak": peaks[-1] if peaks else None, "wall_s": meta["wall_s"]}), flush=True)


# ---------------------------------------------------------------- many runs, each in a fresh process
def fresh(argv, dry_run=False):
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    print("$", " ".join(cmd), flush=True)
    if dry_run:
        return None
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stderr, file=sys.stderr)
    last = [line for line in p.stdout.splitlines() if line.startswith("{")]
    return json.loads(last[-1]) if last else None


def plan_main(args):
    os.makedirs(args.out_dir, exist_ok=True)
    groups = {"lm": ["lm_seq", "lm_batch"], "cnn": ["cnn"], "infer": ["infer"]}
    runs = []
    wanted = ["lm", "cnn", "infer", "one"] if args.group == "all" else [args.group]
    for g in wanted:
        for conf_name, conf in CONFS.items():
            if g == "one":
                prefix, bigs, workloads = "512,512,512", [2048], ["lm_seq"]
            else:
                workloads = groups[g]
                prefix, bigs = None, None
            for w in workloads:
                pre = [int(v) for v in prefix.split(",")] if prefix else DEFAULT_PREFIX[w]
                for big in bigs or [2 * max(pre), 4 * max(pre), 8 * max(pre)]:
                    stem = f"{w}__{conf_name}__big{big}" + ("__one" if g == "one" else "")
                    argv = ["run", w, os.path.join(args.out_dir, stem), "--prefix", ",".join(map(str, pre)), "--big", str(big)]
                    if conf:
                        argv += ["--conf", conf]
                    r = fresh(argv, args.dry_run)
                    runs.append({"stem": stem, "argv": argv, "result": r})
    with open(os.path.join(args.out_dir, "plan.json"), "w") as f:
        json.dump(runs, f, indent=1)


def search_main(args):
    os.makedirs(args.out_dir, exist_ok=True)
    conf_name = next((k for k, v in CONFS.items() if v == args.conf), args.conf.replace(":", "").replace(",", "_") or "default")
    stem = f"search__{args.workload}__{conf_name}__cap{args.cap_mib}"
    prefix = args.prefix or ",".join(map(str, DEFAULT_PREFIX[args.workload]))
    tried = []
    largest = None
    oom_run = 0

    def one(v):
        argv = ["run", args.workload, os.path.join(args.out_dir, f"{stem}__at{v}"), "--prefix", prefix, "--big", str(v),
                "--cap-mib", str(args.cap_mib), "--no-snapshot"]
        if args.conf:
            argv += ["--conf", args.conf]
        r = fresh(argv, args.dry_run)
        meta = None
        path = os.path.join(args.out_dir, f"{stem}__at{v}.json")
        if not args.dry_run and os.path.exists(path):
            with open(path) as f:
                meta = json.load(f)
        big_oom = bool(meta) and any(x["step"] == meta["extra"]["big_index"] for x in meta["log"])
        prefix_oom = bool(meta) and any(x["step"] != meta["extra"]["big_index"] for x in meta["log"])
        return {"value": v, "oom": big_oom, "prefix_oom": prefix_oom, "error": (meta or {}).get("error"),
                "peak_allocated": meta["extra"]["step_peaks"][-1] if meta else None,
                "peak_reserved": meta["extra"]["step_peaks_reserved"][-1] if meta else None, "run": r}

    # `--jobs` values at a time, each its own process under the cap (the cap is per process, so runs
    # side by side do not squeeze each other on a card with room for all of them); the search stops
    # after the wave in which four values in a row have run out of memory.
    import concurrent.futures as cf
    v = args.start or args.step
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        while v <= args.max and oom_run < 4:
            wave = [v + k * args.step for k in range(args.jobs) if v + k * args.step <= args.max]
            v = wave[-1] + args.step
            for t in pool.map(one, wave):
                tried.append(t)
                if t["run"] is not None and not t["oom"] and not t["error"]:
                    largest = t["value"]
                    oom_run = 0
                elif t["oom"]:
                    oom_run += 1
            with open(os.path.join(args.out_dir, stem + ".partial.json"), "w") as f:
                json.dump({"largest_so_far": largest, "tried": tried}, f, indent=1)
    non_monotone = [t["value"] for t in tried if t["oom"] and largest is not None and t["value"] < largest]
    # The prefix alone under the cap, with its snapshot: what allocsim learns from.
    argv = ["run", args.workload, os.path.join(args.out_dir, f"{stem}__prefix"), "--prefix", prefix, "--big", "none",
            "--cap-mib", str(args.cap_mib)]
    if args.conf:
        argv += ["--conf", args.conf]
    fresh(argv, args.dry_run)
    out = {"workload": args.workload, "param": PARAM[args.workload], "conf": args.conf, "cap_mib": args.cap_mib,
           "step": args.step, "prefix": prefix, "largest": largest, "non_monotone": non_monotone, "tried": tried}
    with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"search": stem, "largest": largest, "non_monotone": non_monotone}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one recording, in this process")
    r.add_argument("workload", choices=sorted(PARAM))
    r.add_argument("out")
    r.add_argument("--prefix", help="the values of the small steps, in order (default: the workload's)")
    r.add_argument("--big", help="the value of the last step (`none`: no last step)")
    r.add_argument("--conf", default="", help="PYTORCH_CUDA_ALLOC_CONF")
    r.add_argument("--cap-mib", type=int, help="set_per_process_memory_fraction(N MiB / total)")
    r.add_argument("--stacks", default="python", choices=["python", "all"])
    r.add_argument("--max-entries", type=int, default=10_000_000)
    r.add_argument("--no-snapshot", action="store_true", help="readings only (no history, no snapshot)")
    p = sub.add_parser("plan", help="every recording of a group, each in a fresh process")
    p.add_argument("out_dir")
    p.add_argument("--group", default="all", choices=["lm", "cnn", "infer", "one", "all"])
    p.add_argument("--dry-run", action="store_true", help="print the runs without running them")
    s = sub.add_parser("search", help="the largest value under a cap, by running each in a fresh process")
    s.add_argument("out_dir")
    s.add_argument("--workload", default="lm_seq", choices=sorted(PARAM))
    s.add_argument("--cap-mib", type=int, default=12288)
    s.add_argument("--step", type=int, default=128)
    s.add_argument("--max", type=int, default=8192)
    s.add_argument("--start", type=int, help="the first value tried (default: the step)")
    s.add_argument("--jobs", type=int, default=1, help="values run side by side, each in its own process")
    s.add_argument("--prefix")
    s.add_argument("--conf", default="")
    s.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    {"run": run_main, "plan": plan_main, "search": search_main}[args.cmd](args)


if __name__ == "__main__":
    main()
