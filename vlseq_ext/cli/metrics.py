"""The JSON Lines metrics file of a run: strict JSON records, opened for appending (a resume drops
the records after its checkpoint first)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, TextIO

from ..files import is_stream, open_stream
from .checks import CLIError
from .file_rules import refuse

__all__ = ["MetricsFile", "open_metrics", "open_metrics_file"]


class MetricsFile:
    """The JSON Lines metrics file: strict JSON records, flushed after every write. A failed write
    (a full disk) becomes a CLIError naming the file; closing never raises."""

    def __init__(self, path: Optional[Path], fh: TextIO) -> None:
        self.path, self.fh = path, fh

    def write(self, recs: Sequence[Dict[str, Any]]) -> None:
        """Append records; a non-finite number becomes null (skipped steps say why)."""
        try:
            for r in recs:
                clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
                self.fh.write(json.dumps(clean, allow_nan=False) + "\n")
            self.fh.flush()
        except OSError as exc:
            raise CLIError(f"cannot write the metrics to {self.path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        try:
            self.fh.close()
        except OSError:  # the error was reported by the write that failed
            pass


def open_metrics(path: Path, resume_step: Optional[int]) -> TextIO:
    """Open the metrics file for appending. On resume, records after the checkpoint's step are
    dropped first, in place (file rule resume-trims-metrics: the file stays the one the run's lock
    holds); otherwise it starts empty. A stream (/dev/null, a FIFO) is only appended to (streams). A
    file that is not a metrics file is refused rather than rewritten (resume-not-metrics): a resume
    with --metrics notes.txt would have kept only JSON."""
    if is_stream(path):
        return open_stream(path)
    Path(os.path.realpath(path)).parent.mkdir(parents=True, exist_ok=True)  # (a symbolic link: its target's)
    if resume_step is None or not path.exists():
        return open(path, "w", encoding="utf-8")
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        refuse("resume-not-metrics", path=path, why="not UTF-8 text")
    lines = raw.splitlines(keepends=True)
    kept = offset = 0  # bytes of the records kept (a prefix of the file), bytes before line i
    for i, line in enumerate(lines):
        offset, start = offset + len(line), offset
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # the last line, torn by a crash
                continue
            rec = None
        if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and "type" in rec):
            refuse("resume-not-metrics", path=path, why=f"line {i + 1} is not one of its records")
        if rec["step"] <= resume_step:
            if kept != start:
                refuse("resume-not-metrics", path=path, why=f"line {i + 1} (step {rec['step']}) follows records of "
                                                           "later steps")
            kept = offset
    os.truncate(path, kept)
    fh = open(path, "a", encoding="utf-8")
    if kept and not raw[:kept].endswith(b"\n"):
        fh.write("\n")  # the last record kept had no line end
    return fh


def open_metrics_file(path: Path, resume_step: Optional[int]) -> MetricsFile:
    try:
        return MetricsFile(path, open_metrics(path, resume_step))
    except OSError as exc:
        raise CLIError(f"cannot write the metrics to {path}: {exc.strerror or exc}") from None
