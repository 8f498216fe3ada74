#!/usr/bin/env python3
"""Writes tests/fixtures/json/: snapshots saved the ways users save them, made with Python's own
json module from a real recording (tests/fixtures/field/tiny_stacks_all__default.pickle.gz,
torch 2.11 on an H200, stacks="all").

* tiny_stacks_all.snapshot.json.gz: json.dump(torch.cuda.memory._snapshot(), f), what Mosaic
  reads (gzip'd to keep the repository small; allocsim reads either).
* tiny_stacks_all.segments.json: json.dump(torch.cuda.memory_snapshot(), f): the segments only.

The snapshot pickle holds builtin types only, so pickle.load needs no torch.
"""
import gzip
import json
import pickle
from pathlib import Path

root = Path(__file__).resolve().parent.parent
src = root / "tests/fixtures/field/tiny_stacks_all__default.pickle.gz"
out = root / "tests/fixtures/json"
out.mkdir(parents=True, exist_ok=True)
with gzip.open(src, "rb") as f:
    snap = pickle.load(f)
with gzip.open(out / "tiny_stacks_all.snapshot.json.gz", "wt") as f:
    json.dump(snap, f)
with open(out / "tiny_stacks_all.segments.json", "w") as f:
    json.dump(snap["segments"], f)
