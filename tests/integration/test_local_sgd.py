"""``aps.torch.LocalSGD``: inner steps local, every H steps a pseudo-gradient pushed and the
server's optimizer (the outer one) applied to the workers' mean (BSP: DiLoCo)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
import aps.torch  # noqa: E402
from aps import _reference  # noqa: E402
from aps.cli.status import fetch_stats  # noqa: E402
from aps.errors import ConfigurationError, NonFiniteGradient  # noqa: E402
from aps.testing import wait_for  # noqa: E402

SHAPES = {"weight": (3, 4), "bias": (3,)}


def grads(rank: int, step: int) -> dict[str, np.ndarray]:
    """Dyadic values: every sum, difference and half of them below is exact in float32."""
    rng = np.random.default_rng(100 * rank + step)
    return {name: rng.integers(-8, 9, shape).astype(np.float32) / 16 for name, shape in SHAPES.items()}


def model() -> torch.nn.Module:
    net = torch.nn.Linear(4, 3)
    with torch.no_grad():
        net.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8)
        net.bias.copy_(torch.tensor([1.0, -1.0, 0.5]))
    return net


def in_threads(calls) -> None:
    errors: list[BaseException] = []

    def one(call):
        try:
            call()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors


def two_workers(server, every: int) -> tuple[list, list]:
    """Ranks 0 and 1 of a two-worker run joined together, each a :func:`model` with inner SGD
    of learning rate 1/2 and ``LocalSGD`` every ``every`` steps, over TCP."""
    nets = [model() for _ in range(2)]
    opts: list = [None, None]

    def join(rank):
        inner = torch.optim.SGD(nets[rank].parameters(), lr=0.5)
        opts[rank] = aps.torch.LocalSGD(nets[rank], inner, every=every, address=server.address, rank=rank,
                                        num_workers=2, transport="tcp")

    in_threads([lambda r=r: join(r) for r in range(2)])
    return nets, opts


def inner_steps(net, opt, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        for name, p in net.named_parameters():
            p.grad = torch.from_numpy(grads(rank, step)[name])
        opt.step()


def after_inner_steps(weights: dict, rank: int, steps: range) -> dict:
    """What inner SGD of learning rate 1/2 makes of ``weights`` (exact: dyadic values)."""
    weights = {name: value.copy() for name, value in weights.items()}
    for step in steps:
        for name in weights:
            weights[name] = weights[name] - np.float32(0.5) * grads(rank, step)[name]
    return weights


@pytest.mark.parametrize("every", [1, 3])
def test_local_sgd_under_bsp_with_an_outer_sgd_step_of_1_is_model_averaging_every_h_steps(server_process, every):
    """Two workers, inner SGD with learning rate 1/2, H = ``every``; the server takes an SGD
    step of learning rate 1 on the mean pseudo-gradient: the global weights are the mean of
    the workers' after each H inner steps, bit for bit, and only every H-th step pushes."""
    server = server_process("--workers", "2", "--sync", "bsp", "--lr", "1")
    nets, opts = two_workers(server, every)
    steps = 2 * every

    in_threads([lambda r=r: inner_steps(nets[r], opts[r], r, range(steps)) for r in range(2)])
    expected = {name: p.detach().numpy().copy() for name, p in model().named_parameters()}
    for sync in range(steps // every):
        local = [after_inner_steps(expected, rank, range(sync * every, (sync + 1) * every)) for rank in range(2)]
        expected = {name: (local[0][name] + local[1][name]) / 2 for name in expected}
    for net in nets:
        for name, p in net.named_parameters():
            np.testing.assert_array_equal(p.detach().numpy(), expected[name])
    assert [o.syncs for o in opts] == [steps // every] * 2 and [o.steps for o in opts] == [steps] * 2
    assert fetch_stats(server.address)["server"]["pushes"] == 2 * (steps // every)
    for opt in opts:
        opt.close()


def test_the_state_dict_carries_the_inner_optimizers_state_the_steps_and_the_anchor(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    net = model()
    inner = torch.optim.Adam(net.parameters(), lr=0.01)
    with aps.torch.LocalSGD(net, inner, every=2, address=server.address, rank=0, num_workers=1) as opt:
        inner_steps(net, opt, 0, range(3))  # one sync, then one step past it
        state = opt.state_dict()
        assert state["steps"] == 3 and state["syncs"] == 1 and state["every"] == 2
        assert set(state["inner"]["state"]) == {0, 1}  # Adam's moments, kept across the sync
        with pytest.raises(ConfigurationError, match="not one the inner optimizer steps"):
            aps.torch.LocalSGD(model(), torch.optim.Adam(model().parameters()), every=2, worker=opt.worker)
    fresh = model()  # (a new process: the run goes on at the server)
    with aps.torch.LocalSGD(fresh, torch.optim.Adam(fresh.parameters(), lr=0.01), every=2, address=server.address,
                            rank=0, num_workers=1) as restored:
        restored.load_state_dict(state)
        assert restored.steps == 3 and restored.syncs == 1
        for name, value in state["anchor"].items():
            np.testing.assert_array_equal(restored._anchor[name], value.numpy())
        adam = restored.inner.state_dict()["state"]
        for key, moments in state["inner"]["state"].items():
            assert torch.equal(adam[key]["exp_avg"], moments["exp_avg"])


def test_asynchronous_local_sgd_with_delayed_nesterov_applies_algorithm_3_push_by_push(server_process):
    """ASP, two workers taking turns, H = 2, the outer optimizer delayed Nesterov with a period
    of 2 (the momentum moves at every second push, by the mean of the two) and c = 1/4: the
    server's weights after each sync are the formula applied to the pseudo-gradients in the
    order they came, bit for bit (the twin computes it as the server's kernel does)."""
    lr, beta, period, c, every = 0.7, 0.9, 2, 0.25, 2
    server = server_process("--workers", "2", "--sync", "asp", "--optimizer", "delayed-nesterov", "--lr", str(lr),
                            "--momentum", str(beta), "--momentum-period", str(period),
                            "--momentum-activation", str(c))
    nets, opts = two_workers(server, every)
    start = {name: p.detach().numpy().copy() for name, p in model().named_parameters()}
    weights = dict(start)
    momentum = {name: np.zeros_like(value) for name, value in start.items()}
    delta = {name: np.zeros_like(value) for name, value in start.items()}
    anchors = [dict(start), dict(start)]
    pushes = 0
    for turn in range(3):
        for rank in range(2):
            steps = range(turn * every, (turn + 1) * every)
            inner_steps(nets[rank], opts[rank], rank, steps)
            local = after_inner_steps(anchors[rank], rank, steps)
            pushes += 1
            for name in weights:
                w_out, m_out, d_out = (np.empty_like(weights[name]) for _ in range(3))
                assert _reference.delayed_nesterov_step(
                    w_out, weights[name], anchors[rank][name] - local[name], m_out, momentum[name], d_out,
                    delta[name], pushes, lr, beta, period, c)
                weights[name], delta[name] = w_out, d_out
                if pushes % period == 0:
                    momentum[name] = m_out
            anchors[rank] = dict(weights)
            for name, p in nets[rank].named_parameters():  # the new global weights, taken at the sync
                np.testing.assert_array_equal(p.detach().numpy(), weights[name])
    assert any(np.any(value) for value in momentum.values())
    assert fetch_stats(server.address)["server"]["pushes"] == 6
    for opt in opts:
        opt.close()


def test_aps_torch_optimizer_refuses_a_delayed_nesterov_server_and_names_local_sgd(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--optimizer", "delayed-nesterov", "--lr", "0.7",
                            "--momentum", "0.9")
    net = model()
    with pytest.raises(ConfigurationError, match="use aps.torch.LocalSGD"):
        aps.torch.Optimizer(net.parameters(), address=server.address, rank=0, num_workers=1)


@pytest.mark.parametrize("sync, dynamic", [("asp", True), ("bsp", True), ("asp", False)],
                         ids=["asp-dynamic", "bsp-dynamic", "asp-fixed"])
def test_dynamic_local_updates_give_a_slow_worker_fewer_steps_so_both_sync_about_as_often(
    server_process, sync, dynamic
):
    """H = 20, rank 1's inner steps ten times as slow as rank 0's: with dynamic local updates
    rank 1 takes about H/10 steps between syncs once the server has its rate and rank 0's (its
    own time: under BSP not the waits at the barrier), rank 0 keeps H; without, both take H."""
    server = server_process("--workers", "2", "--sync", sync, "--lr", "1")
    nets = [model() for _ in range(2)]
    opts: list = [None, None]

    def join(rank):
        inner = torch.optim.SGD(nets[rank].parameters(), lr=0.01)
        opts[rank] = aps.torch.LocalSGD(nets[rank], inner, every=20, address=server.address, rank=rank,
                                        num_workers=2, transport="tcp", dynamic=dynamic)

    in_threads([lambda r=r: join(r) for r in range(2)])
    done = threading.Event()
    seen: list[list[int]] = [[], []]

    def train(rank, pause, until):
        opt = opts[rank]
        while not done.is_set() and opt.syncs < until:
            opt.zero_grad()
            for p in nets[rank].parameters():
                p.grad = torch.ones_like(p)
            time.sleep(pause)
            syncs = opt.syncs
            opt.step()
            if opt.syncs > syncs:
                seen[rank].append(opt.current_every)
        done.set()

    # (under BSP each round waits for both: rank 0 stops at rank 1's count of syncs)
    in_threads([lambda: train(0, 0.004, 4 if sync == "bsp" else 10**6), lambda: train(1, 0.04, 4)])
    assert all(count == 20 for count in seen[0]) and len(seen[0]) >= 4, seen
    if dynamic:
        # (its first two syncs take 20 steps each: the server measures a rate over two reports)
        assert 1 <= seen[1][-1] <= 10, seen  # (about 2: ten times as slow; a loaded machine narrows the gap)
        assert opts[1].state_dict()["current_every"] == seen[1][-1]
    else:
        assert seen[1] == [20] * 4
    for opt in opts:
        opt.close()


def test_dynamic_local_updates_measure_the_workers_own_clock(server_process):
    """``clock=``: a worker's time as the caller counts it (here virtual: rank 1's steps take 2.5
    s, rank 0's 1 s, taken one at a time in the order they end), so the steps between syncs
    come out exactly: ceil(10 / 2.5) = 4 for rank 1, 10 for rank 0."""
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    nets = [model() for _ in range(2)]
    now, took = [0.0, 0.0], [1.0, 2.5]
    opts: list = [None, None]

    def join(rank):
        inner = torch.optim.SGD(nets[rank].parameters(), lr=0.01)
        opts[rank] = aps.torch.LocalSGD(nets[rank], inner, every=10, address=server.address, rank=rank,
                                        num_workers=2, transport="tcp", dynamic=True, clock=lambda: now[rank])

    in_threads([lambda r=r: join(r) for r in range(2)])
    for _ in range(120):
        rank = min((0, 1), key=lambda r: (now[r] + took[r], r))
        now[rank] += took[rank]
        for p in nets[rank].parameters():
            p.grad = torch.ones_like(p)
        opts[rank].step()
    assert (opts[0].current_every, opts[1].current_every) == (10, 4)
    for opt in opts:
        opt.close()


def test_a_state_dict_gives_back_where_the_syncs_stood_and_the_residual_of_int8_pushes(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    net = model()
    with aps.torch.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.5), every=3, address=server.address, rank=0,
                            num_workers=1, transport="tcp", compression="int8") as opt:
        inner_steps(net, opt, 0, range(4))  # one sync, one step past it
        state = opt.state_dict()
        assert (state["since_sync"], state["current_every"]) == (1, 3)
        assert state["residual"] is not None and state["residual"].shape == (15,)
        residual = opt.worker.compression_residual
        assert residual is not None and residual.any()  # (what int8 left out of the pseudo-gradient)
    fresh = model()
    with aps.torch.LocalSGD(fresh, torch.optim.SGD(fresh.parameters(), lr=0.5), every=3, address=server.address,
                            rank=0, num_workers=1, transport="tcp", compression="int8") as restored:
        restored.load_state_dict(state)
        assert (restored.since_sync, restored.current_every) == (1, 3)
        np.testing.assert_array_equal(restored.worker.compression_residual, residual)
        older = {key: value for key, value in state.items() if key not in ("since_sync", "current_every", "residual")}
        restored.load_state_dict({**older, "current_every": 1})  # (fixed H: this object's every holds)
        assert (restored.since_sync, restored.current_every) == (1, 3)
        assert restored.worker.compression_residual is None


def test_dynamic_local_updates_need_a_server_that_keeps_step_rates(server_process, monkeypatch):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    net = model()
    worker = aps.Worker(server.address, 0, 1)
    monkeypatch.setattr(type(worker), "server_options", property(lambda self: {"sync": "asp"}))  # an older server
    with pytest.raises(ConfigurationError, match="dynamic local updates need a server that keeps step rates"):
        aps.torch.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.5), every=3, worker=worker, dynamic=True)
    worker.close()


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_bad_h_is_refused_before_connecting(every):
    net = model()
    with pytest.raises(ConfigurationError, match="every must be a whole number"):
        aps.torch.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.1), every=every, address="tcp://127.0.0.1:1")


