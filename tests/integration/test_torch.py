"""aps.torch.Optimizer against torch.optim, with a real aps serve process."""

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import aps  # noqa: E402
import aps.errors  # noqa: E402
import aps.torch  # noqa: E402
from aps import workloads  # noqa: E402
from aps.testing.workers import digits_batches, torch_bsp_worker  # noqa: E402
from aps.testing import run_processes  # noqa: E402

LR, MOMENTUM, BATCH = 0.05, 0.9, 16


def reference_run(steps: int, workers: int, batch: int) -> list[np.ndarray]:
    """Single-process torch.optim SGD on the concatenation of the workers' batches."""
    model = workloads.make_model(8, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        parts = [digits_batches(rank, workers, step, batch) for rank in range(workers)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("zero_grad", ["optimizer", "model"])
@pytest.mark.parametrize("staging", [False, True], ids=["views", "staging"])
def test_one_bsp_worker_equals_torch_optim_exactly(server_process, transport, staging, zero_grad):
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))
    model = workloads.make_model(8, seed=0)
    steps = 12
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport, staging=staging) as opt:
        assert opt.worker.transport == transport
        for step in range(steps):
            x, y = digits_batches(0, 1, step, BATCH)
            # model.zero_grad() sets .grad to None (torch's default): step() must cope
            (opt if zero_grad == "optimizer" else model).zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert opt.version == steps and opt.clock == steps
        ours = [p.detach().numpy().copy() for p in model.parameters()]
    for mine, theirs in zip(ours, reference_run(steps, 1, BATCH), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_p_bsp_workers_equal_large_batch_torch_sgd(server_process, transport):
    workers, steps = 3, 10
    server = server_process("--workers", str(workers), "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))
    results = run_processes(
        torch_bsp_worker, [(server.address, rank, workers, steps, BATCH, transport) for rank in range(workers)],
        timeout=120,
    )
    reference = reference_run(steps, workers, BATCH)
    for rank, version, params in results:
        assert version == steps
        for mine, theirs in zip(params, reference, strict=True):
            # the mean of P gradients is summed in another order than one large batch's: float rounding only
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=2e-6)


def test_parameters_and_gradients_live_in_the_workers_buffers(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1")
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport) as opt:
        weights, grads = opt.worker.flat_weights, opt.worker.flat_grad
        w_lo, g_lo = weights.ctypes.data, grads.ctypes.data
        for param in model.parameters():
            assert w_lo <= param.data_ptr() < w_lo + weights.nbytes
            assert g_lo <= param.grad.data_ptr() < g_lo + grads.nbytes
        x, y = digits_batches(0, 1, 0, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert np.abs(grads).sum() > 0  # backward wrote straight into the push buffer
        before = weights.copy()
        pushed = grads.copy()
        opt.step()
        np.testing.assert_allclose(weights, before - np.float32(0.1) * pushed, rtol=1e-6, atol=1e-7)
        flat_model = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
        np.testing.assert_array_equal(flat_model, weights)  # the pull landed in the model


def test_batchnorm_buffers_stay_local(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.01")
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    model.add_module("frozen", frozen)
    with aps.torch.Optimizer(model, server.address, 0, 1) as opt:
        assert opt.names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
        assert opt.worker.layout.numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
        x = torch.randn(16, 4)
        opt.zero_grad()
        model[:4](x).sum().backward()
        opt.step()
        assert model[1].num_batches_tracked.item() == 1  # updated locally by the forward pass
        assert model[1].running_mean.abs().sum() > 0


def test_bad_models_get_clear_errors_before_connecting():
    with pytest.raises(aps.ConfigurationError, match=r"float32.*0\.weight \(torch\.float64\)"):
        aps.torch.Optimizer(nn.Sequential(nn.Linear(2, 2).double()), "tcp://127.0.0.1:1", 0, 1)
    with pytest.raises(aps.ConfigurationError, match="no trainable parameters"):
        aps.torch.Optimizer(nn.Linear(2, 2).requires_grad_(False), "tcp://127.0.0.1:1", 0, 1)
    with pytest.raises(aps.ConfigurationError, match="staging=False needs a model on the CPU, not on meta"):
        aps.torch.Optimizer(nn.Linear(2, 2, device="meta"), "tcp://127.0.0.1:1", 0, 1, staging=False)


def test_a_failed_init_closes_the_worker_it_opened(server_process, transport):
    server = server_process("--workers", "2", "--sync", "asp")
    with pytest.raises(aps.errors.InitTimeout):  # rank 1 never joins
        aps.torch.Optimizer(nn.Linear(2, 2), server.address, 0, 2, transport=transport, init_timeout=0.3)
    # the optimizer closed the connection it opened: rank 0 is free again (once the server has seen it go)
    deadline = time.monotonic() + 10
    while True:
        try:
            aps.Worker(server.address, 0, 2, transport=transport).close()
            break
        except aps.errors.RankTaken:
            assert time.monotonic() < deadline, "rank 0 is still taken: the failed optimizer kept its connection"
            time.sleep(0.05)


def test_address_rank_and_world_size_come_from_the_environment(server_process, monkeypatch):
    server = server_process("--workers", "2", "--sync", "asp")
    monkeypatch.setenv("APS_ADDRESS", server.address)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    worker = aps.Worker.from_env(transport="tcp")
    try:
        assert (worker.rank, worker.num_workers, worker.address) == (1, 2, server.address)
    finally:
        worker.close()
    monkeypatch.delenv("RANK")
    worker = aps.Worker(transport="tcp")  # without $RANK: the server assigns one at init
    try:
        assert (worker.rank, worker.num_workers) == (None, 2)
    finally:
        worker.close()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(aps.ConfigurationError, match=r"\$RANK='one' is not valid"):
        aps.Worker()


def test_pacer_pads_iterations_to_the_emulated_time():
    pacer = aps.torch.Pacer(0.03, slowdown=2.0)
    pacer.restart()
    start = time.monotonic()
    pacer.wait()
    assert time.monotonic() - start >= 0.06 - 1e-3  # sleep never returns early
    with pytest.raises(aps.ConfigurationError):
        aps.torch.Pacer(0.01, slowdown=0)


def test_pacer_from_the_environment(monkeypatch):
    monkeypatch.delenv("APS_STEP_TIME", raising=False)
    assert aps.torch.Pacer.from_env(0) is None
    monkeypatch.setenv("APS_STEP_TIME", "0.02")
    monkeypatch.setenv("APS_SLOWDOWN", "2.5")
    monkeypatch.setenv("APS_JITTER", "0.1")
    pacer = aps.torch.Pacer.from_env(3)
    assert pacer.target == pytest.approx(0.05) and pacer.jitter == 0.1


def test_a_sharded_model_trains_as_the_unsharded_one(server_process, transport):
    """aps.torch with every shard's address: the parameters and gradients are views into the
    sharded worker's one flat buffer, and one BSP worker equals torch.optim exactly."""
    options = ("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM), "--shards", "3")
    servers = [server_process(*options, "--shard", str(index)) for index in range(3)]
    model = workloads.make_model(8, seed=0)
    steps = 6
    with aps.torch.Optimizer(model, [s.address for s in servers], 0, 1, transport=transport) as opt:
        weights = opt.worker.flat_weights
        assert len(opt.worker.shards) == 3 and opt.worker.transport == transport
        for param in model.parameters():
            assert weights.ctypes.data <= param.data_ptr() < weights.ctypes.data + weights.nbytes
        for step in range(steps):
            x, y = digits_batches(0, 1, step, BATCH)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert opt.version == steps
        ours = [p.detach().numpy().copy() for p in model.parameters()]
    for mine, theirs in zip(ours, reference_run(steps, 1, BATCH), strict=True):
        np.testing.assert_array_equal(mine, theirs)
