#!/usr/bin/env python3
"""Record PyTorch's own allocator tests (test/test_cuda.py) as snapshots, for `allocsim validate`.

    python3 tools/record_test_cuda.py --pytorch-src DIR OUT_DIR [--tests NAME ...] [--settings default expandable]
                                      [--job-timeout S]
    python3 tools/record_test_cuda.py --scenarios OUT_DIR [--settings default expandable]

Needs a GPU, torch, and (for the first form) PyTorch's test/test_cuda.py under DIR/test/, from the
release of the installed wheel (`python -c 'import torch; print(torch.version.git_version)'`): the
wheels do not ship `test/`. A trimmed copy holding only the tests below will do (the GPU session,
tools/record_test_cuda_all.sh, carries one in .ptsrc/); torch's test helpers also need the
`expecttest` package. Each test runs in a process of its own, once per settings (`default`: no
PYTORCH_CUDA_ALLOC_CONF; `expandable`: `expandable_segments:True`), with memory history recorded
from the test's first line (`_record_memory_history(max_entries=...)`, torch's default context and
stacks) to its last; then `_dump_snapshot` writes OUT_DIR/<test>__<settings>.pickle.gz and
OUT_DIR/<test>__<settings>.json holds what the snapshot cannot: the torch version and git commit,
the device's total memory, the settings string, `memory_stats()` before and after the test (the
counters count from process start), the test's outcome, and the calls the test made that change
settings mid-run (`_set_allocator_settings`, `torch._C._accelerator_setAllocatorSettings`,
`set_per_process_memory_fraction`, each with its arguments, result and the trace entry count at the
time), recorded by wrapping those functions. The tests run under torch's own TestCase as
`run_tests` would run them: TestCuda sets `_do_cuda_non_default_stream`, so its tests run with a
side stream made current (common_utils' CudaNonDefaultStream), and their traces show that stream.

The tests recorded by default (DEFAULT_TESTS, each named by the class test_cuda.py defines it in)
are the allocator tests `allocsim` is checked against: TestCuda's OOM-retry, memory-fraction and
record_stream tests, TestCudaMallocAsync's `test_max_split_expandable`,
`test_garbage_collect_expandable`, `test_allocator_settings` and `test_notifies_oom` (that class
runs on the native allocator too; its name is historical), and TestMemPool's. Five of TestMemPool's
(`test_mempool_empty_cache_inactive`, `test_mempool_with_allocator`,
`test_tensor_delete_after_allocator_delete`, `test_mempool_expandable`,
`test_deleted_mempool_not_used_on_oom`) build a dummy allocator with
`torch.utils.cpp_extension.load_inline`: they need a C++ compiler, ninja and the CUDA headers; they
are listed so that the two sources of that extension are built once each. The .json's `outcome` is
`ok` (ran and passed), `skipped` (with the reason in `why`), `failed` (an assertion or error, in
`why`; a snapshot is still written when the test body ran), `crashed` (the process died, see the
.log) or `timeout` (past --job-timeout).

`--scenarios` records the situations the tests do not cover, as small jobs of this script:
  retries_devfull   expandable segments, a second process leaves 2.5 GiB free, then squeezes to 1.5
                    GiB mid-run: cached pages are released inside a malloc and it retries (no OOM)
  settings_midrun   `_set_allocator_settings("roundup_power2_divisions:4")`, allocations, then
                    `_set_allocator_settings("")`, allocations
  fraction_midrun   `set_per_process_memory_fraction` lowered mid-run, with OOMs on each side
  refused_settings  `_set_allocator_settings("pinned_num_register_threads:1024")` (refused) after
                    `expandable_segments:True`
"""
import argparse
import functools
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

MiB = 1 << 20
GiB = 1 << 30

DEFAULT_TESTS = [
    "TestCuda.test_out_of_memory_retry",
    "TestCuda.test_set_per_process_memory_fraction",
    "TestCuda.test_record_stream",
    "TestCuda.test_caching_allocator_record_stream_oom",
    "TestCudaMallocAsync.test_max_split_expandable",
    "TestCudaMallocAsync.test_garbage_collect_expandable",
    "TestCudaMallocAsync.test_allocator_settings",
    "TestCudaMallocAsync.test_notifies_oom",
    "TestMemPool.test_mempool_no_split",
    "TestMemPool.test_mempool_empty_cache",
    "TestMemPool.test_mempool_multithread",
    # load_inline'd dummy allocator, the source with counters (check_vars=True)
    "TestMemPool.test_mempool_empty_cache_inactive",
    "TestMemPool.test_mempool_with_allocator",
    "TestMemPool.test_tensor_delete_after_allocator_delete",
    # load_inline'd dummy allocator, the source without them (check_vars=False)
    "TestMemPool.test_mempool_expandable",
    "TestMemPool.test_deleted_mempool_not_used_on_oom",
]

SETTINGS = {"default": None, "expandable": "expandable_segments:True"}


