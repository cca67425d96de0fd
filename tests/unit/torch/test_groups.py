"""torch.optim's param groups and the server's optimizer, without a server: the forms of
``params`` taken, the defaults and the four values a group sends, what a group may not
change, and the optimizer state from the server's flat arrays to torch's format and back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aps.errors import ConfigurationError
from aps.layout import Layout
from aps.torch.groups import ServerOptimizer, split_groups, uncompiled

SGD = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False}
ADAM = {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


def test_every_form_of_params_torch_takes_becomes_groups_of_tensors():
    net = model()
    (named,) = split_groups(net)
    assert named["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(a is b for a, b in zip(named["params"], net.parameters()))
    (plain,) = split_groups(net.parameters())
    assert "param_names" not in plain and len(plain["params"]) == 4
    given = [{"params": net[0].weight, "lr": 0.5}, {"params": [net[0].bias]}]
    first, second = split_groups(given)
    assert first["params"] == [net[0].weight] and first["lr"] == 0.5 and second["params"] == [net[0].bias]
    assert "params" in given[0] and given[0]["params"] is net[0].weight  # (the caller's dicts are left alone)


@pytest.mark.parametrize(
    "params, message",
    [
        ({torch.zeros(1, requires_grad=True)}, "not a set"),
        (torch.zeros(1, requires_grad=True), "not one tensor"),
        ([], "empty parameter list"),
        ([{"lr": 0.1}], "must be a dict with 'params'"),
        ([{"params": {torch.zeros(1, requires_grad=True)}}], "not a set"),
        ([("a", torch.zeros(1, requires_grad=True)), torch.zeros(1, requires_grad=True)], "with its name or none"),
        ([1.0], "must be tensors, not float"),
        ([torch.zeros(1, requires_grad=True) * 2], "not a leaf tensor"),
    ],
)
def test_params_torch_would_refuse_or_that_have_no_order_are_refused(params, message):
    with pytest.raises(ConfigurationError, match=message):
        split_groups(params)


def test_a_compiled_model_is_named_by_the_model_it_wraps():
    net = model()
    wrapper = torch.nn.Module()
    wrapper._orig_mod = net  # what torch.compile's wrapper holds
    assert uncompiled(wrapper) is net and uncompiled(net) is net


def test_the_defaults_are_the_servers_and_the_values_given_take_their_place():
    sgd = ServerOptimizer(SGD)
    assert (sgd.name, sgd.kind, sgd.state_names) == ("sgd", "sgd", ("momentum_buffer",))
    assert sgd.defaults == {
        "lr": 0.1,
        "weight_decay": 0.0,
        "momentum": 0.9,
        "dampening": 0.0,
        "nesterov": False,
        "maximize": False,
    }
    assert sgd.server_values == (0.1, 0.0, 0.9, 0.0)
    assert sgd.with_values(lr=0.5, momentum=None)["lr"] == 0.5 and sgd.with_values()["momentum"] == 0.9
    adamw = ServerOptimizer({**ADAM, "optimizer": "adamw"})
    assert (adamw.kind, adamw.state_names) == ("adam", ("exp_avg", "exp_avg_sq"))
    assert adamw.defaults["betas"] == (0.9, 0.999) and adamw.server_values == (0.001, 0.01, 0.9, 0.999)
    assert adamw.with_values(betas=[0.8, 0.99])["betas"] == (0.8, 0.99)  # any sequence, kept as a tuple
    with pytest.raises(ConfigurationError, match="momentum is not an option of the server's optimizer"):
        adamw.with_values(momentum=0.9)


@pytest.mark.parametrize("options", [None, {"lr": 0.1}, {**SGD, "optimizer": "lamb"}])
def test_a_server_that_does_not_say_its_optimizer_is_refused(options):
    with pytest.raises(ConfigurationError, match="did not say which optimizer"):
        ServerOptimizer(options)


def test_each_group_sends_its_four_values_and_may_not_change_the_servers_options():
    sgd = ServerOptimizer(SGD)
    groups = [{**sgd.defaults, "lr": 0.2}, {**sgd.defaults, "momentum": 0.0, "weight_decay": 1e-4}]
    assert sgd.group_values(groups) == [(0.2, 0.0, 0.9, 0.0), (0.1, 1e-4, 0.0, 0.0)]
    for changed, message in (
        ({"nesterov": True}, "nesterov is True, the server's is False"),
        ({"maximize": True}, "maximize is not supported"),
        ({"lr": "fast"}, "its optimizer values are not numbers"),
    ):
        with pytest.raises(ConfigurationError, match=f"param group 1: {message}"):
            sgd.group_values([sgd.defaults, {**sgd.defaults, **changed}])
    with pytest.raises(ConfigurationError, match="param group 0 has no momentum"):
        sgd.group_values([{"lr": 0.1, "weight_decay": 0.0, "nesterov": False, "dampening": 0.0}])
    adam = ServerOptimizer(ADAM)
    assert adam.group_values([adam.defaults]) == [(0.001, 0.01, 0.9, 0.999)]
    with pytest.raises(ConfigurationError, match=r"a group of torch\.optim\.AdamW"):
        adam.group_values([{**adam.defaults, "decoupled_weight_decay": True}])
    with pytest.raises(ConfigurationError, match=r"eps is 0\.1"):
        adam.group_values([{**adam.defaults, "eps": 0.1}])


def test_the_state_goes_from_the_servers_arrays_to_torchs_format_and_back():
    net = model()
    params = list(net.parameters())
    layout = Layout.from_arrays({f"p{i}": p.detach().numpy() for i, p in enumerate(params)})
    adam = ServerOptimizer(ADAM)
    arrays = {
        name: np.arange(layout.numel, dtype=np.float32) * scale
        for name, scale in (("exp_avg", 1.0), ("exp_avg_sq", 2.0))
    }
    state = adam.torch_state({"arrays": arrays, "steps": 7}, params, layout)
    assert list(state) == params
    assert state[params[1]]["step"].item() == 7.0 and state[params[1]]["exp_avg"].tolist() == [6.0, 7.0]
    assert state[params[0]]["exp_avg_sq"].shape == (2, 3)
    assert adam.torch_state({"arrays": arrays, "steps": 0}, params, layout) == {}  # before the first step
    groups = [{"params": params}]
    packed = {
        "state": {index: state[param] for index, param in enumerate(params)},
        "param_groups": [{"params": [0, 1, 2, 3]}],
    }
    back = adam.server_state(packed, {"optimizer": "adam"}, groups, params, layout)
    assert back is not None and back["optimizer"] == "adam" and back["steps"] == 7
    assert all(np.array_equal(back["arrays"][name], arrays[name]) for name in arrays)
    assert (
        adam.server_state({"state": {}, "param_groups": [{"params": [0, 1, 2, 3]}]}, {}, groups, params, layout) is None
    )  # nothing to load: a state from before the first step


def test_a_state_the_server_cannot_hold_is_refused():
    params = [torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)]
    layout = Layout.from_arrays({"a": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)})
    groups, saved = [{"params": params}], [{"params": [0, 1]}]
    adam, sgd = ServerOptimizer(ADAM), ServerOptimizer(SGD)
    steps = {
        0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)},
        1: {"step": torch.tensor(4.0), "exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1)},
    }
    with pytest.raises(ConfigurationError, match=r"Adam steps differ \(\[3, 4\]\)"):
        adam.server_state({"state": steps, "param_groups": saved}, {}, groups, params, layout)
    with pytest.raises(ConfigurationError, match="the state is sgd's; the server runs adam"):
        adam.server_state({"state": steps, "param_groups": saved}, {"optimizer": "sgd"}, groups, params, layout)
    with pytest.raises(ConfigurationError, match=r"holds \['exp_avg', 'exp_avg_sq'\]: not the server optimizer's"):
        sgd.server_state({"state": steps, "param_groups": saved}, {}, groups, params, layout)
    momentum = {0: {"momentum_buffer": torch.ones(2)}}  # the other parameter's starts at zero
    loaded = sgd.server_state({"state": momentum, "param_groups": saved}, {"steps": 5}, groups, params, layout)
    assert loaded is not None and loaded["steps"] == 5
    assert loaded["arrays"]["momentum_buffer"].tolist() == [1.0, 1.0, 0.0]
