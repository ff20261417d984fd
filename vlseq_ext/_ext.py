"""Loads the compiled extension once; everything else asks this module whether it is there."""
from __future__ import annotations

import functools
import importlib
import warnings

import torch

try:
    importlib.import_module(f"{__package__}._C")  # importing registers the torch.ops.vlseq_ext ops

    LOADED = True
    LOAD_ERROR = ""
except ImportError as exc:  # a source checkout that was never built, or a broken build
    LOADED = False
    LOAD_ERROR = str(exc)

_warned = False


def warn_fallback_once() -> None:
    """Say once per process that the pure-PyTorch reference replaces the missing extension."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "vlseq_ext: compiled extension not available "
            f"({LOAD_ERROR or 'not built'}); using the pure-PyTorch reference ops, which are slower. "
            "Build it with `pip install --no-build-isolation .`",
            RuntimeWarning,
            stacklevel=3,
        )


def has_kernel(op: str, dispatch_key: str) -> bool:
    return LOADED and _registered(op, dispatch_key)


# Registration happens once, when _C is imported, so the dispatcher's answer (a few microseconds, asked on
# every module forward) is kept; LOADED stays live above because tests switch it off.
@functools.lru_cache(maxsize=None)
def _registered(op: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"vlseq_ext::{op}", dispatch_key)
