"""The commands: vlseq-train (cli.train) and vlseq-predict (cli.predict).

`python -m vlseq_ext [train] ...` and the `vlseq-train` script run `main`, which hands
`python -m vlseq_ext predict ...` to vlseq-predict. See `vlseq-train --help` and `vlseq-predict --help`.

Modules: train (the command and one run's course), config (the typed run configuration and its
parser), resolve (options + a resumed checkpoint -> the run's configuration), file_rules (what may
be written where: the table and its checks), checks (sizes and writable paths), run (a run's parts:
build, restore, save), callbacks (the training loop's progress, validation and checkpoints),
reporting (progress, metrics, plot, summary), predict (vlseq-predict).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `vlseq-train` and `python -m vlseq_ext`: `predict ...` runs vlseq-predict,
    `train ...` or anything else vlseq-train. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "predict":
        from .predict import main as predict_main
        return predict_main(args[1:])
    from .train import main as train_main
    return train_main(args[1:] if args and args[0] == "train" else args)


if __name__ == "__main__":
    sys.exit(main())
