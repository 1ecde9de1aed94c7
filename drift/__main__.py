"""``python -m drift`` = the ``drift`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
