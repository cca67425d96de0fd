"""A worker process that ends without ``close()`` leaves cleanly (issue 23, point 11), and so
does a worker its script lets go of, as an optimizer local to ``main()`` is when ``main()``
returns (issue 45, point 14).

Training scripts (pytorch/examples among them) never call ``close()``: their ranks must be
counted as having left, not as crashes, and the server's log must say what its membership
events say. Real ``aps serve`` processes, real worker processes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import aps
from aps.cli.status import fetch_stats
from aps.wire.protocol import Op
from aps.testing import RawClient, wait_for

#: A training script that ends as scripts do: no close(), no context manager. ``mode``:
#: "exit" (falls off its end), "wait" (waits for a line on stdin first, then ends), "hang"
#: (sleeps: to be killed), "held" (a thread is held at the BSP gate when the script ends).
SCRIPT = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import aps

    address, rank, workers, transport, mode = sys.argv[1:6]
    worker = aps.Worker(address, int(rank), int(workers), transport=transport)
    worker.init({"w": np.zeros(8, np.float32)})
    if mode == "held":
        worker.push(worker.grads)
        def held():
            try:
                worker.pull()  # held: the other rank never pushes
            except aps.errors.APSConnectionError:
                pass  # the exit shut its connection (the thread may run again before the interpreter ends)

        threading.Thread(target=held, daemon=True).start()
    else:
        for _ in range(3):
            worker.push_pull(worker.grads)
    print("trained", flush=True)
    if mode == "wait":
        sys.stdin.readline()
    elif mode == "hang":
        import time
        time.sleep(60)
    elif mode == "held":
        import time
        time.sleep(0.5)  # the pull is in flight
""")

#: The same with aps.torch, the way pytorch/examples' scripts end: the optimizer left open, a
#: global of the module ("global") or a local of main(), freed when main() returns ("local", as
#: mnist and imagenet have it).
TORCH_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import aps.torch

    def main():
        address, rank, workers, transport = sys.argv[1:5]
        model = torch.nn.Linear(4, 2)
        opt = aps.torch.Optimizer(model, address, int(rank), int(workers), transport=transport)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        print("trained", flush=True)
        return opt

    if sys.argv[5] == "global":
        opt = main()
    else:
        main()
        print("returned", flush=True)
        sys.stdin.readline()  # (the process is still there: the leave was the drop's, not the exit's)
""")


def start_script(source: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", source, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def events(server) -> list[tuple[int, str]]:
    return [(event["rank"], event["event"]) for event in fetch_stats(server.address, 10.0)["events"]]


def counts(server) -> dict[str, int]:
    return fetch_stats(server.address, 10.0)["server"]["membership_events"]


def log_events(server) -> list[tuple[int, str]]:
    """The membership changes the server's log reports, in its order."""
    return [(int(rank), event) for rank, event in
            re.findall(r"worker (\d+) (joined|rejoined|left|disconnected|timed out)\b", server.log())]


def wait_event(server, event: tuple[int, str], timeout: float = 15.0) -> None:
    wait_for(lambda: event in events(server), timeout, f"the event {event}")


