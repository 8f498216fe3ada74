#!/usr/bin/env python3
"""`allocsim replay FILE` against CPython's `pickle.load` of the same file, alternating, N runs each
(default 5): best and median wall times and their ratios, one line a file.

    python3 benches/pickle_compare.py target/release/allocsim FILE...

Wall times include process start-up on both sides (`subprocess.run`); other jobs on the machine
inflate them, so the best of several runs is the figure (docs/performance.md, "Pickles").
"""
import os
import subprocess
import sys
import time

LOAD = 'import pickle,sys,gzip\np=sys.argv[1]\nf=gzip.open(p,"rb") if p.endswith(".gz") else open(p,"rb")\npickle.load(f)'


def wall(cmd):
    s = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - s


def main():
    binary, files = sys.argv[1], sys.argv[2:]
    n = int(os.environ.get("N", "5"))
    for f in files:
        ours, py = [], []
        for _ in range(n):
            ours.append(wall([binary, "replay", f]))
            py.append(wall([sys.executable, "-c", LOAD, f]))
        ours.sort()
        py.sort()
        mo, mp = ours[len(ours) // 2], py[len(py) // 2]
        print(f"{os.path.basename(f):45s} {os.path.getsize(f) / 1e6:7.1f} MB  allocsim {ours[0]:.3f}/{mo:.3f} s  "
              f"CPython {py[0]:.3f}/{mp:.3f} s  {py[0] / ours[0]:5.1f}x / {mp / mo:5.1f}x (best / median)", flush=True)


if __name__ == "__main__":
    main()
