"""The answers of allocsim's commands: ``str()`` is the command line's text, ``to_dict()`` and
``to_json()`` its ``--json``."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


class Answer:
    """One command's answer."""

    __slots__ = ("_text", "_json", "_dict", "exit_code")

    def __init__(self, text: str, json_text: str, exit_code: int = 0):
        self._text = text
        self._json = json_text
        self._dict: Optional[Dict[str, Any]] = None
        #: The command line's exit status for this answer (``validate``: 1 when not exact).
        self.exit_code = exit_code

    def __str__(self) -> str:
        # The command line's text; print() adds the final newline back.
        return self._text[:-1] if self._text.endswith("\n") else self._text

    def __repr__(self) -> str:
        first = self._text.split("\n", 1)[0]
        if len(first) > 100:
            first = first[:99] + "…"
        return f"<allocsim.{type(self).__name__}: {first}>"

    def to_json(self) -> str:
        """The command's ``--json`` output (one line)."""
        return self._json

    def to_dict(self) -> Dict[str, Any]:
        """The command's ``--json`` output, parsed (a fresh object each call)."""
        return json.loads(self._json)

    def _data(self) -> Dict[str, Any]:
        # Parsed once, for the properties (which return parts of it).
        if self._dict is None:
            self._dict = json.loads(self._json)
        return self._dict

    def __getitem__(self, key: str) -> Any:
        """A key of ``to_dict()``."""
        return self._data()[key]


class ReplayResult(Answer):
    """``allocsim replay``."""

    __slots__ = ()

    @property
    def stats(self) -> Dict[str, int]:
        """Every ``torch.cuda.memory_stats()`` key at the end of the replay."""
        return self._data()["stats"]

    @property
    def peak_reserved(self) -> int:
        return self._data()["stats"]["reserved_bytes.all.peak"]

    @property
    def peak_allocated(self) -> int:
        return self._data()["stats"]["allocated_bytes.all.peak"]

    @property
    def ooms(self) -> List[Dict[str, Any]]:
        """Each OOM: request, sizes and PyTorch's message."""
        return self._data()["ooms"]

    @property
    def first_oom(self) -> Optional[int]:
        return self._data()["first_oom"]


class ValidateResult(Answer):
    """``allocsim validate``."""

    __slots__ = ()

    @property
    def exact(self) -> bool:
        """Whether every recorded event was reproduced."""
        return bool(self._data()["exact"])

    def __bool__(self) -> bool:
        return self.exact


class Explanation(Answer):
    """``allocsim explain``."""

    __slots__ = ()

    @property
    def request(self) -> Optional[int]:
        """The explained request (None when nothing ran out of memory)."""
        return self._data().get("request")

    @property
    def message(self) -> Optional[str]:
        """PyTorch's OOM message (None when the request was served)."""
        return self._data().get("message")

    @property
    def verdict(self) -> List[str]:
        """The verdict the text opens with: the request, which OOM, the cause, a fix checked by
        replaying, PyTorch's message (empty when the request was served)."""
        return list(self._data().get("verdict") or [])

    @property
    def fix(self) -> Optional[Dict[str, Any]]:
        """The fix: ``{'kind': 'setting', 'conf': ...}``, ``{'kind': 'memory', 'needed': ...}``
        or ``{'kind': 'nothing'}`` (None when the request was served)."""
        return self._data().get("fix")


class SweepResult(Answer):
    """``allocsim sweep``."""

    __slots__ = ("_csv",)

    def __init__(self, text: str, json_text: str, exit_code: int = 0, csv: str = ""):
        super().__init__(text, json_text, exit_code)
        self._csv = csv

    def to_csv(self) -> str:
        """``allocsim sweep --csv``."""
        return self._csv

    @property
    def rows(self) -> List[Dict[str, Any]]:
        """One per config, best first (rejected configs last)."""
        return self._data()["rows"]


class FitResult(Answer):
    """``allocsim fit``."""

    __slots__ = ()


class GraphsResult(Answer):
    """``allocsim graphs``."""

    __slots__ = ()

    @property
    def captures(self) -> List[Dict[str, Any]]:
        """Per asked batch size: ``reserved``, ``allocated``, ``pool_reserved`` after its capture."""
        return self._data()["prediction"]["captures"]

    @property
    def peak_reserved(self) -> int:
        return self._data()["prediction"]["peak_reserved"]


class CompareResult(Answer):
    """``allocsim compare`` of two runs of the same requests."""

    __slots__ = ()

    @property
    def peak_reserved(self) -> List[int]:
        """Peak reserved bytes of side A and side B."""
        return self._data()["peak_reserved"]

    @property
    def first_divergence(self) -> Optional[List[int]]:
        """``[request, reserved A, reserved B]`` after the first request where reserved memory
        differs, or None."""
        return self._data()["first_divergence"]


class PhasesResult(Answer):
    """``allocsim phases``."""

    __slots__ = ()

    @property
    def iterations(self) -> List[Dict[str, Any]]:
        return self._data()["iterations"]


class ScaleResult(Answer):
    """``allocsim scale``."""

    __slots__ = ()

    @property
    def predictions(self) -> List[Dict[str, Any]]:
        """Per asked value: ``peak_allocated`` and ``peak_reserved`` (each ``[lowest, highest]``
        over the runs), ``runs`` (each with its ``oom``), ``exact``, ``extrapolated``,
        ``caveats``."""
        return self._data()["predictions"]

    @property
    def largest(self) -> List[Dict[str, Any]]:
        """Per budget (``largest_under``, each card): the largest ``value`` that fits, and where the
        answer is not monotone."""
        return self._data()["largest"]

    @property
    def largest_value(self) -> Optional[int]:
        """The largest value that fits under the first budget (None when none was asked or none
        fits)."""
        rows = self._data()["largest"]
        return rows[0]["value"] if rows else None


class RanksResult(Answer):
    """``allocsim compare DIR``: the ranks of one job side by side (``allocsim.fleet.compare``)."""

    __slots__ = ("error",)

    def __init__(self, text: str, json_text: str, exit_code: int = 0, error: Optional[str] = None):
        super().__init__(text, json_text, exit_code)
        #: When some files could not be compared, the line the command line ends with (after
        #: ``allocsim: error: ``); their rows hold why. None when every file answered.
        self.error = error

    @property
    def rows(self) -> List[Dict[str, Any]]:
        """One per file, in the order of the files: peaks, OOMs, iteration peaks, or ``error``."""
        return self._data()["rows"]

    @property
    def failed(self) -> List[Dict[str, Any]]:
        """The rows of the files that could not be compared."""
        return [r for r in self.rows if r.get("error") is not None]

    @property
    def first_oom(self) -> Optional[Dict[str, Any]]:
        return self._data()["first_oom"]

    @property
    def first_spike(self) -> Optional[Dict[str, Any]]:
        return self._data()["first_spike"]

    @property
    def largest_peak(self) -> Optional[str]:
        return self._data()["largest_peak"]

    @property
    def median_iteration_peaks(self) -> List[int]:
        return self._data()["median_iteration_peaks"]
