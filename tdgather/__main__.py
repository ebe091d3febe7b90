"""``python -m tdgather``."""

import sys

from .cli import main

sys.exit(main())
