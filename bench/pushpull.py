#!/usr/bin/env python
"""push_pull round trips over TCP against a blocking-socket ping-pong bound.

The same benchmark as ``aps bench``; see ``aps/bench.py`` for the method.
Example: ``python bench/pushpull.py --sizes 4K,64M --workers 1,2,4``.
"""

import sys

from aps.bench import main

if __name__ == "__main__":
    sys.exit(main())
