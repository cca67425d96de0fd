"""Streaming local SGD: the fragments of a sharded model synced in turn, one shard each
(``aps.torch.LocalSGD(..., streaming=True)`` against ``aps serve --shard I --shards K``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
import aps.torch  # noqa: E402
from aps.cli.status import fetch_stats  # noqa: E402
from aps.errors import ConfigurationError  # noqa: E402

from .test_local_sgd import in_threads  # noqa: E402

EVERY = 4


def model() -> torch.nn.Module:
    """40 weights and 5 biases: 45 elements, cut by the two shards inside the weight."""
    net = torch.nn.Linear(8, 5)
    with torch.no_grad():
        net.weight.copy_(torch.arange(40, dtype=torch.float32).reshape(5, 8) / 8)
        net.bias.copy_(torch.arange(5, dtype=torch.float32) / 4)
    return net


def flat_grad(rank: int, step: int) -> np.ndarray:
    """Dyadic values: the sums and halves below are exact in float32."""
    return np.random.default_rng(100 * rank + step).integers(-8, 9, 45).astype(np.float32) / 16


def shards(server_process, *options: str) -> list:
    return [server_process("--workers", "2", "--sync", "bsp", "--lr", "1", "--shard", str(i), "--shards", "2",
                           *options) for i in range(2)]


def join(servers: list, every: int = EVERY, **options) -> tuple[list, list]:
    nets = [model() for _ in range(2)]
    opts: list = [None, None]
    address = ",".join(s.address for s in reversed(servers))  # (any order: each server says which shard it is)

    def one(rank):
        inner = torch.optim.SGD(nets[rank].parameters(), lr=0.5)
        opts[rank] = aps.torch.LocalSGD(nets[rank], inner, every=every, address=address, rank=rank, num_workers=2,
                                        transport="tcp", streaming=True, **options)

    in_threads([lambda r=r: one(r) for r in range(2)])
    return nets, opts


def steps(net, opt, rank: int, which: range) -> None:
    for step in which:
        opt.zero_grad()
        g = torch.from_numpy(flat_grad(rank, step))
        net.weight.grad, net.bias.grad = g[:40].reshape(5, 8).clone(), g[40:].clone()
        opt.step()


def flat(net) -> np.ndarray:
    return np.concatenate([net.weight.detach().numpy().ravel(), net.bias.detach().numpy()])


def test_each_fragment_averages_every_h_steps_at_its_own_offset_and_moves_only_its_bytes(server_process):
    """Two workers, inner SGD of learning rate 1/2, H = 4, an outer SGD step of learning rate 1
    on each shard: fragment 0 (elements 0-15 on shard 0) is the workers' mean after steps 2
    and 6, fragment 1 (16-44 on shard 1) after steps 4 and 8, each rank's other fragment
    untouched by a sync; bit for bit. Each shard took 2 pushes per worker, of its range alone."""
    servers = shards(server_process)
    nets, opts = join(servers)
    assert opts[0].fragments.bounds == (0, 16, 45) and opts[0].fragments.offsets == [2, 0]
    in_threads([lambda r=r: steps(nets[r], opts[r], r, range(8)) for r in range(2)])
    local = [flat(model()), flat(model())]
    anchor = local[0].copy()  # (the global weights each fragment's inner steps start from)
    for step in range(8):
        for rank in range(2):
            local[rank] = local[rank] - np.float32(0.5) * flat_grad(rank, step)
        done = step + 1
        for lo, hi, offset in ((0, 16, 2), (16, 45, 0)):
            if done % EVERY == offset:
                mean = (local[0][lo:hi] + local[1][lo:hi]) / 2
                local[0][lo:hi] = local[1][lo:hi] = anchor[lo:hi] = mean
    for rank in range(2):
        np.testing.assert_array_equal(flat(nets[rank]), local[rank])
    assert [o.syncs for o in opts] == [4, 4]
    for index, server in enumerate(servers):
        stats = fetch_stats(server.address)["server"]
        assert stats["pushes"] == 4, index
    state = opts[0].state_dict()
    np.testing.assert_array_equal(np.concatenate([state["anchor"]["weight"].numpy().ravel(),
                                                  state["anchor"]["bias"].numpy()]), anchor)
    assert not np.array_equal(anchor[:16], local[0][:16])  # (fragment 0 took two steps since its sync)
    for opt in opts:
        opt.close()


def test_int8_fragments_keep_their_own_residual_and_give_it_back(server_process):
    servers = shards(server_process)
    nets, opts = join(servers, compression="int8")
    in_threads([lambda r=r: steps(nets[r], opts[r], r, range(2)) for r in range(2)])  # fragment 0 synced
    state = opts[0].state_dict()
    residual = state["residual"].numpy()
    assert residual.shape == (45,) and residual[:16].any() and not residual[16:].any()  # (fragment 1: no push yet)
    opts[0].load_state_dict({**state, "residual": torch.ones(45)})
    np.testing.assert_array_equal(opts[0].fragments.workers[1].compression_residual, np.ones(29, np.float32))
    opts[0].load_state_dict({**state, "anchor": {name: value + 1 for name, value in state["anchor"].items()}})
    np.testing.assert_array_equal(opts[0].fragments.anchor[:40], state["anchor"]["weight"].numpy().ravel() + 1)
    opts[0].load_state_dict(state)
    np.testing.assert_array_equal(opts[0].state_dict()["residual"].numpy(), residual)
    np.testing.assert_array_equal(opts[0].fragments.anchor[40:], state["anchor"]["bias"].numpy())
    for opt in opts:
        opt.close()


def test_streaming_needs_the_shards_and_no_dynamic_h(server_process):
    one = server_process("--workers", "1", "--sync", "asp")
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=0.5)
    with pytest.raises(ConfigurationError, match="give the address of every shard"):
        aps.torch.LocalSGD(net, inner, every=4, address=one.address, rank=0, num_workers=1, streaming=True)
    with pytest.raises(ConfigurationError, match="no worker= or dynamic=True"):
        aps.torch.LocalSGD(net, inner, every=4, address=f"{one.address},{one.address}", rank=0, num_workers=1,
                           streaming=True, dynamic=True)


def test_a_fragments_worker_has_one_server_which_is_the_shard_it_means(server_process):
    """(A plain worker still refuses one shard: it would train the whole model on it.)"""
    servers = shards(server_process)
    plain = server_process("--workers", "2", "--sync", "bsp")
    with pytest.raises(ConfigurationError, match="one shard's address"):
        aps.Worker(",".join(s.address for s in servers), 0, 2, _fragment=(0, 2))
    with pytest.raises(ConfigurationError, match="give the worker every shard's address"):
        aps.Worker(servers[0].address, 0, 2)
    with pytest.raises(ConfigurationError, match="is shard 1 of 2, not shard 0 of 2"):
        aps.Worker(servers[1].address, 0, 2, _fragment=(0, 2))
    with pytest.raises(ConfigurationError, match="is shard 0 of 1, not one of 2 shards"):
        aps.Worker(plain.address, 0, 2, _fragment=(None, 2))
    worker = aps.Worker(servers[1].address, 0, 2, _fragment=(1, 2))
    assert json.loads(worker.server_info.shard)["shard"] == 1
    worker.close()


def test_a_rank_that_joins_mid_period_takes_the_runs_place_in_it(server_process):
    """Both ranks take 6 steps (fragment 0 synced at 2 and 6, fragment 1 at 4); rank 1's process
    ends and rank 0 takes a step alone; a new rank 1 joins: from the shards' clocks it is at
    step 6, so both push fragment 1 at step 8 and fragment 0 at 10 (counting from 0 it would
    push fragment 0 at its step 2 while rank 0 waits at fragment 1: both stuck)."""
    servers = shards(server_process)
    nets, opts = join(servers)
    in_threads([lambda r=r: steps(nets[r], opts[r], r, range(6)) for r in range(2)])
    opts[1].close()
    steps(nets[0], opts[0], 0, range(6, 7))
    new = model()
    address = ",".join(s.address for s in servers)
    fresh = aps.torch.LocalSGD(new, torch.optim.SGD(new.parameters(), lr=0.5), every=EVERY, address=address, rank=1,
                               num_workers=2, transport="tcp", streaming=True, init_timeout=30)
    assert fresh.fragments.position == 6 and fresh.steps == 0
    in_threads([lambda: steps(nets[0], opts[0], 0, range(7, 11)), lambda: steps(new, fresh, 1, range(4))])
    assert (opts[0].syncs, fresh.syncs) == (5, 2)
    np.testing.assert_array_equal(fresh.fragments.anchor, opts[0].fragments.anchor)  # (both took 8's and 10's)
    for opt in (opts[0], fresh):
        opt.close()


def test_parameters_in_another_memory_format_sync_in_their_logical_order(server_process):
    servers = [server_process("--workers", "1", "--sync", "asp", "--lr", "1", "--shard", str(i), "--shards", "2")
               for i in range(2)]
    conv = torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    opt = aps.torch.LocalSGD(conv, torch.optim.SGD(conv.parameters(), lr=0.5), every=2, rank=0, num_workers=1,
                             address=",".join(s.address for s in servers), transport="tcp", streaming=True)
    before = opt.fragments.range(0, opt.fragments.layout.numel)
    np.testing.assert_array_equal(before[:288], conv.weight.detach().reshape(-1).numpy())
    for _ in range(2):
        opt.zero_grad()
        conv.weight.grad = torch.ones_like(conv.weight)
        conv.bias.grad = torch.ones_like(conv.bias)
        opt.step()
    # An outer SGD step of 1 on one worker: the global weights are the local ones when each
    # fragment synced (fragment 0 after step 1, fragment 1 after step 2), in the logical order.
    cut = opt.fragments.bounds[1]
    after = [before - np.float32(0.5), before - np.float32(0.5) - np.float32(0.5)]
    np.testing.assert_allclose(opt.fragments.anchor[:cut], after[0][:cut], rtol=1e-6)
    np.testing.assert_allclose(opt.fragments.anchor[cut:], after[1][cut:], rtol=1e-6)
    np.testing.assert_allclose(conv.weight.detach().reshape(-1).numpy(), after[1][:288], rtol=1e-6)
    opt.close()


@pytest.mark.parametrize("which", ["newest", "older", "cut"])
def test_a_shard_killed_and_resumed_mid_run_leaves_both_ranks_training_in_step(server_process, tmp_path, which,
                                                                                caplog):
    """kill -9 one shard of a streaming BSP run and start it again from its newest checkpoint, or
    from the one before, or cut one rank's connection to it (``cut``): both ranks go on to the
    end (no rank waits on a round of one shard that the other's sync on the other shard holds
    up), and they end on the same global weights of every fragment, both shards having taken
    every rank's syncs in the same rounds."""
    import signal
    import socket
    import threading
    import time

    from aps.checkpoint import list_checkpoints
    from aps.testing import wait_for

    dirs = [tmp_path / f"shard{i}" for i in range(2)]
    options = ("--workers", "2", "--sync", "bsp", "--lr", "1", "--shards", "2", "--checkpoint-every", "0",
               "--checkpoint-every-updates", "3", "--checkpoint-keep", "100")
    servers = [server_process(*options, "--shard", str(i), "--checkpoint-dir", str(dirs[i])) for i in range(2)]
    nets, opts = join(servers)
    total, done = 400, [0, 0]
    errors: list[BaseException] = []

    resume_rank_1 = threading.Event()

    def run(rank: int) -> None:
        try:
            for step in range(total):
                steps(nets[rank], opts[rank], rank, range(step, step + 1))
                done[rank] = step + 1
                if which == "cut" and rank == 1 and step + 1 == 42:  # (just synced fragment 0)
                    resume_rank_1.wait(60)
                time.sleep(0.002)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(2)]
    for thread in threads:
        thread.start()
    try:
        if which == "cut":
            # rank 1's connection to shard 1 breaks while it waits; rank 0's next sync there closes
            # the round without it; then rank 1 goes on, and its sync of that round is dropped
            wait_for(lambda: done[1] == 42 or errors, timeout=60, what="rank 1 at step 42")
            version = fetch_stats(servers[1].address)["server"]["version"]
            opts[1].fragments.workers[1]._channels[0]._conn.sock.shutdown(socket.SHUT_RDWR)
            at_kill = list(done)
            wait_for(lambda: fetch_stats(servers[1].address)["server"]["version"] > version, timeout=30,
                     what="a round of shard 1 closed without rank 1")
            resume_rank_1.set()
        else:
            wait_for(lambda: len(list_checkpoints(dirs[1])) >= 3 or errors, timeout=60,
                     what="three checkpoints of shard 1")
            assert not errors, errors
            killed = servers[1]
            port = killed.port
            killed.signal(signal.SIGKILL)
            killed.proc.wait(10)
            at_kill = list(done)
            written = list_checkpoints(dirs[1])  # (newest first)
            resume = written[0] if which == "newest" else written[1]
            servers[1] = server_process(*options, "--shard", "1", "--checkpoint-dir", str(dirs[1]), "--port", str(port),
                                        "--resume", str(resume))
        for thread in threads:
            thread.join(90)
        assert not errors, errors
        assert done == [total, total], f"stuck at steps {done}"
        assert max(at_kill) < total - 2 * EVERY, at_kill  # (mid-run)
        assert opts[0].syncs == opts[1].syncs
        np.testing.assert_array_equal(opts[0].fragments.anchor, opts[1].fragments.anchor)
        if which == "older":  # (both ranks were past it: each dropped the sync in flight, and said so)
            assert caplog.text.count("this fragment's pseudo-gradient was computed on") == 2, caplog.text
        if which == "cut":
            events = fetch_stats(servers[1].address)["server"]["membership_events"]
            assert events["rejoined"] == 1 and events["disconnected"] == 1, events
            assert fetch_stats(servers[1].address)["server"]["dropped"] == 1  # (rank 1's sync of the closed round)
    finally:  # (whatever failed: rank 1 goes on, and every worker closes within bounds, not retrying for minutes)
        resume_rank_1.set()
        closers = [threading.Thread(target=opt.close, daemon=True) for opt in opts]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(15)
