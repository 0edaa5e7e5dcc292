"""`python -m tempo.bench`: the Hugging Face bench, tempo/apps/bench.py."""

import sys

from .apps.bench import main

if __name__ == "__main__":
    sys.exit(main())
