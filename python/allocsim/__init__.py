"""allocsim: PyTorch's CUDA caching allocator, replayed.

Load a memory snapshot (a file that ``torch.cuda.memory._dump_snapshot()`` wrote, its bytes, or
the dict ``torch.cuda.memory._snapshot()`` returns in the running process) and ask it what the
``allocsim`` command line answers::

    s = allocsim.load("snapshot.pickle")
    print(s.explain())                 # why the first recorded OOM happened
    s.sweep().to_dict()["rows"][0]     # the best setting, as `allocsim sweep --json` gives it

Every answer's ``str()`` is the command line's text and ``to_dict()``/``to_json()`` its
``--json``. Decoding and replaying release the GIL. ``allocsim.torch`` records snapshots and
explains OOMs inside a training process; ``allocsim.fleet.compare`` compares the ranks of a job
(``allocsim compare DIR``) with each file read in a process of its own or a Ray task.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from . import _allocsim
from ._allocsim import ConfigError, Error, TraceError, parse_size
from ._results import (
    Answer,
    CompareResult,
    Explanation,
    FitResult,
    GraphsResult,
    PhasesResult,
    RanksResult,
    ReplayResult,
    ScaleResult,
    SweepResult,
    ValidateResult,
)

__all__ = [
    "load",
    "replay",
    "scale",
    "Snapshot",
    "Error",
    "TraceError",
    "ConfigError",
    "parse_size",
    "Answer",
    "ReplayResult",
    "ValidateResult",
    "Explanation",
    "SweepResult",
    "FitResult",
    "GraphsResult",
    "PhasesResult",
    "ScaleResult",
    "RanksResult",
    "CompareResult",
    "fleet",
]

__version__ = _allocsim.VERSION

Size = Union[int, float, str, None]


def _size(v: Size, what: str) -> Optional[int]:
    """Bytes from an int, a float that is a whole number (``80e9``) or a string as the command
    line takes it (``'24GiB'``, ``'2e9'``); None stays None."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise TypeError(f"{what}: expected bytes (int) or a size such as '24GiB', got {v!r}")
    if isinstance(v, float):
        if not v.is_integer():
            raise ValueError(f"{what}: {v!r} is not a whole number of bytes")
        v = int(v)
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"{what}: {v} is negative")
        return v
    if isinstance(v, str):
        try:
            return parse_size(v)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    raise TypeError(f"{what}: expected bytes (int) or a size such as '24GiB', got {type(v).__name__}")


def _sizes(v: Union[Size, Iterable[Size]], what: str) -> List[int]:
    """A list of sizes as the command line takes one (``'24GiB,80GiB'``), or any iterable of
    sizes (``['24GiB', 80e9]``); None is the empty list."""
    if v is None:
        return []
    if isinstance(v, str):
        return [_size(x.strip(), what) for x in v.split(",") if x.strip()]  # type: ignore[misc]
    if isinstance(v, (int, float)):
        return [_size(v, what)]  # type: ignore[list-item]
    return [_size(x, what) for x in v]  # type: ignore[misc]


def _ints(v: Union[int, str, Iterable[int], None], what: str) -> List[int]:
    """A list of whole numbers as the command line takes one (``'256,128,64'``), or any iterable."""
    if v is None:
        return []
    if isinstance(v, str):
        items: List[Any] = [x.strip() for x in v.split(",") if x.strip()]
    elif isinstance(v, int):
        items = [v]
    else:
        items = list(v)
    try:
        return [int(x) for x in items]
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected whole numbers, got {v!r}") from None


def load(source: Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Dict[str, Any]], name: Optional[str] = None) -> "Snapshot":
    """Loads a snapshot.

    ``source`` is a path (``.pickle``, ``.pickle.gz``, allocsim's ``.jsonl``/``.jsonl.gz``), the
    bytes of such a file, or the dict ``torch.cuda.memory._snapshot()`` returns (taken in the
    running process without writing a file). The pickle is decoded without executing anything.
    ``name`` is what the answers call the trace (default: the path, else ``'snapshot'``).
    Raises ``TraceError`` for anything that is not a readable snapshot.
    """
    if isinstance(source, dict):
        try:
            data = pickle.dumps(source, protocol=4)
        except Exception as e:  # objects that are not plain data
            raise TraceError(f"{name or 'snapshot'}: not a memory snapshot: the dict does not pickle as plain data ({e})") from None
        return Snapshot(_allocsim.Snapshot.from_bytes(data, name or "snapshot"))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return Snapshot(_allocsim.Snapshot.from_bytes(bytes(source), name or "snapshot"))
    if isinstance(source, (str, os.PathLike)):
        return Snapshot(_allocsim.Snapshot.from_path(os.fspath(source), name))
    raise TypeError(f"load: expected a path, bytes or the dict torch.cuda.memory._snapshot() returns, got {type(source).__name__}")