def finished(proc: subprocess.Popen, timeout: float = 60.0, *, read: bool = False) -> None:
    """``proc`` ends well (``read``: its "trained" line was read already)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    assert (read or "trained" in out) and "Traceback" not in err, err


def test_a_script_that_ends_without_close_has_left(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    finished(start_script(SCRIPT, server.address, 0, 1, transport, "exit"))
    wait_event(server, (0, "left"))
    assert counts(server)["disconnected"] == 0
    assert log_events(server) == events(server) == [(0, "joined"), (0, "left")]


def test_a_torch_script_whose_optimizer_is_local_to_main_has_left_when_main_returns(server_process):
    server = server_process("--workers", "1", "--sync", "bsp")
    proc = start_script(TORCH_SCRIPT, server.address, 0, 1, "auto", "local")
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["trained", "returned"], proc.stderr.read()
        wait_event(server, (0, "left"))  # (the process is still there, waiting on its stdin)
    finally:
        finished(proc, 30.0, read=True)
    assert counts(server)["disconnected"] == 0
    assert log_events(server) == events(server) == [(0, "joined"), (0, "left")]


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["global", "local"])
def test_every_rank_of_a_torch_script_that_ends_without_close_has_left(server_process, transport, scope):
    server = server_process("--workers", "2", "--sync", "bsp")
    procs = [start_script(TORCH_SCRIPT, server.address, rank, 2, transport, scope) for rank in range(2)]
    for proc in procs:
        finished(proc, 120.0)  # (a "local" script's wait on its stdin ends as its stdin is closed)
    wait_for(lambda: counts(server)["left"] == 2, 15.0, "both ranks to leave")
    assert counts(server)["disconnected"] == 0
    assert sorted(log_events(server)) == sorted(events(server)) == [(0, "joined"), (0, "left"), (1, "joined"),
                                                                     (1, "left")]


def test_a_killed_worker_is_still_disconnected(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    proc = start_script(SCRIPT, server.address, 0, 1, transport, "hang")
    assert proc.stdout.readline().strip() == "trained"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    wait_event(server, (0, "disconnected"))
    assert counts(server)["left"] == 0
    assert log_events(server) == events(server) == [(0, "joined"), (0, "disconnected")]


def test_the_exit_is_safe_when_the_server_is_gone(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    proc = start_script(SCRIPT, server.address, 0, 1, transport, "wait")
    assert proc.stdout.readline().strip() == "trained"
    server.proc.kill()
    server.proc.wait(10)
    start = time.monotonic()
    proc.stdin.write("\n")
    proc.stdin.flush()
    finished(proc, 30.0, read=True)
    assert time.monotonic() - start < 10.0


def test_the_exit_is_bounded_while_a_thread_is_held_at_the_gate(server_process, transport):
    server = server_process("--workers", "2", "--sync", "bsp")
    with aps.Worker(server.address, 1, 2, transport=transport) as other:  # never pushes: rank 0 stays held
        thread = threading.Thread(target=other.init, args=({"w": np.zeros(8, np.float32)},), daemon=True)
        thread.start()
        proc = start_script(SCRIPT, server.address, 0, 2, transport, "held")
        assert proc.stdout.readline().strip() == "trained"
        start = time.monotonic()
        finished(proc, 30.0, read=True)
        # the interpreter's start-up is not in it: the exit alone, sleep(0.5) included
        assert time.monotonic() - start < aps.client.channel.EXIT_LEAVE_S + 3.0
        wait_event(server, (0, "disconnected"))  # it could not say goodbye in the middle of a call
        thread.join(10)


def test_the_exit_hook_keeps_no_worker_alive_and_a_dropped_worker_leaves(server_process, transport):
    import gc
    import weakref

    server = server_process("--workers", "1", "--sync", "asp")
    worker = aps.Worker(server.address, 0, 1, transport=transport)
    worker.init({"w": np.zeros(8, np.float32)})
    ref = weakref.ref(worker)
    del worker
    gc.collect()
    assert ref() is None
    wait_event(server, (0, "left"))  # dropped without close(): it left, as close() leaves
    assert counts(server)["disconnected"] == 0


def test_a_dropped_worker_whose_server_is_gone_is_freed_at_once(server_process):
    import gc
    import weakref

    server = server_process("--workers", "1", "--sync", "asp")
    worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect=False)
    worker.init({"w": np.zeros(8, np.float32)})
    ref = weakref.ref(worker)
    server.proc.send_signal(signal.SIGSTOP)  # (it answers nothing: the goodbye is bounded)
    try:
        start = time.monotonic()
        del worker
        gc.collect()
        # (bounded by the goodbye's limit, not by a timeout of tens of seconds; the margin is for a loaded machine)
        assert ref() is None and time.monotonic() - start < aps.client.channel.DROP_LEAVE_S + 3.0
    finally:
        server.proc.send_signal(signal.SIGCONT)


def test_log_lines_and_events_agree(server_process):
    server = server_process("--workers", "3", "--sync", "asp", "--heartbeat-timeout", "1")
    params = {"w": np.zeros(4, np.float32)}
    steady = aps.Worker(server.address, 0, 3, transport="tcp", heartbeat=0.2)
    leaving = aps.Worker(server.address, 1, 3, transport="tcp", heartbeat=0.2)
    silent = RawClient(server.port)  # joins, then sends nothing: timed out
    joins = [threading.Thread(target=w.init, args=(params,)) for w in (steady, leaving)]
    for thread in joins:
        thread.start()
    silent.init(2, 3, params)
    for thread in joins:
        thread.join(10)
    assert silent.reply()[0].op == Op.INIT_REPLY
    leaving.close()  # left
    steady.shards[0]._conn.sock.shutdown(socket.SHUT_RDWR)  # disconnected
    wait_event(server, (2, "timed out"))
    wait_event(server, (0, "disconnected"))
    steady.reconnect()  # rejoined
    wait_event(server, (0, "rejoined"))
    steady.close()
    wait_event(server, (0, "left"))
    seen = events(server)
    assert sorted(seen[:3]) == [(0, "joined"), (1, "joined"), (2, "joined")]
    assert log_events(server) == seen
    assert seen.count((0, "left")) == 1 and (1, "left") in seen and (0, "rejoined") in seen
    silent.close()
