"""`python -m vlseq_ext`: the same as the `vlseq-train` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
