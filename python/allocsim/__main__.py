"""``python -m allocsim …`` and the ``allocsim`` command: the command line, run in-process."""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from . import _allocsim

    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    return _allocsim.cli(["allocsim", *args])


if __name__ == "__main__":
    sys.exit(main())
