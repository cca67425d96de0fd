"""``/metrics``: the server's statistics as Prometheus families (``prometheus_client``).

:class:`StatsCollector` reads one statistics snapshot at scrape time (the HTTP side
caches the exposition for a second) and yields every family docs/metrics.md lists.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .._version import __version__
from .engine.stats import MEMBERSHIP_EVENTS, WAIT_BUCKETS_S

__all__ = ["MAX_EXPORTED_GROUPS", "STALENESS_BUCKETS", "StatsCollector"]

#: The ``le`` bounds of the staleness histograms (in versions).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 255)
#: aps_worker_learning_rate exports at most this many groups of a rank (the first ones), so a
#: worker with many param groups cannot swell every scrape; /api/stats has them all.
MAX_EXPORTED_GROUPS = 16


class StatsCollector:
    """A ``prometheus_client`` collector over the server's statistics snapshot."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        stats = self._snapshot()
        server, workers = stats["server"], stats["workers"]
        # Every counter counts from 0 with this process (a resumed run's version and run totals
        # come back lower than a dead process last exported: as counters they would read as a
        # reset, and rate() and increase() would count them again). The version is a gauge.
        counters = server.get("counters") or {}
        build = GaugeMetricFamily(
            "aps_build_info",
            "The aps release this server runs (`aps --version`) and its Python (always 1).",
            labels=["version", "python"],
        )
        build.add_metric([__version__, platform.python_version()], 1.0)
        yield build
        yield GaugeMetricFamily(
            "aps_version",
            "Version of the weights: updates published in the whole run (a resumed run starts at its checkpoint's).",
            value=server["version"],
        )
        yield CounterMetricFamily(
            "aps_updates", "Updates applied to the weights by this server process.", value=counters.get("updates", 0)
        )
        yield GaugeMetricFamily(
            "aps_server_start_time_seconds",
            "When this server process started (Unix time): its counters count from then.",
            value=counters.get("since_unix", 0.0),
        )
        yield GaugeMetricFamily(
            "aps_workers", "Workers the server was started for (--workers; MAX of MIN:MAX).", value=server["workers"]
        )
        yield GaugeMetricFamily(
            "aps_workers_min",
            "Live workers training needs (MIN of --workers MIN:MAX; --workers for a fixed size).",
            value=server.get("min_workers", server["workers"]),
        )
        yield GaugeMetricFamily(
            "aps_quorum_held",
            "1 while an elastic run holds with fewer than MIN workers live.",
            value=float(server.get("quorum_held_s") is not None),
        )
        yield GaugeMetricFamily(
            "aps_shard", "This server's shard of the model (--shard; 0 when unsharded).", value=server.get("shard", 0)
        )
        yield GaugeMetricFamily("aps_shards", "Shards the model is cut into (--shards).", value=server.get("shards", 1))
        yield GaugeMetricFamily(
            "aps_workers_live", "Workers connected and counted by the sync policy.", value=server["live"]
        )
        yield GaugeMetricFamily(
            "aps_training_started", "1 once every worker joined and training runs.", value=float(server["started"])
        )
        yield GaugeMetricFamily(
            "aps_updates_per_second", "Updates per second over the last 10 seconds.", value=server["updates_per_s"]
        )
        by_rank = {
            "pushes": ("aps_pushes", "Gradients taken from each rank (applied, accumulated or dropped)."),
            "pulls": ("aps_pulls", "Weights sent to each rank after the sync policy released it."),
        }
        for key, (name, text) in by_rank.items():
            family = CounterMetricFamily(name, text, labels=["rank"])
            for w in workers:
                family.add_metric([str(w["rank"])], w[key])
            yield family
        refused = CounterMetricFamily(
            "aps_gradients_not_applied",
            "Gradients not applied, by rank and reason: "
            "closed_round (BSP, dropped), stale (older than the SSP/DSSP bound allows, "
            "sent again after a reconnect: dropped), resumed (computed on weights newer "
            "than a shard that resumed from an older checkpoint holds: dropped), cutoff (older "
            "than --staleness-cutoff: dropped) or "
            "non_finite (NaN or infinity, rejected).",
            labels=["rank", "reason"],
        )
        for w in workers:
            stale, resumed, cut = w.get("dropped_stale", 0), w.get("dropped_resumed", 0), w.get("dropped_cutoff", 0)
            refused.add_metric([str(w["rank"]), "closed_round"], w["dropped"] - stale - resumed - cut)
            refused.add_metric([str(w["rank"]), "stale"], stale)
            refused.add_metric([str(w["rank"]), "resumed"], resumed)
            refused.add_metric([str(w["rank"]), "cutoff"], cut)
            refused.add_metric([str(w["rank"]), "non_finite"], w["rejected"])
        yield refused
        compensated = CounterMetricFamily(
            "aps_gradients_compensated",
            "With --compensation: gradients taken by "
            "rank, compensated (done) or not (without_weights: computed on weights the "
            "server did not keep).",
            labels=["rank", "outcome"],
        )
        for w in workers:
            compensated.add_metric([str(w["rank"]), "done"], w.get("compensated", 0))
            compensated.add_metric([str(w["rank"]), "without_weights"], w.get("uncompensated", 0))
        yield compensated
        yield CounterMetricFamily(
            "aps_duplicate_pushes",
            "Pushes sent again after a lost reply, recognised and not applied twice.",
            value=counters.get("duplicates", 0),
        )
        for direction, key, text in (("received", "bytes_in", "Bytes received"), ("sent", "bytes_out", "Bytes sent")):
            family = CounterMetricFamily(
                f"aps_{direction}_bytes",
                f"{text}, by transport (shared memory: the gradients read in place and the weights copied out).",
                labels=["transport"],
            )
            for name, traffic in server["transports"].items():
                family.add_metric([name], traffic[key])
            yield family
        for key, name, text in (
            ("clock", "aps_worker_clock", "Each rank's clock: gradients it has pushed."),
            ("gap", "aps_worker_gap", "Each live rank's clock minus the slowest live one's."),
        ):
            gauge = GaugeMetricFamily(name, text, labels=["rank"])
            for w in workers:
                if w[key] is not None:
                    gauge.add_metric([str(w["rank"])], w[key])
            yield gauge
        rates = GaugeMetricFamily(
            "aps_worker_learning_rate",
            "Learning rate each connected rank's gradients are "
            "applied with, by group of parameters (its own, or the server's as group 0; "
            f"the first {MAX_EXPORTED_GROUPS} groups).",
            labels=["rank", "group"],
        )
        for w in workers:
            for index, group in enumerate((w.get("hyperparameters") or ())[:MAX_EXPORTED_GROUPS]):
                rates.add_metric([str(w["rank"]), str(index)], group["lr"])
        yield rates
        held = GaugeMetricFamily("aps_worker_held", "1 while the rank is held at the gate.", labels=["rank"])
        for w in workers:
            held.add_metric([str(w["rank"])], float(w["held"]))
        yield held
        staleness = HistogramMetricFamily(
            "aps_gradient_staleness",
            "Staleness of each gradient taken, in versions (server version minus the version it was computed on).",
            labels=["rank"],
        )
        waits = HistogramMetricFamily(
            "aps_gate_wait_seconds", "Time each pull waited at the sync policy's gate.", labels=["rank"]
        )
        for w in workers:
            rank = str(w["rank"])
            counts = {int(k): v for k, v in w["staleness_hist"].items()}
            buckets = [
                (repr(float(bound)), sum(v for k, v in counts.items() if k <= bound)) for bound in STALENESS_BUCKETS
            ]
            buckets.append(("+Inf", sum(counts.values())))
            staleness.add_metric([rank], buckets, sum_value=sum(k * v for k, v in counts.items()))
            cumulative, rows = 0, []
            for bound, n in zip(WAIT_BUCKETS_S, w["wait_buckets"]):
                cumulative += n
                rows.append((repr(float(bound)), cumulative))
            rows.append(("+Inf", w["pulls"]))
            waits.add_metric([rank], rows, sum_value=w["wait_s_total"])
        yield staleness
        yield waits
        yield from _checkpoint_metrics(server.get("checkpoints"))
        yield from _replica_metrics(server.get("replicas"))
        events = CounterMetricFamily(
            "aps_membership_events",
            "Membership events by kind: joined, rejoined "
            "(reconnected), left, disconnected, timed out (dropped for silence).",
            labels=["event"],
        )
        counts = server.get("membership_events", {})
        for event in MEMBERSHIP_EVENTS:
            events.add_metric([event.replace(" ", "_")], counts.get(event, 0))
        yield events
        yield from _auth_metrics(server)
        yield from _table_metrics(server.get("tables"), server.get("table_memory"))
        yield from _report_metrics(workers, stats.get("warnings", ()))
        kernels = server.get("kernels")
        if kernels:
            isa = GaugeMetricFamily(
                "aps_kernel_isa_info",
                "The instruction set the update kernels run on (APS_KERNEL_ISA), and whether SGD rounds "
                "x*y + z once (a fused multiply-add, as torch does on this machine) (always 1).",
                labels=["isa", "fused_multiply_add"],
            )
            isa.add_metric([kernels["isa"], str(kernels["fused_multiply_add"]).lower()], 1.0)
            yield isa
        process = server["process"]
        yield GaugeMetricFamily(
            "aps_server_resident_memory_bytes", "Resident memory of the server process.", value=process["rss_bytes"]
        )
        yield CounterMetricFamily(
            "aps_server_cpu_seconds", "CPU time of the server process (user and system).", value=process["cpu_s"]
        )


