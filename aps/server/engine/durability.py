"""Durability: what a checkpoint keeps of the engine and taking it up again, the run's
identity (its id, this server's incarnation and the lineage before it, the shards' run
ids, where it is served) and the counters workers claim from.

A part of the engine of its own because it is what outlives the process: the rules of
training and membership live with them, this module says what of their state a
checkpoint holds and how a restore hands it back (the model to
:class:`~aps.server.engine.model.Model`, the ranks' places to membership through
:class:`Resumable`, the push count to training through :class:`Counted`, the digests of
what was loaded through :class:`Loaded`). A checkpoint's capture runs as a job of the
update lane, between two updates.
"""

from __future__ import annotations

import json
import logging
import re
import reprlib
import secrets
import uuid
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...checkpoint.format import layout_json
from ...config import RUN_OPTIONS, ServerConfig
from ...errors import CheckpointError, InvalidIds, LayoutMismatch, MalformedFrame
from ...layout import Layout
from ...wire.protocol import MAX_COUNTER, MAX_COUNTER_NAME, MAX_COUNTERS
from .lane import Job, UpdateLane
from .members import Roster, Seat
from .model import Model
from .rows import RowTable
from .scalars import Scalars
from .stats import ServerStats
from .sync import SyncPolicy

if TYPE_CHECKING:
    from ...checkpoint import Checkpoint
    from .membership import Placements

__all__ = ["MAX_LINEAGE", "Counted", "Durability", "Loaded", "Resumable"]

log = logging.getLogger("aps.server")

#: The incarnations a lineage keeps (the newest): a worker's last server is among them
#: unless the run restarted this many times since that worker last reached it.
MAX_LINEAGE = 64
_INCARNATION = re.compile(r"[0-9a-f]{16}")


class Resumable(Protocol):
    """What a restore hands membership (:class:`aps.server.engine.membership.Membership`)."""

    def resume(self, placements: Placements | None) -> None:
        """Where each rank live in the checkpoint goes when it rejoins (None: no checkpoint after all)."""


class Counted(Protocol):
    """What a checkpoint keeps of training: the gradients taken."""

    pushes: int


class Loaded(Protocol):
    """What a checkpoint keeps of the loads: the digests of the state and the weights loaded."""

    loaded_state: bytes | None
    loaded_weights: bytes | None


