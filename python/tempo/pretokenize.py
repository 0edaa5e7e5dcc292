"""`python -m tempo.pretokenize`: text into the ids `tempo train --data` reads, tempo/apps/pretokenize.py."""

import sys

from .apps.pretokenize import main

if __name__ == "__main__":
    sys.exit(main())