def _replica_metrics(status: dict | None) -> Iterator:
    """The replica set's families (nothing for a server without --replicas)."""
    if not status:
        return
    yield GaugeMetricFamily(
        "aps_replica_term", "The replica set's term (the coordinator's revision of its record).", value=status["term"]
    )
    backups = GaugeMetricFamily(
        "aps_replica_backups",
        "Backups by state: listed (they hold every acknowledged update), joining (catching up), connected.",
        labels=["state"],
    )
    for state in ("listed", "joining", "connected"):
        backups.add_metric([state], len(status[state]))
    yield backups
    yield GaugeMetricFamily(
        "aps_replica_without_backups",
        "1 while the primary runs with no backup listed: its crash loses what its last checkpoint does not hold.",
        value=float(not status["listed"]),
    )
    lag = GaugeMetricFamily(
        "aps_replica_lag_captures", "Captures shipped that a backup has not acknowledged yet.", labels=["backup"]
    )
    for backup, behind in status["lag"].items():
        lag.add_metric([backup], behind)
    yield lag
    yield CounterMetricFamily(
        "aps_replica_captures", "States captured and shipped to the backups by this process.", value=status["captures"]
    )
    yield CounterMetricFamily(
        "aps_replica_capture_seconds",
        "Time the update lane spent capturing the state for the backups.",
        value=status["capture_seconds"],
    )
    yield GaugeMetricFamily(
        "aps_replica_held_replies", "Replies waiting for the backups to hold their state.", value=status["held_replies"]
    )
    yield GaugeMetricFamily(
        "aps_replica_took_over",
        "1 when this process became primary by taking over from a lost one.",
        value=status["took_over"],
    )


