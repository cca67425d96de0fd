"""``python -m aps``: the ``aps`` command."""

import sys

from .cli import main

sys.exit(main())
