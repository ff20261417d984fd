"""vlseq_ext: fast, exact multi-GPU training of sequence models on variable-length samples."""
from . import ops
from .checkpoint import load_model
from .training.execution import SlowPlanWarning
from .models import SeqModel
from .training.replicas import GradientMerger
from .training.trainer import ParallelTrainer

__all__ = ["ops", "GradientMerger", "SeqModel", "ParallelTrainer", "SlowPlanWarning", "load_model"]
from ._version import __version__  # noqa: E402  (the one version source, vlseq_ext/_version.py)
