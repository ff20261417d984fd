"""vlseq_ext: fast, exact multi-GPU training of sequence models on variable-length samples."""
from . import ops

__version__ = "0.1.0"
