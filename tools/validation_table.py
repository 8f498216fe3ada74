#!/usr/bin/env python3
"""The validation table (docs/validation-table.md): every workload trace x allocator configs, real PyTorch vs allocsim.

    python3 tools/validation_table.py run --bin BIN --out DIR [--traces DIR ...] [--jobs 7]
                                          [--gpu-budget-gib 120] [--deadline-s 400] [--only SUBSTR]
    python3 tools/validation_table.py sim --bin BIN [--traces DIR ...] [--only SUBSTR]   # no GPU: blind predictions only
    python3 tools/validation_table.py table RESULTS.jsonl                               # the markdown table
    python3 tools/validation_table.py recheck --bin BIN RESULTS.jsonl ARTIFACT_DIR [--traces DIR ...]   # no GPU: steps 3-4 again
    python3 tools/validation_table.py prepare [--bin target/release/allocsim] [--dest target/vt]   # what the device call carries

`run` (on a machine with a GPU, torch and python3) does, for each case (trace, config, allowed maximum), in
parallel processes on the one GPU (each torch process caps itself with set_per_process_memory_fraction;
jobs start only while the sum of the running jobs' caps plus 1 GiB each stays within --gpu-budget-gib, so
no replay can run out of *physical* memory because of another):

  1. `BIN replay TRACE --config C --capacity CAP --trace-capacity TCAP --json`: the blind prediction (the
     trace's own segment addresses) and the inferred `empty_cache()` calls;
  2. `tools/torch_replay.py TRACE --conf C --capacity CAP --empty-cache-from <1> -o real.pickle.gz`: the
     requests through the real allocator (the ground truth);
  3. `BIN validate real.pickle.gz --capacity CAP --json`: the produced recording replayed under its own
     settings (must be exact: every segment event, OOM, allocation address, final segment);
  4. `BIN replay TRACE --config C --capacity CAP --trace-capacity TCAP --addresses-from real.pickle.gz
     --json`: the prediction given the real run's segment addresses, compared with the real run: segment
     events (request, action, size, address) in order, the OOM requests, peak reserved, num_device_alloc
     and num_device_free.

TCAP is the allowed maximum the trace itself was recorded under (it tells the trace's `empty_cache()` calls
from its own OOM retries); for an uncapped recording it is the device's total memory (nothing is ever
over it), so that replaying an uncapped trace under a cap does not mistake its releases.

Each finished case appends one JSON line to DIR/results.jsonl (flushed), so a run cut short still leaves
every finished row; DIR/env.json holds the machine, driver and torch versions; DIR/artifacts.tar.gz the
produced snapshots (left out if too large) and the prediction JSONs.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

H200_TOTAL = 150109880320
GIB = 1 << 30

CONFIGS = [
    "",
    "expandable_segments:True",
    "roundup_power2_divisions:4",
    "max_split_size_mb:128",
    "garbage_collection_threshold:0.6",
    "roundup_power2_divisions:[256:1,512:2,>:4]",
    "large_segment_size_mb:64",
]

# trace, allowed maximum replayed under, allowed maximum the trace was recorded under (None: uncapped), where the cap comes from
CASES = [
    ("frag__default__2048M", 2147483648, 2147483648, "recorded: frag__*__2048M.json cap_bytes"),
    ("frag__expandable__2048M", 2147483648, 2147483648, "recorded: frag__*__2048M.json cap_bytes"),
    ("emptycache__default__0M", 406847488, None, "chosen: 388 MiB (uncapped peak reserved 512 MiB, peak allocated 384 MiB)"),
    ("emptycache__expandable__0M", 406847488, None, "chosen: 388 MiB (uncapped peak reserved 400 MiB, peak allocated 384 MiB)"),
    ("synthetic__default__0M", 9237954560, None, "recorded: synthetic__*__8810M.json cap_bytes"),
    ("transformer__default__0M", 22420652032, None, "recorded: transformer__*__21382M.json cap_bytes"),
    ("unet__default__0M", 16777216000, None, "recorded: unet__*__16000M.json cap_bytes"),
    ("unet512__default__0M", 12884901888, None, "chosen: 12 GiB (uncapped peak reserved 15.32 GiB, peak allocated 10.89 GiB)"),
]
SKIPPED = [
    ("cudagraph__default__0M", "CUDA-graph private pool: its requests are made during graph capture into a private "
     "pool; plain tensor requests cannot reproduce that (torch_replay.py refuses private-pool segments)"),
    ("multistream__default__0M", "400 cross-stream frees (record_stream): when each free completes depends on GPU "
     "timing; torch_replay.py approximates it with a sleeping side stream, so the real run is not a faithful oracle"),
]


def find_trace(name, dirs):
    for d in dirs:
        p = os.path.join(d, name + ".pickle.gz")
        if os.path.exists(p):
            return p
    return None


def tag(conf):
    return "default" if not conf else "".join(c if c.isalnum() else "_" for c in conf)


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def seg_events_real(entries):
    out, req = [], 0
    for e in entries:
        a = e["action"]
        if a in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            out.append((req, a, e["size"], e["addr"]))
        elif a in ("alloc", "oom"):
            req += 1
    return out


def compare(real_path, sim):
    import torch_replay

    entries, _ = torch_replay.load_trace(real_path)
    real = seg_events_real(entries)
    real_ooms, req = [], 0
    for e in entries:
        if e["action"] == "oom":
            real_ooms.append(req)
        if e["action"] in ("alloc", "oom"):
            req += 1
    pred = [(e["request"], e["action"], e["size"], e["addr"]) for e in sim["segment_events"]]
    pred_ooms = [o["request"] for o in sim.get("ooms", [])]
    matched = 0
    for x, y in zip(real, pred):
        if x != y:
            break
        matched += 1
    first = None if matched == len(real) == len(pred) else matched
    peak, cur = 0, 0
    for _, a, size, _ in real:
        cur += size if a in ("segment_alloc", "segment_map") else -size
        peak = max(peak, cur)
    return {
        "requests": req,
        "events_real": len(real),
        "events_pred": len(pred),
        "events_matched": matched,
        "first_difference": first,
        "at": [list(real[first]) if first is not None and first < len(real) else None,
               list(pred[first]) if first is not None and first < len(pred) else None],
        "ooms_real": real_ooms,
        "ooms_pred": pred_ooms,
        "peak_real": peak,
        "peak_pred": sim["stats"].get("reserved_bytes.all.peak"),
    }


def sim_summary(sim):
    return {
        "events": len(sim["segment_events"]),
        "ooms": [o["request"] for o in sim.get("ooms", [])],
        "peak": sim["stats"].get("reserved_bytes.all.peak"),
        "empty_cache_calls": sim.get("empty_cache_calls", []),
    }


def run_case(args, trace, cap, tcap, conf, work):
    t0 = time.time()
    name = os.path.basename(trace).replace(".pickle.gz", "")
    base = os.path.join(work, f"{name}__{tag(conf)}")
    row = {"trace": name, "config": conf, "cap": cap, "trace_cap": tcap}
    simargs = ["--capacity", str(cap), "--trace-capacity", str(tcap or args.device_memory)]
    conf_args = ["--config", conf]
    # 1. blind prediction + inferred empty_cache() calls
    p = sh([args.bin, "replay", trace, *conf_args, *simargs, "--json"])
    if p.returncode != 0:
        row["error"] = f"allocsim replay: rc {p.returncode}: {p.stderr[-500:]}"
        return row
    with open(base + ".blind.json", "w") as f:
        f.write(p.stdout)
    blind = json.loads(p.stdout)
    row["blind"] = sim_summary(blind)
    # 2. the real allocator
    real = base + ".real.pickle.gz"
    t1 = time.time()
    p = sh([sys.executable, os.path.join(HERE, "torch_replay.py"), trace, "--conf", conf, "--capacity", str(cap),
            "--empty-cache-from", base + ".blind.json", "-o", real], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    row["torch_s"] = round(time.time() - t1, 2)
    if p.returncode != 0:
        row["error"] = f"torch_replay: rc {p.returncode}: {p.stderr[-800:]}"
        return row
    meta = json.loads(p.stdout.strip().splitlines()[-1])
    row["real_meta"] = {k: meta.get(k) for k in ("requests", "ooms", "empty_cache_at_requests", "max_memory_reserved",
                                                 "num_device_alloc", "num_device_free", "wall_s", "device_total_memory")}
    # 3. validate the produced recording
    p = sh([args.bin, "validate", real, "--capacity", str(cap), "--json"])
    try:
        row["validate"] = json.loads(p.stdout)
    except ValueError:
        row["validate"] = {"exact": False, "error": f"rc {p.returncode}: {p.stderr[-500:]}"}
    # 4. prediction with the real run's addresses, compared
    p = sh([args.bin, "replay", trace, *conf_args, *simargs, "--addresses-from", real, "--json"])
    if p.returncode != 0:
        row["error"] = f"allocsim replay --addresses-from: rc {p.returncode}: {p.stderr[-500:]}"
        return row
    with open(base + ".pred.json", "w") as f:
        f.write(p.stdout)
    pred = json.loads(p.stdout)
    c = compare(real, pred)
    c["num_device_alloc"] = [meta.get("num_device_alloc"), pred["stats"].get("num_device_alloc")]
    c["num_device_free"] = [meta.get("num_device_free"), pred["stats"].get("num_device_free")]
    c["max_memory_reserved_torch"] = meta.get("max_memory_reserved")
    row["compare"] = c
    row["exact"] = (c["first_difference"] is None and c["ooms_real"] == c["ooms_pred"] and c["peak_real"] == c["peak_pred"]
                    and c["num_device_alloc"][0] == c["num_device_alloc"][1]
                    and c["num_device_free"][0] == c["num_device_free"][1])
    row["validate_exact"] = bool(row["validate"].get("exact"))
    row["wall_s"] = round(time.time() - t0, 2)
    return row


def cases(args):
    out = []
    for name, cap, tcap, why in CASES:
        trace = find_trace(name, args.traces)
        if trace is None:
            print(f"missing {name}: skipped", flush=True)
            continue
        for conf in CONFIGS:
            if args.only and args.only not in f"{name}|{conf}":
                continue
            out.append((trace, cap, tcap, conf))
    # longest first
    order = {"synthetic": 0, "transformer": 1, "unet": 2, "unet512": 3}
    out.sort(key=lambda c: order.get(os.path.basename(c[0]).split("__")[0], 9))
    return out


def cmd_run(args):
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    t_start = time.time()
    env = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for k, cmd in [("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]),
                   ("nvidia_smi_header", ["sh", "-c", "nvidia-smi | head -4"]),
                   ("uname", ["uname", "-r"]),
                   ("torch", [sys.executable, "-c", "import torch,sys; print(torch.__version__, torch.version.cuda, "
                              "torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory, "
                              "torch.cuda.mem_get_info(0), sys.version.split()[0])"]),
                   ("allocsim", [args.bin, "--version"])]:
        try:
            p = sh(cmd, timeout=120)
            env[k] = (p.stdout or p.stderr).strip()
        except (OSError, subprocess.SubprocessError) as e:
            env[k] = repr(e)
    with open(os.path.join(args.out, "env.json"), "w") as f:
        json.dump(env, f, indent=1)
    print(json.dumps(env), flush=True)
    todo = cases(args)
    lock = threading.Lock()
    cond = threading.Condition(lock)
    state = {"gpu": 0.0, "running": 0}
    results = open(os.path.join(args.out, "results.jsonl"), "a")

    def need(cap):
        return cap / GIB + 1.0

    def worker(case):
        trace, cap, tcap, conf = case
        try:
            row = run_case(args, trace, cap, tcap, conf, work)
        except Exception as e:  # noqa: BLE001 - a row with the error beats a lost row
            row = {"trace": os.path.basename(trace), "config": conf, "cap": cap, "error": repr(e)}
        with cond:
            results.write(json.dumps(row) + "\n")
            results.flush()
            state["gpu"] -= need(cap)
            state["running"] -= 1
            cond.notify_all()
        c = row.get("compare", {})
        print(f"[{time.time() - t_start:6.1f}s] {row['trace']} [{conf or 'default'}] cap={cap}: "
              f"exact={row.get('exact')} validate={row.get('validate_exact')} "
              f"events {c.get('events_matched')}/{c.get('events_real')} (pred {c.get('events_pred')}) "
              f"ooms real {len(c.get('ooms_real', []))} pred {len(c.get('ooms_pred', []))} "
              f"peak {c.get('peak_real')} / {c.get('peak_pred')} torch {row.get('torch_s')}s "
              f"{row.get('error', '')}", flush=True)

    threads = []
    for case in todo:
        with cond:
            while state["running"] >= args.jobs or (state["running"] and state["gpu"] + need(case[1]) > args.gpu_budget_gib):
                cond.wait(1.0)
            if time.time() - t_start > args.deadline_s:
                print(f"deadline: {case[0]} [{case[3]}] and later cases not started", flush=True)
                break
            state["gpu"] += need(case[1])
            state["running"] += 1
        th = threading.Thread(target=worker, args=(case,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(max(1.0, args.deadline_s + 60 - (time.time() - t_start)))
    results.close()
    print(f"done in {time.time() - t_start:.1f} s", flush=True)
    pack(args.out, work)


def pack(out, work):
    dest = os.path.join(out, "artifacts.tar.gz")
    for limit in (None, 2_000_000, 0):  # every produced snapshot, then the small ones, then none
        with tarfile.open(dest, "w:gz") as tf:
            for fn in sorted(os.listdir(work)):
                if limit is not None and fn.endswith(".pickle.gz") and os.path.getsize(os.path.join(work, fn)) > limit:
                    continue
                tf.add(os.path.join(work, fn), arcname=fn)
        if os.path.getsize(dest) < 15_500_000:
            break
    shutil.rmtree(work, ignore_errors=True)


def cmd_sim(args):
    for trace, cap, tcap, conf in cases(args):
        p = sh([args.bin, "replay", trace, "--config", conf, "--capacity", str(cap), "--trace-capacity",
                str(tcap or args.device_memory), "--json"])
        if p.returncode:
            print(os.path.basename(trace), conf, "ERROR", p.stderr[-300:])
            continue
        s = sim_summary(json.loads(p.stdout))
        print(f"{os.path.basename(trace):36s} {conf or 'default':45s} cap={cap:>12d} events={s['events']:5d} "
              f"ooms={len(s['ooms']):3d} first={s['ooms'][:1]} peak={s['peak']} ec={len(s['empty_cache_calls'])}")


def cmd_recheck(args):
    """Steps 3 and 4 again with another binary, against the real snapshots a `run` produced (unpacked from
    its artifacts.tar.gz into ARTIFACT_DIR): the ground truth does not change, so no GPU is needed."""
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    n = ok = 0
    for r in rows:
        trace = find_trace(r["trace"], args.traces)
        real = os.path.join(args.artifacts, f"{r['trace']}__{tag(r['config'])}.real.pickle.gz")
        if trace is None or not os.path.exists(real):
            print(f"{r['trace']} [{r['config'] or 'default'}]: no trace or real snapshot here, skipped")
            continue
        n += 1
        v = sh([args.bin, "validate", real, "--capacity", str(r["cap"]), "--json"])
        v = json.loads(v.stdout) if v.stdout.strip() else {"exact": False}
        p = sh([args.bin, "replay", trace, "--config", r["config"], "--capacity", str(r["cap"]), "--trace-capacity",
                str(r.get("trace_cap") or args.device_memory), "--addresses-from", real, "--json"])
        c = compare(real, json.loads(p.stdout)) if p.returncode == 0 else None
        e = bool(v.get("exact")) and c is not None and c["first_difference"] is None and c["ooms_real"] == c["ooms_pred"] \
            and c["peak_real"] == c["peak_pred"]
        ok += e
        if not e:
            print(f"{r['trace']} [{r['config'] or 'default'}]: validate exact {v.get('exact')}, compare {json.dumps(c)[:400]}")
    print(f"recheck: {ok}/{n} exact")
    return 0 if ok == n else 1


def cmd_prepare(args):
    """Copies the binary (stripped) and every case's trace into DEST, an ignored folder the device tool can carry."""
    os.makedirs(os.path.join(args.dest, "traces"), exist_ok=True)
    shutil.copyfile(args.bin, os.path.join(args.dest, "allocsim"))
    os.chmod(os.path.join(args.dest, "allocsim"), 0o755)
    if shutil.which("strip"):
        subprocess.run(["strip", os.path.join(args.dest, "allocsim")], check=False)
    for name, *_rest in CASES:
        trace = find_trace(name, args.traces)
        if trace is None:
            raise SystemExit(f"missing {name} in {args.traces}")
        shutil.copyfile(trace, os.path.join(args.dest, "traces", os.path.basename(trace)))
    print(f"{args.dest}: allocsim and {len(CASES)} traces")


