"""`python -m vlseq_ext`: vlseq-train; `python -m vlseq_ext predict ...`: vlseq-predict."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
