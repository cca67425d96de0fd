"""DSSP, dynamic stale synchronous parallel, with bounds ``[s_L, s_U]``."""

from __future__ import annotations

from .base import ApplyOnArrival

__all__ = ["DSSP"]


class DSSP(ApplyOnArrival):
    """SSP whose threshold moves within ``[s_L, s_U]`` at run time (docs/algorithms.md, DSSP).

    Gradients are applied on arrival. A worker whose gap is at most ``s_L``
    is released at once; beyond that, the fastest worker may be granted
    extra iterations ``r*`` by the synchronization controller, which predicts
    from the last push intervals when the slowest worker will push next and
    picks the number of extra iterations that makes the fast worker's next
    wait shortest. The release spends one unit of ``r*``, and grants are cut
    so the gap never exceeds ``s_U``. All of it lives in the
    ``StalenessWindow`` (native, with its reference twin); with
    ``s_L == s_U`` this is exactly SSP.
    """

    name = "dssp"
