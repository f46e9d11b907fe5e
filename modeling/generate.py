"""``python -m modeling.generate``: the command line lives in ``modeling.cli``."""
import sys

from .cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
