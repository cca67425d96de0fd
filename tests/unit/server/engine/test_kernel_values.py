"""The values the update kernels compute with, checked in their own precision (float32) before
anything runs: a value the checks refuse is one the kernels would turn into NaN or infinity on
every gradient (shown here on the kernels themselves, both implementations), and the largest a
check accepts is one they compute with."""

import math

import numpy as np
import pytest

from aps.errors import ConfigurationError, InvalidHyperparameters
from aps.server.engine.compensation import EPS, Compensation, check_lambda
from aps.server.engine.optim import Adam, check_kernel_values, make_optimizer
from aps.wire.protocol import HyperGroup

N = 64


def _zeros():
    return np.zeros(N, np.float32)


@pytest.mark.parametrize("name, values, message", [
    ("sgd", {"lr": 1e39}, "--lr is 1e\\+39, beyond float32"),
    ("sgd", {"lr": 0.1, "momentum": 1e300}, "--momentum is 1e\\+300, beyond float32"),
    ("sgd", {"lr": 0.1, "weight_decay": 3.5e38}, "--weight-decay is 3.5e\\+38, beyond float32"),
    ("sgd", {"lr": 1e-50}, "--lr is 1e-50, which is 0 in float32"),
    ("adam", {"lr": 0.1, "eps": 1e-50}, "--eps is 1e-50, which is 0 in float32"),
    ("adam", {"lr": 1e36, "betas": (0.99999, 0.999)}, "first step size lr / \\(1 - beta1\\) = 1e\\+41"),
    ("adamw", {"lr": 1e30, "weight_decay": 1e30}, "decay factor 1 - lr \\* weight_decay"),
    ("delayed-nesterov", {"lr": 0.1, "momentum": 1e300}, "--momentum is 1e\\+300, beyond float32"),
])
def test_values_beyond_float32_are_refused_naming_the_flag(name, values, message):
    with pytest.raises(ConfigurationError, match=message):
        check_kernel_values(name, **values)
    with pytest.raises(ConfigurationError, match=message):  # and the optimizer is never made with them
        make_optimizer(name, N, **values)


def test_what_the_checks_refuse_the_kernels_would_refuse_on_every_gradient(kernels):
    """Bypassing the checks, each refused value makes the kernel refuse a gradient of zeros
    (nothing wrong with it): the run would never take a step."""
    w = np.ones(N, np.float32)
    out, buf_out = _zeros(), _zeros()
    assert kernels.sgd_step(out, w, _zeros(), None, None, 0.1)  # (a zero gradient is fine)
    assert not kernels.sgd_step(out, w, _zeros(), None, None, 1e39, weight_decay=0.5)
    ones = np.ones(N, np.float32)  # (momentum enters from the second step: the first starts the buffer)
    assert not kernels.sgd_step(out, w, _zeros(), buf_out, ones, 0.1, momentum=1e39)
    adam = dict(step=1, lr=1e36, beta1=0.99999, beta2=0.999, eps=1e-8)
    grad = np.full(N, 1e-3, np.float32)
    assert not kernels.adam_step(out, w, grad, _zeros(), _zeros(), _zeros(), _zeros(), **adam)
    assert kernels.adam_step(out, w, grad, _zeros(), _zeros(), _zeros(), _zeros(), **{**adam, "lr": 1e30})


@pytest.mark.parametrize("kind, lam, message", [
    ("dc", 1e300, "--compensation dc:1e\\+300: LAMBDA 1e\\+300 is beyond float32"),
    ("dc-adaptive", 1e38, "reaches 3.16228e\\+41 for a parameter whose gradients have been 0"),
    ("dc", 1e-50, "LAMBDA is 0 in float32"),
])
def test_a_lambda_the_kernel_cannot_compute_with_is_refused(kind, lam, message):
    with pytest.raises(ConfigurationError, match=message):
        check_lambda(kind, lam)
    with pytest.raises(ConfigurationError, match=message):
        Compensation(kind, lam, N)


def test_the_largest_lambda_accepted_is_computed_with_and_a_larger_one_refuses_every_gradient(kernels):
    """The kernel's dc-adaptive factor is LAMBDA / sqrt(mean square + EPS), largest for a
    parameter whose gradients are 0: at the largest LAMBDA accepted it is finite and a zero
    gradient is taken; at one refused (and for dc:1e300), a first gradient of zeros on weights
    that have not moved (w == w_then) is refused."""
    message = str(pytest.raises(ConfigurationError, check_lambda, "dc-adaptive", 1e36).value)
    largest = float(message.rsplit("at most ", 1)[1])
    check_lambda("dc-adaptive", largest)
    assert largest == pytest.approx(float(np.finfo(np.float32).max) * math.sqrt(np.float32(EPS)), rel=1e-5)
    w = np.ones(N, np.float32)
    code = kernels.COMPENSATE_DC_ADAPTIVE
    assert kernels.compensate(_zeros(), _zeros(), w, w, _zeros(), _zeros(), code, largest, 0.95, EPS)
    assert not kernels.compensate(_zeros(), _zeros(), w, w, _zeros(), _zeros(), code, 1e38, 0.95, EPS)
    assert not kernels.compensate(_zeros(), _zeros(), w, w, None, None, kernels.COMPENSATE_DC, 1e300)


def test_an_adam_group_whose_first_step_overflows_is_refused():
    adam = Adam(N, 1e-3)
    adam.check_groups([HyperGroup(N, 1e30, 0.0, 0.9, 0.999)])  # 1e31: fine in float32
    with pytest.raises(InvalidHyperparameters, match="group 0: .*first step size"):
        adam.check_groups([HyperGroup(N, 1e36, 0.0, 0.99999, 0.999)])