def _checkpoint_metrics(status: dict | None) -> Iterator:
    """The checkpoint families, from the server's start (nothing without --checkpoint-dir):
    a failing disk shows before the first checkpoint is ever written."""
    if not status:
        return
    now = time.time()
    written = status.get("last_written_unix")
    yield GaugeMetricFamily(
        "aps_checkpoint_age_seconds",
        "Seconds since the last checkpoint was written (before the first: since the server started keeping them).",
        value=max(0.0, now - (written if written is not None else status["since_unix"])),
    )
    if status.get("last_written_version") is not None:
        yield GaugeMetricFamily(
            "aps_checkpoint_version", "Version of the last checkpoint written.", value=status["last_written_version"]
        )
    for key, text in (
        ("written", "Checkpoints written"),
        ("failed", "Checkpoints that failed"),
        ("skipped", "Timed checkpoints skipped (the previous one was still being written)"),
    ):
        yield CounterMetricFamily(f"aps_checkpoints_{key}", f"{text} by this server process.", value=status[key])
    yield GaugeMetricFamily(
        "aps_checkpoint_failing",
        "1 while the newest checkpoint attempt failed.",
        value=float(bool(status.get("failing"))),
    )
    yield GaugeMetricFamily(
        "aps_checkpoint_failures_in_a_row",
        "Checkpoints failed since the last one written.",
        value=status.get("failed_in_a_row", 0),
    )
    error = status.get("last_error")
    if error:
        yield GaugeMetricFamily(
            "aps_checkpoint_last_failure_timestamp_seconds",
            "When the newest checkpoint failure happened (Unix time).",
            value=error["unix"],
        )
        info = GaugeMetricFamily(
            "aps_checkpoint_last_failure_info",
            "The newest checkpoint failure: its error, the version it was for, and why it was taken (always 1).",
            labels=["error", "version", "reason"],
        )
        info.add_metric([error["error"][:_LABEL_CHARS], str(error["version"]), error["reason"]], 1.0)
        yield info


#: A label value of the exposition (the newest error) is cut to this many characters.
_LABEL_CHARS = 200