def entries(torch):
    """Trace entries recorded so far (device 0)."""
    try:
        return len(torch.cuda.memory._snapshot()["device_traces"][0])
    except Exception:
        return None


def watch_settings_calls(torch, log):
    """Wrap the calls that change settings mid-run, so the .json can say what a snapshot cannot.

    `torch._C._accelerator_setAllocatorSettings` is what `_set_allocator_settings` calls, and what
    test_allocator_settings calls directly with strings it expects refused: a call made inside
    another watched call is not logged again."""
    depth = [0]

    def wrap(owner, name):
        orig = getattr(owner, name, None)
        if orig is None:
            return

        @functools.wraps(orig)
        def wrapped(*args, **kwargs):
            if depth[0]:
                return orig(*args, **kwargs)
            rec = {"call": name, "args": [repr(a) for a in args], "at_entry": entries(torch)}
            depth[0] += 1
            try:
                out = orig(*args, **kwargs)
                rec["result"] = "ok"
                return out
            except Exception as e:
                rec["result"] = f"{type(e).__name__}: {e}"
                raise
            finally:
                depth[0] -= 1
                log.append(rec)
        setattr(owner, name, wrapped)
    wrap(torch.cuda.memory, "_set_allocator_settings")
    wrap(torch._C, "_accelerator_setAllocatorSettings")
    wrap(torch.cuda, "set_per_process_memory_fraction")
    wrap(torch.cuda.memory, "set_per_process_memory_fraction")


def env_meta(torch):
    props = torch.cuda.get_device_properties(0)
    return {
        "torch": torch.__version__,
        "git_version": torch.version.git_version,
        "cuda": torch.version.cuda,
        "device_name": props.name,
        "device_total_memory": props.total_memory,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def finish(torch, out, meta, started):
    raw = out + ".pickle"
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(raw)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(raw, "rb") as f, gzip.open(out + ".pickle.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    meta.update(env_meta(torch))
    meta.update({
        "mem_get_info_end": list(torch.cuda.mem_get_info()),
        "memory_stats": torch.cuda.memory_stats(),
        "wall_s": round(time.time() - started, 3),
    })
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)


def run_test(src, test, out):
    """In this process: load test/test_cuda.py from `src`, run one test with history on."""
    import unittest
    import torch

    sys.path.insert(0, os.path.join(src, "test"))
    spec = importlib.util.spec_from_file_location("test_cuda", os.path.join(src, "test", "test_cuda.py"))
    mod = importlib.util.module_from_spec(spec)
    # common_utils parses sys.argv when imported: hide this script's arguments from it.
    sys.argv = [sys.argv[0]]
    sys.modules["test_cuda"] = mod
    spec.loader.exec_module(mod)
    cls_name, meth = test.split(".")
    cls = getattr(mod, cls_name)
    log = []
    meta = {"test": test, "settings_calls": log}
    watch_settings_calls(torch, log)
    torch.zeros(1, device="cuda")
    meta["memory_stats_before"] = torch.cuda.memory_stats()
    started = time.time()
    orig = getattr(cls, meth)

    # functools.wraps keeps the test's unittest.skipIf marks (__unittest_skip__ in its __dict__),
    # so a test skipped by its decorators is skipped here too, before any recording.
    @functools.wraps(orig)
    def recorded(self, *args, **kwargs):
        torch.cuda.memory._record_memory_history(max_entries=10_000_000)
        try:
            return orig(self, *args, **kwargs)
        finally:
            try:
                finish(torch, out, meta, started)
            except Exception:
                # the test's own outcome stands; the .json says why no snapshot was written
                meta["finish_error"] = traceback.format_exc()[-2000:]
    setattr(cls, meth, recorded)
    result = unittest.TextTestRunner(verbosity=0).run(unittest.defaultTestLoader.loadTestsFromName(meth, cls))
    # wasSuccessful() is True for a skipped test, and for one that never ran.
    if result.failures or result.errors or result.unexpectedSuccesses:
        outcome = "failed"
    elif result.skipped:
        outcome = "skipped"
    elif result.testsRun and result.wasSuccessful():
        outcome = "ok"
    else:
        outcome = "failed"
    why = [str(r[1])[-2000:] for r in result.failures + result.errors + result.skipped]
    if os.path.exists(out + ".json"):
        with open(out + ".json") as f:
            meta = json.load(f)
    else:
        meta.update(env_meta(torch))
    meta.update({"outcome": outcome, "why": why, "tests_run": result.testsRun})
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)


# ---------------------------------------------------------------- scenarios the tests do not cover
def neighbour_main():
    """A second process: `leave N` takes all free memory but N bytes."""
    import torch
    torch.zeros(1, device="cuda")
    held = []
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if parts and parts[0] == "leave":
            held.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            n = (free - int(parts[1])) // (2 * MiB) * (2 * MiB)
            if n > 0:
                held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif parts and parts[0] == "quit":
            break


