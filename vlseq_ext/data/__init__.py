"""The data layer: where samples come from (sources: .npz and .ts files, the built-in sets, the
split), the in-memory dataset and its checks (ragged), and how samples form steps (samplers).

`vlseq_ext.data.save_ragged`, `load_ragged`, ... are the documented paths; they live in sources.
"""
from .ragged import MAX_CLASS_LABEL, DataError, RaggedDataset
from .sources import (BUILTIN, check_file, japanese_vowels, load_ragged, load_ts, open_dataset, save_ragged,
                      sequence_lengths, split, synthetic)

__all__ = ["DataError", "RaggedDataset", "save_ragged", "load_ragged", "load_ts", "synthetic", "japanese_vowels",
           "open_dataset", "split", "sequence_lengths", "check_file", "BUILTIN", "MAX_CLASS_LABEL"]
