"""Resuming the way training scripts do (issue 23, point 9): pytorch/examples'
``imagenet/main.py`` builds the model and the optimizer, then loads the checkpoint into
both (``model.load_state_dict``, ``optimizer.load_state_dict``), then trains. With aps the
server holds the freshly initialised weights by then: the loaded weights must become the
server's, or be refused clearly, never silently replaced. Real ``aps serve`` processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

import aps  # noqa: E402
import aps.torch  # noqa: E402
from aps import workloads  # noqa: E402
from aps.errors import ErrorCode  # noqa: E402
from aps.wire.protocol import DType, Flag, Op, decode_error, weights_digest  # noqa: E402
from aps.testing.workers import digits_batches  # noqa: E402
from aps.testing import RawClient  # noqa: E402

LR, MOMENTUM, BATCH = 0.05, 0.9, 16
SGD = ("--optimizer", "sgd", "--lr", str(LR), "--momentum", str(MOMENTUM))


def torch_checkpoint(path, steps: int = 4) -> dict:
    """What imagenet/main.py saves: a model trained for a while with torch.optim.SGD, and its optimizer."""
    torch.manual_seed(0)
    model = workloads.make_model(8, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = digits_batches(0, 1, step, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    checkpoint = {"epoch": 1, "state_dict": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(checkpoint, path)
    return checkpoint


def train(model, opt, steps: int, rank: int = 0, workers: int = 1, start: int = 10) -> None:
    for step in range(start, start + steps):
        x, y = digits_batches(rank, workers, step, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def torch_resumed(path, steps: int, workers: int = 1) -> list[np.ndarray]:
    """The reference: the same resume with torch.optim.SGD (the workers' batches as one)."""
    model = workloads.make_model(8, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["state_dict"])
    opt.load_state_dict(checkpoint["optimizer"])
    for step in range(10, 10 + steps):
        batches = [digits_batches(rank, workers, step, BATCH) for rank in range(workers)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def assert_weights(model, expected, atol=2e-5) -> None:
    for param, want in zip(model.parameters(), expected):
        np.testing.assert_allclose(param.detach().numpy(), want, rtol=0, atol=atol)


def test_the_imagenet_scripts_resume_order_trains_as_torch_does(server_process, tmp_path, transport):
    path = tmp_path / "checkpoint.pth.tar"
    saved = torch_checkpoint(path)
    server = server_process("--workers", "1", "--sync", "bsp", *SGD)
    model = workloads.make_model(8, seed=1)  # freshly initialised: other weights than the checkpoint's
    opt = aps.torch.Optimizer(model.parameters(), server.address, 0, 1, transport=transport)  # as main.py: no model=
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["state_dict"])
    opt.load_state_dict(checkpoint["optimizer"])
    assert_weights(model, [t.numpy() for t in saved["state_dict"].values()], atol=0)
    train(model, opt, 6)
    assert_weights(model, torch_resumed(path, 6))
    opt.close()
    server.wait_for_log("weights loaded")


@pytest.mark.parametrize("how", ["parameters", "module"])
def test_weights_loaded_before_the_first_step_are_kept(server_process, transport, how):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0")
    model = torch.nn.Linear(4, 2)
    params = model if how == "module" else model.parameters()
    with aps.torch.Optimizer(params, server.address, 0, 1, transport=transport) as opt:
        model.load_state_dict({"weight": torch.full((2, 4), 7.0), "bias": torch.full((2,), 7.0)})
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()  # lr=0: the weights stay what was loaded
        assert torch.equal(model.weight, torch.full((2, 4), 7.0)) and torch.equal(model.bias, torch.full((2,), 7.0))
        assert np.array_equal(opt.worker.pull()[opt.names[0]], np.full((2, 4), 7.0, np.float32))  # the server's


def test_a_load_after_an_update_is_refused_and_changes_nothing(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1")
    model = torch.nn.Linear(4, 2)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport) as opt:
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        before = {name: value.copy() for name, value in opt.worker.pull().items()}
        model.load_state_dict({"weight": torch.full((2, 4), 7.0), "bias": torch.full((2,), 7.0)})
        with pytest.raises(aps.WeightsRefused, match="applied 1 updates.*before the first update.*before its first"):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        after = opt.worker.pull()
        assert all(np.array_equal(after[name], before[name]) for name in before)
        assert torch.equal(model.bias.detach(), torch.from_numpy(before["bias"]))  # the model has the server's again


def test_ranks_loading_different_weights_are_refused(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "0")
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    opts: list = [None, None]

    def make(rank: int) -> None:
        opts[rank] = aps.torch.Optimizer(models[rank], server.address, rank, 2, transport="tcp")

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    models[0].load_state_dict({"weight": torch.full((2, 4), 7.0), "bias": torch.full((2,), 7.0)})
    opts[0].load_state_dict(opts[0].state_dict())  # sends the model's weights: no gradient taken yet
    models[1].load_state_dict({"weight": torch.full((2, 4), 8.0), "bias": torch.full((2,), 8.0)})
    models[1](torch.ones(3, 4)).sum().backward()
    with pytest.raises(aps.WeightsRefused, match="other weights were loaded.*every rank must load the same"):
        opts[1].step()
    assert np.array_equal(opts[1].worker.pull()["weight"], np.full((2, 4), 7.0, np.float32))
    for opt in opts:
        opt.close()


#: A rank of imagenet/main.py, reduced to its resume: the model and the optimizer first, then
#: the checkpoint into both, then training; saves its final weights.
RANK_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from torch.nn import functional as F
    import aps.torch
    from aps import workloads
    from aps.testing.workers import digits_batches

    address, rank, workers, transport, path, steps, out = sys.argv[1:8]
    rank, workers, steps = int(rank), int(workers), int(steps)
    torch.set_num_threads(1)
    model = workloads.make_model(8, seed=100 + rank)  # every rank initialises its own
    optimizer = aps.torch.Optimizer(model.parameters(), address, rank, workers, transport=transport)
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(10, 10 + steps):
        x, y = digits_batches(rank, workers, step, 16)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    np.savez(out, *[p.detach().numpy() for p in model.parameters()])
""")


@pytest.mark.slow
def test_two_ranks_loading_the_same_checkpoint_train_as_torch_does(server_process, tmp_path, transport):
    path = tmp_path / "checkpoint.pth.tar"
    torch_checkpoint(path)
    server = server_process("--workers", "2", "--sync", "bsp", *SGD)
    steps = 5
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, server.address, str(rank), "2", transport,
                               str(path), str(steps), str(tmp_path / f"rank{rank}.npz")],
                              stderr=subprocess.PIPE, text=True, env=os.environ.copy()) for rank in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    expected = torch_resumed(path, steps, workers=2)
    for rank in range(2):
        with np.load(tmp_path / f"rank{rank}.npz") as final:
            for index, want in enumerate(expected):
                np.testing.assert_allclose(final[f"arr_{index}"], want, rtol=0, atol=2e-5)
    assert server.log().count("weights loaded") == 1  # taken once; the other rank's was a no-op


def test_sharded_weights_are_loaded_on_every_shard_or_none(server_process):
    servers = [server_process("--shard", str(i), "--shards", "2", "--workers", "2", "--sync", "asp", "--lr", "0")
               for i in range(2)]
    address = ",".join(s.address for s in servers)
    initial = {"w": np.zeros(64, np.float32)}
    workers = [aps.Worker(address, rank, 2, transport="tcp") for rank in range(2)]
    threads = [threading.Thread(target=w.init, args=(initial,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    first, second = workers
    bound = first.shards[0].layout.numel
    # one shard holds other weights already (the way a partial load would leave it)
    second.shards[1].load_weights(np.full(64 - bound, 8.0, np.float32))
    with pytest.raises(aps.WeightsRefused, match="other weights were loaded"):
        first.load_weights({"w": np.full(64, 7.0, np.float32)})
    assert np.array_equal(first.pull()["w"][:bound], np.zeros(bound, np.float32))  # shard 0 was not changed
    assert first.shards[0].load_weights(np.full(bound, 8.0, np.float32))  # it had loaded nothing
    assert first.load_weights({"w": np.full(64, 8.0, np.float32)}) is False  # the same on both: a no-op
    assert second.load_weights(np.full(64, 8.0, np.float32)) is False
    first.push_pull(first.grads)
    assert np.array_equal(first.weights["w"], np.full(64, 8.0, np.float32))
    for worker in workers:
        worker.close()


def test_a_torch_model_on_shards_keeps_the_weights_it_loaded(server_process, transport):
    servers = [server_process("--shard", str(i), "--shards", "2", "--workers", "1", "--sync", "asp", "--lr", "0")
               for i in range(2)]
    model = torch.nn.Linear(64, 8)
    with aps.torch.Optimizer(model, ",".join(s.address for s in servers), 0, 1, transport=transport) as opt:
        model.load_state_dict({"weight": torch.full((8, 64), 7.0), "bias": torch.full((8,), 7.0)})
        train_once = model(torch.ones(3, 64)).sum()
        train_once.backward()
        opt.step()
        assert torch.equal(model.weight, torch.full((8, 64), 7.0)) and torch.equal(model.bias, torch.full((8,), 7.0))


def test_bad_load_weights_frames_are_refused_and_change_nothing(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0")
    raw = RawClient(server.port)
    good = np.full(8, 7.0, np.float32)

    def load(values: np.ndarray, digest: bytes | None = None, **fields) -> tuple[int, str] | int:
        payload = (weights_digest((values,)) if digest is None else digest) + values.tobytes()
        fields.setdefault("dtype", DType.FLOAT32)
        raw.frame(Op.LOAD_WEIGHTS, payload, request_id=7, **fields)
        header, body = raw.reply()
        if header.op == Op.ERROR:
            return decode_error(body)
        assert header.op == Op.LOAD_WEIGHTS_REPLY and header.request_id == 7
        return header.flags

    assert load(good)[0] == ErrorCode.NOT_INITIALIZED  # before INIT
    raw.init(0, 1, {"w": np.zeros(8, np.float32)})
    assert raw.reply()[0].op == Op.INIT_REPLY
    assert load(good[:4])[0] == ErrorCode.PAYLOAD_SIZE_MISMATCH
    assert load(good, dtype=DType.FLOAT16)[0] == ErrorCode.DTYPE_MISMATCH
    code, message = load(good, digest=bytes(16))
    assert code == ErrorCode.WEIGHTS_REFUSED and "digest" in message
    nan = good.copy()
    nan[3] = np.nan
    code, message = load(nan)
    assert code == ErrorCode.WEIGHTS_REFUSED and "weight 3 is nan" in message
    raw.frame(Op.LOAD_WEIGHTS, weights_digest((good,)), request_id=7, dtype=DType.FLOAT32, flags=Flag.CHECK)
    assert raw.reply()[0].flags == 0  # it would take them; nothing loaded
    assert load(good) == 0  # loaded
    assert load(good) == Flag.DROPPED  # the same again: a no-op
    code, message = load(good + 1)
    assert code == ErrorCode.WEIGHTS_REFUSED and "other weights" in message
    raw.close()
    assert server.alive()
