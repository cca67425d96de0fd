"""What a checkpoint keeps of the engine, and taking it up again: the :class:`Durable`
part of :class:`aps.server.engine.Engine` (a mixin, so that the engine's module holds
its rules and this one what outlives the process: the checkpoint's state and its
capture, the shards' run ids and the counters workers claim from)."""

from __future__ import annotations

import json
import logging
import re
import reprlib
from typing import TYPE_CHECKING

import numpy as np

from ...checkpoint.format import layout_json
from ...config import RUN_OPTIONS
from ...errors import CheckpointError, InvalidIds, LayoutMismatch, MalformedFrame
from ...wire.protocol import MAX_COUNTER, MAX_COUNTER_NAME, MAX_COUNTERS
from .members import Seat
from .rows import RowTable, Tables

if TYPE_CHECKING:
    from . import Engine

__all__ = ["MAX_LINEAGE", "Durable"]

log = logging.getLogger("aps.server")

#: The incarnations a lineage keeps (the newest): a worker's last server is among them
#: unless the run restarted this many times since that worker last reached it.
MAX_LINEAGE = 64
_INCARNATION = re.compile(r"[0-9a-f]{16}")


class Durable:
    """The engine's checkpoints: the state to save between two updates, and a restore."""

    def checkpoint_state(self: Engine) -> tuple[dict, dict[str, np.ndarray]]:
        """The state to save, between two updates: a JSON-able manifest, and the live
        arrays to copy (the optimizer's state; the running sum while a round is open).
        The weights are the current snapshot (the caller leases it)."""
        table, layout, policy, config = self.table, self.layout, self.policy, self.config
        optimizer = table.optimizer
        policy_state = policy.state()
        arrays = dict(optimizer.state_arrays())
        compensation = table.compensation
        if compensation is not None:
            arrays.update(compensation.state_arrays())
        for name, rows in self.rows.items():  # (taken on the loop: pulls make rows)
            arrays.update({f"tables/{name}/{key}": value for key, value in rows.arrays().items()})
        if self.aggregate is not None and (policy_state.get("contributed") or policy_state.get("count")):
            arrays["aggregate"] = self.aggregate.current
            for name, saved in self.rows.open_round().items():  # the round's rows, as its sum is kept
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
            "pushes": self.pushes,
            "layout": layout_json(layout),
            "config": {name: getattr(config, name) for name in RUN_OPTIONS},
            # the rest, for the record (resume takes its own)
            "server": {name: value for name, value in config.public().items() if name not in RUN_OPTIONS},
            "optimizer": {"name": optimizer.name, "steps": optimizer.steps, **optimizer.hyperparameters(),
                          **({"loaded_state": self.loaded_state.hex()} if self.loaded_state is not None else {})},
            "policy": policy_state,
            **({"compensation": {"kind": compensation.describe(), "steps": compensation.steps}}
               if compensation is not None else {}),
            **({"table_steps": {name: rows.steps for name, rows in self.rows.items()}} if self.rows else {}),
            # an open round of rows alone (no dense gradient in its sum: its update leaves the dense part)
            **({"round_dense": False} if self.aggregate is not None and not self.aggregate.dense else {}),
            "seats": {str(rank): seat.to_json() for rank, seat in sorted(self._seats.items())},
            # a worker finished (leave(finished=True)): the run is ending, MIN no longer holds the rest
            **({"draining": True} if self.draining else {}),
            "counters": self.stats.run_counters(),
            # the curves of what the workers logged (aps.server.engine.scalars; their points in "scalars/...")
            **({"scalars": scalars} if scalars else {}),
            **({"loaded_weights": self.loaded_weights.hex()} if self.loaded_weights is not None else {}),
        }
        return manifest, arrays

    def restore(self: Engine, checkpoint) -> None:
        """Take up the state of ``checkpoint`` (an :class:`aps.checkpoint.Checkpoint`) before
        anyone joins: weights, optimizer state, version, the policy's clocks and rounds,
        and what each rank's last push was. Training starts again once every worker
        has rejoined. Raises CheckpointError (and keeps nothing) if it does not fit."""
        if self.table is not None or self.members:
            raise CheckpointError("a checkpoint is restored before anyone joins")
        manifest = checkpoint.manifest
        try:
            layout = checkpoint.layout
            self._create_table(layout, checkpoint.flat_weights())
            steps = manifest.get("table_steps", {})
            if not isinstance(steps, dict) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53 for v in steps.values()):
                raise ValueError("its table_steps are not whole numbers from 0 to 2**53 by table")
            for name, rows in self.rows.items():
                keys = ("ids", "rows", *rows.table.state_per_row())
                saved = {key: checkpoint.state[f"tables/{name}/{key}"] for key in keys
                         if f"tables/{name}/{key}" in checkpoint.state}
                if saved:
                    self.rows[name] = RowTable.restored(name, rows.table, saved, int(steps.get(name, 0)),
                                                        self.kernels)
            optimizer = self.table.optimizer
            saved = manifest["optimizer"]
            if saved["name"] != optimizer.name:
                raise ValueError(f"it holds {saved['name']} state, this server runs {optimizer.name}")
            state = {}
            # (sgd keeps momentum buffers once a worker asked for them, also when started without)
            keys = list(optimizer.state_arrays()) or [
                key for key in optimizer.state_names if f"{key}/{layout.names[0]}" in checkpoint.state]
            for key in keys:
                state[key] = _flat_state(checkpoint, layout, key)
            optimizer.load_state(state, int(saved["steps"]))
            compensation = self.table.compensation
            if compensation is not None:  # (its state, made by the same --compensation: a run option)
                kept = {key: _flat_state(checkpoint, layout, key) for key in compensation.state_arrays()}
                compensation.load_state(kept, int(manifest["compensation"]["steps"]))
            loaded = saved.get("loaded_state")
            self.loaded_state = bytes.fromhex(loaded) if isinstance(loaded, str) else None
            loaded = manifest.get("loaded_weights")
            self.loaded_weights = bytes.fromhex(loaded) if isinstance(loaded, str) else None
            self.table.version = int(manifest["version"])
            self._placements = self.policy.restore(manifest["policy"])
            self._seats = {int(rank): Seat.from_json(seat) for rank, seat in manifest["seats"].items()}
            forget = getattr(self.policy, "forget_open_round", None)
            if self.config.shards > 1 and forget is not None:
                # A shard resumes alone (docs/algorithms.md, "Sharded resume"): its open round is left out.
                self._placements, dropped = forget(self._placements)
                for rank in dropped:
                    if rank in self._seats:
                        self._seats[rank].push_id = self._seats[rank].push_clock = -1
            elif self.aggregate is not None and "aggregate" in checkpoint.state:
                np.copyto(self.aggregate.current, checkpoint.state["aggregate"])
                self.aggregate.dense = manifest.get("round_dense", True) is not False
                self.rows.reopen_round({name: tuple(checkpoint.state[f"round/{name}/{key}"]
                                                    for key in ("ids", "grads", "ranks"))
                                        for name in self.rows if f"round/{name}/ids" in checkpoint.state})
            self._start_ranks = set(self._placements) or None
            self.pushes = int(manifest["pushes"])
            self.stats.carry(manifest.get("counters", {}))
            self.run_id = str(manifest["run_id"])
            self.carry_lineage(manifest.get("lineage"))
            runs = manifest.get("shard_runs")
            self.shard_runs = [str(r) for r in runs] if isinstance(runs, list) else None
            self.counters = {str(name): int(value) for name, value in manifest.get("claims", {}).items()}
            self.draining = manifest.get("draining", False) is True
        except (KeyError, ValueError, TypeError, IndexError, InvalidIds) as exc:
            if self.table is not None:
                self.table.close()
            self.table = self.layout = self.aggregate = None
            self.rows = Tables()
            self._placements, self._seats, self._start_ranks = {}, {}, None
            self.loaded_state = self.loaded_weights = None
            self.stats.carry({})
            detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CheckpointError(f"checkpoint {checkpoint.path} cannot be resumed: {detail}") from None
        if "scalars" in manifest:  # (curves to look at: a checkpoint whose curves do not fit still resumes)
            try:
                self.scalars.restore(manifest["scalars"], checkpoint.state.get("scalars/steps"),
                                     checkpoint.state.get("scalars/values"))
            except Exception as exc:  # (whatever the reason: the weights and the run go on)
                log.warning("checkpoint %s: the curves of what the workers logged are not taken up (%s); they "
                            "start afresh", checkpoint.path, exc)
        self.resumed_from = str(checkpoint.path)
        log.info("resumed from %s: version %d, clocks %s; training goes on once all %d workers are back",
                 checkpoint.path, self.version, manifest["policy"]["clocks"], self.num_workers)

    # What the run keeps beside its weights -----------------------------------
    def capture_checkpoint(self: Engine, job) -> None:
        """Queue ``job`` (an ``aps.server.checkpointer.CaptureJob``) in the update lane: it runs
        between two updates, and sees every update decided before it."""
        self._lane.submit(job)

    @property
    def lineage_text(self: Engine) -> str:
        """:attr:`lineage`, as the handshake says it (ServerInfo.lineage)."""
        return ",".join(self.lineage)

    def carry_lineage(self: Engine, saved: object) -> None:
        """Go on from a checkpoint's lineage (a list of incarnation ids, oldest first; one
        that does not hold together is left out, with a warning: the workers then know this
        server by its own incarnation alone)."""
        if saved is None:
            return
        if (not isinstance(saved, list) or not all(isinstance(i, str) and _INCARNATION.fullmatch(i) for i in saved)):
            log.warning("the checkpoint's lineage is not a list of incarnation ids: left out (%s)",
                        reprlib.repr(saved))
            return
        self.lineage = [*saved, self.incarnation][-MAX_LINEAGE:]

    @property
    def shard_description(self: Engine) -> str:
        """What the handshake tells workers of this shard (JSON): its index, the options all
        the shards share (ServerConfig.shard_description), the shards' recorded run ids,
        whether the model is registered, and its --heartbeat-timeout (how long a silent
        connection keeps its rank: a worker reseated by the server waits that long)."""
        return json.dumps({**self.config.shard_description(), "runs": self.shard_runs,
                           "registered": self.table is not None,
                           "heartbeat_timeout": self.config.heartbeat_timeout}, separators=(",", ":"))

    def record_shard_runs(self: Engine, runs: list[str]) -> list[str]:
        """A sharded worker says which run each shard holds; the first record stands (a
        resumed shard has it from its checkpoint). Returns the record."""
        shards = self.config.shards
        if shards == 1:
            raise MalformedFrame("SHARDS is for a model sharded across servers (--shards > 1)")
        if (not isinstance(runs, list) or len(runs) != shards
                or not all(isinstance(r, str) and 0 < len(r) <= 64 for r in runs)):
            raise MalformedFrame(f"SHARDS takes a JSON list of the {shards} shards' run ids")
        if runs[self.config.shard] != self.run_id:
            raise MalformedFrame(f"SHARDS gives shard {self.config.shard} run {runs[self.config.shard]}, but this "
                                 f"shard holds run {self.run_id}")
        if self.shard_runs is None:
            self.shard_runs = list(runs)
        elif runs != self.shard_runs:
            odd = next(i for i, (kept, given) in enumerate(zip(self.shard_runs, runs)) if kept != given)
            raise LayoutMismatch(f"this model's shards are runs {self.shard_runs}, but shard {odd} now holds run "
                                 f"{runs[odd]}: it was started without --resume, or from another run's checkpoint")
        return self.shard_runs

    def claim(self: Engine, name: str, count: int) -> int:
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


def _flat_state(checkpoint, layout, key: str) -> np.ndarray:
    """The state array ``key`` of ``checkpoint`` (kept per tensor, ``key/name``) as one flat vector."""
    flat = np.empty(layout.numel, np.float32)
    layout.flatten_into({name: checkpoint.state[f"{key}/{name}"] for name in layout.names}, flat)
    return flat
