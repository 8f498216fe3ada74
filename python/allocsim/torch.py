"""allocsim inside a PyTorch process: record snapshots, explain OOMs where they happen.

``torch`` is imported when these functions are first called, not when this module is imported.

    import allocsim.torch
    allocsim.torch.install_oom_hook("oom_dumps")    # at start-up
    ...                                              # an OOM now writes the snapshot and why

* :func:`record` — a context manager: records the allocator's history, dumps the snapshot on exit
  and on every OOM (file names carry the rank when ``torch.distributed`` is initialised).
* :func:`install_oom_hook` — on an OOM (``torch._C._cuda_attach_out_of_memory_observer``), dumps
  the snapshot and writes allocsim's explanation beside it (``.txt`` and ``.json``). It never
  raises inside the observer, and says on stderr what it wrote.
* :func:`explain_now` — the live allocator's state explained, without a file.
* :func:`step` — ``with allocsim.torch.step(seq=L):`` around a training or inference step: the
  ``record_function("seq=L")`` region ``allocsim scale`` learns each step's shape from. Where the
  steps are annotated so, the OOM hook's explanation ends with the largest value of the shape that
  would have fit.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Union

import allocsim

__all__ = ["record", "install_oom_hook", "explain_now", "step", "OomHook", "Recording"]

#: Entries the allocator's history keeps (a ring buffer; allocsim replays a trace that starts
#: mid-history from the state it reconstructs).
DEFAULT_MAX_ENTRIES = 100_000


def _torch() -> Any:
    import torch  # noqa: PLC0415 (imported lazily: allocsim does not depend on torch)

    return torch


def _rank_suffix(torch: Any) -> str:
    """``_rank{N}`` when torch.distributed is initialised, else ``''``."""
    try:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return f"_rank{dist.get_rank()}"
    except Exception:
        pass
    return ""


def _free_path(directory: str, stem: str, ext: str) -> str:
    """``directory/stem.ext``, or ``stem-2.ext``, ``stem-3.ext``… if taken."""
    path = os.path.join(directory, stem + ext)
    k = 1
    while os.path.exists(path):
        k += 1
        path = os.path.join(directory, f"{stem}-{k}{ext}")
    return path


def _start_history(torch: Any, max_entries: int, stacks: str) -> None:
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks, max_entries=max_entries)


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except Exception:
        pass


def _sizes(n: int) -> str:
    """Bytes as PyTorch's OOM message writes them (``format_size``)."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


