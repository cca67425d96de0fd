#!/usr/bin/env python
"""push_pull round trips against bounds measured in the same run: ``aps bench`` as a script.

Same arguments as ``aps bench`` (``--help``); the code is ``aps/lab/bench.py``.
Example: ``python bench/pushpull.py --sizes 4K,64M --workers 1,2,4 --out bench/results/pushpull.json``.
"""

import sys

from aps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
