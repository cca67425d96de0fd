"""aps.torch.Optimizer as a torch.optim.Optimizer: param groups, learning rate schedulers,
per-group values, against the same loop with torch.optim, with a real aps serve process."""

import copy
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.optim import lr_scheduler  # noqa: E402

import aps  # noqa: E402
import aps.errors  # noqa: E402
import aps.torch  # noqa: E402
from aps import workloads  # noqa: E402
from aps.testing.workers import digits_batches  # noqa: E402

LR, MOMENTUM, BATCH, STEPS = 0.05, 0.9, 16, 12


def grouped(model: nn.Module) -> list[dict]:
    """What people write: no weight decay on biases, the classifier at a tenth of the rate."""
    head = set(map(id, model[-1].parameters()))
    decay = [p for p in model.parameters() if p.ndim > 1 and id(p) not in head]
    no_decay = [p for p in model.parameters() if p.ndim <= 1 and id(p) not in head]
    return [
        {"params": decay, "weight_decay": 5e-3},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": list(model[-1].parameters()), "lr": LR / 10},
    ]


SCHEDULERS = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=4, gamma=0.3),
    "MultiStepLR": lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[3, 7], gamma=0.5),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=[0.2, 0.2, 0.02], total_steps=STEPS),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, [lambda s: 0.9**s, lambda s: 1.0 / (1 + s), lambda s: 1.0]),
    "warm-up then cosine": lambda opt: lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4),
              lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 4)], milestones=[4]),
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5),
    "ChainedScheduler": lambda opt: lr_scheduler.ChainedScheduler(
        [lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=3), lr_scheduler.ExponentialLR(opt, gamma=0.9)]),
    "CyclicLR": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3,
                                                  base_momentum=0.8, max_momentum=0.9),
}


def train(model: nn.Module, opt, scheduler, steps: int = STEPS) -> list[list[tuple]]:
    """The usual loop; returns each step's (lr, momentum) per group, as the step used them."""
    history = []
    for step in range(steps):
        x, y = digits_batches(0, 1, step, BATCH)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        history.append([(g["lr"], g.get("momentum")) for g in opt.param_groups])
        opt.step()
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(loss.item())
        elif scheduler is not None:
            scheduler.step()
    return history


