"""The recorder every suite writes into (Results), what a suite hands the runner (Task, Skip) and the
buffer sizes the suites share (SIZES). The bottom layer of vlseq_ext.bench: the suites import it, and
report.py (targets, summary.md, plots) sits on top of them. The JSON schema is in the package docstring."""
from __future__ import annotations

import json
import math
import os
import traceback
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

from .timing import stats

SCHEMA_VERSION = 1
SIZES = {"1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20, "256MB": 256 << 20}


class Skip(Exception):
    """A method that does not apply to this machine: recorded under `skipped` with the reason."""


class Task(NamedTuple):
    section: str  # "merge", "flatten", "train" or "ddp": per-section timings
    key: str      # where errors and skips are recorded, e.g. "merge.seed_model.vlseq"
    fn: Callable[[], None]


class Results:
    """Nested dict of results; paths are dot-separated ("merge.seed_model.us_per_merge")."""

    def __init__(self, meta: Dict[str, Any]) -> None:
        self.data: Dict[str, Any] = {"schema_version": SCHEMA_VERSION, "meta": meta, "merge": {}, "flatten": {},
                                     "diag": {}, "train": {}, "targets": {}, "skipped": {}, "errors": {},
                                     "timings_s": {}}

    def node(self, path: str) -> Dict[str, Any]:
        d = self.data
        for part in path.split("."):
            d = d.setdefault(part, {})
        return d

    def get(self, path: str, default: Any = None) -> Any:
        v = lookup(self.data, path)
        return default if v is None else v

    def set(self, path: str, value: Any) -> None:
        head, _, last = path.rpartition(".")
        (self.node(head) if head else self.data)[last] = value

    def record(self, path: str, method: str, values: Sequence[float]) -> None:
        """path.method <- median (a plain number); path_spread.method <- {median, min, max, n}."""
        st = stats(values)
        self.node(path)[method] = st["median"]
        self.node(path + "_spread")[method] = st

    def dump(self, out_dir: str) -> str:
        """Writes out_dir/bench-results.json (atomically: a run killed mid-write keeps the last one)."""
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "bench-results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(_finite(self.data), f, indent=1, default=str, allow_nan=False)
        os.replace(path + ".tmp", path)
        return path

    def skip(self, key: str, reason: str) -> None:
        self.data["skipped"][key] = reason

    def error(self, key: str, exc: "BaseException | str") -> None:
        if isinstance(exc, str):
            self.data["errors"][key] = exc
            return
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
        self.data["errors"][key] = f"{type(exc).__name__}: {exc}{where}"


def _finite(x: Any) -> Any:
    """NaN/inf -> None, so the file stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def fmt(v: Optional[float]) -> str:
    """A measurement for the tables: thousands separators from 100 up, three significant digits below."""
    if v is None:
        return "-"
    if v == 0 or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def lookup(d: Dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d