class Durability:
    """The engine's checkpoints and the run's identity (see the module docstring).

    Args:
        config: the server's options (the run options a checkpoint keeps).
        model: the model saved and restored.
        roster: the seats (each rank's last push) and whether the run is draining.
        membership: where a restore puts the ranks of the checkpoint.
        training: the push count.
        loads: the digests of what was loaded.
        policy: the sync policy (its clocks and rounds).
        stats: the counters kept across restarts.
        scalars: the curves of what the workers logged.
        lane: the update lane a capture runs in.
    """

    def __init__(
        self,
        config: ServerConfig,
        model: Model,
        roster: Roster,
        membership: Resumable,
        training: Counted,
        loads: Loaded,
        policy: SyncPolicy,
        stats: ServerStats,
        scalars: Scalars,
        lane: UpdateLane,
    ) -> None:
        self.config = config
        self.model = model
        self.roster = roster
        self.membership = membership
        self.training = training
        self.loads = loads
        self.policy = policy
        self.stats = stats
        self.scalars = scalars
        self.lane = lane
        #: This run's identity: new for a new model, kept across checkpoints and resumes.
        self.run_id = uuid.uuid4().hex
        #: This server's own identity within the run, drawn anew at every start, and the run's
        #: incarnations that led to it (its checkpoint's lineage, then its own; at most
        #: MAX_LINEAGE, oldest first): workers refuse a server their last one is not an
        #: ancestor of (two servers of one run, one started from a copy of its checkpoints).
        self.incarnation = secrets.token_hex(8)
        self.lineage: list[str] = [self.incarnation]
        #: The run id of every shard of this model, in shard order, as a sharded worker recorded
        #: them (SHARDS): kept in checkpoints, so that shards resumed from the checkpoints of
        #: different runs are told apart. None until recorded (and when unsharded).
        self.shard_runs: list[str] | None = None
        #: The checkpoint this engine resumed from (its path), if any.
        self.resumed_from: str | None = None
        #: Where the server listens (set by it): in the statistics, and kept in checkpoints as
        #: ``served_at`` (a server resumed from them asks there whether the run is still served).
        self.address = ""
        #: The run's counters (CLAIM): name -> value, kept in checkpoints.
        self.counters: dict[str, int] = {}

    def checkpoint_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The state to save, between two updates: a JSON-able manifest, and the live
        arrays to copy (the optimizer's state; the running sum while a round is open).
        The weights are the current snapshot (the caller leases it)."""
        model, policy, config, loads, roster = self.model, self.policy, self.config, self.loads, self.roster
        table, layout, rows_of, aggregate = model.table, model.layout, model.rows, model.aggregate
        assert table is not None and layout is not None, "a checkpoint is captured once the model exists"
        optimizer = table.optimizer
        policy_state = policy.state()
        arrays = dict(optimizer.state_arrays())
        compensation = table.compensation
        if compensation is not None:
            arrays.update(compensation.state_arrays())
        for name, rows in rows_of.items():  # (taken on the loop: pulls make rows)
            arrays.update({f"tables/{name}/{key}": value for key, value in rows.arrays().items()})
        if aggregate is not None and (policy_state.get("contributed") or policy_state.get("count")):
            arrays["aggregate"] = aggregate.current
            for name, saved in rows_of.open_round().items():  # the round's rows, as its sum is kept
                for key, value in zip(("ids", "grads", "ranks"), saved):
                    arrays[f"round/{name}/{key}"] = value
        scalars, steps, values = self.scalars.saved()
        if scalars:
            arrays["scalars/steps"], arrays["scalars/values"] = steps, values
        manifest = {
            "run_id": self.run_id,
            "lineage": list(self.lineage),
            **({"served_at": self.address} if self.address else {}),
            "shard_runs": self.shard_runs,
            "version": table.version,
            **({"claims": dict(self.counters)} if self.counters else {}),
            "pushes": self.training.pushes,
            "layout": layout_json(layout),
            "config": {name: getattr(config, name) for name in RUN_OPTIONS},
            # the rest, for the record (resume takes its own)
            "server": {name: value for name, value in config.public().items() if name not in RUN_OPTIONS},
            "optimizer": {
                "name": optimizer.name,
                "steps": optimizer.steps,
                **optimizer.hyperparameters(),
                **({"loaded_state": loads.loaded_state.hex()} if loads.loaded_state is not None else {}),
            },
            "policy": policy_state,
            **(
                {"compensation": {"kind": compensation.describe(), "steps": compensation.steps}}
                if compensation is not None
                else {}
            ),
            **({"table_steps": {name: rows.steps for name, rows in rows_of.items()}} if rows_of else {}),
            # an open round of rows alone (no dense gradient in its sum: its update leaves the dense part)
            **({"round_dense": False} if aggregate is not None and not aggregate.dense else {}),
            "seats": {str(rank): seat.to_json() for rank, seat in sorted(roster.seats.items())},
            # a worker finished (leave(finished=True)): the run is ending, MIN no longer holds the rest
            **({"draining": True} if roster.draining else {}),
            "counters": self.stats.run_counters(),
            # the curves of what the workers logged (aps.server.engine.scalars; their points in "scalars/...")
            **({"scalars": scalars} if scalars else {}),
            **({"loaded_weights": loads.loaded_weights.hex()} if loads.loaded_weights is not None else {}),
        }
        return manifest, arrays

    def restore(self, checkpoint: Checkpoint, *, taken_over: bool = False) -> None:
        """Take up the state of ``checkpoint`` (an :class:`aps.checkpoint.Checkpoint`) before
        anyone joins: weights, optimizer state, version, the policy's clocks and rounds,
        and what each rank's last push was. Training starts again once every worker
        has rejoined. Raises CheckpointError (and keeps nothing) if it does not fit.

        ``taken_over``: the state a backup of a replica set held when its primary was lost
        (aps.server.replicas), as new as anything a worker was told: a shard of a sharded
        run keeps its open round, which the other shards hold too (a shard resumed from a
        checkpoint leaves it out)."""
        model, roster, loads = self.model, self.roster, self.loads
        if model.table is not None or roster.members:
            raise CheckpointError("a checkpoint is restored before anyone joins")
        manifest = checkpoint.manifest
        try:
            layout = checkpoint.layout
            model.create(layout, checkpoint.flat_weights())
            table, rows_of, aggregate = model.table, model.rows, model.aggregate
            assert table is not None, "made just now"
            steps = manifest.get("table_steps", {})
            if not isinstance(steps, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53 for v in steps.values()
            ):
                raise ValueError("its table_steps are not whole numbers from 0 to 2**53 by table")
            for name, rows in rows_of.items():
                keys = ("ids", "rows", *rows.table.state_per_row())
                found = {
                    key: checkpoint.state[f"tables/{name}/{key}"]
                    for key in keys
                    if f"tables/{name}/{key}" in checkpoint.state
                }
                if found:
                    rows_of[name] = RowTable.restored(name, rows.table, found, int(steps.get(name, 0)), model.kernels)
            optimizer = table.optimizer
            saved = manifest["optimizer"]
            if saved["name"] != optimizer.name:
                raise ValueError(f"it holds {saved['name']} state, this server runs {optimizer.name}")
            state = {}
            # (sgd keeps momentum buffers once a worker asked for them, also when started without)
            keys = list(optimizer.state_arrays()) or [
                key for key in optimizer.state_names if f"{key}/{layout.names[0]}" in checkpoint.state
            ]
            for key in keys:
                state[key] = _flat_state(checkpoint, layout, key)
            optimizer.load_state(state, int(saved["steps"]))
            compensation = table.compensation
            if compensation is not None:  # (its state, made by the same --compensation: a run option)
                kept = {key: _flat_state(checkpoint, layout, key) for key in compensation.state_arrays()}
                compensation.load_state(kept, int(manifest["compensation"]["steps"]))
            loaded = saved.get("loaded_state")
            loads.loaded_state = bytes.fromhex(loaded) if isinstance(loaded, str) else None
            loaded = manifest.get("loaded_weights")
            loads.loaded_weights = bytes.fromhex(loaded) if isinstance(loaded, str) else None
            table.version = int(manifest["version"])
            placements = self.policy.restore(manifest["policy"])
            seats = {int(rank): Seat.from_json(seat) for rank, seat in manifest["seats"].items()}
            forget = getattr(self.policy, "forget_open_round", None)
            if self.config.shards > 1 and forget is not None and not taken_over:
                # A shard resumes alone (docs/algorithms.md, "Sharded resume"): its open round is left out.
                placements, dropped = forget(placements)
                for rank in dropped:
                    if rank in seats:
                        seats[rank].push_id = seats[rank].push_clock = -1
            elif aggregate is not None and "aggregate" in checkpoint.state:
                np.copyto(aggregate.current, checkpoint.state["aggregate"])
                aggregate.dense = manifest.get("round_dense", True) is not False
                rows_of.reopen_round(
                    {
                        name: tuple(checkpoint.state[f"round/{name}/{key}"] for key in ("ids", "grads", "ranks"))
                        for name in rows_of
                        if f"round/{name}/ids" in checkpoint.state
                    }
                )
            roster.seats = seats
            self.membership.resume(placements)
            self.training.pushes = int(manifest["pushes"])
            self.stats.carry(manifest.get("counters", {}))
            self.run_id = str(manifest["run_id"])
            self.carry_lineage(manifest.get("lineage"))
            runs = manifest.get("shard_runs")
            self.shard_runs = [str(r) for r in runs] if isinstance(runs, list) else None
            self.counters = {str(name): int(value) for name, value in manifest.get("claims", {}).items()}
            roster.draining = manifest.get("draining", False) is True
        except (KeyError, ValueError, TypeError, IndexError, InvalidIds) as exc:
            model.forget()
            roster.seats = {}
            self.membership.resume(None)
            loads.loaded_state = loads.loaded_weights = None
            self.stats.carry({})
            detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CheckpointError(f"checkpoint {checkpoint.path} cannot be resumed: {detail}") from None
        if "scalars" in manifest:  # (curves to look at: a checkpoint whose curves do not fit still resumes)
            try:
                self.scalars.restore(
                    manifest["scalars"], checkpoint.state.get("scalars/steps"), checkpoint.state.get("scalars/values")
                )
            except Exception as exc:  # (whatever the reason: the weights and the run go on)
                log.warning(
                    "checkpoint %s: the curves of what the workers logged are not taken up (%s); they start afresh",
                    checkpoint.path,
                    exc,
                )
        self.resumed_from = str(checkpoint.path)
        log.info(
            "resumed from %s: version %d, clocks %s; training goes on once all %d workers are back",
            checkpoint.path,
            model.version,
            manifest["policy"]["clocks"],
            self.config.workers,
        )

    # What the run keeps beside its weights -----------------------------------
    def capture_checkpoint(self, job: Job) -> None:
        """Queue ``job`` (an ``aps.server.checkpointer.CaptureJob``) in the update lane: it runs
        between two updates, and sees every update decided before it."""
        self.lane.submit(job)

    @property
    def lineage_text(self) -> str:
        """:attr:`lineage`, as the handshake says it (ServerInfo.lineage)."""
        return ",".join(self.lineage)

    def carry_lineage(self, saved: object) -> None:
        """Go on from a checkpoint's lineage (a list of incarnation ids, oldest first; one
        that does not hold together is left out, with a warning: the workers then know this
        server by its own incarnation alone)."""
        if saved is None:
            return
        if not isinstance(saved, list) or not all(isinstance(i, str) and _INCARNATION.fullmatch(i) for i in saved):
            log.warning("the checkpoint's lineage is not a list of incarnation ids: left out (%s)", reprlib.repr(saved))
            return
        self.lineage = [*saved, self.incarnation][-MAX_LINEAGE:]

    @property
    def shard_description(self) -> str:
        """What the handshake tells workers of this shard (JSON): its index, the options all
        the shards share (ServerConfig.shard_description), the shards' recorded run ids,
        whether the model is registered, and its --heartbeat-timeout (how long a silent
        connection keeps its rank: a worker reseated by the server waits that long), that it takes
        pipelined pushes, and its replica set's addresses."""
        return json.dumps(
            {
                **self.config.shard_description(),
                "runs": self.shard_runs,
                "registered": self.model.table is not None,
                "heartbeat_timeout": self.config.heartbeat_timeout,
                # it takes pipelined pushes (AsyncWorker(pipeline=N): a PUSH with Flag.GATE waits at the gate)
                "pipelining": True,
                # it keeps step rates (PACE: LocalSGD's dynamic local updates)
                "pace": True,
                # its replica set's addresses (--replicas): where a worker looks for it after a failover
                **(
                    {"replicas": self.config.replicas.split(","), "failover_timeout": self.config.failover_timeout}
                    if self.config.replicas
                    else {}
                ),
            },
            separators=(",", ":"),
        )

    def record_shard_runs(self, runs: list[str]) -> list[str]:
        """A sharded worker says which run each shard holds; the first record stands (a
        resumed shard has it from its checkpoint). Returns the record."""
        shards = self.config.shards
        if shards == 1:
            raise MalformedFrame("SHARDS is for a model sharded across servers (--shards > 1)")
        if (
            not isinstance(runs, list)
            or len(runs) != shards
            or not all(isinstance(r, str) and 0 < len(r) <= 64 for r in runs)
        ):
            raise MalformedFrame(f"SHARDS takes a JSON list of the {shards} shards' run ids")
        if runs[self.config.shard] != self.run_id:
            raise MalformedFrame(
                f"SHARDS gives shard {self.config.shard} run {runs[self.config.shard]}, but this "
                f"shard holds run {self.run_id}"
            )
        if self.shard_runs is None:
            self.shard_runs = list(runs)
        elif runs != self.shard_runs:
            odd = next(i for i, (kept, given) in enumerate(zip(self.shard_runs, runs)) if kept != given)
            raise LayoutMismatch(
                f"this model's shards are runs {self.shard_runs}, but shard {odd} now holds run "
                f"{runs[odd]}: it was started without --resume, or from another run's checkpoint"
            )
        return self.shard_runs

    def claim(self, name: str, count: int) -> int:
        """Add ``count`` to the counter ``name`` (made at 0); returns its value before: each
        value is handed out once, whoever asks (docs/protocol.md, CLAIM).

        Raises:
            MalformedFrame: a name that is empty or too long, more counters than a run keeps,
                or a value over 2**53 (nothing changed)."""
        if not 0 < len(name.encode("utf-8")) <= MAX_COUNTER_NAME:
            raise MalformedFrame(f"a counter's name is 1 to {MAX_COUNTER_NAME} UTF-8 bytes")
        value = self.counters.get(name)
        if value is None and len(self.counters) >= MAX_COUNTERS:
            raise MalformedFrame(f"this run keeps {MAX_COUNTERS} counters already: name no new one")
        value = value or 0
        if value + count > MAX_COUNTER:
            raise MalformedFrame(f"counter {name!r} at {value} cannot take {count} more (2**53 at most)")
        self.counters[name] = value + count
        return value


def _flat_state(checkpoint: Checkpoint, layout: Layout, key: str) -> np.ndarray:
    """The state array ``key`` of ``checkpoint`` (kept per tensor, ``key/name``) as one flat vector."""
    flat = np.empty(layout.numel, np.float32)
    layout.flatten_into({name: checkpoint.state[f"{key}/{name}"] for name in layout.names}, flat)
    return flat