def replay(
    path: Union[str, "os.PathLike[str]"],
    config: Optional[str] = None,
    capacity: Size = None,
    *,
    device_memory: Size = None,
    trace_capacity: Size = None,
    placements: Optional[int] = None,
    device: Optional[int] = None,
    torch_version: Optional[str] = None,
    addresses_from: Union[str, "os.PathLike[str]", None] = None,
) -> ReplayResult:
    """``allocsim replay PATH``: a snapshot file replayed as the command line replays it, without
    keeping it: streamed in memory bounded by the live set where one pass gives the answer, else
    read compactly (one pass, tens of bytes a trace entry) and replayed in memory. The same answer
    as ``load(path).replay(...)``; for a multi-GB file that does not need the snapshot again.
    ``addresses_from`` is the path of another run of the same requests."""
    r = _allocsim.replay_file(
        os.fspath(path),
        config,
        _size(capacity, "capacity"),
        _size(device_memory, "device_memory"),
        _size(trace_capacity, "trace_capacity"),
        placements,
        device,
        torch_version,
        os.fspath(addresses_from) if addresses_from is not None else None,
    )
    return ReplayResult(*r)


Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Dict[str, Any], "Snapshot"]


def _value_list(vs: Iterable[Any], what: str) -> list:
    """One trace's values: ints, with None (or ``'-'``) for an iteration whose value is not told."""
    out = []
    for v in vs:
        if v is None or v == "-":
            out.append(None)
        elif isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what}: expected whole numbers (or None for an iteration not told), got {v!r}")
        elif v < 1:
            raise ValueError(f"{what}: {v} is not a shape value (values are at least 1)")
        else:
            out.append(v)
    return out


def scale(
    traces: Union[Source, Sequence[Source]],
    param: str,
    predict: Optional[Sequence[int]] = None,
    *,
    values: Optional[Sequence[Any]] = None,
    hold_out: Optional[Sequence[int]] = None,
    after: Optional[int] = None,
    largest_under: Union[Size, bool] = None,
    cards: Optional[Sequence[Size]] = None,
    reserve: Size = None,
    step: Optional[int] = None,
    config: Optional[str] = None,
    capacity: Size = None,
    by: Optional[str] = None,
    device: Optional[int] = None,
    device_memory: Size = None,
    trace_capacity: Size = None,
) -> ScaleResult:
    """``allocsim scale``: a step at a shape never run, predicted from recorded steps at other
    shapes, and the largest shape a budget holds.

    ``traces``: one snapshot or several of the same job (paths, bytes, snapshot dicts or
    ``Snapshot`` objects; the first gives the state the asked steps follow). Each step is a
    ``record_function("PARAM=VALUE")`` region (``allocsim.torch.step(seq=L)``), unless ``values``
    gives the value of each iteration of the ``phases`` layout: a list for one trace, a list of
    lists for several (``None`` for an iteration not told). ``predict``: the values to predict a
    step at, after step ``after`` (default: the last); steps at the values of ``hold_out`` are
    not learnt from. ``largest_under``: an allowed maximum to find
    the largest value under (``True``: the trace's own budget); ``cards``: the same on each card."""
    items = list(traces) if isinstance(traces, (list, tuple)) else [traces]
    if not items:
        raise ValueError("scale: no trace given")
    snaps = [t if isinstance(t, Snapshot) else load(t) for t in items]
    if values is None:
        per_trace: list = []
    elif len(snaps) == 1 and all(v is None or isinstance(v, (int, str)) for v in values):
        per_trace = [_value_list(values, "values")]
    else:
        per_trace = [_value_list(vs, f"values[{k}]") for k, vs in enumerate(values)]
    budget = largest_under is True
    under = None if largest_under is None or isinstance(largest_under, bool) else _size(largest_under, "largest_under")
    r = _allocsim.scale(
        [s._s for s in snaps],
        param,
        per_trace,
        [int(v) for v in (predict or [])],
        [int(v) for v in (hold_out or [])],
        after,
        under,
        budget,
        [_size(c, "cards") for c in (cards or [])],
        _size(reserve, "reserve"),
        step,
        config,
        _size(capacity, "capacity"),
        by,
        device,
        _size(device_memory, "device_memory"),
        _size(trace_capacity, "trace_capacity"),
    )
    return ScaleResult(*r)


