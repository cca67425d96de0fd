"""aps.torch.Optimizer off the happy path: a step that raises under GradScaler, state dicts
that cannot be loaded, pre-hooks, names, construction that fails after connecting, copies."""

import copy

import pytest

torch = pytest.importorskip("torch")

import aps
import aps.torch
import aps.torch.optimizer
from aps.errors import ConfigurationError, InvalidHyperparameters, InvalidState

LR, MOMENTUM = 0.05, 0.9


def sgd_server(server_process):
    return server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM))


def one_step(model, opt):
    opt.zero_grad()
    model(torch.ones(3, 2)).sum().backward()
    opt.step()


def test_a_step_that_raises_leaves_no_grad_scale_for_the_next(server_process, transport):
    """GradScaler sets grad_scale and found_inf and removes them only when step() returns:
    after a refused step, the retried scaler.step() unscales once, not by the scale squared."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    with aps.torch.Optimizer(model, sgd_server(server_process).address, 0, 1, transport=transport) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 2)).sum()).backward()
        opt.param_groups[0]["lr"] = -1.0
        with pytest.raises(InvalidHyperparameters):
            scaler.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        opt.param_groups[0]["lr"] = LR
        weight, grad = model.weight.detach().clone(), model.weight.grad.clone()
        scaler.step(opt)
        scaler.update()
        torch.testing.assert_close(model.weight.detach(), weight - LR * grad / 4.0)


def test_a_refused_load_changes_no_group(server_process):
    """load_state_dict() that the server refuses (the run has started) leaves the groups' values."""
    model = torch.nn.Linear(2, 1)
    with aps.torch.Optimizer(model, sgd_server(server_process).address, 0, 1, transport="tcp") as opt:
        one_step(model, opt)
        saved = opt.state_dict()
        saved["param_groups"][0]["lr"] = 7.0
        saved["state"][0]["momentum_buffer"] += 1.0
        with pytest.raises(InvalidState):
            opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == LR


def test_groups_of_another_optimizer_are_refused_at_load_and_change_nothing(server_process):
    """A torch.optim.Adam state dict from before its first step holds no state, only Adam's
    groups: an SGD server cannot use them, so the load is refused and the next step still works."""
    model = torch.nn.Linear(2, 1)
    adam = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
    with aps.torch.Optimizer(model, sgd_server(server_process).address, 0, 1, transport="tcp") as opt:
        with pytest.raises(ConfigurationError, match="momentum"):
            opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["momentum"] == MOMENTUM
        one_step(model, opt)
        assert opt.version == 1


def test_torch_adamw_groups_are_refused_by_an_adam_server(server_process):
    """torch.optim.AdamW's groups say decoupled_weight_decay=True: an adam server decays otherwise."""
    model = torch.nn.Linear(2, 1)
    adamw = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), weight_decay=0.1)
    server = server_process("--workers", "1", "--sync", "bsp", "--optimizer", "adam")
    with aps.torch.Optimizer(model, server.address, 0, 1, transport="tcp") as opt:
        with pytest.raises(ConfigurationError, match="decoupled_weight_decay"):
            opt.load_state_dict(adamw.state_dict())
        assert "decoupled_weight_decay" not in opt.param_groups[0]


def test_load_state_dict_pre_hooks_shape_what_the_server_gets(server_process):
    """torch runs the load pre-hooks first (torch's docs suggest them to adapt a state dict);
    a hook that drops the state (keeping the groups) loads no state into the server."""
    reference = torch.nn.Linear(2, 1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=MOMENTUM)
    reference(torch.ones(3, 2)).sum().backward()
    ref_opt.step()
    model = torch.nn.Linear(2, 1)
    with aps.torch.Optimizer(model, sgd_server(server_process).address, 0, 1, transport="tcp") as opt:
        opt.register_load_state_dict_pre_hook(lambda _, state_dict: {**state_dict, "state": {}})
        opt.load_state_dict(ref_opt.state_dict())
        assert opt.param_groups[0]["lr"] == 0.5
        assert opt.worker.optimizer_state()["steps"] == 0  # nothing loaded: the run may still take a state


def test_two_parameters_of_one_name_are_refused(server_process):
    """Names from two submodules' named_parameters() repeat ("weight", "bias"): the server's
    model names each parameter once, so this is refused before connecting."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    groups = [{"params": model[0].named_parameters()}, {"params": model[1].named_parameters(), "lr": 0.01}]
    with pytest.raises(ConfigurationError, match="'weight'"):
        aps.torch.Optimizer(groups, sgd_server(server_process).address, 0, 1, transport="tcp")


def test_a_constructor_that_fails_after_connecting_closes_its_worker(server_process, monkeypatch):
    made = []

    class Recorded(aps.Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(aps.torch.optimizer, "Worker", Recorded)  # (the worker the optimizer makes)
    monkeypatch.setenv("APS_STEP_TIME", "0.01")
    monkeypatch.setenv("APS_SLOWDOWN", "0")  # refused by the Pacer, made last
    with pytest.raises(ConfigurationError, match="slowdown"):
        aps.torch.Optimizer(torch.nn.Linear(2, 1), sgd_server(server_process).address, 0, 1, transport="tcp")
    assert len(made) == 1 and made[0].shards[0]._conn is None


def test_an_optimizer_cannot_be_copied_into_one_without_a_connection(server_process):
    model = torch.nn.Linear(2, 1)
    with aps.torch.Optimizer(model, sgd_server(server_process).address, 0, 1, transport="tcp") as opt:
        with pytest.raises(TypeError, match="state_dict"):
            copy.deepcopy(opt)
        one_step(model, opt)


def test_a_model_moved_after_the_optimizer_was_made_still_trains_or_is_refused(server_process):
    """``model.to("cpu:N")`` (what accelerate does under a launcher) copies every parameter to
    new storage: the optimizer's steps would no longer reach the model, silently. The next
    step attaches the model to the worker's buffers again, and it trains as torch's SGD does;
    a model moved to another dtype is refused with what to do."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    reference = copy.deepcopy(model)
    plain = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    with aps.torch.Optimizer(model, sgd_server(server_process).address, 0, 1, transport="tcp") as opt:
        model.to(torch.device("cpu", 0))
        for _ in range(3):
            one_step(model, opt)
            one_step(reference, plain)
        torch.testing.assert_close(model.weight.detach(), reference.weight.detach())
        torch.testing.assert_close(model.bias.detach(), reference.bias.detach())
        model.double()
        model(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
        with pytest.raises(ConfigurationError, match="after the optimizer was made"):
            opt.step()
