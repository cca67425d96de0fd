#!/usr/bin/env python
"""Which sync paradigm reaches a target accuracy first: ``aps compare`` as a benchmark script.

Same arguments as ``aps compare`` (``--help``). The defaults train the bundled
MNIST CNN on 4 emulated workers under BSP, ASP, SSP s=3, SSP s=15, DSSP [3,15]
and n-softsync, each asynchronous one also with the staleness-aware learning
rate, on a homogeneous and a heterogeneous (speeds 1,1,1,2.5) cluster::

    python bench/paradigms.py --repeats 3 --out bench/results/compare
"""

import sys

from aps.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
