"""Per-group optimizer values (HYPER): the wire codec, the checks, the cut by shard, and
the optimizers' per-range steps against torch.optim with the same param groups."""

import math

import numpy as np
import pytest

from aps.errors import ConfigurationError, InvalidHyperparameters, MalformedFrame
from aps.server.engine.optim import SGD, Adam, AdamW
from aps.wire.protocol import MAX_HYPER_GROUPS, HyperGroup, ServerInfo, decode_hyper, encode_hyper
from aps.client.shards import shard_groups
from aps.client.payloads import resolve_hyperparameters, server_hyperparameters

N = 1031  # odd, so vector loops end with a remainder
CUT = 517  # where the second group begins
STEPS = 12


@pytest.fixture
def problem():
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(STEPS)]
    return w0, grads


def run_groups(optimizer, w0, grads, groups_by_step, pieces=None):
    """Step ``optimizer`` with each step's groups (checked); ``pieces`` cuts every step into
    slices as a streamed push is applied."""
    w = w0.copy()
    for g, groups in zip(grads, groups_by_step):
        checked = optimizer.check_groups(groups)
        optimizer.allocate_for(checked)  # as the engine does when a worker sets them
        out = np.empty_like(w)
        if pieces is None:
            assert optimizer.step(out, w, g, groups=checked)
        else:
            bounds = [0, *pieces, N]
            for start, stop in zip(bounds, bounds[1:]):
                assert optimizer.step_slice(out, w, g, 1.0, start, stop, groups=checked)
        optimizer.commit()
        w = out
    return w


def run_torch(torch, cls, w0, grads, options_by_step, **common):
    """torch.optim ``cls`` over two parameters (the two groups), each step's group options set
    before it, as a scheduler does."""
    first = torch.nn.Parameter(torch.from_numpy(w0[:CUT].copy()))
    second = torch.nn.Parameter(torch.from_numpy(w0[CUT:].copy()))
    opt = cls([{"params": [first], **options_by_step[0][0]}, {"params": [second], **options_by_step[0][1]}],
              **common)
    for g, options in zip(grads, options_by_step):
        for group, values in zip(opt.param_groups, options):
            group.update(values)
        opt.zero_grad()
        first.grad = torch.from_numpy(g[:CUT].copy())
        second.grad = torch.from_numpy(g[CUT:].copy())
        opt.step()
    return np.concatenate([first.detach().numpy(), second.detach().numpy()])


def sgd_groups(first: dict, second: dict) -> list[HyperGroup]:
    return [HyperGroup(CUT, first["lr"], first["weight_decay"], first["momentum"], 0.0),
            HyperGroup(N, second["lr"], second["weight_decay"], second["momentum"], 0.0)]


@pytest.mark.parametrize("pieces", [None, [100, CUT - 3, CUT + 200]], ids=["whole", "streamed"])
def test_sgd_groups_equal_torch_param_groups_bit_for_bit(problem, kernels, pieces):
    torch = pytest.importorskip("torch")
    w0, grads = problem
    first = {"lr": 0.05, "weight_decay": 1e-2, "momentum": 0.9}
    second = {"lr": 0.2, "weight_decay": 0.0, "momentum": 0.5}
    ours = run_groups(SGD(N, 1.0, momentum=0.9, kernels=kernels), w0, grads, [sgd_groups(first, second)] * STEPS,
                      pieces)
    theirs = run_torch(torch, torch.optim.SGD, w0, grads, [(first, second)] * STEPS, lr=1.0)
    np.testing.assert_array_equal(ours, theirs)


def test_a_schedule_and_a_group_without_momentum_equal_torch(problem, kernels):
    """The learning rate changes every step (a scheduler), and the second group's momentum is
    0 for a while: torch leaves that group's buffer as it was, and so does aps."""
    torch = pytest.importorskip("torch")
    w0, grads = problem
    options = []
    for step in range(STEPS):
        first = {"lr": 0.1 * 0.8 ** step, "weight_decay": 5e-4, "momentum": 0.9}
        second = {"lr": 0.05 * (step + 1), "weight_decay": 0.0, "momentum": 0.0 if 3 <= step < 7 else 0.9}
        options.append((first, second))
    ours = run_groups(SGD(N, 1.0, momentum=0.9, kernels=kernels), w0, grads, [sgd_groups(*o) for o in options])
    theirs = run_torch(torch, torch.optim.SGD, w0, grads, options, lr=1.0)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dampening", [0.0, 0.25])