def params_of(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_schedulers_with_param_groups_equal_torch_optim_exactly(server_process, name):
    """One BSP worker with three param groups and a scheduler takes the same steps as
    torch.optim.SGD with the same groups and scheduler, bit for bit."""
    make = SCHEDULERS[name]
    reference = workloads.make_model(8, seed=0)
    ref_opt = torch.optim.SGD(grouped(reference), lr=LR, momentum=MOMENTUM)
    ref_history = train(reference, ref_opt, make(ref_opt))
    assert len({tuple(h) for h in ref_history}) > 1, "the scheduler never changed a value: the test shows nothing"

    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(grouped(model), server.address, 0, 1, model=model, transport="tcp") as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        history = train(model, opt, make(opt))
        assert opt.version == STEPS
    assert history == ref_history
    for mine, theirs in zip(params_of(model), params_of(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_groups_and_a_scheduler_equal_torch_optim(server_process, transport, optimizer):
    """Adam and AdamW with param groups (betas per group too) and OneCycleLR cycling beta1."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer]

    def groups(model):
        parts = grouped(model)
        parts[2]["betas"] = (0.8, 0.99)
        return parts

    def make(opt):
        return lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 1e-2, 1e-3], total_steps=STEPS)

    reference = workloads.make_model(8, seed=0)
    ref_opt = cls(groups(reference), lr=1e-3, weight_decay=0.01)
    ref_history = train(reference, ref_opt, make(ref_opt))
    server = server_process("--workers", "1", "--sync", "bsp", "--optimizer", optimizer, "--lr", "1e-3",
                            "--weight-decay", "0.01")
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(groups(model), server.address, 0, 1, model=model, transport=transport) as opt:
        assert opt.defaults["betas"] == (0.9, 0.999) and opt.param_groups[2]["betas"] == (0.8, 0.99)
        history = train(model, opt, make(opt))
    assert history == ref_history
    for mine, theirs in zip(params_of(model), params_of(reference), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=2e-5, atol=2e-6)


def test_a_scheduler_changes_the_servers_updates(server_process, transport):
    """StepLR to zero: the server's weights move while the rate is 0.1 and stop when it is 0."""
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1")
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport) as opt:
        scheduler = lr_scheduler.StepLR(opt, step_size=3, gamma=0.0)
        moved = []
        for step in range(6):
            before = opt.worker.flat_weights.copy()
            x, y = digits_batches(0, 1, step, BATCH)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            scheduler.step()
            moved.append(bool(np.any(opt.worker.flat_weights != before)))
        assert opt.version == 6  # every gradient was applied, the last three with a rate of 0
    assert moved == [True, True, True, False, False, False]


def test_asp_workers_with_their_own_schedules(server_process, transport):
    """Two ASP workers, each with its own rate and schedule, take turns: every update is the
    server's weights minus that worker's current rate times its gradient."""
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "0.01")
    models = [workloads.make_model(8, seed=0), workloads.make_model(8, seed=0)]
    opts: list = [None, None]

    def make(rank):
        opts[rank] = aps.torch.Optimizer(models[rank], server.address, rank, 2, transport=transport,
                                         lr=[0.1, 0.02][rank])

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    schedulers = [lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5),
                  lr_scheduler.LambdaLR(opts[1], lambda s: min(1.0, (s + 1) / 3))]
    try:
        server_weights = opts[0].worker.pull()  # both hold the first weights
        current = np.concatenate([w.reshape(-1) for w in server_weights.values()])
        rates = {0: [], 1: []}
        for step in range(8):
            rank = step % 2
            opt, model = opts[rank], models[rank]
            opt.worker.pull()  # the newest weights, into the model
            np.testing.assert_array_equal(opt.worker.flat_weights, current)
            x, y = digits_batches(rank, 2, step, BATCH)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grad = opt.worker.flat_grad.copy()
            rate = opt.param_groups[0]["lr"]
            rates[rank].append(rate)
            opt.step()
            schedulers[rank].step()
            np.testing.assert_allclose(opt.worker.flat_weights, current - np.float32(rate) * grad,
                                       rtol=1e-6, atol=1e-8)
            current = opt.worker.flat_weights.copy()
        assert rates == {0: [0.1, 0.1, 0.05, 0.05], 1: pytest.approx([0.02 / 3, 0.02 * 2 / 3, 0.02, 0.02])}
    finally:
        for opt in opts:
            opt.close()


def test_values_are_sent_only_when_they_change(server_process, monkeypatch):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", str(LR), "--momentum", str(MOMENTUM))
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport="tcp") as opt:
        sent = []
        real = opt.worker.set_hyperparameters
        monkeypatch.setattr(opt.worker, "set_hyperparameters", lambda groups: (sent.append(groups), real(groups)))
        scheduler = lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
        train(model, opt, scheduler, steps=6)
        assert [group["lr"] for (group,) in sent] == [LR / 2, LR / 4]  # the server's lr needs no request
        assert all(group["stop"] == opt.worker.layout.numel for (group,) in sent)


def test_defaults_are_the_servers_and_the_constructor_overrides_them(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.3", "--momentum", "0.5", "--nesterov",
                            "--weight-decay", "1e-4")
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport="tcp", lr=0.2) as opt:
        assert opt.defaults == {"lr": 0.2, "momentum": 0.5, "dampening": 0.0, "weight_decay": 1e-4,
                                "nesterov": True, "maximize": False}
        assert [g["lr"] for g in opt.param_groups] == [0.2]
        assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
        assert opt.worker.layout.names == tuple(n for n, _ in model.named_parameters())
        with pytest.raises(aps.ConfigurationError, match="betas is not an option of the server's optimizer"):
            aps.torch.Optimizer(model, worker=opt.worker, betas=(0.9, 0.99))


