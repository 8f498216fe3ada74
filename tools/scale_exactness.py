#!/usr/bin/env python3
"""How exactly `allocsim scale` predicts steps it did not learn from, on recordings with their
readings (the figures of docs/scale.md).

For each recording (a training job whose `.json` holds `extra.seq_lens` and `extra.step_peaks`:
`max_memory_allocated()` read after each step with `reset_peak_memory_stats()` at its start), every
step is predicted after the one before it, learnt only from the steps at values at most half its
own ("2x": the asked value is at least twice every value learnt from), and again learnt from every
step at another value ("held out"). The prediction's peak allocated is compared with the step's
reading, and its peak reserved with the step's peak reserved as the trace's own segment events
give it (`segment_alloc`/`segment_free`/`segment_map`/`segment_unmap` entries: what the allocator
asked the driver for, recorded, not replayed).

    python3 tools/scale_exactness.py --bin target/release/allocsim [--json out.json]
    python3 tools/scale_exactness.py --recordings DIR [--bin …]

`--recordings DIR` reads what tools/record_scale.py wrote instead: each run's last step (the larger
one) is predicted after the step before it, learnt from the run's other steps (their
`record_function("PARAM=VALUE")` regions; the last step's value held out), and compared with the
`max_memory_allocated()` and `max_memory_reserved()` the job read after it (or, where it ran out of
memory, with PyTorch's message); each search's largest value with the one `allocsim scale
--largest-under` finds on its prefix recording.

Recordings without readings for every step (a step cut short by an OOM) are compared where they
have them. Iterations are the optimizer's steps (`Optimizer.step#…` annotations), as `phases` and
`scale --values` find them; a job whose OOM step did not reach its optimizer step makes one
iteration of that step and the next (its values are given as '-', not learnt from).
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

RECORDINGS = [
    "traces/field/llama_train__default",
    "traces/field/llama_oom__default",
    "traces/field/ranks/rank0",
    "traces/field/ranks/rank1",
]


def load(path: str) -> Dict[str, Any]:
    with gzip.open(path + ".pickle.gz", "rb") as f:
        return pickle.load(f)


def meta(path: str) -> Dict[str, Any]:
    with open(path + ".json") as f:
        m = json.load(f)
    extra = m.get("extra") or m
    return {"seq_lens": extra["seq_lens"], "step_peaks": extra["step_peaks"], "log": m.get("log") or []}


def iterations(snap: Dict[str, Any]) -> List[Tuple[int, int]]:
    """Entry ranges [start, end) of the optimizer's steps, placed as allocsim places an END
    annotation: after every entry of the same microsecond or earlier."""
    trace = snap["device_traces"][0]
    ends = sorted(a["time_us"] for a in snap.get("external_annotations", []) if a.get("stage") == "END" and str(a.get("name", "")).startswith("Optimizer.step"))
    out, start, j = [], 0, 0
    for t in ends:
        while j < len(trace) and trace[j]["time_us"] <= t:
            j += 1
        out.append((start, j))
        start = j
    if any(e["action"] in ("alloc", "oom") for e in trace[start:]):
        out.append((start, len(trace)))
    return out


def reserved_peaks(snap: Dict[str, Any], its: List[Tuple[int, int]]) -> List[int]:
    """Each iteration's peak reserved from the recorded segment events: the reserved bytes at its
    start (those at the trace's start: the final segments less what the trace reserved), and their
    highest point inside it."""
    trace = snap["device_traces"][0]
    final = sum(s["total_size"] for s in snap["segments"] if s.get("device", 0) == 0)
    delta = 0
    for e in trace:
        if e["action"] in ("segment_alloc", "segment_map"):
            delta += e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            delta -= e["size"]
    cur = final - delta
    out = []
    for a, b in its:
        peak = cur
        for e in trace[a:b]:
            if e["action"] in ("segment_alloc", "segment_map"):
                cur += e["size"]
                peak = max(peak, cur)
            elif e["action"] in ("segment_free", "segment_unmap"):
                cur -= e["size"]
        out.append(peak)
    return out


def step_of_iteration(m: Dict[str, Any], n_its: int) -> List[Optional[int]]:
    """The job's step each iteration is (None: an iteration that holds a step cut short by an OOM
    and the next step)."""
    oom_steps = sorted(x["step"] for x in m["log"] if "oom" in x and "step" in x)
    out: List[Optional[int]] = []
    step = 0
    for _ in range(n_its):
        if step in oom_steps:
            out.append(None)
            step += 2
        else:
            out.append(step)
            step += 1
    return out


def run(binary: str, path: str, values: List[Optional[int]], predict: int, after: int) -> Optional[Dict[str, Any]]:
    vals = ",".join("-" if v is None else str(v) for v in values)
    args = [binary, "scale", path + ".pickle.gz", "--param", "seq", "--values", vals, "--predict", str(predict), "--after", str(after), "--json"]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return json.loads(r.stdout)


def figures(msg: str) -> str:
    """An OOM message's figures a replay can know: the request, the allowed maximum, the
    allocated and the reserved-but-unallocated bytes (not the device's free memory or NVML's line)."""
    return msg[msg.index("Tried"):msg.index(" GPU")] + " … " + msg[msg.index("Of the allocated"):msg.index(" If reserved")]


def recordings_main(a: argparse.Namespace) -> int:
    import glob
    import os

    n = exact_a = exact_r = 0
    worst = 0.0
    for path in sorted(glob.glob(os.path.join(a.recordings, "*.json"))):
        if path.endswith(("plan.json", ".partial.json")):  # the plan's list of runs, a search's running tally
            continue
        with open(path) as f:
            m = json.load(f)
        base = path[: -len(".json")]
        if "tried" in m:  # a search
            prefix = base + "__prefix.pickle.gz"
            with open(base + "__prefix.json") as f:
                cap = json.load(f)["cap_bytes"]
            r = subprocess.run([a.bin, "scale", prefix, "--param", m["param"], "--largest-under", str(cap), "--step", str(m["step"]), "--json"], capture_output=True, text=True)
            if r.returncode:
                print(f"{os.path.basename(base)}: error: {r.stderr.strip()}")
                continue
            got = json.loads(r.stdout)["largest"][0]
            print(f"{os.path.basename(base)}: largest {m['param']} by running {m['largest']} (not monotone at {m['non_monotone']}), "
                  f"by allocsim {got['value']} (not monotone at {got['non_monotone']}) {'=' if got['value'] == m['largest'] else 'DIFF'}")
            continue
        x = m.get("extra") or {}
        if x.get("big_index") is None or not os.path.exists(base + ".pickle.gz"):
            continue
        k = x["big_index"]
        v = x["values"][k]
        r = subprocess.run([a.bin, "scale", base + ".pickle.gz", "--param", x["param"], "--hold-out", str(v), "--predict", str(v), "--after", str(k - 1), "--json"], capture_output=True, text=True)
        if r.returncode:
            print(f"{os.path.basename(base)}: error: {r.stderr.strip()}")
            continue
        p = json.loads(r.stdout)["predictions"][0]
        lo, hi = p["peak_allocated"]
        rlo, rhi = p["peak_reserved"]
        ra, rr = x["step_peaks"][k], x["step_peaks_reserved"][k]
        n += 1
        exact_a += lo == hi == ra
        exact_r += rlo == rhi == rr
        worst = max(worst, abs(lo - ra) / ra, abs(hi - ra) / ra, abs(rlo - rr) / rr, abs(rhi - rr) / rr)
        oom = next((e["oom"] for e in m["log"] if e["step"] == k), None)
        oom_word = ""
        if oom:
            same = all(run["oom"] and figures(run["oom"]["message"]) == figures(oom) for run in p["runs"])
            oom_word = f", OOM {'as recorded' if same else 'DIFF'}"
        print(f"{os.path.basename(base)}: {x['param']}={v} from {sorted(set(x['values'][:k]))}: allocated {lo}–{hi} vs {ra}, reserved {rlo}–{rhi} vs {rr}{oom_word}"
              + (" (range)" if lo != hi or rlo != rhi else ""))
    print(f"{n} larger steps: peak allocated to the byte in {exact_a}, peak reserved in {exact_r}; worst relative error {worst:.4%}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/allocsim")
    ap.add_argument("--json", help="write every comparison here")
    ap.add_argument("--recordings", help="a directory tools/record_scale.py wrote")
    a = ap.parse_args()
    if a.recordings:
        return recordings_main(a)
    rows = []
    for path in RECORDINGS:
        snap, m = load(path), meta(path)
        its = iterations(snap)
        steps = step_of_iteration(m, len(its))
        res = reserved_peaks(snap, its)
        values = [None if s is None else m["seq_lens"][s] for s in steps]
        for i in range(2, len(its)):
            s = steps[i]
            if steps[i - 1] is None:
                continue
            if s is None:
                # A step cut short by an OOM: the step after the one before it, whose peak the job
                # read when it caught the OOM, and the OOM message PyTorch printed.
                oom = next((x for x in m["log"] if "oom" in x and x.get("step") not in steps), None)
                if oom is None:
                    continue
                s, v = oom["step"], m["seq_lens"][oom["step"]]
            else:
                v = values[i]
            for kind, keep in (("2x", lambda x: x is not None and 2 * x <= v), ("held out", lambda x: x is not None and x != v)):
                learn = [x if keep(x) else None for x in values]
                if not any(x is not None for j, x in enumerate(learn) if j > 0):
                    continue
                out = run(a.bin, path, learn, v, i - 1)
                row = {"recording": path, "kind": kind, "iteration": i, "step": s, "value": v, "learnt": sorted({x for x in learn if x is not None})}
                row["reading_allocated"] = m["step_peaks"][s]
                row["reading_reserved"] = None if steps[i] is None else res[i]
                if steps[i] is None:
                    row["reading_oom"] = next(x["oom"] for x in m["log"] if x.get("step") == s)
                if out is None or "error" in out:
                    row["error"] = (out or {}).get("error")
                else:
                    p = out["predictions"][0]
                    row.update(
                        exact=p["exact"],
                        allocated=p["peak_allocated"],
                        reserved=p["peak_reserved"],
                        extrapolated=p["extrapolated"],
                        ranged=any(r["bound"] != "fitted" for r in p["runs"]),
                        ooms=[r["oom"]["message"] if r["oom"] else None for r in p["runs"]],
                    )
                rows.append(row)
    point = {"n": 0, "alloc": 0, "res": 0, "res_n": 0, "worst": 0.0}
    ranged = {"n": 0, "alloc_in": 0, "res_in": 0, "res_n": 0, "widest": 0.0}
    for r in rows:
        if "error" in r:
            print(f"{r['recording']} {r['kind']} iteration {r['iteration']} (seq {r['value']}): error: {r['error']}")
            continue
        lo, hi = r["allocated"]
        rlo, rhi = r["reserved"]
        ra, rr = r["reading_allocated"], r["reading_reserved"]
        a_ok = lo == hi == ra
        r_ok = rr is not None and rlo == rhi == rr
        a_in = lo <= ra <= hi
        r_in = rr is not None and rlo <= rr <= rhi
        if lo != hi or (rr is not None and rlo != rhi):
            ranged["n"] += 1
            ranged["alloc_in"] += a_in
            ranged["res_in"] += r_in
            ranged["res_n"] += rr is not None
            ranged["widest"] = max(ranged["widest"], (hi - lo) / ra)
        else:
            point["n"] += 1
            point["alloc"] += a_ok
            point["res"] += r_ok
            point["res_n"] += rr is not None
            point["oom"] = point.get("oom", 0) + bool(r.get("reading_oom"))
            point["worst"] = max(point["worst"], abs(lo - ra) / ra, abs(rlo - rr) / rr if rr else 0.0)
        word = lambda ok, inside: "=" if ok else ("in range" if inside else "DIFF")
        oom = ""
        if r.get("reading_oom"):
            same = all(o is not None and figures(o) == figures(r["reading_oom"]) for o in r["ooms"])
            oom = f", OOM {'as recorded' if same else 'DIFF'} ({figures(r['reading_oom'])})"
        print(
            f"{r['recording'].split('/')[-1]:22} {r['kind']:8} it {r['iteration']:2} seq {r['value']:5} from {r['learnt']}: "
            f"allocated {lo}–{hi} vs {ra} {word(a_ok, a_in)}"
            + ("" if rr is None else f", reserved {rlo}–{rhi} vs {rr} {word(r_ok, r_in)}")
            + oom
            + (" (range: requests seen at one value)" if r["ranged"] else "")
        )
    print(
        f"{point['n']} predictions of one figure: peak allocated to the byte in {point['alloc']}, peak reserved in {point['res']} of {point['res_n']} "
        f"(the others ran out of memory: {point.get('oom', 0)}); worst relative error {point['worst']:.4%}"
    )
    print(
        f"{ranged['n']} ranges (requests seen at one value, at both ends of their range): the reading inside for peak allocated in {ranged['alloc_in']}, "
        f"peak reserved in {ranged['res_in']} of {ranged['res_n']}; widest range {ranged['widest']:.1%} of the reading"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