def test_momentum_asked_of_a_server_started_without_is_torchs_momentum(problem, kernels, dampening):
    """``aps serve`` without --momentum, a worker's torch-like ``SGD(..., momentum=0.9)``
    from step 4 on: the buffers are made at its request and start from that step's gradient,
    as torch.optim.SGD's do at their first step with momentum."""
    torch = pytest.importorskip("torch")
    w0, grads = problem
    options = []
    for step in range(STEPS):
        momentum = 0.0 if step < 4 else 0.9
        options.append(({"lr": 0.05, "weight_decay": 1e-3, "momentum": momentum, "dampening": dampening},
                         {"lr": 0.1, "weight_decay": 0.0, "momentum": momentum, "dampening": dampening}))
    sgd = SGD(N, 1.0, kernels=kernels)
    groups = [[HyperGroup(CUT, a["lr"], a["weight_decay"], a["momentum"], dampening),
               HyperGroup(N, b["lr"], b["weight_decay"], b["momentum"], dampening)] for a, b in options]
    ours = run_groups(sgd, w0, grads[:4], groups[:4])
    assert sgd.momentum_buffer is None and sgd.state_arrays() == {}  # nothing made before it is asked for
    ours = run_groups(sgd, ours, grads[4:], groups[4:])
    assert sgd.momentum_buffer is not None and list(sgd.state_arrays()) == ["momentum_buffer"]
    theirs = run_torch(torch, torch.optim.SGD, w0, grads, options, lr=1.0)
    np.testing.assert_array_equal(ours, theirs)


