"""The chaos soak's ledger model (see :mod:`aps.testing.chaos`): one float32 weight per
(shard, rank, slot), SGD with lr=1, so that each weight counts the times its gradient was
applied on its shard; :func:`analyse_ledger` reads applied-twice and lost gradients off it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SHARD_ALIGN = 16
TOLERANCE = 1e-4  # relative, on one application's value (float32 rounding of P / n)


@dataclass(frozen=True)
class LedgerLayout:
    """Where each (shard, rank, slot) weight lives in the flat model.

    Each shard's block holds ``ranks * slots`` weights, padded to the shard
    alignment, so that ``aps.layout.shard_bounds`` cuts the model exactly at the
    blocks and shard ``s`` holds block ``s``.
    """

    shards: int
    ranks: int
    slots: int

    @property
    def block(self) -> int:
        return -(-self.ranks * self.slots // SHARD_ALIGN) * SHARD_ALIGN

    @property
    def numel(self) -> int:
        return self.shards * self.block

    def index(self, shard: int, rank: int, slot: int) -> int:
        return shard * self.block + rank * self.slots + slot

    def check(self) -> None:
        from aps.layout import shard_bounds

        bounds = shard_bounds(self.numel, self.shards)
        expected = tuple(self.block * s for s in range(self.shards + 1))
        if tuple(bounds) != expected:
            raise AssertionError(f"shard bounds {bounds} do not fall on the ledger's blocks {expected}")


def analyse_ledger(weights: np.ndarray, layout: LedgerLayout, acked: np.ndarray, bsp: bool) -> dict:
    """What the final weights say: applications per (shard, rank, slot) against the pushes
    the workers saw acknowledged (``acked``: bool, shards x ranks x slots).

    Returns counts and the first few places of every anomaly: ``applied_twice``,
    ``lost`` (acknowledged, zero on a shard), ``skipped`` (zeros never acknowledged
    below a rank's final slot: a push that failed and was given up, or under BSP a
    round the rank missed),
    ``applied_unacknowledged`` (the reply was lost to a kill or a cut: fine),
    ``phantom`` (weights in the padding, or negative: must be 0).
    """
    P, MC = layout.ranks, layout.slots
    out: dict[str, Any] = {
        "final_slots": [],
        "acknowledged": int(acked.sum()),
        "applied_twice": 0,
        "lost": 0,
        "skipped": 0,
        "zeros_below_final_slot": 0,
        "applied_unacknowledged": 0,
        "phantom": 0,
        "max_applications": 0.0,
        "per_shard": [],
        "twice_at": [],
        "lost_at": [],
    }
    for s in range(layout.shards):
        final = np.array([int(np.flatnonzero(acked[s, r]).max()) + 1 if acked[s, r].any() else 0 for r in range(P)])
        below_final = np.arange(MC)[None, :] < final[:, None]
        out["final_slots"].append(final.tolist())
        block = weights[s * layout.block : (s + 1) * layout.block]
        padding = block[P * MC :]
        w = block[: P * MC].reshape(P, MC).astype(np.float64)
        nonzero = np.abs(w) > 1e-6
        if bsp:  # one application at slot v adds P / n, n the gradients of that round (all at slot v)
            single = P / np.maximum(1, nonzero.sum(axis=0))[None, :]
        else:
            single = np.ones((1, MC))
        applications = np.where(nonzero, w / single, 0.0)
        twice = w > single * (1 + TOLERANCE) + 1e-6
        negative = w < -1e-6
        lost = acked[s] & ~nonzero
        skipped = ~acked[s] & ~nonzero & below_final
        unacked = ~acked[s] & nonzero
        row = {
            "shard": s,
            "applied_twice": int(twice.sum()),
            "lost": int(lost.sum()),
            "skipped": int(skipped.sum()),
            "applied_unacknowledged": int(unacked.sum()),
            "phantom": int(negative.sum() + np.count_nonzero(np.abs(padding) > 1e-6)),
            "applied": int(nonzero.sum()),
            "max_applications": round(float(applications.max(initial=0.0)), 4),
        }
        out["per_shard"].append(row)
        for key in ("applied_twice", "lost", "skipped", "applied_unacknowledged", "phantom"):
            out[key] += row[key]
        out["zeros_below_final_slot"] += int((~nonzero & below_final).sum())
        out["max_applications"] = max(out["max_applications"], row["max_applications"])
        for r, c in zip(*np.nonzero(twice)):
            if len(out["twice_at"]) < 40:
                out["twice_at"].append(
                    {"shard": s, "rank": int(r), "slot": int(c), "applications": round(float(applications[r, c]), 3)}
                )
        for r, c in zip(*np.nonzero(lost)):
            if len(out["lost_at"]) < 40:
                out["lost_at"].append({"shard": s, "rank": int(r), "slot": int(c)})
    return out
