"""`python -m tempo.frontier`: the memory-vs-throughput frontier, tempo/apps/frontier.py."""

import sys

from .apps.frontier import main

if __name__ == "__main__":
    sys.exit(main())