def test_momentum_buffers_are_made_only_when_a_group_asks_and_a_failed_allocation_changes_nothing(monkeypatch):
    sgd = SGD(N, 0.1)
    sgd.allocate_for(sgd.check_groups([HyperGroup(N, 0.1, 0, 0.0, 0.5)]))
    assert sgd.momentum_buffer is None
    import aps.server.engine.optim

    real_zeros = np.zeros
    calls = []

    def zeros(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise MemoryError("no room for the second buffer")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(aps.server.engine.optim.np, "zeros", zeros)
    with pytest.raises(MemoryError):
        sgd.allocate_for(sgd.check_groups([HyperGroup(N, 0.1, 0, 0.9, 0)]))
    assert sgd.momentum_buffer is None and sgd.state_arrays() == {}
    monkeypatch.setattr(aps.server.engine.optim.np, "zeros", real_zeros)
    sgd.allocate_for(sgd.check_groups([HyperGroup(N, 0.1, 0, 0.9, 0)]))
    assert sgd.momentum_buffer.shape == (N,) and not sgd.momentum_buffer.any()


def test_a_saved_momentum_state_loads_into_sgd_started_without():
    sgd = SGD(N, 0.1)
    saved = np.linspace(-1, 1, N, dtype=np.float32)
    assert sgd.state_problem({"momentum_buffer": [saved]}, 5) is None
    assert "has 1030 elements" in sgd.state_problem({"momentum_buffer": [saved[1:]]}, 5)
    sgd.load_state({"momentum_buffer": saved}, 5)
    np.testing.assert_array_equal(sgd.momentum_buffer, saved)
    assert sgd.steps == 5


@pytest.mark.parametrize("cls, name", [(Adam, "Adam"), (AdamW, "AdamW")])
def test_adam_groups_equal_torch_param_groups(problem, kernels, cls, name):
    torch = pytest.importorskip("torch")
    w0, grads = problem
    first = {"lr": 1e-3, "weight_decay": 1e-2, "betas": (0.9, 0.999)}
    second = {"lr": 5e-3, "weight_decay": 0.0, "betas": (0.5, 0.9)}
    groups = [HyperGroup(CUT, first["lr"], first["weight_decay"], *first["betas"]),
              HyperGroup(N, second["lr"], second["weight_decay"], *second["betas"])]
    ours = run_groups(cls(N, 1.0, kernels=kernels), w0, grads, [groups] * STEPS)
    theirs = run_torch(torch, getattr(torch.optim, name), w0, grads, [(first, second)] * STEPS, lr=1.0)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_one_group_of_the_servers_values_is_the_default_step(problem, kernels):
    w0, grads = problem
    plain = SGD(N, 0.1, momentum=0.9, weight_decay=1e-3, kernels=kernels)
    grouped = SGD(N, 0.1, momentum=0.9, weight_decay=1e-3, kernels=kernels)
    explicit = run_groups(grouped, w0, grads, [[grouped.defaults]] * STEPS)
    w = w0.copy()
    for g in grads:
        out = np.empty_like(w)
        assert plain.step(out, w, g)
        plain.commit()
        w = out
    np.testing.assert_array_equal(explicit, w)


@pytest.mark.parametrize("groups, message", [
    ([HyperGroup(N, math.nan, 0, 0.9, 0)], "group 0: lr is nan"),
    ([HyperGroup(CUT, 0.1, 0, 0.9, 0), HyperGroup(N, 0.1, -1e-4, 0.9, 0)], "group 1: weight_decay is -0.0001"),
    ([HyperGroup(CUT, 0.1, 0, math.inf, 0), HyperGroup(N, 0.1, 0, 0.9, 0)], "group 0: momentum is inf"),
    ([HyperGroup(CUT, 0.1, 0, 0.9, 0), HyperGroup(CUT, 0.1, 0, 0.9, 0)], "group 1: stop 517 is not after"),
    ([HyperGroup(0, 0.1, 0, 0.9, 0), HyperGroup(N, 0.1, 0, 0.9, 0)], "group 0: stop 0 is not after"),
    ([HyperGroup(CUT, 0.1, 0, 0.9, 0)], "the last group stops at 517, but the model has 1031"),
    ([HyperGroup(N + 1, 0.1, 0, 0.9, 0)], "beyond the model's 1031"),
    ([], "0 groups"),
])
def test_check_groups_names_the_group_and_the_value(groups, message):
    with pytest.raises(InvalidHyperparameters, match=message.replace("(", r"\(")):
        SGD(N, 0.1, momentum=0.9).check_groups(groups)


def test_checks_that_depend_on_the_optimizer():
    with pytest.raises(InvalidHyperparameters, match="group 0: beta2 is 1.0; it must be in"):
        Adam(N, 1e-3).check_groups([HyperGroup(N, 1e-3, 0, 0.9, 1.0)])
    with pytest.raises(InvalidHyperparameters, match="group 0: beta1 is -0.1"):
        AdamW(N, 1e-3).check_groups([HyperGroup(N, 1e-3, 0, -0.1, 0.9)])
    assert SGD(N, 0.1).momentum_buffer is None  # momentum asked of a server without: see the test below
    SGD(N, 0.1).check_groups([HyperGroup(N, 0.1, 0, 0.9, 0)])
    with pytest.raises(InvalidHyperparameters, match="Nesterov"):
        SGD(N, 0.1, momentum=0.9, nesterov=True).check_groups([HyperGroup(N, 0.1, 0, 0.9, 0.1)])
    assert len(SGD(N, 0.1).check_groups([HyperGroup(N, 0.1, 0, 0, 0.5)])) == 1  # dampening alone is harmless


def test_the_wire_codec():
    groups = [HyperGroup(3, 0.1, 0.0, 0.9, 0.0), HyperGroup(10, 1e-3, 5e-4, 0.5, 0.25)]
    payload = encode_hyper(groups)
    assert len(payload) == 4 + 40 * 2
    assert decode_hyper(payload) == groups
    with pytest.raises(MalformedFrame, match="2 groups take 84"):
        decode_hyper(payload[:-1])
    with pytest.raises(InvalidHyperparameters, match=f"{MAX_HYPER_GROUPS + 1} groups"):
        decode_hyper((MAX_HYPER_GROUPS + 1).to_bytes(4, "little"))


def test_groups_are_cut_by_shard():
    groups = [HyperGroup(5, 1.0, 0, 0, 0), HyperGroup(12, 2.0, 0, 0, 0), HyperGroup(20, 3.0, 0, 0, 0)]
    assert [(g.stop, g.lr) for g in shard_groups(groups, 0, 8)] == [(5, 1.0), (8, 2.0)]
    assert [(g.stop, g.lr) for g in shard_groups(groups, 8, 12)] == [(4, 2.0)]
    assert [(g.stop, g.lr) for g in shard_groups(groups, 12, 20)] == [(8, 3.0)]


def test_missing_values_are_the_servers():
    info = ServerInfo("h", "", "run", '{"shard":0,"optimizer":"adam","lr":0.001,"weight_decay":0.0,'
                                      '"momentum":0.0,"betas":[0.8,0.99]}')
    defaults = server_hyperparameters(info)
    assert defaults == {"lr": 0.001, "weight_decay": 0.0, "momentum": 0.8, "dampening": 0.99}
    records = resolve_hyperparameters([{"stop": 4, "lr": 0.5}, {"weight_decay": 0.1}], 10, defaults)
    assert records == [HyperGroup(4, 0.5, 0.0, 0.8, 0.99), HyperGroup(10, 0.001, 0.1, 0.8, 0.99)]
    with pytest.raises(ConfigurationError, match="'lr' is needed"):
        resolve_hyperparameters([{"stop": 10}], 10, None)
    with pytest.raises(ConfigurationError, match="'stop' is needed"):
        resolve_hyperparameters([{"lr": 0.1}, {"lr": 0.2}], 10, defaults)
    with pytest.raises(ConfigurationError, match="unknown keys"):
        resolve_hyperparameters([{"learning_rate": 0.1}], 10, defaults)


def test_neighbours_with_equal_values_are_one_range_and_huge_values_are_refused_early():
    from aps.server.engine.optim import HyperGroups

    merged = HyperGroups([HyperGroup(10, 0.1, 0, 0.9, 0), HyperGroup(20, 0.1, 0, 0.9, 0),
                          HyperGroup(N, 0.2, 0, 0.9, 0)])
    assert [g.stop for g in merged.groups] == [20, N]  # one kernel call for the first two
    assert [(lo, hi) for lo, hi, _ in merged.ranges(5, 25)] == [(5, 20), (20, 25)]
    with pytest.raises(InvalidHyperparameters, match="group 0: weight_decay is 1e\\+39; it must be finite in float32"):
        SGD(N, 0.1).check_groups([HyperGroup(N, 0.1, 1e39, 0, 0)])
    with pytest.raises(ConfigurationError, match="group 0: lr .* is too large for a float"):
        resolve_hyperparameters([{"lr": 10**400}], N, {"lr": 0.1, "weight_decay": 0, "momentum": 0, "dampening": 0})
