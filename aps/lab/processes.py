"""Child processes that end with their parent."""

from __future__ import annotations

import os
import signal

__all__ = ["die_with_parent"]


def die_with_parent(parent: int | None = None, signum: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``signum`` when its parent dies, even of SIGKILL
    (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing). Call it in the child (a
    ``preexec_fn``, or first thing in a process's target); ``parent``: the parent's pid,
    to catch a parent that died before the call."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # (1: PR_SET_PDEATHSIG)
    except (OSError, AttributeError):  # (not Linux)
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)