def _grid(grid: Union[str, Dict[str, Iterable[Any]], None]) -> Optional[str]:
    """A grid as the command line writes it: ``'key=v1,v2; key2=...'`` (a dict of lists too)."""
    if grid is None or isinstance(grid, str):
        return grid
    parts = []
    for k, vs in grid.items():
        vals = ["none" if v is None else str(v) for v in vs]
        parts.append(f"{k}={','.join(vals)}")
    return "; ".join(parts)


class Snapshot:
    """A decoded memory snapshot. Every method replays it (with the GIL released) and returns the
    answer of the command of the same name."""

    __slots__ = ("_s",)

    def __init__(self, native: "_allocsim.Snapshot"):
        self._s = native

    @property
    def name(self) -> str:
        """What the answers call this trace."""
        return self._s.name

    @property
    def entries(self) -> list:
        """Trace entries per device."""
        return self._s.entries

    @property
    def segments(self) -> int:
        """The number of final segments."""
        return self._s.segments

    @property
    def alloc_conf(self) -> Optional[str]:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` the snapshot recorded."""
        return self._s.alloc_conf

    def requests(self, device: int = 0) -> int:
        """How many requests (``alloc`` and ``oom`` entries) the trace holds on ``device``."""
        return self._s.requests(device)

    def recorded_ooms(self, device: int = 0) -> list:
        """The request numbers of the OOMs the trace recorded on ``device``."""
        return self._s.recorded_ooms(device)

    def to_pickle(self) -> bytes:
        """The snapshot as torch 2.11's snapshot pickle (opens in memory_viz)."""
        return self._s.to_pickle()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return self._s.same_as(other._s)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = sum(self.entries)
        return f"<allocsim.Snapshot {self.name!r}: {n} trace entries on {len(self.entries)} device(s), {self.segments} segments>"

    def replay(
        self,
        config: Optional[str] = None,
        capacity: Size = None,
        *,
        device_memory: Size = None,
        trace_capacity: Size = None,
        placements: Optional[int] = None,
        device: Optional[int] = None,
        torch_version: Optional[str] = None,
        addresses_from: Optional["Snapshot"] = None,
    ) -> ReplayResult:
        """``allocsim replay``: the requests replayed under ``config`` (a ``PYTORCH_CUDA_ALLOC_CONF``
        string; default the snapshot's own settings) and ``capacity`` (the allowed maximum, e.g.
        ``'24GiB'``; default the budget inferred from the trace)."""
        r = self._s.replay(
            config,
            _size(capacity, "capacity"),
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
            placements,
            device,
            torch_version,
            addresses_from._s if addresses_from is not None else None,
        )
        return ReplayResult(*r)

    def validate(self, capacity: Size = None, *, device_memory: Size = None) -> ValidateResult:
        """``allocsim validate``: a replay under the snapshot's own settings checked against every
        recorded segment event, OOM, address and final segment (``.exact``)."""
        return ValidateResult(*self._s.validate(_size(capacity, "capacity"), _size(device_memory, "device_memory")))

    def explain(
        self,
        at: Union[str, int, None] = None,
        config: Optional[str] = None,
        capacity: Size = None,
        *,
        top: int = 5,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
        addresses_from: Optional["Snapshot"] = None,
    ) -> Explanation:
        """``allocsim explain``: why the job ran out of memory. ``at`` is ``'oom'`` (the default:
        the OOM that ended the run, the last the trace recorded), ``'first'`` (the replay's first
        OOM), ``'peak'`` or a request number. The text opens with the verdict (``.verdict``)."""
        r = self._s.explain(
            None if at is None else str(at),
            config,
            _size(capacity, "capacity"),
            top,
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
            addresses_from._s if addresses_from is not None else None,
        )
        return Explanation(*r)

    def sweep(
        self,
        grid: Union[str, Dict[str, Iterable[Any]], None] = None,
        capacity: Size = None,
        *,
        base: str = "",
        placements: int = 4,
        top: int = 15,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> SweepResult:
        """``allocsim sweep``: every config of ``grid`` (``'key=v1,v2; key2=...'``, or a dict of
        lists; default a grid over the four settings that matter) replayed and ranked."""
        text, js, csv = self._s.sweep(
            _grid(grid),
            _size(capacity, "capacity"),
            base,
            placements,
            top,
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
        )
        return SweepResult(text, js, 0, csv)

    def fit(
        self,
        cards: Union[str, Size, Iterable[Size], None] = None,
        config: Optional[str] = None,
        *,
        grid: Union[str, Dict[str, Iterable[Any]], None] = None,
        reserve: Size = None,
        placements: int = 1,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> FitResult:
        """``allocsim fit``: the smallest allowed maximum without OOM, and whether each of
        ``cards`` (``'24GiB,80GiB'`` as on the command line, or ``['24GiB', 80e9]``) is enough
        after the memory outside the allocator."""
        sizes = _sizes(cards, "cards")
        r = self._s.fit(
            sizes,
            config,
            _grid(grid),
            _size(reserve, "reserve"),
            placements,
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
        )
        return FitResult(*r)

    def graphs(
        self,
        captured: Union[str, Iterable[int]],
        batches: Union[str, Iterable[int], None] = None,
        config: Optional[str] = None,
        capacity: Size = None,
        *,
        placements: int = 4,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> GraphsResult:
        """``allocsim graphs``: what capturing CUDA graphs for ``batches`` (in capture order) into
        one shared pool would reserve, learnt from the trace's captures at ``captured``."""
        r = self._s.graphs(
            _ints(captured, "captured"),
            _ints(batches, "batches"),
            config,
            _size(capacity, "capacity"),
            placements,
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
        )
        return GraphsResult(*r)

    def scale(
        self,
        param: str,
        predict: Optional[Sequence[int]] = None,
        *,
        values: Optional[Sequence[Any]] = None,
        hold_out: Optional[Sequence[int]] = None,
        after: Optional[int] = None,
        largest_under: Union[Size, bool] = None,
        cards: Optional[Sequence[Size]] = None,
        reserve: Size = None,
        step: Optional[int] = None,
        config: Optional[str] = None,
        capacity: Size = None,
        by: Optional[str] = None,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> ScaleResult:
        """``allocsim scale`` on this snapshot (see :func:`allocsim.scale`; ``values``: one per
        iteration)."""
        return scale(
            [self],
            param,
            predict,
            values=None if values is None else [list(values)],
            hold_out=hold_out,
            after=after,
            largest_under=largest_under,
            cards=cards,
            reserve=reserve,
            step=step,
            config=config,
            capacity=capacity,
            by=by,
            device=device,
            device_memory=device_memory,
            trace_capacity=trace_capacity,
        )

    def phases(
        self,
        config: Optional[str] = None,
        capacity: Size = None,
        *,
        by: Optional[str] = None,
        top: int = 3,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> PhasesResult:
        """``allocsim phases``: the iterations (the optimizer's steps, or ``by`` an annotation) and
        annotated regions, each with its peaks."""
        r = self._s.phases(
            config,
            _size(capacity, "capacity"),
            by,
            top,
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
        )
        return PhasesResult(*r)

    def compare(
        self,
        other: Optional["Snapshot"] = None,
        *,
        config: Optional[str] = None,
        config_b: Optional[str] = None,
        capacity: Size = None,
        top: int = 10,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> CompareResult:
        """``allocsim compare``: with ``other``, this recorded run against another of the same
        requests, each as recorded (``allocsim compare A B``); without, this trace's requests
        replayed under ``config`` (side A) and ``config_b`` (side B), each the trace's own
        settings where not given (``allocsim compare A --config X --config-b Y``). For many
        files as the ranks of one job, see :func:`allocsim.fleet.compare`."""
        if other is not None and not isinstance(other, Snapshot):
            raise TypeError(f"compare: other must be a Snapshot (allocsim.load), not {type(other).__name__}")
        r = self._s.compare(
            None if other is None else other._s,
            config,
            config_b,
            _size(capacity, "capacity"),
            top,
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
        )
        return CompareResult(*r)

    def report(
        self,
        path: Union[str, "os.PathLike[str]"] = "report.html",
        config: Union[str, Sequence[str], None] = None,
        capacity: Size = None,
        *,
        svg_dir: Union[str, "os.PathLike[str]", None] = None,
        device: Optional[int] = None,
        device_memory: Size = None,
        trace_capacity: Size = None,
    ) -> str:
        """``allocsim report``: writes one self-contained HTML page (timeline, OOMs,
        fragmentation, segment maps) to ``path`` and returns the path. ``config`` may be a list
        to overlay several."""
        configs = [] if config is None else ([config] if isinstance(config, str) else list(config))
        self._s.report(
            os.fspath(path),
            configs,
            _size(capacity, "capacity"),
            None if svg_dir is None else os.fspath(svg_dir),
            device,
            _size(device_memory, "device_memory"),
            _size(trace_capacity, "trace_capacity"),
        )
        return os.fspath(path)


from . import fleet  # noqa: E402  (it uses the helpers above)
