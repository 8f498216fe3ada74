"""allocsim.torch on a real GPU (docs/gpu-validation.md, "The Python package's OOM hook").

    pip install ./python            # or the wheel; torch with CUDA beside it
    python3 tools/gpu_oom_hook.py main OUT_DIR

Two jobs, each in its own process with `install_oom_hook`: one capped at 2 GiB with
`set_per_process_memory_fraction`, one with the device filled by a second process (all but 2.5 GiB).
Each allocates 300 × 6 MiB, frees two of every three, then asks for 256 MiB, 512 MiB, … until
PyTorch raises OutOfMemoryError. Checked: the hook wrote the snapshot, the text and the JSON; the
explanation's OOM message equals the exception's text without NVML's per-process sentences;
`load(torch.cuda.memory._snapshot())` equals loading the file `_dump_snapshot` wrote right after
(less the `snapshot` entry torch records for each `_snapshot()` call); the dumped OOM snapshot
validates exact; `record()` dumps a snapshot that validates exact. Writes OUT_DIR/results.json.
"""
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
GiB = 1 << 30


def without_nvml(msg):
    parts = msg.split(". ")
    keep = []
    for s in parts:
        if (s.startswith("Process ") or s.startswith("Including non-PyTorch memory, this process has ")) and s.endswith(" memory in use"):
            continue
        keep.append(s)
    return ". ".join(keep)


def neighbour(leave):
    import torch
    free, total = torch.cuda.mem_get_info()
    x = torch.empty(free - leave, dtype=torch.uint8, device="cuda")
    print(f"ready holding {x.numel()} of {total}", flush=True)
    sys.stdin.read()


def job(mode, d):
    import torch
    import allocsim
    import allocsim.torch
    r = {"mode": mode}
    total = torch.cuda.get_device_properties(0).total_memory
    if mode == "cap":
        torch.cuda.set_per_process_memory_fraction(2 * GiB / total)
        r["cap_bytes"] = int(2 * GiB / total * total)
    hook = allocsim.torch.install_oom_hook(d)
    blocks = [torch.empty(6 * MiB, dtype=torch.uint8, device="cuda") for _ in range(300)]
    blocks = [b for i, b in enumerate(blocks) if i % 3 == 0]
    held = []
    try:
        for size in [256 * MiB, 512 * MiB, 1 * GiB, 2 * GiB, 4 * GiB]:
            held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        r["exception"] = None
    except torch.OutOfMemoryError as e:
        r["exception"] = str(e)
    r["hook_written"] = hook.written
    r["hook_error"] = hook.error
    r["hook_count"] = hook.count
    if hook.written:
        ex = json.load(open(hook.written[2]))
        r["explained_request"] = ex.get("request")
        r["allocsim_message"] = ex.get("message")
        r["observer"] = ex.get("observer")
        r["budget_description"] = (ex.get("budget") or {}).get("description")
        r["exception_without_nvml"] = without_nvml(r["exception"] or "")
        r["message_equal"] = r["allocsim_message"] == r["exception_without_nvml"]
        r["txt_head"] = open(hook.written[1]).read().split("\n")[:30]
        # The dumped file against the dict the process returns, taken with no allocation between.
        live = torch.cuda.memory._snapshot()
        path = os.path.join(d, "live.pickle")
        torch.cuda.memory._dump_snapshot(path)
        import pickle
        with open(path, "rb") as f:
            filed = pickle.load(f)
        # torch records a `snapshot` entry for every _snapshot() call, after taking it: the file
        # (taken second) holds the one the live call made.
        r["file_extra_entries"] = [e["action"] for t, l in zip(filed["device_traces"], live["device_traces"]) for e in t[len(l):]]
        trimmed = dict(filed)
        trimmed["device_traces"] = [t[: len(l)] for t, l in zip(filed["device_traces"], live["device_traces"])]
        s_live = allocsim.load(live, name="x")
        s_file = allocsim.load(path, name="x")
        r["live_equals_file"] = s_live == s_file
        r["live_equals_file_less_marker"] = s_live == allocsim.load(trimmed, name="x")
        r["live_replay_json_equal"] = s_live.replay().to_dict() == s_file.replay().to_dict()
        r["live_explain_text_equal"] = str(s_live.explain()) == str(s_file.explain())
        r["hook_file_validate"] = str(allocsim.load(hook.written[0]).validate())
        r["explain_now_head"] = str(allocsim.torch.explain_now()).split("\n")[:6]
    return r


def record_check(d):
    import torch
    import allocsim
    import allocsim.torch
    with allocsim.torch.record(d) as rec:
        xs = [torch.empty(n * MiB, device="cuda") for n in (1, 3, 5, 40)]
        del xs[1]
        y = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
        del y
    s = allocsim.load(rec.path)
    v = s.validate()
    return {"path": rec.path, "entries": s.entries, "validate_exact": v.exact, "validate": str(v)}


def main(out):
    here = os.path.abspath(__file__)
    results = {}
    # 1. A fraction cap of 2 GiB.
    d = os.path.join(out, "cap")
    p = subprocess.run([sys.executable, here, "job", "cap", d], capture_output=True, text=True, timeout=120)
    results["cap"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-3000:]}
    results["cap"]["stderr_tail"] = p.stderr[-600:]
    # 2. The device filled by a second process, leaving 2.5 GiB.
    nb = subprocess.Popen([sys.executable, here, "neighbour", str(int(2.5 * GiB))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results["neighbour"] = nb.stdout.readline().strip()
    try:
        d = os.path.join(out, "devfull")
        p = subprocess.run([sys.executable, here, "job", "devfull", d], capture_output=True, text=True, timeout=120)
        results["devfull"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-3000:]}
        results["devfull"]["stderr_tail"] = p.stderr[-600:]
    finally:
        nb.stdin.close()
        nb.wait(timeout=30)
    # 3. record()
    p = subprocess.run([sys.executable, here, "record", os.path.join(out, "record")], capture_output=True, text=True, timeout=120)
    results["record"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-3000:]}
    json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    for k in ("cap", "devfull"):
        r = results[k]
        print(f"== {k}: message_equal={r.get('message_equal')} hook_error={r.get('hook_error')}")
        print({kk: r.get(kk) for kk in ("live_equals_file", "file_extra_entries", "live_equals_file_less_marker", "live_replay_json_equal", "live_explain_text_equal")})
        print("exception :", r.get("exception"))
        print("allocsim  :", r.get("allocsim_message"))
        print("observer  :", r.get("observer"))
        print("\n".join((r.get("txt_head") or [])[:3]))
        print(r.get("stderr_tail"))
    print("== record:", results["record"])


if __name__ == "__main__":
    if sys.argv[1] == "main":
        main(sys.argv[2])
    elif sys.argv[1] == "neighbour":
        neighbour(int(sys.argv[2]))
    elif sys.argv[1] == "job":
        print(json.dumps(job(sys.argv[2], sys.argv[3])))
    elif sys.argv[1] == "record":
        print(json.dumps(record_check(sys.argv[2])))
