"""``python -m aps.workloads``: the built-in training example (see ``aps.workloads.training``)."""

import sys

from .training import main

sys.exit(main())
