"""What the vlseq-train test modules share: a small configuration, running the command in this
process or in another, and the checks of a one-line error."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from vlseq_ext import cli

REPO = Path(__file__).resolve().parents[1]
# A small, fast configuration: a tiny model on short synthetic runs.
SMALL = ["--devices", "cpu:2", "--hidden", "8", "--synthetic-samples", "64", "--quiet"]

HAS_AEON = importlib.util.find_spec("aeon") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
needs_aeon = pytest.mark.skipif(not HAS_AEON, reason="aeon is not installed (pip install 'vlseq_ext[ts]')")
needs_mpl = pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed (pip install 'vlseq_ext[plot]')")


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def steps(path):
    return {r["step"]: r for r in map(json.loads, Path(path).read_text().splitlines()) if r["type"] == "step"}


def cmd(*argv):
    return [sys.executable, "-m", "vlseq_ext", *map(str, argv)]


def subprocess_env(**extra):
    # faulthandler: a native crash (SIGABRT, SIGSEGV) prints the Python stack into the stderr a test reports
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **extra}


def one_line_error(rc, err, *expect, during_training=False):
    """Exit code 2 and one error line (the last line, after the start-up lines when it happened during
    training; else the only one)."""
    assert rc == 2, err
    assert "Traceback" not in err and err.count("error: ") == 1 and err.endswith("\n"), err
    line = err.splitlines()[-1]
    assert line.startswith("vlseq-train: error: ") and (during_training or err.count("\n") == 1), err
    for e in expect:
        assert str(e) in err, err


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}
