"""``python -m drift`` = the ``drift`` command."""

import sys

from .cli import main

sys.exit(main())