def test_frozen_parameters_and_several_groups_equal_torch_optim(server_process, transport):
    """A frozen layer inside a group stays out of the server's model and does not move;
    the others train as torch.optim trains them."""
    def build():
        model = workloads.make_model(8, seed=0)
        model[0][0].requires_grad_(False)  # the convolution: frozen
        return model, [{"params": list(model[0].parameters()) + list(model[2].parameters()), "weight_decay": 1e-3},
                       {"params": list(model[4].parameters()), "lr": LR / 2}]

    reference, groups = build()
    ref_opt = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM)
    train(reference, ref_opt, None, steps=6)
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))
    model, groups = build()
    frozen = [p.detach().clone() for p in model[0][0].parameters()]
    with aps.torch.Optimizer(groups, server.address, 0, 1, model=model, transport=transport) as opt:
        assert opt.worker.layout.names == ("2.weight", "2.bias", "4.weight", "4.bias")
        train(model, opt, None, steps=6)
    for before, after in zip(frozen, model[0][0].parameters()):
        assert torch.equal(before, after)
    for mine, theirs in zip(params_of(model), params_of(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_what_the_server_cannot_follow_is_refused_clearly(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1", "--momentum", "0.9")
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport) as opt:
        with pytest.raises(aps.ConfigurationError, match="cannot add a param group"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        x, y = digits_batches(0, 1, 0, BATCH)

        def attempt():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        weights = opt.worker.flat_weights.copy()
        for key, value, error, match in [
            ("lr", -0.1, aps.errors.InvalidHyperparameters, "group 0: lr is -0.1; it must be >= 0"),
            ("lr", float("nan"), aps.errors.InvalidHyperparameters, "lr is nan"),
            ("weight_decay", "much", aps.ConfigurationError, "not numbers"),
            ("nesterov", True, aps.ConfigurationError, "nesterov is True, the server's is False"),
            ("maximize", True, aps.ConfigurationError, "maximize is not supported"),
        ]:
            saved = opt.param_groups[0][key]
            opt.param_groups[0][key] = value
            with pytest.raises(error, match=match):
                attempt()
            opt.param_groups[0][key] = saved
            assert opt.clock == 0 and np.array_equal(opt.worker.flat_weights, weights)  # nothing pushed
        model[0][0].weight.requires_grad_(False)
        model[0][0].weight.grad = None
        attempt()  # a parameter frozen later is pushed a zero gradient; the others train
        assert opt.clock == 1
    # a parameter frozen at construction that gets a gradient later cannot join the server's model
    model = workloads.make_model(8, seed=0)
    model[0][0].requires_grad_(False)
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1")
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport) as opt:
        model[0][0].requires_grad_(True)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(aps.ConfigurationError, match="0.0.weight was frozen"):
            opt.step()
        assert opt.clock == 0


def test_params_in_every_form_torch_takes(server_process):
    model = workloads.make_model(8, seed=0)
    names = tuple(n for n, _ in model.named_parameters())
    for params, kwargs, expected in [
        (model.named_parameters(), {}, names),
        (model.parameters(), {"model": model}, names),
        (model.parameters(), {}, tuple(f"param{i}" for i in range(len(names)))),
    ]:
        server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1")
        with aps.torch.Optimizer(params, server.address, 0, 1, transport="tcp", **kwargs) as opt:
            assert opt.worker.layout.names == expected
    with pytest.raises(aps.ConfigurationError, match="appears twice"):
        aps.torch.Optimizer([{"params": [model[2].weight]}, {"params": [model[2].weight]}], server.address, 0, 1)
    with pytest.raises(aps.ConfigurationError, match="not a set"):
        aps.torch.Optimizer({model[2].weight}, server.address, 0, 1)
    with pytest.raises(aps.ConfigurationError, match="empty parameter list"):
        aps.torch.Optimizer([], server.address, 0, 1)


def test_a_sharded_model_with_groups_and_a_scheduler_equals_torch_optim(server_process, transport):
    """The groups cut across the shards' ranges: each shard applies its part of each group."""
    make = SCHEDULERS["OneCycleLR"]
    reference = workloads.make_model(8, seed=0)
    ref_opt = torch.optim.SGD(grouped(reference), lr=LR, momentum=MOMENTUM)
    train(reference, ref_opt, make(ref_opt), steps=6)
    options = ("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM), "--shards", "3")
    servers = [server_process(*options, "--shard", str(index)) for index in range(3)]
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(grouped(model), [s.address for s in servers], 0, 1, model=model,
                             transport=transport) as opt:
        train(model, opt, make(opt), steps=6)
    for mine, theirs in zip(params_of(model), params_of(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)


# state_dict ---------------------------------------------------------------------------

TORCH_OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": LR, "momentum": MOMENTUM}, ("--momentum", str(MOMENTUM))),
                    "adam": (torch.optim.Adam, {"lr": 1e-3}, ("--optimizer", "adam", "--lr", "1e-3"))}


def steps_of(model, opt, first: int, last: int) -> None:
    for step in range(first, last):
        x, y = digits_batches(0, 1, step, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("kind", TORCH_OPTIMIZERS)
def test_state_dict_is_torch_optims_and_restarts_a_run_exactly(server_process, transport, tmp_path, kind):
    """Six steps, torch.save({"model", "optim"}) as people write it, a fresh server, load both,
    six more steps: the same weights as twelve steps without a stop, and as torch.optim; the
    state_dict itself holds what torch.optim's holds."""
    cls, options, flags = TORCH_OPTIMIZERS[kind]
    reference = workloads.make_model(8, seed=0)
    ref_opt = cls(grouped(reference), **options)
    steps_of(reference, ref_opt, 0, 6)
    ref_state = copy.deepcopy(ref_opt.state_dict())  # torch's holds the live tensors
    steps_of(reference, ref_opt, 6, 12)

    model = workloads.make_model(8, seed=0)
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(options["lr"]), *flags)
    with aps.torch.Optimizer(grouped(model), server.address, 0, 1, model=model, transport=transport) as opt:
        steps_of(model, opt, 0, 6)
        saved = opt.state_dict()
        torch.save({"model": model.state_dict(), "optim": saved}, tmp_path / "ckpt.pt")
    assert saved["aps"] == {"optimizer": kind, "steps": 6, "version": 6}
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in ref_state["param_groups"]]
    assert set(saved["state"]) == set(ref_state["state"])
    for index, state in ref_state["state"].items():
        assert set(saved["state"][index]) == set(state)
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][index][key], value, rtol=1e-5, atol=1e-7)
            if kind == "sgd":
                assert torch.equal(saved["state"][index][key], value)

    checkpoint = torch.load(tmp_path / "ckpt.pt")
    model = workloads.make_model(8, seed=1)  # other initial weights: the checkpoint's win
    model.load_state_dict(checkpoint["model"])
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(options["lr"]), *flags)
    with aps.torch.Optimizer(grouped(model), server.address, 0, 1, model=model, transport=transport) as opt:
        opt.load_state_dict(checkpoint["optim"])
        opt.load_state_dict(checkpoint["optim"])  # every rank may load it: taken once
        steps_of(model, opt, 6, 12)
        with pytest.raises(aps.errors.InvalidState, match="applied 6 updates"):
            opt.load_state_dict(ref_state)  # another state into a run that has started
        after = opt.state_dict()
    assert after["aps"]["steps"] == 12
    for mine, theirs in zip(params_of(model), params_of(reference), strict=True):
        if kind == "sgd":
            np.testing.assert_array_equal(mine, theirs)
        else:
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_torch_optim_state_continues_on_aps(server_process):
    """A run begun with torch.optim.SGD goes on with aps from its state_dict, bit for bit."""
    reference = workloads.make_model(8, seed=0)
    ref_opt = torch.optim.SGD(grouped(reference), lr=LR, momentum=MOMENTUM)
    steps_of(reference, ref_opt, 0, 5)
    weights, state = copy.deepcopy(reference.state_dict()), copy.deepcopy(ref_opt.state_dict())
    steps_of(reference, ref_opt, 5, 10)
    model = workloads.make_model(8, seed=0)
    model.load_state_dict(weights)
    server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))
    with aps.torch.Optimizer(grouped(model), server.address, 0, 1, model=model, transport="tcp") as opt:
        opt.load_state_dict(state)
        steps_of(model, opt, 5, 10)
    for mine, theirs in zip(params_of(model), params_of(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    with pytest.raises(aps.ConfigurationError, match="not the server optimizer's"):
        adam = torch.optim.Adam(grouped(reference))
        steps_of(reference, adam, 0, 1)
        server = server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))
        with aps.torch.Optimizer(grouped(model), server.address, 0, 1, model=model, transport="tcp") as opt:
            opt.load_state_dict(adam.state_dict())