class OomHook:
    """What :func:`install_oom_hook` installed. ``written`` lists the files of the last OOM,
    ``count`` the OOMs it handled; ``active = False`` makes the observer do nothing (torch offers
    no way to detach it)."""

    def __init__(self, directory: str, explain: bool, quiet: bool):
        self.directory = directory
        self.explain = explain
        self.quiet = quiet
        self.active = True
        self.count = 0
        self.written: List[str] = []
        self.error: Optional[str] = None
        self._busy = threading.local()

    def __repr__(self) -> str:
        return f"<allocsim.torch.OomHook {self.directory!r}: {self.count} OOMs handled>"

    # torch calls this with the allocator's numbers: the device, the bytes it tried to allocate,
    # the allowed maximum (set_per_process_memory_fraction) or else the device's total, and the
    # device's free memory (cudaMemGetInfo).
    def __call__(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not self.active or getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            self.error = None
            self.written = self._handle(int(device), int(alloc), int(device_allocated), int(device_free))
            self.count += 1
            if not self.quiet:
                _say(f"allocsim: CUDA out of memory on device {device} (tried to allocate {_sizes(int(alloc))}); wrote {', '.join(self.written)}")
        except BaseException as e:  # never raise inside the allocator's observer
            self.error = f"{type(e).__name__}: {e}"
            _say(f"allocsim: the OOM hook could not write its files: {self.error}")
        finally:
            self._busy.on = False

    def _handle(self, device: int, alloc: int, limit: int, device_free: int) -> List[str]:
        torch = _torch()
        snap = torch.cuda.memory._snapshot()
        os.makedirs(self.directory, exist_ok=True)
        stem = f"oom{_rank_suffix(torch)}_{time.strftime('%Y%m%d-%H%M%S')}"
        path = _free_path(self.directory, stem, ".pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        written = [path]
        if not self.explain:
            return written
        try:
            written += self._explain(snap, path, device, alloc, limit, device_free)
        except Exception as e:  # the snapshot is written; say why the explanation is not
            self.error = f"the explanation failed: {type(e).__name__}: {e}"
            _say(f"allocsim: {self.error}")
        return written

    def _explain(self, snap: Dict[str, Any], path: str, device: int, alloc: int, limit: int, device_free: int) -> List[str]:
        torch = _torch()
        observed = {"device": device, "alloc_size": alloc, "limit_or_total": limit, "device_free": device_free}
        total = None
        try:
            total = int(torch.cuda.get_device_properties(device).total_memory)
            observed["device_total"] = total
        except Exception:
            pass
        s = allocsim.load(snap, name=path)
        ooms = s.recorded_ooms(device)
        x = s.explain(at=ooms[-1] if ooms else "oom", device=device, device_memory=total)
        base = path[: -len(".pickle")]
        limit_words = "the allowed maximum" if total is not None and limit < total else "the device's total"
        header = (
            f"PyTorch's out-of-memory observer: device {device}, tried to allocate {_sizes(alloc)} ({alloc} bytes); "
            f"{limit_words} {_sizes(limit)} ({limit} bytes); {_sizes(device_free)} ({device_free} bytes) free on the device.\n"
            f"allocsim's explanation of {path}:\n\n"
        )
        largest = _largest_shape(s, snap, device, limit, total)
        with open(base + ".txt", "w", encoding="utf-8") as f:
            f.write(header + str(x) + "\n")
            if largest is not None:
                f.write(largest[0] + "\n")
        d = x.to_dict()
        d["observer"] = observed
        if largest is not None:
            d["largest_shape"] = largest[1]
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(d, f)
        return [base + ".txt", base + ".json"]


#: A step's annotation, ``NAME=VALUE`` (what :func:`step` records).
_SHAPE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=([0-9]+)$")


def _shape_param(snap: Dict[str, Any], device: int) -> Optional[str]:
    """The name of the steps' shape annotation (``seq`` for ``seq=512``) on ``device``, when there
    is one; None otherwise (or when several names are used)."""
    names = set()
    for a in snap.get("external_annotations") or []:
        if not isinstance(a, dict) or a.get("device", device) != device:
            continue
        m = _SHAPE.match(str(a.get("name", "")))
        if m:
            names.add(m.group(1))
    return names.pop() if len(names) == 1 else None


def _largest_shape(s: "allocsim.Snapshot", snap: Dict[str, Any], device: int, limit: int, total: Optional[int]) -> Optional[tuple]:
    """The largest value of the steps' shape that would have fit, as ``allocsim scale
    --largest-under`` finds it (under the allowed maximum when one was set, else the trace's own
    budget: the device with what others held): the sentence that ends the explanation, and the
    answer's ``largest`` entry. None when the steps are not annotated; the sentence says why when
    they are but it could not be found."""
    try:
        param = _shape_param(snap, device)
    except Exception:
        param = None
    if param is None:
        return None
    capped = total is not None and limit < total
    try:
        r = allocsim.scale(s, param, largest_under=limit if capped else True, device=device, device_memory=total)
    except Exception as e:
        return (f"The largest {param} that would have fit could not be found: {e}", {"param": param, "error": str(e)})
    row = r.largest[0]
    line = next((l for l in str(r).splitlines() if l.startswith(f"largest {param} under")), "")
    if row.get("value") is None:
        return (f"No {param} would have fit: {line}", {"param": param, **row})
    return (f"The largest {param} that would have fit: {row['value']} ({line})", {"param": param, **row})


@contextlib.contextmanager
def step(**shape: int) -> Iterator[None]:
    """``with allocsim.torch.step(seq=L):`` around one training or inference step: a
    ``record_function("seq=L")`` region in the profiler and in the memory snapshot's annotations,
    which ``allocsim scale --param seq`` learns each step's shape from. One keyword, a whole
    number."""
    if len(shape) != 1:
        raise TypeError(f"step() takes one shape keyword, e.g. step(seq=512); got {sorted(shape) or 'none'}")
    ((name, value),) = shape.items()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"step({name}={value!r}): the shape value is a whole number of at least 1")
    torch = _torch()
    with torch.autograd.profiler.record_function(f"{name}={value}"):
        yield


def install_oom_hook(
    directory: Union[str, "os.PathLike[str]"] = "oom_snapshots",
    *,
    record: bool = True,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    stacks: str = "python",
    explain: bool = True,
    quiet: bool = False,
) -> OomHook:
    """On every CUDA out-of-memory error, dump the snapshot into ``directory`` and write
    allocsim's explanation beside it (``.txt``: the text, ``.json``: ``explain --json`` plus the
    observer's numbers). Starts recording the allocator's history (``record=False`` if you
    already do). The hook never raises inside the observer; it prints on stderr what it wrote."""
    torch = _torch()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    if record:
        _start_history(torch, max_entries, stacks)
    hook = OomHook(directory, explain, quiet)
    torch._C._cuda_attach_out_of_memory_observer(hook)
    return hook


class Recording:
    """What :func:`record` yields: ``path`` (the snapshot written on exit) and ``hook`` (the
    :class:`OomHook` that dumps on OOM, or None)."""

    def __init__(self, directory: str, hook: Optional[OomHook]):
        self.directory = directory
        self.hook = hook
        self.path: Optional[str] = None

    def __repr__(self) -> str:
        return f"<allocsim.torch.Recording {self.directory!r}: {self.path or 'recording'}>"


@contextlib.contextmanager
def record(
    directory: Union[str, "os.PathLike[str]"] = "snapshots",
    max_entries: int = DEFAULT_MAX_ENTRIES,
    stacks: str = "python",
    *,
    on_oom: bool = True,
    explain: bool = True,
) -> Iterator[Recording]:
    """Records the allocator's history inside the block and dumps the snapshot into ``directory``
    on exit (``snapshot[_rankN].pickle``), and on every OOM (``oom[_rankN]_….pickle`` with
    the explanation, unless ``on_oom=False``). ``stacks``: ``'python'`` or ``'all'``."""
    torch = _torch()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    _start_history(torch, max_entries, stacks)
    hook = install_oom_hook(directory, record=False, explain=explain) if on_oom else None
    rec = Recording(directory, hook)
    try:
        yield rec
    finally:
        try:
            path = _free_path(directory, f"snapshot{_rank_suffix(torch)}", ".pickle")
            torch.cuda.memory._dump_snapshot(path)
            rec.path = path
        finally:
            if hook is not None:
                hook.active = False
            torch.cuda.memory._record_memory_history(enabled=None)


def explain_now(
    device: Optional[int] = None,
    at: Union[str, int, None] = None,
    **options: Any,
) -> "allocsim.Explanation":
    """The live allocator's state explained, from ``torch.cuda.memory._snapshot()`` (no file).
    ``at`` defaults to the last OOM the history recorded, else the last request (the state now).
    Needs the history on (:func:`record`, :func:`install_oom_hook` or
    ``torch.cuda.memory._record_memory_history()``). Other options as ``Snapshot.explain``."""
    torch = _torch()
    dev = torch.cuda.current_device() if device is None else int(device)
    s = allocsim.load(torch.cuda.memory._snapshot(), name="torch.cuda.memory._snapshot()")
    n = s.requests(dev)
    if n == 0:
        raise RuntimeError(
            f"no allocation history on device {dev}: turn it on first (allocsim.torch.record(), "
            "allocsim.torch.install_oom_hook() or torch.cuda.memory._record_memory_history())"
        )
    if at is None:
        ooms = s.recorded_ooms(dev)
        at = ooms[-1] if ooms else n - 1
    if "device_memory" not in options:
        try:
            options["device_memory"] = int(torch.cuda.get_device_properties(dev).total_memory)
        except Exception:
            pass
    return s.explain(at=at, device=dev, **options)
