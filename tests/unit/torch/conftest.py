"""aps.torch needs the ``torch`` extra: without it, its unit tests are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("torch") is not None else ["test_*.py"]
