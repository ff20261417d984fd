"""vlseq_ext: fast, exact multi-GPU training of sequence models on variable-length samples."""
import sys as _sys

from . import ops
from .checkpoint import load_model
from .models import SeqModel
from .training import loop
from .training.execution import SlowPlanWarning
from .training.replicas import GradientMerger
from .training.trainer import ParallelTrainer

__all__ = ["ops", "GradientMerger", "SeqModel", "ParallelTrainer", "SlowPlanWarning", "load_model"]
from ._version import __version__  # noqa: E402  (the one version source, vlseq_ext/_version.py)

# vlseq_ext.loop: the path README gave before the training engine moved to vlseq_ext/training/
_sys.modules[f"{__name__}.loop"] = loop
