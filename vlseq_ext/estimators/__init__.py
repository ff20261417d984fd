"""aeon / scikit-learn estimators for collections of time series of unequal length:
`SeqClassifier` and `SeqRegressor` (vlseq_ext.estimators.base), over ParallelTrainer.

    from vlseq_ext.estimators import SeqClassifier
    clf = SeqClassifier().fit(X_train, y_train)   # X: a list of (channels, length_i) arrays, or 3D
    clf.score(X_test, y_test)

They need aeon (pip install 'vlseq_ext[ts]'); they are imported on first use, so `import vlseq_ext`
and the network and training helpers here (`network.SeqNet`, `training`) work without it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["SeqClassifier", "SeqRegressor", "SeqNet"]


def __getattr__(name: str) -> Any:
    if name in ("SeqClassifier", "SeqRegressor"):
        from . import base  # raises ImportError naming the missing aeon
        return getattr(base, name)
    if name == "SeqNet":
        from .network import SeqNet
        return SeqNet
    raise AttributeError(f"module 'vlseq_ext.estimators' has no attribute {name!r}")
