"""``python -m allocsim.fleet._worker``: one process of ``allocsim.fleet``'s local pool. It reads a
header line (the options, pickled and base64'd), then one JSON line per file, ``[name, source]``,
and answers each with one line: ``S `` and the summary's JSON, or ``E `` and ``[name, error]``."""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys


def main() -> int:
    # The answers go to a descriptor of their own; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from . import summarize

    inp = sys.stdin.buffer
    header = pickle.loads(base64.b64decode(inp.readline()))
    options, storage_options = header["options"], header["storage_options"]
    for line in inp:
        name, source = json.loads(line)
        r = summarize(name, source, options, storage_options)
        out.write(b"S " + r.encode() + b"\n" if isinstance(r, str) else b"E " + json.dumps(list(r)).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