def gib(b):
    return f"{b / GIB:.3f}" if b is not None else "–"


def cmd_table(args):
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    key = {n: i for i, (n, *_rest) in enumerate(CASES)}
    rows.sort(key=lambda r: (key.get(r["trace"], 99), CONFIGS.index(r["config"]) if r["config"] in CONFIGS else 99))
    print("| trace | cap (bytes) | PYTORCH_CUDA_ALLOC_CONF | requests | segment events matched (real / predicted) "
          "| OOMs real / predicted (first) | OOM agree | peak reserved GiB real / sim | device alloc/free real = sim "
          "| prediction exact | `validate` real snapshot |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    n = n_exact = n_val = 0
    for r in rows:
        n += 1
        if "compare" not in r:
            print(f"| {r['trace']} | {r['cap']} | `{r['config'] or '(unset)'}` | – | ERROR: {r.get('error', '')[:120]} | | | | | no | |")
            continue
        c = r["compare"]
        ev = f"{c['events_matched']}/{c['events_real']}" + ("" if c["events_pred"] == c["events_real"] else f" (pred {c['events_pred']})")
        fo = lambda l: f"{len(l)} ({l[0]})" if l else "0"  # noqa: E731
        oa = c["ooms_real"] == c["ooms_pred"]
        dev = (c["num_device_alloc"][0] == c["num_device_alloc"][1] and c["num_device_free"][0] == c["num_device_free"][1])
        devs = f"{c['num_device_alloc'][0]}/{c['num_device_free'][0]}" + ("" if dev else f" ≠ {c['num_device_alloc'][1]}/{c['num_device_free'][1]}")
        pk = f"{gib(c['peak_real'])} / {gib(c['peak_pred'])}" + ("" if c["peak_real"] == c["peak_pred"] else " ✗")
        v = r.get("validate_exact")
        n_exact += bool(r.get("exact"))
        n_val += bool(v)
        print(f"| {r['trace']} | {r['cap']} | `{r['config'] or '(unset)'}` | {c['requests']} | {ev} | {fo(c['ooms_real'])} / {fo(c['ooms_pred'])} "
              f"| {'yes' if oa else 'NO'} | {pk} | {devs} | {'yes' if r.get('exact') else 'NO'} | {'exact' if v else 'NOT exact'} |")
    print(f"\nprediction exact: {n_exact}/{n}; validate exact: {n_val}/{n}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "sim"):
        s = sub.add_parser(name)
        s.add_argument("--bin", default="target/release/allocsim")
        s.add_argument("--traces", nargs="+", default=["traces", "../shared/traces"])
        s.add_argument("--only")
        s.add_argument("--device-memory", type=int, default=H200_TOTAL)
        if name == "run":
            s.add_argument("--out", required=True)
            s.add_argument("--jobs", type=int, default=7)
            s.add_argument("--gpu-budget-gib", type=float, default=120.0)
            s.add_argument("--deadline-s", type=float, default=400.0)
    rc = sub.add_parser("recheck")
    rc.add_argument("--bin", default="target/release/allocsim")
    rc.add_argument("--traces", nargs="+", default=["traces", "../shared/traces"])
    rc.add_argument("--device-memory", type=int, default=H200_TOTAL)
    rc.add_argument("results")
    rc.add_argument("artifacts")
    pr = sub.add_parser("prepare")
    pr.add_argument("--bin", default="target/release/allocsim")
    pr.add_argument("--traces", nargs="+", default=["traces", "../shared/traces"])
    pr.add_argument("--dest", default="target/vt")
    t = sub.add_parser("table")
    t.add_argument("results")
    args = ap.parse_args()
    sys.exit({"run": cmd_run, "sim": cmd_sim, "table": cmd_table, "prepare": cmd_prepare, "recheck": cmd_recheck}[args.cmd](args))


if __name__ == "__main__":
    main()
