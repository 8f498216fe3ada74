"""``allocsim.fleet``: the ranks of one job compared as ``allocsim compare DIR`` compares them, for
jobs with more snapshots than one machine should read: each file is read and replayed where it is
read (a pool of processes on this machine, or Ray tasks on a cluster), and the small summaries that
come back are compared by the same Rust code the command line runs::

    import allocsim.fleet
    r = allocsim.fleet.compare("s3://bucket/job42/", engine="ray", address="auto")
    print(r)                  # the text of `allocsim compare DIR`
    r.to_dict()               # its --json

Each task reads one file (a local path, or an fsspec URL read through fsspec) and returns the
file's summary: its row (peaks, OOMs, fragmentation at the peak, every iteration's peak) and the
recorded time of each iteration's peak, as one line of JSON made in Rust. A file that cannot be
read or replayed, or whose task fails, is a row with its error; the other files still answer.
``python -m allocsim.fleet DIR [--ray [ADDRESS]] [--json]`` is the same from a shell.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .. import _allocsim
from .._results import RanksResult

__all__ = ["compare", "expand", "RanksResult"]

PathLike = Union[str, "os.PathLike[str]"]
Size = Union[int, float, str, None]

#: What a directory stands for (as `allocsim compare DIR`): snapshots by their names.
_SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".jsonl", ".pickle.gz", ".pkl.gz", ".jsonl.gz")


def _is_url(p: str) -> bool:
    return "://" in p


def _fsspec():
    try:
        import fsspec  # type: ignore[import-not-found]
    except ImportError:
        raise ImportError("allocsim.fleet: reading URLs needs fsspec (pip install fsspec, and the filesystem's own package, e.g. s3fs)") from None
    return fsspec


def _expand_url(url: str, storage_options: Dict[str, Any]) -> List[str]:
    """An fsspec URL as `allocsim compare` expands a path: a glob in its last component gives the
    files it matches, a directory the snapshots in it, anything else itself; each list sorted."""
    fsspec = _fsspec()
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if any(c in last for c in "*?"):
        found = sorted(p for p in fs.glob(path) if fs.isfile(p))
        if not found:
            raise ValueError(f"{url}: no file matches")
    elif fs.isdir(path):
        found = sorted(p for p in fs.ls(path, detail=False) if p.rsplit("/", 1)[-1].endswith(_SNAPSHOT_SUFFIXES) and fs.isfile(p))
        if not found:
            raise ValueError(f"{url}: no snapshots (*.pickle, *.pkl, *.jsonl, optionally .gz) in this directory")
    else:
        return [url]
    return [fs.unstrip_protocol(p) for p in found]


def expand(paths: Union[PathLike, Sequence[PathLike]], storage_options: Optional[Dict[str, Any]] = None) -> List[str]:
    """The files ``compare`` reads for ``paths``, named as its rows name them: local paths as
    ``allocsim compare`` expands and prints them (the same Rust code: a directory stands for the
    snapshots in it, a ``*``/``?`` in the last component for the files it matches, each list
    sorted by name), URLs (``s3://…``, ``gs://…``, ``file://…``, any fsspec protocol) the same way
    through fsspec, as full URLs."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError("allocsim.fleet: no files given")
    out: List[str] = []
    for p in items:
        p = os.fspath(p)
        out.extend(_expand_url(p, storage_options or {}) if _is_url(p) else _allocsim.rank_paths([p]))
    return out


def _read(url: str, storage_options: Dict[str, Any]) -> bytes:
    with _fsspec().open(url, "rb", **storage_options) as f:
        return f.read()


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def summarize(name: str, source: str, options: Dict[str, Any], storage_options: Optional[Dict[str, Any]] = None) -> Union[str, Tuple[str, str]]:
    """One file's summary (what each task runs): ``source`` is the file to read (a local path, or
    a URL read through fsspec into memory), ``name`` what its row calls it. Returns the summary's
    JSON (``_allocsim.rank_summary``), or ``(name, error)`` when the file could not be fetched."""
    try:
        if _is_url(source):
            return _allocsim.rank_summary(_read(source, storage_options or {}), name, **options)
        return _allocsim.rank_summary(source, name, **options)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # (pyo3's PanicException is a BaseException)
        return (name, f"{name}: {_one_line(e)}")


class _Progress:
    """A bar over files on stderr: tqdm's when it is installed, else a counter."""

    def __init__(self, total: int, enabled: Optional[bool]):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.total, self.done, self.on = total, 0, bool(enabled) and total > 0
        self.bar = None
        self.last = 0.0
        if self.on:
            try:
                from tqdm import tqdm  # type: ignore[import-not-found]

                self.bar = tqdm(total=total, unit="file", desc="allocsim.fleet", file=sys.stderr)
            except ImportError:
                self.bar = None

    def step(self, n: int = 1) -> None:
        self.done += n
        if not self.on:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= 0.2 or self.done == self.total:
            self.last = now
            sys.stderr.write(f"\rallocsim.fleet: {self.done}/{self.total} files")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.on:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _decode(line: bytes) -> Union[str, Tuple[str, str]]:
    """A worker's answer line (see ``_worker``)."""
    kind, body = line[:2], line[2:].rstrip(b"\n").decode()
    if kind == b"S ":
        return body
    name, error = json.loads(body)
    return (name, error)


def _map_local(jobs: List[Tuple[str, str]], options: Dict[str, Any], storage_options: Dict[str, Any], workers: Optional[int], bar: _Progress) -> List[Any]:
    """Each job in one of ``workers`` processes (``python -m allocsim.fleet._worker``, fed one
    file at a time by a thread of this process, so the fastest take the most). A process that dies
    on a file makes that file's error row and is started again for the rest. (Processes of their
    own rather than multiprocessing's: nothing of the caller's ``__main__`` is imported or forked.)"""
    header = base64.b64encode(pickle.dumps({"options": options, "storage_options": storage_options})) + b"\n"
    todo: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    for i in range(len(jobs)):
        todo.put(i)
    done: "queue.SimpleQueue[Tuple[int, Any]]" = queue.SimpleQueue()

    def start() -> "subprocess.Popen[bytes]":
        p = subprocess.Popen([sys.executable, "-m", "allocsim.fleet._worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert p.stdin is not None
        p.stdin.write(header)
        return p

    def serve() -> None:
        p: "Optional[subprocess.Popen[bytes]]" = None
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                break
            name, src = jobs[i]
            line = b""
            try:
                if p is None:
                    p = start()
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(json.dumps([name, src]).encode() + b"\n")
                p.stdin.flush()
                line = p.stdout.readline()
            except (OSError, ValueError):
                pass
            if line:
                done.put((i, _decode(line)))
                continue
            code = p.wait() if p is not None else None
            p = None
            done.put((i, (name, f"{name}: the process reading it ended (exit status {code}) before it answered")))
        if p is not None:
            assert p.stdin is not None
            p.stdin.close()
            p.wait()

    n = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    threads = [threading.Thread(target=serve, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    out: List[Any] = [None] * len(jobs)
    for _ in range(len(jobs)):
        i, r = done.get()
        out[i] = r
        bar.step()
    for t in threads:
        t.join()
    return out


def _map_ray(
    jobs: List[Tuple[str, str]],
    options: Dict[str, Any],
    storage_options: Dict[str, Any],
    address: Optional[str],
    task_options: Optional[Dict[str, Any]],
    bar: _Progress,
) -> List[Any]:
    try:
        import ray  # type: ignore[import-not-found]
    except ImportError:
        raise ImportError('allocsim.fleet: engine="ray" needs Ray (pip install ray)') from None
    started = False
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
        started = True
    try:
        task = ray.remote(summarize).options(**{"num_cpus": 1, **(task_options or {})})
        refs = [task.remote(name, src, options, storage_options) for name, src in jobs]
        index = {r: i for i, r in enumerate(refs)}
        out: List[Any] = [None] * len(jobs)
        pending = refs
        while pending:
            done, pending = ray.wait(pending, num_returns=min(len(pending), 256), timeout=0.5)
            for r in done:
                i = index[r]
                try:
                    out[i] = ray.get(r)
                except Exception as e:  # the task or its worker failed (after Ray's retries)
                    out[i] = (jobs[i][0], f"{jobs[i][0]}: the Ray task reading it failed: {_one_line(e)}")
            bar.step(len(done))
        return out
    finally:
        if started:
            ray.shutdown()


def _size(v: Size, what: str) -> Optional[int]:
    from .. import _size as size

    return size(v, what)


def compare(
    paths: Union[PathLike, Sequence[PathLike]],
    *,
    engine: str = "local",
    address: Optional[str] = None,
    config: Optional[str] = None,
    capacity: Size = None,
    device_memory: Size = None,
    trace_capacity: Size = None,
    device: Optional[int] = None,
    by: Optional[str] = None,
    spike: float = 1.1,
    workers: Optional[int] = None,
    progress: Optional[bool] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    task_options: Optional[Dict[str, Any]] = None,
) -> RanksResult:
    """``allocsim compare PATHS`` over ranks: the same answer (``str()`` its text, ``to_dict()``
    its ``--json``), each file read and replayed in a task of its own.

    ``paths``: a directory, a glob, a file, or a list of them; local paths or fsspec URLs (see
    :func:`expand`). ``engine``: ``"local"`` (a pool of ``workers`` processes on this machine,
    default one per core, each ``python -m allocsim.fleet._worker``) or ``"ray"`` (one Ray task per file, on the cluster Ray is connected
    to: ``ray.init(address=address)`` unless Ray is initialised already, shut down afterwards only
    if this call started it; ``task_options`` are passed to ``.options()``, e.g.
    ``{"memory": 2 << 30}``, default ``num_cpus=1``). ``config``, ``capacity``, ``device_memory``,
    ``trace_capacity``, ``device``, ``by``, ``spike``: as ``allocsim compare``'s options. ``progress``: a bar over the
    files on stderr (tqdm's if installed), by default only when stderr is a terminal.
    ``storage_options`` go to fsspec. Local files are read by each task at their absolute path
    (on a cluster, a path every node sees), and their rows keep the names as given.

    A file that cannot be read or replayed is a row with its ``error``; then ``exit_code`` is 2
    and ``error`` holds the command line's last line. Raises ``ConfigError``/``ValueError`` for
    settings the command line refuses, before any file is read."""
    if engine not in ("local", "ray"):
        raise ValueError(f'allocsim.fleet.compare: engine {engine!r}: expected "local" or "ray"')
    _allocsim.rank_check(config, float(spike))
    options = dict(
        config=config,
        capacity=_size(capacity, "capacity"),
        device_memory=_size(device_memory, "device_memory"),
        trace_capacity=_size(trace_capacity, "trace_capacity"),
        device=device,
        by=by,
    )
    so = dict(storage_options or {})
    names = expand(paths, so)
    jobs = [(n, n if _is_url(n) else os.path.abspath(n)) for n in names]
    bar = _Progress(len(jobs), progress)
    try:
        if engine == "ray":
            summaries = _map_ray(jobs, options, so, address, task_options, bar)
        else:
            summaries = _map_local(jobs, options, so, workers, bar)
    finally:
        bar.close()
    return RanksResult(*_allocsim.rank_reduce(summaries, float(spike)))