def _auth_metrics(server: dict) -> Iterator:
    """Failed handshakes and what the throttle did about them; INITs refused for the layout budget."""
    auth = server.get("auth", {})
    yield CounterMetricFamily(
        "aps_auth_failures", "Handshakes failed: a wrong token, or a request before it.", value=auth.get("failures", 0)
    )
    yield CounterMetricFamily(
        "aps_auth_throttled",
        "AUTH attempts held back for their turn after failures by the same user (on this host) or address.",
        value=auth.get("throttled", 0),
    )
    yield CounterMetricFamily(
        "aps_auth_refused",
        "AUTH attempts refused unchecked: too many of the same "
        "user's or address's were waiting their turn after failures.",
        value=auth.get("refused", 0),
    )
    yield CounterMetricFamily(
        "aps_layout_budget_refusals",
        "INITs refused while the layout blocks being read used up the server's budget for them.",
        value=server.get("strangers", {}).get("layout_refused", 0),
    )


def _table_metrics(tables: dict | None, memory: dict | None) -> Iterator:
    """Each embedding table's rows and bytes held, and the rows this process pulled, pushed
    and evicted (counters: rate() gives rows per second); the bytes the rows take against
    the limit, and the limit; nothing for a model without tables."""
    if not tables:
        return
    if memory:
        yield GaugeMetricFamily(
            "aps_table_memory_bytes",
            "Bytes the embedding tables' rows take as --table-memory "
            "counts them (values, optimizer state, index and scratch of the rows held).",
            value=memory["bytes"],
        )
        if memory.get("limit"):
            yield GaugeMetricFamily(
                "aps_table_memory_limit_bytes",
                "Bytes the embedding tables' rows may take "
                "(--table-memory, or by default half the memory available at start); a push "
                "past it evicts (evict=True tables) or is refused.",
                value=memory["limit"],
            )
    families = (
        (GaugeMetricFamily, "aps_table_rows", "rows", "Rows each embedding table holds (those touched, not evicted)."),
        (
            GaugeMetricFamily,
            "aps_table_bytes",
            "bytes",
            "Bytes each embedding table's rows take: their values, their optimizer state and the index.",
        ),
        (
            CounterMetricFamily,
            "aps_table_rows_pulled",
            "rows_pulled",
            "Rows pulled from each embedding table (ids asked for, duplicates counted).",
        ),
        (
            CounterMetricFamily,
            "aps_table_rows_pushed",
            "rows_pushed",
            "Rows pushed to each embedding table and applied (ids pushed, duplicates counted).",
        ),
        (
            CounterMetricFamily,
            "aps_table_rows_evicted",
            "rows_evicted",
            "Rows each embedding table evicted (least recently used, to stay within --table-memory).",
        ),
    )
    for kind, name, key, text in families:
        family = kind(name, text, labels=["table"])
        for table, values in tables.items():
            family.add_metric([table], values.get(key, 0))
        yield family


def _report_metrics(workers: list[dict], warnings) -> Iterator:
    """What the workers' training loops report (aps.Worker.log): each rank's newest scalars,
    its process's CPU time and memory, and the pairs of ranks found on the same data."""
    scalars = GaugeMetricFamily(
        "aps_worker_scalar",
        "The newest value each rank logged of each scalar (aps.Worker.log: its loss, accuracy, learning rate...).",
        labels=["rank", "name"],
    )
    steps = GaugeMetricFamily(
        "aps_worker_scalar_step", "The step of each rank's newest value of each scalar.", labels=["rank", "name"]
    )
    cpu = CounterMetricFamily(
        "aps_worker_cpu_seconds",
        "CPU time of each rank's worker process (user and system), as it last reported.",
        labels=["rank"],
    )
    memory = GaugeMetricFamily(
        "aps_worker_resident_memory_bytes",
        "Resident memory of each rank's worker process, as it last reported.",
        labels=["rank"],
    )
    for w in workers:
        reported = w.get("reported")
        if not reported:
            continue
        rank = str(w["rank"])
        for name, newest in reported["scalars"].items():
            scalars.add_metric([rank, name], newest["value"])
            steps.add_metric([rank, name], newest["step"])
        if reported.get("process"):
            cpu.add_metric([rank], reported["process"]["cpu_s"])
            memory.add_metric([rank], reported["process"]["rss_bytes"])
    yield from (scalars, steps, cpu, memory)
    yield GaugeMetricFamily(
        "aps_ranks_on_same_data",
        "Pairs of ranks found training on the same batches at the "
        "same steps (each should read its own part of the data).",
        value=len(warnings),
    )