def scenario(name, out):
    import torch
    log = []
    meta = {"scenario": name, "settings_calls": log, "ooms": []}
    watch_settings_calls(torch, log)
    torch.zeros(1, device="cuda")
    meta["memory_stats_before"] = torch.cuda.memory_stats()
    started = time.time()
    torch.cuda.memory._record_memory_history(max_entries=10_000_000)
    keep = []

    def alloc(nbytes):
        try:
            keep.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            meta["ooms"].append(str(e))

    if name == "retries_devfull":
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        nb = subprocess.Popen([sys.executable, __file__, "--neighbour"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert nb.stdout.readline().strip() == "ready"

        def leave(n):
            torch.cuda.synchronize()
            nb.stdin.write(f"leave {n}\n")
            nb.stdin.flush()
            assert nb.stdout.readline().strip() == "ok"
        leave(2560 * MiB)
        for round_ in range(4):
            for i in range(8):
                alloc((96 + 16 * i) * MiB)
            del keep[::2]
            # The neighbour takes more: the next mallocs that need pages find the device full,
            # release the cached pages and retry.
            leave((1536 - 128 * round_) * MiB)
            for i in range(4):
                alloc((100 + 24 * i) * MiB)
            keep.clear()
        meta["neighbour"] = "left 2560 MiB, then 1536/1408/1280/1152 MiB"
        nb.stdin.write("quit\n")
        nb.stdin.flush()
    elif name == "settings_midrun":
        torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
        for i in range(16):
            alloc((17 + 3 * i) * MiB + 4096)
        keep.clear()
        torch.cuda.memory._set_allocator_settings("")
        for i in range(16):
            alloc((17 + 3 * i) * MiB + 4096)
    elif name == "fraction_midrun":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(2 * GiB / total)
        for i in range(24):
            alloc(200 * MiB)
        keep.clear()
        torch.cuda.set_per_process_memory_fraction(1 * GiB / total)
        for i in range(12):
            alloc(200 * MiB)
        keep.clear()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    elif name == "refused_settings":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        for i in range(8):
            alloc((3 + i) * MiB)
        try:
            torch.cuda.memory._set_allocator_settings("pinned_num_register_threads:1024")
        except Exception as e:
            meta["refused"] = f"{type(e).__name__}: {e}"
        for i in range(8):
            alloc((5 + i) * MiB)
    else:
        raise SystemExit(f"unknown scenario {name}")
    keep.clear()
    finish(torch, out, meta, started)


def main():
    if "--neighbour" in sys.argv:
        return neighbour_main()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--pytorch-src")
    ap.add_argument("--tests", nargs="*", default=DEFAULT_TESTS)
    ap.add_argument("--scenarios", action="store_true")
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS))
    ap.add_argument("--job-timeout", type=float, default=180,
                    help="seconds one test (or scenario) under one settings may take (default 180)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.scenarios:
            return scenario(args.one, args.out)
        return run_test(args.pytorch_src, args.one, args.out)
    if not args.scenarios and not args.pytorch_src:
        ap.error("--pytorch-src DIR (a checkout at the installed wheel's commit) or --scenarios")
    os.makedirs(args.out_dir, exist_ok=True)
    jobs = ["retries_devfull", "settings_midrun", "fraction_midrun", "refused_settings"] if args.scenarios else args.tests
    for job in jobs:
        for s in args.settings:
            name = job.split(".")[-1]
            out = os.path.join(args.out_dir, f"{name}__{s}")
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            if SETTINGS[s]:
                env["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS[s]
            cmd = [sys.executable, __file__, args.out_dir, "--one", job, "--out", out]
            cmd += ["--scenarios"] if args.scenarios else ["--pytorch-src", args.pytorch_src]
            t0 = time.time()
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout)
                rc, stdout, stderr = p.returncode, p.stdout, p.stderr
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired as e:
                rc, status = None, "timeout"
                stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            # always kept: load_inline's build output and the test runner's report are here
            with open(out + ".log", "w") as f:
                f.write(stdout + "\n" + stderr)
            outcome = None
            if rc != 0:
                # the process died (or was stopped) before writing its outcome: say so in the .json
                meta = {}
                if os.path.exists(out + ".json"):
                    with open(out + ".json") as f:
                        meta = json.load(f)
                if "outcome" not in meta or rc is None:
                    meta.update({"test" if not args.scenarios else "scenario": job,
                                 "outcome": "timeout" if rc is None else "crashed",
                                 "returncode": rc, "why": [(stdout + "\n" + stderr)[-2000:]]})
                    with open(out + ".json", "w") as f:
                        json.dump(meta, f, indent=1)
            if os.path.exists(out + ".json"):
                with open(out + ".json") as f:
                    outcome = json.load(f).get("outcome")
            print(json.dumps({"job": job, "settings": s, "status": status, "outcome": outcome,
                              "wall_s": round(time.time() - t0, 1),
                              "snapshot": os.path.exists(out + ".pickle.gz")}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
