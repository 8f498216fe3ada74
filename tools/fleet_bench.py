#!/usr/bin/env python3
"""Measures allocsim.fleet against `allocsim compare DIR` (docs/fleet.md).

    python tools/fleet_bench.py --allocsim target/release/allocsim --dir /tmp/fleet1000 \
        --files 1000 --requests 4000 [--large 500] [--out bench.json]

Makes FILES synthetic rank snapshots in DIR (`allocsim synth --workload training`, seeds
0..FILES-1, REQUESTS requests each, .pickle.gz) unless they are there, then times one comparison
of them each way, every answer checked equal to the command line's JSON:

* `allocsim compare DIR --json` (rayon threads, one per core): wall time and peak RSS
  (/usr/bin/time -v);
* `allocsim.fleet.compare(DIR)` with engine="local" and engine="ray" (a local Ray instance,
  `ray.init(num_cpus=cores)`, its start timed apart): wall time, the driver's own peak RSS
  (getrusage) and the peak of the RSS summed over the driver and every process under it (Ray's
  raylet and workers included; sampled every 0.1 s by psutil);
* the summaries' bytes per file;
* with --reduce N: the reduce alone (`_allocsim.rank_reduce`) over N summaries made from one of
  DIR's, their iterations stretched to 12, 100 and 1000, with the driver's peak RSS after each;
* with --large MB: one uncompressed snapshot of about that many MB (`synth -o x.pickle`), one
  summary of it timed in a process of its own with its peak RSS: the per-file, per-MB cost the
  projection in docs/fleet.md scales from.

Run it in a virtual environment that has allocsim (pip install ./python), ray and psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import threading
import time


def synth(allocsim, path, requests, seed):
    subprocess.run([allocsim, "synth", "--workload", "training", "--requests", str(requests), "--seed", str(seed), "-o", path], check=True, capture_output=True)


def timed_v(cmd):
    """(wall seconds, peak RSS bytes, stdout) of a command under /usr/bin/time -v."""
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if p.returncode not in (0, 2):
        raise SystemExit(f"{cmd}: exit {p.returncode}: {p.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", p.stderr).group(1)
    secs = 0.0
    for part in wall.split(":"):
        secs = secs * 60 + float(part)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    return secs, rss, p.stdout


class TreeRss:
    """The peak of the RSS summed over this process and all under it."""

    def __init__(self):
        import psutil

        self.me = psutil.Process()
        self.peak = 0
        self.stop = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        import psutil

        while not self.stop:
            total = 0
            try:
                procs = [self.me, *self.me.children(recursive=True)]
            except psutil.Error:
                procs = [self.me]
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.1)

    def close(self):
        self.stop = True
        self.t.join()
        return self.peak


def fleet_run(engine, d, cores):
    """Runs in a child process: one comparison, with its measurements, as JSON on stdout."""
    import allocsim.fleet

    tree = TreeRss()
    init = 0.0
    if engine == "ray":
        import ray

        t = time.monotonic()
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
        init = time.monotonic() - t
    t = time.monotonic()
    r = allocsim.fleet.compare(d, engine=engine, progress=False)
    wall = time.monotonic() - t
    if engine == "ray":
        ray.shutdown()
    peak_tree = tree.close()
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    json.dump({"wall_s": wall, "init_s": init, "driver_rss": driver, "tree_rss": peak_tree, "json": r.to_dict()}, sys.stdout)


def reduce_scale(path, n):
    from allocsim import _allocsim

    base = json.loads(_allocsim.rank_summary(path, path))
    out = []
    for iters in (12, 100, 1000):
        s, row = dict(base), dict(base["row"])
        row["iteration_peaks"] = [row["iteration_peaks"][i % len(row["iteration_peaks"])] + i for i in range(iters)]
        s["iteration_peak_us"] = [1796325217497720 + 1000 * i for i in range(iters)]
        items = []
        for k in range(n):
            row["file"] = f"s3://bucket/job/rank{k:05d}.pickle"
            s["row"] = row
            items.append(json.dumps(s, separators=(",", ":")))
        t = time.monotonic()
        text, js, _, _ = _allocsim.rank_reduce(items, 1.1)
        m = {
            "iterations": iters,
            "summary_bytes": sum(map(len, items)) / n,
            "reduce_s": time.monotonic() - t,
            "json_bytes": len(js),
            "driver_peak_rss_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        print(f"reduce of {n} summaries of {iters} iterations: {m['summary_bytes']:.0f} B each, {m['reduce_s']:.2f} s, driver peak RSS so far {m['driver_peak_rss_so_far'] / 2**20:.0f} MiB", file=sys.stderr)
        out.append(m)
        del items
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--allocsim", required=True, help="the allocsim binary (a release build)")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--large", type=int, default=0, help="MB of one uncompressed snapshot to time alone")
    ap.add_argument("--reduce", type=int, default=0, help="summaries to time the reduce over")
    ap.add_argument("--engines", default="cli,local,ray")
    ap.add_argument("--out")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    if a._child:
        fleet_run(a._child[0], a._child[1], cores)
        return
    os.makedirs(a.dir, exist_ok=True)
    t = time.monotonic()
    made = 0
    for i in range(a.files):
        f = os.path.join(a.dir, f"rank{i:05d}.pickle.gz")
        if not os.path.exists(f):
            synth(a.allocsim, f, a.requests, i)
            made += 1
    files = sorted(os.listdir(a.dir))
    sizes = [os.path.getsize(os.path.join(a.dir, f)) for f in files]
    res = {
        "machine": f"{platform.machine()}, {cores} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB",
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "files": len(files),
        "requests_each": a.requests,
        "bytes_gz_total": sum(sizes),
        "synth_s": time.monotonic() - t if made else None,
    }
    import gzip

    res["bytes_raw_sample_mean"] = sum(len(gzip.open(os.path.join(a.dir, f)).read()) for f in files[:20]) / min(20, len(files))
    want = None
    engines = [e for e in a.engines.split(",") if e]
    if "cli" in engines:
        wall, rss, out = timed_v([a.allocsim, "compare", a.dir, "--json"])
        want = json.loads(out)
        res["cli"] = {"wall_s": wall, "rss": rss}
        print(f"allocsim compare: {wall:.2f} s, peak RSS {rss / 2**20:.0f} MiB", file=sys.stderr)
    for engine in ("local", "ray"):
        if engine not in engines:
            continue
        p = subprocess.run([sys.executable, __file__, "--allocsim", a.allocsim, "--dir", a.dir, "--_child", engine, a.dir], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{engine}: {p.stderr[-3000:]}")
        m = json.loads(p.stdout)
        got = m.pop("json")
        m["equal_to_cli"] = None if want is None else got == want
        res[engine] = m
        print(f"fleet {engine}: {m['wall_s']:.2f} s (+{m['init_s']:.2f} s ray.init), driver RSS {m['driver_rss'] / 2**20:.0f} MiB, tree {m['tree_rss'] / 2**20:.0f} MiB, equal {m['equal_to_cli']}", file=sys.stderr)
    from allocsim import _allocsim

    sample = [len(_allocsim.rank_summary(os.path.join(a.dir, f), os.path.join(a.dir, f)).encode()) for f in files[:50]]
    res["summary_bytes_mean"] = sum(sample) / len(sample)
    res["summary_bytes_max"] = max(sample)
    if a.reduce:
        res["reduce"] = reduce_scale(os.path.join(a.dir, files[1]), a.reduce)
    if a.large:
        # About 148 bytes of pickle per request on the training workload (3000 requests: 444 kB).
        big = os.path.join(a.dir + "-large", f"large{a.large}.pickle")
        os.makedirs(os.path.dirname(big), exist_ok=True)
        req = a.large * 6750
        if not os.path.exists(big):
            t = time.monotonic()
            synth(a.allocsim, big, req, 7)
            res["large_synth_s"] = time.monotonic() - t
        code = f"import time,json;from allocsim import _allocsim as n;t=time.monotonic();s=n.rank_summary({big!r},'large');print(json.dumps([time.monotonic()-t,len(s),json.loads(s)['row']['requests'],json.loads(s)['row']['error']]))"
        wall, rss, out = timed_v([sys.executable, "-c", code])
        secs, nbytes, nreq, err = json.loads(out)
        res["large"] = {"bytes": os.path.getsize(big), "requests": nreq, "summary_s": secs, "process_wall_s": wall, "rss": rss, "summary_bytes": nbytes, "error": err}
        print(f"large: {os.path.getsize(big) / 1e6:.0f} MB, {nreq} requests: {secs:.2f} s, RSS {rss / 2**20:.0f} MiB", file=sys.stderr)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
