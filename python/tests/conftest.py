"""Shared fixtures: the repository's traces (required: a test that needs them fails without them)."""

import gzip
import json
import os
import pickle
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TRACES = os.path.join(ROOT, "traces")
FRAG = os.path.join(TRACES, "frag__default__2048M.pickle.gz")


def trace(name):
    """A trace of traces/ (its path); fails when it is missing."""
    path = os.path.join(TRACES, name)
    assert os.path.exists(path), f"{path} is required (the repository's traces/)"
    return path


def meta(name):
    """The .json a recording wrote beside its trace."""
    with open(trace(name.replace(".pickle.gz", ".json"))) as f:
        return json.load(f)


def snapshot_dict(name):
    """The dict torch.cuda.memory._snapshot() returned in the recorded process (the file unpickled:
    these snapshots hold only plain data)."""
    with gzip.open(trace(name), "rb") as f:
        return pickle.load(f)


def without_nvml(msg):
    """PyTorch's OOM message without NVML's per-process sentences, which a trace cannot show."""
    parts = msg.split(". ")
    keep = [
        s
        for s in parts
        if not ((s.startswith("Process ") or s.startswith("Including non-PyTorch memory, this process has ")) and s.endswith(" memory in use"))
    ]
    return ". ".join(keep)


def cli(*args):
    """The package's command line (`python -m allocsim ARGS`), run from the repository root."""
    # (Without COLUMNS: tables are as wide as they are by default, as in the package's answers.)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "allocsim", *args], cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    # Trace names in the answers are the paths as given: relative to the repository root, as the
    # command line is run in these tests.
    monkeypatch.chdir(ROOT)


def required(what):
    """Whether a missing optional dependency fails a test instead of skipping it: under
    ALLOCSIM_REQUIRE_SHARED=1 (CI) or ALLOCSIM_REQUIRE_RAY=1 (.ci/run installs Ray and fsspec)."""
    return any(os.environ.get(k) == "1" for k in ("ALLOCSIM_REQUIRE_SHARED", "ALLOCSIM_REQUIRE_RAY"))


def need(module, what=None):
    """`module` imported; without it the test (or `what`) skips with one line naming it, and fails
    when required."""
    try:
        return __import__(module)
    except ImportError:
        test = what or os.environ.get("PYTEST_CURRENT_TEST", "this test").split(" ")[0]
        if required(module):
            pytest.fail(f"{test}: {module} is not installed (pip install {module}), and ALLOCSIM_REQUIRE_SHARED=1 or ALLOCSIM_REQUIRE_RAY=1 requires it")
        pytest.skip(f"skipped {test}: {module} is not installed (pip install {module})")
