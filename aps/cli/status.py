"""``aps status``: a running server's statistics, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import time

from ..errors import ConfigurationError
from ..wire.protocol import Op
from ..server.engine.stats import lr_range
from ..client.tcp import control_request
from ..wire.net import parse_address
from ._args import ADDRESS_DEFAULT, add_token_arguments, number, require, server_address, token_advice, token_from_args

__all__ = ["checkpoint_alarm", "fetch_stats", "format_lr", "format_stats", "register", "replica_alarm"]


def register(commands) -> None:
    parser = commands.add_parser(
        "status",
        help="print a running server's statistics",
        description="Print a running server's statistics: version, update rate, per embedding table its rows "
        "held and pulled and pushed, and per worker its clock, staleness, time waited at the gate, DSSP grants "
        "and learning rate.",
    )
    parser.add_argument(
        "address",
        nargs="?",
        default=None,
        type=_addresses,
        help=f"the server, tcp://HOST:PORT; the shards of a model, comma-separated ({ADDRESS_DEFAULT})",
    )
    parser.add_argument("--json", action="store_true", help="print the raw statistics as JSON")
    parser.add_argument(
        "--watch", type=number, metavar="SECONDS", help="refresh every SECONDS until interrupted (default: print once)"
    )
    parser.add_argument("--timeout", type=number, default=10.0, help="seconds to wait for the server")
    add_token_arguments(parser)
    parser.set_defaults(run=run)


def _addresses(text: str) -> list[str]:
    try:
        return [str(parse_address(one.strip())) for one in text.split(",")]
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fetch_stats(address: str, timeout: float = 10.0, token: str | None = None) -> dict:
    """The statistics of the server at ``address`` (``tcp://HOST:PORT``, or ``tls://`` with
    ``$APS_TLS_CA`` and the like), as ``Server.stats()`` returns them. ``token``: the
    server's, if it has one (default ``$APS_TOKEN``, else the token file of a loopback
    server of this user, see :mod:`aps.wire.tokens`)."""
    return json.loads(control_request(address, Op.STATS, token, timeout))


def run(args: argparse.Namespace) -> int:
    require(args.watch is None or args.watch > 0, f"--watch must be > 0 seconds, got {args.watch}")
    require(args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}")
    addresses = args.address or _addresses(server_address(None))
    token = token_from_args(args)
    while True:
        with token_advice(args):
            every = [fetch_stats(address, args.timeout, token) for address in addresses]
        if args.json:
            print(json.dumps(every[0] if len(every) == 1 else every, indent=2), flush=True)
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print("\n\n".join(format_stats(stats) for stats in every), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _by_transport(server: dict, key: str) -> str:
    """`` (tcp 1.2 MB, shm 3.4 GB)``: the transports that moved anything."""
    parts = [f"{name} {_fmt_bytes(t[key])}" for name, t in server["transports"].items() if t[key]]
    return f" ({', '.join(parts)})" if parts else ""


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1.0:
        return f"{s:.2f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f}ms"
    return f"{s * 1e6:.0f}us"


def _fmt_hist(hist: dict[str, int], limit: int = 6) -> str:
    if not hist:
        return "-"
    items = sorted(hist.items(), key=lambda kv: -kv[1])[:limit]
    text = " ".join(f"{k}:{v}" for k, v in sorted(items, key=lambda kv: int(kv[0])))
    return text + (" ..." if len(hist) > limit else "")


def format_lr(worker: dict) -> str:
    """A worker's learning rate: one value when every group has the same, else ``min..max``;
    ``*`` when the worker set its own (else they are the server's); ``-`` without a worker."""
    span = lr_range(worker.get("hyperparameters"))
    if span is None:
        return "-"
    low, high = span
    text = f"{low:g}" if low == high else f"{low:g}..{high:g}"
    return text + ("*" if worker.get("hyperparameters_own") else "")


def _fmt_age(s: float) -> str:
    """A duration as people say it: ``45s``, ``3m 05s``, ``2h 10m``."""
    s = max(0, int(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s // 60 % 60:02d}m"


def checkpoint_alarm(server: dict, now: float | None = None) -> str | None:
    """The alarm line for a server whose newest checkpoint attempt failed (None when its
    checkpoints are fine, or it writes none): how many failed in a row, the newest error
    with the version it was for and when, and how long since the last one written.

    Args:
        server: the ``server`` part of a statistics snapshot.
        now: the time (Unix seconds) to measure ages at; default now.
    """
    status = server.get("checkpoints")
    if not status or not status.get("failing"):
        return None
    now = time.time() if now is None else now
    error = status.get("last_error") or {}
    in_a_row = status.get("failed_in_a_row", 0)
    text = (
        f"CHECKPOINTS FAILING: {in_a_row} failed in a row ({status.get('failed', in_a_row)} since the server "
        f"started); the newest, of version {error.get('version', '?')}, {_fmt_age(now - error.get('unix', now))} "
        f"ago: {error.get('error', 'unknown error')}"
    )
    written = status.get("last_written_unix")
    if written is not None:
        text += (
            f"; the last checkpoint written is {_fmt_age(now - written)} old (version "
            f"{status.get('last_written_version')})"
        )
    else:
        text += f"; none written in the {_fmt_age(now - status['since_unix'])} since the server started"
    return text


def replica_alarm(server: dict) -> str | None:
    """The alarm line for a replica set's primary running without a listed backup (None
    otherwise, and for a server without --replicas)."""
    status = server.get("replicas")
    if not status or status.get("listed"):
        return None
    joining = status.get("joining") or []
    return "RUNNING WITHOUT BACKUPS: a crash of this primary loses what its last checkpoint does not hold" + (
        f" (catching up: {', '.join(joining)})" if joining else ""
    )


def _replica_lines(server: dict) -> list[str]:
    """The replica set: this primary's term, its backups and how far behind each is."""
    status = server.get("replicas")
    if not status:
        return []
    lag = status.get("lag") or {}
    backups = ", ".join(f"{b} (lag {lag.get(b, 0)})" for b in status.get("listed", [])) or "none"
    return [
        f"replica set: primary at term {status['term']}{' (took over)' if status.get('took_over') else ''}, "
        f"backups {backups}; captures {status['captures']}, replies held {status['held_replies']}"
    ]


def _checkpoint_lines(server: dict) -> list[str]:
    """The last checkpoint (or that none is written yet) and where the run resumed from."""
    lines = []
    last = server.get("checkpoint")
    status = server.get("checkpoints") or {}
    if last:
        age = max(0.0, time.time() - last["written_unix"])
        lines.append(
            f"checkpoint version {last['version']} {_fmt_seconds(age)} ago ({last['reason']}, written in "
            f"{_fmt_seconds(last['seconds'])}, loop {last['loop_ms']:.1f}ms)  {last['path']}  "
            f"written {status.get('written', last['written'])} failed {status.get('failed', last['failed'])} "
            f"skipped {status.get('skipped', last['skipped'])}"
        )
    elif status:
        lines.append(
            f"checkpoints to {status['directory']}: none written yet "
            f"(failed {status['failed']}, skipped {status['skipped']})"
        )
    if server.get("resumed_from"):
        lines.append(f"resumed from {server['resumed_from']}")
    return lines


def _table_lines(server: dict) -> list[str]:
    """The model's embedding tables (a model without any: no lines): the rows each holds and
    their bytes, and the rows this process pulled, pushed and evicted (ids, duplicates counted)."""
    tables = server.get("tables") or {}
    if not tables:
        return []
    width = max(5, *(len(name) for name in tables))
    lines = [
        "",
        f"{'table':<{width}} {'dim':>5}  {'optimizer':<15} {'rows held':>12} {'bytes':>9} "
        f"{'rows pulled':>13} {'rows pushed':>13} {'evicted':>10}",
    ]
    for name, t in tables.items():
        lines.append(
            f"{name:<{width}} {t['dim']:>5}  {t['optimizer']:<15} {t['rows']:>12} {_fmt_bytes(t['bytes']):>9} "
            f"{t['rows_pulled']:>13} {t['rows_pushed']:>13} {t['rows_evicted']:>10}"
        )
    return lines


def _shard(server: dict) -> str:
    shards = server.get("shards", 1)
    return f"  shard {server.get('shard', 0)} of {shards}" if shards > 1 else ""


def format_stats(stats: dict) -> str:
    """A readable table of a stats snapshot (what ``aps status`` prints)."""
    s = stats["server"]
    uptime = int(s["uptime_s"])
    lines = [
        f"aps {s['address']}{_shard(s)}  sync {s['sync']}  optimizer {s['optimizer']}"
        + (f"  kernels {s['kernels']['isa']}" if s.get("kernels") else ""),
        *(f"!! {alarm}" for alarm in [checkpoint_alarm(s), replica_alarm(s)] if alarm is not None),  # seen first
        f"version {s['version']}  updates/s {s['updates_per_s']:.1f} (mean {s['updates_per_s_mean']:.1f})  "
        f"live {s['live']}/{s['workers']}{'' if s['started'] else ' (waiting for workers)'}  "
        f"pushes {s['pushes']}  rejected {s['rejected']}  "
        f"up {uptime // 3600:d}:{uptime // 60 % 60:02d}:{uptime % 60:02d}",
        f"in {_fmt_bytes(s['bytes_in'])}{_by_transport(s, 'bytes_in')}  "
        f"out {_fmt_bytes(s['bytes_out'])}{_by_transport(s, 'bytes_out')}  "
        f"server memory {_fmt_bytes(s['process']['rss_bytes'])}  cpu {s['process']['cpu_s']:.1f} s",
        *_checkpoint_lines(s),
        *_replica_lines(s),
        *_table_lines(s),
        "",
        f"{'rank':>4} {'live':>4} {'clock':>7} {'gap':>4} {'max':>4} {'held':>4} {'pushes':>7} {'dropped':>7} "
        f"{'stale':>6} {'wait mean':>9} {'wait max':>9} {'interval':>9} {'lr':>13}  staleness / r*",
    ]
    own = False
    for w in stats["workers"]:
        stale = "-" if w["staleness_mean"] is None else f"{w['staleness_mean']:.2f}"
        hists = _fmt_hist(w["staleness_hist"])
        if w["r_star_hist"]:
            hists += "  /  r* " + _fmt_hist(w["r_star_hist"])
        lines.append(
            f"{w['rank']:>4} {'yes' if w['live'] else 'no':>4} {w['clock']:>7} {w['gap'] if w['live'] else '-':>4} "
            f"{w['max_release_gap'] if w['max_release_gap'] is not None else '-':>4} "
            f"{'yes' if w['held'] else 'no':>4} {w['pushes']:>7} {w['dropped']:>7} {stale:>6} "
            f"{_fmt_seconds(w['wait_s_mean']):>9} {_fmt_seconds(w['wait_s_max'] or None):>9} "
            f"{_fmt_seconds(w['last_interval_s']):>9} {format_lr(w):>13}  {hists}"
        )
        own = own or bool(w.get("hyperparameters_own"))
    if own:
        lines.append(
            "* the worker's own optimizer values (set by it, e.g. by a torch LR scheduler); others use the server's"
        )
    return "\n".join(lines)
