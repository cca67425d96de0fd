"""Sync policies, one per file, and the registry mapping ``--sync`` names to them."""

from __future__ import annotations

from .... import _core
from ....config import ServerConfig
from ....errors import ConfigurationError
from .asp import ASP
from .base import CLOSED_ROUND, CUTOFF, RESUMED, STALE, Outcome, Plan, PlanKind, SyncPolicy
from .bsp import BSP
from .dssp import DSSP
from .softsync import Softsync
from .ssp import SSP

__all__ = [
    "ASP",
    "BSP",
    "CLOSED_ROUND",
    "CUTOFF",
    "DSSP",
    "POLICIES",
    "RESUMED",
    "STALE",
    "Outcome",
    "Plan",
    "PlanKind",
    "SSP",
    "Softsync",
    "SyncPolicy",
    "make_policy",
]

POLICIES: dict[str, type[SyncPolicy]] = {cls.name: cls for cls in (BSP, ASP, SSP, DSSP, Softsync)}


def make_policy(config: ServerConfig, window_type: type = _core.StalenessWindow) -> SyncPolicy:
    """The policy ``config.sync`` names, over a window of type ``window_type``."""
    try:
        cls = POLICIES[config.sync]
    except KeyError:
        raise ConfigurationError(f"unknown sync paradigm {config.sync!r}: choose from {', '.join(POLICIES)}") from None
    return cls(config, window_type)