#: Rank 1 of a BSP run, killed mid-H: it joins, takes one inner step of H (argv: address, H,
#: a file to write once it has), and waits to be killed before it syncs.
DOOMED = r"""
import pathlib, sys, time
import torch
import aps.torch
address, every, ready = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
net = torch.nn.Linear(4, 3)
opt = aps.torch.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.5), every=every, address=address, rank=1,
                         num_workers=2, transport="tcp")
for p in net.parameters():
    p.grad = torch.full_like(p, 64.0)
opt.step()
ready.write_text(str(opt.steps))
time.sleep(120)
"""


def test_a_worker_killed_mid_h_leaves_nothing_of_its_steps_and_rejoins_from_the_global_weights(
    server_process, tmp_path
):
    """BSP, H = 3, the outer step SGD of learning rate 1 (a round's mean): rank 1 dies after
    one inner step; the round goes on with rank 0 alone, nothing of rank 1's step reaches the
    server; rank 1's new process takes the global weights at join and the next round is the
    mean of both, bit for bit."""
    every = 3
    server = server_process("--workers", "2", "--sync", "bsp", "--lr", "1")
    ready = tmp_path / "ready"
    doomed = subprocess.Popen([sys.executable, "-c", DOOMED, server.address, str(every), str(ready)],
                              stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = model()
        opt0 = aps.torch.LocalSGD(first, torch.optim.SGD(first.parameters(), lr=0.5), every=every,
                                  address=server.address, rank=0, num_workers=2, transport="tcp")
        wait_for(ready.exists, timeout=60, what="rank 1's inner step")
        assert ready.read_text() == "1"  # mid-H: one step of three, nothing pushed
    finally:
        doomed.kill()
        doomed.communicate(timeout=10)
    server.wait_for_log("worker 1 disconnected")
    start = {name: p.detach().numpy().copy() for name, p in first.named_parameters()}
    inner_steps(first, opt0, 0, range(every))  # the round: rank 0 alone
    alone = after_inner_steps(start, 0, range(every))
    for name, p in first.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), alone[name])
    assert fetch_stats(server.address)["server"]["pushes"] == 1  # (rank 1's step: never pushed)

    again = torch.nn.Linear(4, 3)  # its own initial weights: not used, the run is under way
    opt1 = aps.torch.LocalSGD(again, torch.optim.SGD(again.parameters(), lr=0.5), every=every,
                              address=server.address, rank=1, num_workers=2, transport="tcp")
    for name, p in again.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), alone[name])
    assert opt1.steps == 0 and opt1.syncs == 0
    nets, opts = [first, again], [opt0, opt1]
    in_threads([lambda r=r: inner_steps(nets[r], opts[r], r, range(every, 2 * every)) for r in range(2)])
    both = [after_inner_steps(alone, rank, range(every, 2 * every)) for rank in range(2)]
    expected = {name: (both[0][name] + both[1][name]) / 2 for name in alone}
    for net in nets:
        for name, p in net.named_parameters():
            np.testing.assert_array_equal(p.detach().numpy(), expected[name])
    assert fetch_stats(server.address)["server"]["pushes"] == 3
    for opt in opts:
        opt.close()


