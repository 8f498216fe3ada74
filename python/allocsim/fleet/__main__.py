"""``python -m allocsim.fleet PATHS… [--ray [ADDRESS]] [--json]``: ``allocsim compare`` over
ranks, each file read and replayed in a process of its own or a Ray task. The text is that of
``allocsim compare DIR`` and ``--json`` its ``--json``; exit status 2 when a file could not be
compared (its row says why) or an option is refused."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m allocsim.fleet",
        description="Compare the ranks of one job (allocsim compare DIR), each file in a process of its own or a Ray task.",
    )
    ap.add_argument("paths", nargs="+", help="snapshots: a directory, a glob ('rank*.pickle.gz'), files, or fsspec URLs (s3://bucket/job/)")
    ap.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="one Ray task per file; ADDRESS as ray.init takes it ('auto': the cluster of this node; none: RAY_ADDRESS, else a local instance). Put it after the paths.",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the text (allocsim compare --json)")
    ap.add_argument("--config", help="a PYTORCH_CUDA_ALLOC_CONF string for every file (default: each file's own settings)")
    ap.add_argument("--capacity", help="the allowed maximum for every file (default: each trace's own budget)")
    ap.add_argument("--device-memory", help="the device's total memory (default: as each trace shows it, else an H200's)")
    ap.add_argument("--trace-capacity", help="the allowed maximum every file was recorded under (default: inferred from each trace)")
    ap.add_argument("--device", type=int, help="which device's trace, in every file")
    ap.add_argument("--by", help="iterations by this annotation (default: the optimizer's step)")
    ap.add_argument("--spike", type=float, default=1.1, help="a file spikes when an iteration's peak is at least this times the median (default 1.1)")
    ap.add_argument("--workers", type=int, help="local processes (default: one per core); not with --ray")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    a = ap.parse_args(argv)

    from .. import ConfigError, Error
    from . import compare

    try:
        r = compare(
            a.paths,
            engine="ray" if a.ray is not None else "local",
            address=a.ray or None,
            config=a.config,
            capacity=a.capacity,
            device_memory=a.device_memory,
            trace_capacity=a.trace_capacity,
            device=a.device,
            by=a.by,
            spike=a.spike,
            workers=a.workers,
            progress=False if a.no_progress else None,
        )
    except ConfigError as e:  # PyTorch's words, after the option as the command line names it
        sys.stderr.write(f"allocsim: error: --config {json.dumps(a.config)}: {e}\n")
        return 2
    except (Error, ValueError, ImportError, OSError) as e:
        sys.stderr.write(f"allocsim: error: {e}\n")
        return 2
    out = r.to_json() + "\n" if a.json else r._text
    sys.stdout.write(out)
    sys.stdout.flush()
    if r.error is not None:
        sys.stderr.write(f"allocsim: error: {r.error}\n")
    return r.exit_code


if __name__ == "__main__":
    sys.exit(main())