def test_a_pseudo_gradient_that_is_not_finite_is_refused_and_changes_nothing(server_process):
    """An inner step that diverged (a NaN in the weights) makes a pseudo-gradient the server
    refuses: the sync raises, the global weights and version stay, and the other worker's
    syncs go on."""
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    nets, opts = two_workers(server, 1)
    start = {name: p.detach().numpy().copy() for name, p in nets[0].named_parameters()}
    opts[0].zero_grad()
    for p in nets[0].parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(NonFiniteGradient):
        opts[0].step()
    stats = fetch_stats(server.address)["server"]
    assert stats["version"] == 0 and stats["pushes"] == 0
    inner_steps(nets[1], opts[1], 1, range(1))  # rank 1 syncs on the weights nothing changed
    expected = after_inner_steps(start, 1, range(1))
    for name, p in nets[1].named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), expected[name])
    assert fetch_stats(server.address)["server"]["version"] == 1
    for opt in opts:
        opt.close()


@pytest.mark.slow  # (ten epochs of two workers)
def test_diloco_learns_the_digits_with_a_tenth_of_the_pushes(server_process):
    """DiLoCo as the paper runs it: inner AdamW, H = 10, the server's outer step SGD with learning
    rate 0.7 and Nesterov momentum 0.9 on the BSP mean of two workers' pseudo-gradients, each
    worker on its own half of scikit-learn's digits: held-out accuracy above 90%, with one push
    per worker every 10 steps."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    test_x, test_y, train_x, train_y = x[:360], y[:360], x[360:], y[360:]
    server = server_process("--workers", "2", "--sync", "bsp", "--optimizer", "sgd", "--lr", "0.7",
                            "--momentum", "0.9", "--nesterov")
    nets = []
    for _ in range(2):
        torch.manual_seed(0)
        nets.append(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
    opts: list = [None, None]

    def join(rank):
        inner = torch.optim.AdamW(nets[rank].parameters(), lr=3e-3)
        opts[rank] = aps.torch.LocalSGD(nets[rank], inner, every=10, address=server.address, rank=rank,
                                        num_workers=2)

    in_threads([lambda r=r: join(r) for r in range(2)])

    def train(rank):
        xs, ys = train_x[rank::2], train_y[rank::2]
        for epoch in range(10):
            for start in range(0, len(ys) - 31, 32):  # 22 steps an epoch, the same for both workers
                opts[rank].zero_grad()
                torch.nn.functional.cross_entropy(nets[rank](xs[start:start + 32]), ys[start:start + 32]).backward()
                opts[rank].step()

    in_threads([lambda r=r: train(r) for r in range(2)])
    steps = opts[0].steps
    assert steps == 220 and opts[0].syncs == 22
    assert fetch_stats(server.address)["server"]["pushes"] == 2 * 22
    with torch.no_grad():
        accuracy = (nets[0](test_x).argmax(1) == test_y).float().mean().item()
    print(f"held-out accuracy {accuracy:.3f}")
    assert accuracy > 0.9, accuracy
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):  # both hold the global weights after a sync
        assert torch.equal(a, b)
    for opt in opts:
        opt.close()
